"""The small real edges of the core: the process table, the filesystem, the clock, and the
inventory of a host with no GPUs to manage. ``isolator.daemon.main`` hands them to the core."""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import select
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from isolator.errors import NotFound
from isolator.host import rootfs as rootfs_paths
from isolator.model import Topology


def read_text(path: str) -> str:
    """A small ``/proc`` or sysfs file in full through os.open, os.read and os.close: Python's
    ``open()`` adds an fstat, an ioctl and three objects (30 us a read against 8 us here)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


class PidFd:
    """A process held by a pidfd (pidfd_open(2)): while it is alive, its pid names it and nothing else."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def alive(self) -> bool:
        """False once the process has exited, a zombie not yet reaped included: poll(2) reports a
        pidfd readable then (a signal 0, which a zombie still takes, would say alive)."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return not poller.poll(0)

    def close(self) -> None:
        os.close(self._fd)


PF_KTHREAD = 0x00200000  # include/linux/sched.h


class ProcProcesses:
    """The process table as ``/proc`` shows it (``proc_root`` for a mounted elsewhere copy)."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._own_lock = threading.Lock()
        self._own: _OwnChain | None = None
        self._own_finalizer: weakref.finalize[[], ProcProcesses] | None = None

    def exists(self, pid: int) -> bool:
        return os.path.exists(os.path.join(self.proc_root, str(pid)))

    def pin(self, pid: int) -> PidFd | None:
        """None when ``pid`` names no process: gone (ESRCH), or a thread that is not its process's
        leader (ENOENT since Linux 6.9, EINVAL before; ``leader_of`` tells which process it is in)."""
        try:
            return PidFd(os.pidfd_open(pid))
        except OSError as exc:
            if exc.errno in (errno.ESRCH, errno.ENOENT, errno.EINVAL):
                return None
            raise

    def _status(self, pid: int) -> dict[str, str]:
        """``/proc/<pid>/status`` as key -> value; empty when it cannot be read (gone)."""
        try:
            text = read_text(os.path.join(self.proc_root, str(pid), "status"))
        except OSError:
            return {}
        return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)

    def same_pid_namespace(self, pid: int) -> bool | None:
        """Whether ``pid`` lives in the sidecar's pid namespace (``/proc/<pid>/ns/pid`` names the
        same namespace as ``/proc/self/ns/pid``; ``readlink`` shows ``pid:[<inode>]``); None when
        it cannot be read (gone). A pid such a process sends names a process of its own namespace."""
        try:
            theirs = os.stat(os.path.join(self.proc_root, str(pid), "ns", "pid"))
            ours = os.stat(os.path.join(self.proc_root, "self", "ns", "pid"))
        except OSError:
            return None
        return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)

    def leader_of(self, pid: int) -> int | None:
        """The leader of ``pid``'s thread group (``Tgid`` in /proc/<pid>/status; ``ps -L`` shows it
        as PID beside the thread's LWP): ``pid`` itself for a process; None when gone. /proc/<tid>
        answers for any thread, though ``ls /proc`` lists only leaders."""
        try:
            return int(self._status(pid)["Tgid"])
        except (KeyError, ValueError):
            return None

    def exited(self, pid: int) -> bool:
        """Whether ``pid`` has exited and waits to be reaped (state Z, zombie, or X, dead; ``ps``
        shows ``Z``/``<defunct>``). False when gone: ``exists`` says that."""
        return self._status(pid).get("State", "")[:1] in ("Z", "X")

    def kernel_thread(self, pid: int) -> bool:
        """Whether ``pid`` is a kernel thread (PF_KTHREAD in the flags of /proc/<pid>/stat; ``ps`` shows
        them in brackets). False for a pid that is gone: the caller's pin says that."""
        try:
            flags = int(read_text(os.path.join(self.proc_root, str(pid), "stat")).rsplit(")", 1)[1].split()[6])
        except (OSError, ValueError, IndexError):
            return False
        return bool(flags & PF_KTHREAD)

    def descends_from(self, pid: int, ancestor: int) -> bool:
        """Whether ``ancestor`` is in the parent chain of ``pid`` (``ps -o ppid`` repeated); False when
        ``pid`` is gone. The walk stops at ``ancestor``, at pid 1 or where a parent cannot be read, so
        a launcher's child costs one read of ``/proc/<pid>/stat`` whatever the depth of the tree."""
        seen: set[int] = set()
        while pid > 1 and len(seen) < 4096:
            parent = self._parent(pid)
            if parent is None or parent <= 0 or parent in seen:
                return False
            if parent == ancestor:
                return True
            seen.add(parent)
            pid = parent
        return False

    def sidecar_pids(self) -> frozenset[int]:
        """The sidecar and its ancestors, walked once and again only after one of them has exited.

        The chain changes only when an ancestor exits (its children go to a reaper that is itself
        an ancestor, or to init), and a pidfd on each one says so: poll(2) reports POLLIN once its
        process has exited. Between exits a call costs one poll(2) instead of a read of
        ``/proc/<pid>/stat`` per ancestor. Where a pidfd cannot be opened, every call walks."""
        with self._own_lock:
            own = self._own
            if own is not None and own.pid == os.getpid() and not own.watch.poll(0):
                return own.pids
            self._own = None
            if own is not None:
                own.close()
            pids = self._walk_own()
            own = _OwnChain.watch_chain(os.getpid(), pids)
            # The chain read again after the pidfds were opened: each pid in it was then a live
            # ancestor, so no pidfd names a process that took the number of one that had exited.
            if own is not None and self._walk_own() != pids:
                own.close()
                own = None
            self._own = own
            if self._own_finalizer is not None:
                self._own_finalizer.detach()
            self._own_finalizer = weakref.finalize(self, own.close) if own is not None else None
            return pids

    def _walk_own(self) -> frozenset[int]:
        out = set()
        pid = os.getpid()
        while pid > 0 and pid not in out:
            out.add(pid)
            parent = self._parent(pid)
            if parent is None:
                break
            pid = parent
        return frozenset(out)

    def _parent(self, pid: int) -> int | None:
        """The ppid in ``/proc/<pid>/stat``; None when it cannot be read."""
        try:
            # pid (comm) state ppid ...: comm may hold spaces and parentheses; split after the last ')'.
            return int(read_text(os.path.join(self.proc_root, str(pid), "stat")).rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None


class _OwnChain:
    """The sidecar's pid chain as walked by ``pid``, and pidfds on its ancestors polled for an exit."""

    def __init__(self, pid: int, pids: frozenset[int], fds: list[int]) -> None:
        self.pid = pid
        self.pids = pids
        self._fds = fds
        self.watch = select.poll()
        for fd in fds:
            self.watch.register(fd, select.POLLIN)

    @classmethod
    def watch_chain(cls, pid: int, pids: frozenset[int]) -> _OwnChain | None:
        """Pidfds on every pid of the chain but ``pid`` itself; None when one cannot be opened."""
        fds: list[int] = []
        try:
            for other in sorted(pids - {pid}):
                fds.append(os.pidfd_open(other))
        except OSError:
            for fd in fds:
                os.close(fd)
            return None
        return cls(pid, pids, fds)

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


class LocalFilesystem:
    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def make_dirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def make_dirs_in(self, rootfs: str, path: str) -> str:
        return rootfs_paths.make_dirs_in(rootfs, path)

    def mount_target(self, rootfs: str, path: str) -> str:
        return rootfs_paths.mount_target_in(rootfs, path)


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class EmptyInventory:
    """A host with no GPUs to manage (``gpus:0``, or no NVML and none requested): every container
    gets the standard devices only."""

    driver_version = ""
    cuda_driver_version = ""
    records: tuple[Any, ...] = ()

    def topology(self) -> Topology:
        return Topology(gpus=())

    def healthy(self) -> frozenset[int]:
        return frozenset()

    def usage(self, index: int) -> Any:
        raise NotFound(f"GPU {index} is not managed by this sidecar")

    def device_count(self) -> int:
        return 0

    def on_health_change(self, callback: Callable[[Any], None]) -> None:
        pass

    def occupancy(self, index: int) -> Any:
        raise NotFound(f"GPU {index} is not managed by this sidecar")

    def process_usage(self, index: int) -> tuple[Any, ...]:
        raise NotFound(f"GPU {index} is not managed by this sidecar")

    def reset_settings(self, index: int, compute_mode: int) -> tuple[Any, ...]:
        return ()

    def close(self) -> None:
        pass


class PasswdUsers:
    """The host's users (getpwnam(3): /etc/passwd, or NSS as configured). ``getent passwd NAME``
    shows the same."""

    def uid(self, name: str) -> int | None:
        try:
            return pwd.getpwnam(name).pw_uid
        except (KeyError, ValueError):  # no such user; a name with a NUL byte
            return None
