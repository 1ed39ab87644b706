"""The Mesos isolator hooks, one module each: prepare, isolate, update, watch (with usage and status),
cleanup. ``Hooks`` is them together, the part of IsolatorService that runs a container's lifecycle.

Each hook holds its container's lock (isolator/core/locks.py) for its whole run, and the booking
lock only for the decision on the shared GPUs.
"""

from __future__ import annotations

from isolator.core.cleanup import CleanupHook
from isolator.core.isolate import IsolateHook
from isolator.core.prepare import MS_BIND, PrepareHook
from isolator.core.update import UpdateHook
from isolator.core.watch import WatchHook

__all__ = ["MS_BIND", "Hooks"]


class Hooks(PrepareHook, IsolateHook, UpdateHook, WatchHook, CleanupHook):
    """A container's lifecycle: prepare, isolate, update, watch, usage, status, cleanup (part of IsolatorService)."""
