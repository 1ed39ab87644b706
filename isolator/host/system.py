"""The small real edges of the core: the process table, the filesystem, the clock, and the
inventory of a host with no GPUs to manage. ``isolator.daemon.main`` hands them to the core."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from isolator.errors import NotFound
from isolator.host import rootfs as rootfs_paths
from isolator.model import Topology


class PidFd:
    """A process held by a pidfd (pidfd_open(2)): while it is alive, its pid names it and nothing else."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def alive(self) -> bool:
        try:
            signal.pidfd_send_signal(self._fd, 0)
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        os.close(self._fd)


PF_KTHREAD = 0x00200000  # include/linux/sched.h


class ProcProcesses:
    """The process table as ``/proc`` shows it (``proc_root`` for a mounted elsewhere copy)."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root

    def exists(self, pid: int) -> bool:
        return os.path.exists(os.path.join(self.proc_root, str(pid)))

    def pin(self, pid: int) -> PidFd | None:
        try:
            return PidFd(os.pidfd_open(pid))
        except ProcessLookupError:
            return None

    def kernel_thread(self, pid: int) -> bool:
        """Whether ``pid`` is a kernel thread (PF_KTHREAD in the flags of /proc/<pid>/stat; ``ps`` shows
        them in brackets). False for a pid that is gone: the caller's pin says that."""
        try:
            with open(os.path.join(self.proc_root, str(pid), "stat")) as fh:
                flags = int(fh.read().rsplit(")", 1)[1].split()[6])
        except (OSError, ValueError, IndexError):
            return False
        return bool(flags & PF_KTHREAD)

    def ancestors(self, pid: int) -> tuple[int, ...]:
        """The parent chain of ``pid`` (``ps -o ppid`` repeated) up to pid 1; () when it is gone."""
        out: list[int] = []
        while pid > 1 and len(out) < 4096:
            try:
                with open(os.path.join(self.proc_root, str(pid), "stat")) as fh:
                    pid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
            if pid <= 0 or pid in out:
                break
            out.append(pid)
        return tuple(out)

    def sidecar_pids(self) -> frozenset[int]:
        out = set()
        pid = os.getpid()
        while pid > 0 and pid not in out:
            out.add(pid)
            try:
                with open(os.path.join(self.proc_root, str(pid), "stat")) as fh:
                    # pid (comm) state ppid ...: comm may hold spaces and parentheses; split after the last ')'.
                    pid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        return frozenset(out)


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

    def reset_settings(self, index: int, compute_mode: int) -> tuple[Any, ...]:
        return ()

    def close(self) -> None:
        pass
