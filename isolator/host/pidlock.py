"""Ownership locks: an flock(2) on a file that holds the holder's pid, for the holder's life.

The kernel drops an flock when the last descriptor of its open file closes, so a lock is never
stale, ``kill -9`` included; the pid in the file only names the holder in a refusal. Nothing here
decides what is owned: the daemon (isolator/daemon/ownership.py) and the socket guard do.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat

from isolator.errors import OwnershipHeld, StateError


class PidLock:
    """A lock file held from ``acquire`` until ``release`` or the process's end.

    A ``removable`` lock file is unlinked by its holder on release (nothing stays behind in
    /run); whoever then locks the old file, having opened it just before, sees that the path no
    longer names it and tries again, so two processes never both believe they hold the lock.
    """

    def __init__(self, path: str, fd: int, removable: bool) -> None:
        self.path = path
        self._fd: int | None = fd
        self._removable = removable

    @classmethod
    def acquire(
        cls,
        path: str,
        what: str,
        /,
        removable: bool = False,
        held: type[OwnershipHeld] = OwnershipHeld,
        **fields: str,
    ) -> PidLock:
        """Take the lock, or raise ``held`` (exit 75) with ``holder`` naming the live holder's pid.

        ``what`` names the thing in errors (``work directory '/var/lib/gpu-isolator'``); ``fields``
        go to ``held``'s message template beside ``path``, ``lock`` and ``holder``.
        """
        for _ in range(100):  # each retry means a holder let go in between: bounded, never a spin
            try:
                # O_CLOEXEC (Python's default): a child (nvidia-modprobe) must not inherit the lock.
                # O_NOFOLLOW: a link planted beside it never makes us open its target; O_NONBLOCK:
                # neither does a FIFO hang the start (it is refused just below).
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except OSError as exc:
                raise StateError(op="open lock file", path=path, cause=exc.strerror or str(exc)) from exc
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    raise StateError(op="lock", path=path, cause=f"not a regular file owned by uid {os.geteuid()}")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise held(what=what, lock=path, holder=_holder(fd), **fields) from None
                except OSError as exc:
                    raise StateError(op="lock", path=path, cause=exc.strerror or str(exc)) from exc
                if removable and not _names(path, st):
                    os.close(fd)
                    continue  # the holder we waited behind unlinked it: lock the file there now
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                except OSError as exc:
                    raise StateError(op="write", path=path, cause=exc.strerror or str(exc)) from exc
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            return cls(path, fd, removable)
        raise StateError(op="lock", path=path, cause="it was replaced 100 times while locking")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Let go. A removable file is unlinked first, while still held (see the class)."""
        if self._fd is None:
            return
        if self._removable:
            with contextlib.suppress(OSError):
                if _names(self.path, os.fstat(self._fd)):
                    os.unlink(self.path)
        else:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = None


def sweep(directory: str, suffix: str = ".lock") -> int:
    """Remove the removable lock files in ``directory`` whose holders died without releasing them
    (SIGKILL): each one is locked, unlinked while held and let go, as its holder would have. A held
    one is left alone; a contender that opened one just before sees it gone and tries again (the
    class's protocol). Returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.endswith(suffix):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: its holder is alive
            if _names(path, st):
                os.unlink(path)
                removed += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _names(path: str, st: os.stat_result) -> bool:
    """Whether ``path`` still names the file ``st`` describes."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _holder(fd: int) -> str:
    """``gpu-isolator pid N`` from the lock file; the holder writes it just after locking, so a
    refusal in between may find it empty."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").split("\n", 1)[0].strip()
    except OSError:
        text = ""
    return f"gpu-isolator pid {text}" if text.isdigit() else "another gpu-isolator (its pid is not yet written)"
