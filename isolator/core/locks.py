"""Per-container locks: one container's hooks run one at a time, different containers in parallel.

The hooks of one top-level container (and its nested containers) are serialised by that
container's lock, which they hold across their slow work (fsynced commits, the volume build, the
wait for a pid). Nothing shared is held across that work: decisions on the shared GPUs are short
critical sections under the booking lock (``Core.booking.lock``, isolator/core/booking.py). Recovery takes the table
``exclusive``ly: it waits for every container's hooks to finish and keeps new ones out. The table
knows which thread holds what, so "call with the container's lock held" is checked (``require``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from isolator.model import ContainerId


class ContainerLocks:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._locks: dict[ContainerId, tuple[threading.Lock, list[int]]] = {}
        self._exclusive = False
        self._holders = 0
        # Which thread holds each top-level container's lock, and the table exclusively (``require``).
        self._owners: dict[ContainerId, int] = {}
        self._exclusive_owner: int | None = None

    @contextlib.contextmanager
    def hold(self, cid: ContainerId) -> Iterator[None]:
        """Run the block as the only hook of ``cid``'s top-level container. Not re-entrant."""
        key = cid.root
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            entry = self._locks.get(key)
            if entry is None:
                entry = self._locks[key] = (threading.Lock(), [0])
            entry[1][0] += 1
            self._holders += 1
        try:
            with entry[0]:
                self._owners[key] = threading.get_ident()
                try:
                    yield
                finally:
                    del self._owners[key]
        finally:
            with self._cond:
                entry[1][0] -= 1
                if entry[1][0] == 0:
                    del self._locks[key]
                self._holders -= 1
                if self._holders == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Run the block with no container's hook in progress (recovery). Not re-entrant."""
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._exclusive = True
            self._cond.wait_for(lambda: self._holders == 0)
            self._exclusive_owner = threading.get_ident()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive_owner = None
                self._exclusive = False
                self._cond.notify_all()

    def held(self, cid: ContainerId) -> bool:
        """Whether the calling thread holds ``cid``'s top-level container's lock or the table exclusively."""
        me = threading.get_ident()
        return self._exclusive_owner == me or self._owners.get(cid.root) == me

    def require(self, cid: ContainerId, what: str) -> None:
        """Raise unless the calling thread holds ``cid``'s container lock (or the table exclusively)."""
        if not self.held(cid):
            raise LockNotHeld(f"{what} must be called with container {cid.root}'s lock (or the table exclusive) held")

    def busy(self) -> int:
        """How many hooks hold or wait for a container lock (for tests and the health view)."""
        with self._cond:
            return self._holders


class LockNotHeld(RuntimeError):
    """A method that must run inside a critical section was called outside it: a bug of ours."""


def require_kernel_write(locks: ContainerLocks, booking_lock: OwnedLock, cid: ContainerId, what: str) -> None:
    """The kernel writers' contract (core/grant.py, core/cpuset.py): the container's lock held, the
    booking lock not (a cgroup write is I/O, never done inside a booking decision)."""
    locks.require(cid, what)
    if booking_lock.held():
        raise LockNotHeld(f"{what} must not be called with the booking lock held (a kernel write is I/O)")


class OwnedLock:
    """A plain lock that knows which thread holds it, so that "call with it held" is a checked
    contract (``require``), not a comment. Used as ``with lock:`` only; not re-entrant."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> OwnedLock:
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc: object) -> None:
        self._owner = None
        self._lock.release()

    def held(self) -> bool:
        return self._owner == threading.get_ident()

    def require(self, what: str) -> None:
        """Raise unless the calling thread holds the lock."""
        if not self.held():
            raise LockNotHeld(f"{what} must be called with the {self.name} lock held")
