"""One daemon per state directory: an flock(2) on ``<work-dir>/gpu-isolator.pid``, held for the
daemon's life. The kernel drops it when the holder dies, kill -9 included, so it is never stale;
the file's content (the holder's pid) only names the holder in the refusal (isolator/host/pidlock.py)."""

from __future__ import annotations

import os

from isolator.errors import StateError, WorkDirHeld
from isolator.host.pidlock import PidLock

LOCK_FILE = "gpu-isolator.pid"


class WorkDirLock:
    """The work directory's lock, held from ``acquire`` until ``release`` or the process's end."""

    def __init__(self, lock: PidLock) -> None:
        self.path = lock.path
        self._lock = lock

    @classmethod
    def acquire(cls, work_dir: str) -> WorkDirLock:
        """Take the lock, or raise WorkDirHeld naming the live holder's pid."""
        path = os.path.join(work_dir, LOCK_FILE)
        try:
            os.makedirs(work_dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StateError(op="open lock file", path=path, cause=exc.strerror or str(exc)) from exc
        # The file stays when released: removing it would race a successor's open.
        return cls(PidLock.acquire(path, f"work directory '{work_dir}'", held=WorkDirHeld, path=work_dir))

    def release(self) -> None:
        """Let the directory go."""
        self._lock.release()
