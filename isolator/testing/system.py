"""Fakes of the small edges: the process table, the filesystem, the clock and the device nodes."""

from __future__ import annotations

import posixpath
import threading

from isolator.errors import InvalidArgument
from isolator.model import check_rootfs
from isolator.policy.devices import ControlDevices, DeviceNumber


class _Pinned:
    def __init__(self, table: FakeProcesses, pid: int) -> None:
        self._table, self.pid = table, pid

    def alive(self) -> bool:
        return self._table.exists(self.pid) and not self._table.exited(self.pid)

    def close(self) -> None:
        pass


class FakeProcesses:
    """A pid table: ``spawn()`` makes a process, ``exit(pid)`` ends it; ``own`` are the sidecar's
    pid and its ancestors' (pid 1 included)."""

    def __init__(self, first_pid: int = 1000) -> None:
        self._lock = threading.Lock()
        self._next = first_pid
        self.own: set[int] = {1, 600, 601}
        self.kernel: set[int] = {2}  # kthreadd
        self.alive: set[int] = self.own | self.kernel
        self.parents: dict[int, int] = {601: 600, 600: 1}
        self.threads: dict[int, int] = {}  # thread id -> its process (the thread group's leader)
        self.zombies: set[int] = set()
        self.foreign: set[int] = set()  # processes in another pid namespace than the sidecar's

    def pin(self, pid: int) -> _Pinned | None:
        # pidfd_open(2) refuses a thread that is not its group's leader, as a pid that is gone.
        return _Pinned(self, pid) if self.exists(pid) and pid not in self.threads else None

    def leader_of(self, pid: int) -> int | None:
        with self._lock:
            return self.threads.get(pid, pid) if pid in self.alive else None

    def exited(self, pid: int) -> bool:
        with self._lock:
            return pid in self.zombies and pid in self.alive

    def same_pid_namespace(self, pid: int) -> bool | None:
        with self._lock:
            return pid not in self.foreign if pid in self.alive else None

    def thread(self, process: int) -> int:
        """A thread of ``process`` (not its leader): a pid /proc answers for, that names no process."""
        tid = self.spawn(self.parents.get(process, 1))
        with self._lock:
            self.threads[tid] = process
        return tid

    def exit_unreaped(self, pid: int) -> None:
        """``pid`` exits and stays a zombie until its parent reaps it (``exit``)."""
        with self._lock:
            self.zombies.add(pid)

    def sidecar_pids(self) -> frozenset[int]:
        return frozenset(self.own)

    def kernel_thread(self, pid: int) -> bool:
        with self._lock:
            return pid in self.kernel and pid in self.alive

    def spawn(self, parent: int = 1) -> int:
        """A new process, child of ``parent`` (pid 1 by default: nobody's descendant)."""
        with self._lock:
            pid = self._next
            self._next += 1
            self.alive.add(pid)
            self.parents[pid] = parent
            return pid

    def descends_from(self, pid: int, ancestor: int) -> bool:
        with self._lock:
            if pid not in self.alive:
                return False
            while pid in self.parents and pid != 1:
                pid = self.parents[pid]
                if pid == ancestor:
                    return True
            return False

    def exit(self, pid: int) -> None:
        with self._lock:
            self.alive.discard(pid)
            self.zombies.discard(pid)

    def exists(self, pid: int) -> bool:
        with self._lock:
            return pid in self.alive


class FakeFilesystem:
    """Directories that exist, by path; ``make_dirs`` adds one and every parent."""

    def __init__(self, dirs: tuple[str, ...] = ()) -> None:
        self._lock = threading.Lock()
        self.dirs: set[str] = set()
        for d in dirs:
            self.make_dirs(d)

    def is_dir(self, path: str) -> bool:
        with self._lock:
            return path.rstrip("/") in self.dirs

    def make_dirs(self, path: str) -> None:
        with self._lock:
            parts = path.rstrip("/").split("/")
            for i in range(1, len(parts) + 1):
                self.dirs.add("/".join(parts[:i]) or "/")

    # The fake has no links, so resolving in the rootfs is joining; the rootfs is checked as the
    # real edge checks it (absolute, normalized), and it must exist.
    def make_dirs_in(self, rootfs: str, path: str) -> str:
        target = self._in(rootfs, path)
        self.make_dirs(target)
        return target

    def mount_target(self, rootfs: str, path: str) -> str:
        target = self._in(rootfs, path)
        self.make_dirs(posixpath.dirname(target))
        return target

    def _in(self, rootfs: str, path: str) -> str:
        root = check_rootfs(rootfs)
        if not self.is_dir(root):
            raise InvalidArgument(f"the container's rootfs '{rootfs}' does not exist")
        return posixpath.join(root, posixpath.normpath("/" + path).lstrip("/"))


class ManualClock:
    """Time moves only when told: ``advance(s)``; ``sleep`` advances it instead of waiting."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._lock = threading.Lock()
        self._wall = start
        self._mono = 1000.0
        self.slept = 0.0
        self.sleeps: list[float] = []  # each sleep asked for, in order

    def time(self) -> float:
        with self._lock:
            return self._wall

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)
        with self._lock:
            self.slept += seconds
            self.sleeps.append(seconds)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._wall += seconds
            self._mono += seconds


class FakeDeviceNodes:
    """The NVIDIA control nodes of a real driver (nvidiactl 195:255) and dynamic uvm/caps majors."""

    def __init__(self, dev_root: str = "/dev", uvm_major: int = 510, caps_major: int | None = 511) -> None:
        self.dev_root = dev_root
        self.uvm_major = uvm_major
        self._caps_major = caps_major

    def control_devices(self) -> ControlDevices:
        return ControlDevices(
            nvidiactl=DeviceNumber(195, 255, f"{self.dev_root}/nvidiactl"),
            uvm=DeviceNumber(self.uvm_major, 0, f"{self.dev_root}/nvidia-uvm"),
            uvm_tools=DeviceNumber(self.uvm_major, 1, f"{self.dev_root}/nvidia-uvm-tools"),
        )

    def caps_major(self) -> int | None:
        return self._caps_major


class FakeUsers:
    """A user database (UserDb): ``root`` is 0 and ``nobody`` 65534, as on the hosts we run on;
    ``names`` adds or replaces names."""

    def __init__(self, names: dict[str, int] | None = None) -> None:
        self.names = {"root": 0, "nobody": 65534, **(names or {})}

    def uid(self, name: str) -> int | None:
        return self.names.get(name)
