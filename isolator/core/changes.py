"""Change notification: what a Watch waits on, and the containers it ended lately. One job, one lock.

A change is a GPU's health changing, a container going away or recovery. Waiters subscribe a
callback (the transport's Watch: an entry here, not a thread); nothing in the core waits for one.
Lock contract: ``_lock`` guards the subscriptions and the ended containers only; callbacks run after
it is released, on the notifying thread, and must not block. Nothing else is ever taken while holding it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Callable

from isolator.model import ContainerId

LOG = logging.getLogger(__name__)

# How many cleaned-up containers Watch still recognises and Prepare refuses (a few minutes of a busy
# agent's churn; the module's one extra poll comes within a watch period of the cleanup, and a stale
# Prepare within its caller's deadline).
ENDED_KEPT = 4096


class Changes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Callbacks told of changes without a thread waiting: by top-level container, or under None
        # for every change.
        self._listeners: dict[ContainerId | None, dict[int, Callable[[], None]]] = {}
        self._tokens = itertools.count()
        # Top-level containers Mesos cleaned up lately, oldest first (bounded): the command module
        # polls Watch once more after each Cleanup, which is answered "no limitation" quietly for
        # these, and NOT_FOUND for a container never seen (docs/mesos-agent.md, section 4). They are
        # also the tombstones a stale Prepare is refused by: Mesos never reuses a container ID
        # (docs/reliability.md, "Stale hooks").
        self._ended: collections.OrderedDict[ContainerId, None] = collections.OrderedDict()

    def notify(self, container: ContainerId | None = None) -> None:
        """Wake the Watches: of ``container`` when only it changed (it went away), else all of them
        (a GPU's health changed, recovery)."""
        with self._lock:
            if container is None:
                told = [cb for group in self._listeners.values() for cb in group.values()]
            else:
                told = [*self._listeners.get(container.root, {}).values(), *self._listeners.get(None, {}).values()]
        for callback in told:
            try:
                callback()
            except Exception:  # a listener's bug must not stop a hook
                LOG.exception("change listener failed")

    def subscribe(self, callback: Callable[[], None], container: ContainerId | None = None) -> Callable[[], None]:
        """Call ``callback`` (from the notifying thread; it must not block) on each change that may
        concern ``container`` (every change when None) until the returned function is called.

        A waiter costs an entry here, not a thread.
        """
        key = None if container is None else container.root
        token = next(self._tokens)
        with self._lock:
            self._listeners.setdefault(key, {})[token] = callback

        def unsubscribe() -> None:
            with self._lock:
                group = self._listeners.get(key)
                if group is not None:
                    group.pop(token, None)
                    if not group:
                        del self._listeners[key]

        return unsubscribe

    def listeners(self) -> int:
        """How many subscriptions are open (tests and the load bench)."""
        with self._lock:
            return sum(len(group) for group in self._listeners.values())

    def mark_ended(self, cid: ContainerId) -> None:
        """Remember that Mesos cleaned up ``cid`` (the last ENDED_KEPT of them)."""
        with self._lock:
            self._ended.pop(cid, None)
            self._ended[cid] = None
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)

    def recently_ended(self, cid: ContainerId) -> bool:
        with self._lock:
            return cid in self._ended
