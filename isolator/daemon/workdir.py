"""One daemon per state directory: an flock(2) on ``<work-dir>/gpu-isolator.pid``, held for the
daemon's life. The kernel drops it when the holder dies, kill -9 included, so it is never stale;
the file's content (the holder's pid) only names the holder in the refusal."""

from __future__ import annotations

import contextlib
import fcntl
import os

from isolator.errors import StateError, WorkDirHeld

LOCK_FILE = "gpu-isolator.pid"


class WorkDirLock:
    """The work directory's lock, held from ``acquire`` until ``release`` or the process's end."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, work_dir: str) -> WorkDirLock:
        """Take the lock, or raise WorkDirHeld naming the live holder's pid."""
        path = os.path.join(work_dir, LOCK_FILE)
        try:
            os.makedirs(work_dir, mode=0o700, exist_ok=True)
            # O_CLOEXEC (Python's default): a child (nvidia-modprobe) must not inherit the lock.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise StateError(op="open lock file", path=path, cause=exc.strerror or str(exc)) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise WorkDirHeld(path=work_dir, holder=holder, lock=path) from None
        except OSError as exc:
            os.close(fd)
            raise StateError(op="lock", path=path, cause=exc.strerror or str(exc)) from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise StateError(op="write", path=path, cause=exc.strerror or str(exc)) from exc
        return cls(path, fd)

    def release(self) -> None:
        """Let the directory go (the file stays: removing it would race a successor's open)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _holder(fd: int) -> str:
    """``gpu-isolator pid N`` from the lock file; the holder writes it just after locking, so a
    refusal in between may find it empty."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"gpu-isolator pid {text}" if text.isdigit() else "another gpu-isolator (its pid is not yet written)"
