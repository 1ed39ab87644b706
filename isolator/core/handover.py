"""The handover check (docs/handover.md): a released GPU is handed out again only when NVML shows
nothing left on it, and after what a container may have changed is set back.

It owns the drain marks (in memory under ``Core.booking.lock``, persisted in the state store) and
the record of the last resets; it decides with ``isolator.policy.handover`` and reaches NVML through
the GpuInventory port, never under that lock. It never chooses GPUs: the allocator skips the marked ones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from isolator.core.booking import Booking
from isolator.core.changes import Changes
from isolator.core.ports import Clock, GpuInventory, RecordStore
from isolator.errors import IsolatorError, NotFound
from isolator.model import DrainRecord, Gpu, ResetStep, Undrained, compute_mode_name
from isolator.policy import handover as policy


class HandoverSettings(Protocol):
    """What the handover reads of the core's ``Settings`` (isolator/core/context.py)."""

    @property
    def drain_check(self) -> bool: ...

    @property
    def drain_memory_bytes(self) -> int: ...

    @property
    def drain_timeout_s(self) -> float: ...

    @property
    def default_compute_mode(self) -> int: ...


LOG = logging.getLogger(__name__)

PENDING = "the handover check has not run yet"


class Handover:
    """Built by ``Core`` with the collaborators it uses, each by its port or its object."""

    def __init__(
        self,
        *,
        settings: HandoverSettings,
        clock: Clock,
        inventory: GpuInventory,
        store: RecordStore,
        booking: Booking,
        changes: Changes,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.inventory = inventory
        self.store = store
        self.booking = booking
        self.changes = changes
        self.marks: dict[int, DrainRecord] = {}  # minor -> why it is kept out; under self.booking.lock
        self.resets: dict[int, tuple[str, ...]] = {}  # minor -> what the last handover reset or failed to
        self.events: Counter[str] = Counter()  # draining, cleared, unhealthy, undrained, reset, reset-failed
        self._persisted: set[int] = set()  # minors with a row in the store
        self._checking = threading.Lock()  # one check at a time (NVML I/O; never held with alloc waiting on it)

    @property
    def enabled(self) -> bool:
        return self.settings.drain_check

    # ---- marks (call with self.booking.lock held) ----------------------------------------------------------

    def apply_marks(self) -> None:
        """Copy the marks into the allocator (after it was rebuilt). Call with ``alloc`` held."""
        self.booking.lock.require("apply_marks")
        for minor in self.marks:
            if minor in self.booking.total:
                self.booking.set_draining(minor, True)

    def mark_pending(self, minors: Iterable[int]) -> None:
        """GPUs just released: out of the pool until ``check`` has looked. Call with ``alloc`` held,
        in the same section as the release, so that no Prepare takes one in between."""
        self.booking.lock.require("mark_pending")
        if not self.enabled:
            return
        clock = self.clock
        for minor in minors:
            if minor in self.booking.gpus and minor not in self.marks:
                self.marks[minor] = DrainRecord(minor, clock.time(), clock.monotonic(), PENDING)
                self.booking.set_draining(minor, True)

    # ---- the check -----------------------------------------------------------------------------------

    def start(self) -> None:
        """At start, after the recorded GPUs are booked: restore the persisted marks (a GPU held by a
        record again has none), then check every free GPU, so that a crash between a release and its
        check, or a process started while the sidecar was down, cannot hand out a busy GPU."""
        rows = self.store.drains()
        if not self.enabled:
            for minor in rows:
                self.store.clear_drain(minor)
            if rows:
                LOG.warning("--drain-check off: GPUs %s are no longer kept out as draining", sorted(rows))
            return
        with self.booking.lock:
            # A shared GPU without sharers is booked but held by nobody: checked like a free one.
            idle = frozenset(m for m, n in self.booking.shares_held().items() if not n)
            held = self.booking.allocated - idle
            stale = [m for m in rows if m not in self.booking.gpus or m in held]
            for minor, row in rows.items():
                if minor not in stale:
                    self.marks[minor] = row
                    self._persisted.add(minor)
            self.apply_marks()
            free = sorted(self.booking.total - held)
        for minor in stale:
            self.store.clear_drain(minor)
        self.check(free, marked_only=False)

    def recheck(self) -> None:
        """Check the draining GPUs again (periodically, and before each allocation)."""
        if not self.enabled:
            return
        with self.booking.lock:
            minors = sorted(self.marks)
        if minors:
            self.check(minors)

    def check(self, minors: Iterable[int], *, marked_only: bool = True) -> None:
        """Look at each GPU through NVML; a clear one has its settings reset and returns to the pool,
        a busy one (or one NVML cannot answer for: fail closed) stays out, marked draining.

        A GPU whose mark is gone when its turn comes was checked and let go meanwhile (a Prepare's
        recheck and the Cleanup that released it race for the same GPU), and may be a container's
        again: it is not looked at twice, nor marked while held. ``start`` checks free GPUs that
        carry no mark yet (``marked_only=False``)."""
        if not self.enabled:
            return
        for minor in sorted(set(minors)):
            gpu = self.booking.gpus.get(minor)
            if gpu is None:
                continue
            with self._checking:
                if marked_only:
                    with self.booking.lock:
                        marked = minor in self.marks
                    if not marked:
                        continue
                self._check_one(gpu)

    def _check_one(self, gpu: Gpu) -> None:
        inv = self.inventory
        pids: tuple[int, ...] = ()
        memory = 0
        try:
            occupancy = inv.occupancy(gpu.index)
        except IsolatorError as exc:
            reason: str | None = f"the handover check could not be done: {exc.message}"
        else:
            reason = policy.busy_reason(occupancy, self.settings.drain_memory_bytes)
            pids = tuple(sorted(p.pid for p in occupancy.processes))
            memory = occupancy.memory_used
        if reason is None:
            reason = self._reset(gpu)
        now, now_mono = self.clock.time(), self.clock.monotonic()
        with self.booking.lock:
            old = self.marks.get(gpu.minor)
            if reason is None:
                self.marks.pop(gpu.minor, None)
                self.booking.set_draining(gpu.minor, False)
                new = None
            else:
                since, since_mono = (old.since, old.since_mono) if old is not None else (now, now_mono)
                since_mono = min(since_mono, now_mono)  # a monotonic clock from before a reboot restarts
                timed = policy.timed_out(since_mono, now_mono, self.settings.drain_timeout_s)
                new = DrainRecord(gpu.minor, since, since_mono, reason, pids, memory, timed)
                self.marks[gpu.minor] = new
                self.booking.set_draining(gpu.minor, True)
        self._after(gpu, old, new)

    def _reset(self, gpu: Gpu) -> str | None:
        """Reset what a container may have changed; why the GPU stays out, or None."""
        try:
            steps = self.inventory.reset_settings(gpu.index, self.settings.default_compute_mode)
        except IsolatorError as exc:
            return f"its settings could not be reset: {exc.message}"
        self._record_reset(gpu, steps)
        return policy.reset_reason(steps)

    def _record_reset(self, gpu: Gpu, steps: tuple[ResetStep, ...]) -> None:
        done = tuple(str(s) for s in steps if s.changed or s.error)
        if not done:
            return
        self.resets[gpu.minor] = done
        for step in steps:
            if step.error:
                self.events["reset-failed"] += 1
                LOG.error("GPU %d (%s) after its container: failed to reset %s", gpu.index, gpu.uuid, step)
            elif step.changed:
                self.events["reset"] += 1
                LOG.warning("GPU %d (%s) after its container: %s", gpu.index, gpu.uuid, step)

    def _after(self, gpu: Gpu, old: DrainRecord | None, new: DrainRecord | None) -> None:
        """Persist the change, log it, and tell the watchers."""
        name = f"GPU {gpu.index} (minor {gpu.minor}, {gpu.uuid})"
        try:
            if new is None and gpu.minor in self._persisted:
                self.store.clear_drain(gpu.minor)
                self._persisted.discard(gpu.minor)
            elif new is not None and new != old:
                self.store.set_drain(new)
                self._persisted.add(gpu.minor)
        except IsolatorError as exc:  # the mark in memory stands; a restart checks the GPU again
            LOG.error("failed to record the drain state of %s: %s", name, exc.message)
        if new is None:
            if old is not None and old.reason != PENDING:
                self.events["cleared"] += 1
                LOG.warning("%s is free again: nothing runs on it (it drained since %s)", name, _when(old.since))
                self.changes.notify()
            return
        if old is None or old.reason == PENDING:
            self.events["draining"] += 1
            LOG.error("%s is draining, not handed out: %s", name, new.reason)
            self.changes.notify()
        elif new.timed_out and not old.timed_out:
            self.events["unhealthy"] += 1
            LOG.error(
                "%s is unhealthy: still draining after %.0f s (--drain-timeout): %s",
                name,
                self.settings.drain_timeout_s,
                new.reason,
            )
            self.changes.notify()

    # ---- the admin's way out ---------------------------------------------------------------------------

    def undrain(self, gpu: Gpu) -> Undrained:
        """Return a draining GPU to the pool whatever NVML shows (the admin's decision); the resets
        are still tried, and reported."""
        with self._checking:
            with self.booking.lock:
                old = self.marks.pop(gpu.minor, None)
                self.booking.set_draining(gpu.minor, False)
            steps: tuple[ResetStep, ...] = ()
            note = ""
            try:
                steps = self.inventory.reset_settings(gpu.index, self.settings.default_compute_mode)
                self._record_reset(gpu, steps)
            except IsolatorError as exc:
                note = f"; its settings could not be reset: {exc.message}"
            if gpu.minor in self._persisted or old is not None:
                try:
                    self.store.clear_drain(gpu.minor)
                    self._persisted.discard(gpu.minor)
                except IsolatorError as exc:
                    note += f"; its drain row could not be cleared ({exc.message}): a restart checks it again"
        name = f"GPU {gpu.index} (minor {gpu.minor}, {gpu.uuid})"
        if old is None:
            detail = f"{name} was not draining; nothing to do{note}"
        else:
            self.events["undrained"] += 1
            detail = (
                f"{name} returned to the pool by an admin; it was {old.state} since {_when(old.since)}: {old.reason}"
            )
            detail += note
            LOG.warning("admin: %s", detail)
            self.changes.notify()
        return Undrained(
            index=gpu.index,
            minor=gpu.minor,
            uuid=gpu.uuid,
            was="" if old is None else old.state,
            detail=detail,
            reset=tuple(str(s) for s in steps if s.changed or s.error),
        )

    def find(self, name: str) -> Gpu:
        """A managed GPU by NVML index, UUID or ``minor:N``."""
        for gpu in self.booking.gpus.values():
            if name in (str(gpu.index), gpu.uuid, f"minor:{gpu.minor}"):
                return gpu
        raise NotFound(f"no managed GPU '{name}' (give its index, its UUID or minor:<N>)")

    # ---- views -----------------------------------------------------------------------------------------

    def view(self) -> dict[int, DrainRecord]:
        with self.booking.lock:
            return dict(self.marks)

    def describe(self) -> str:
        """One line for the Health view."""
        marks = self.view()
        if not self.enabled:
            return "off (--drain-check off): released GPUs are handed out unchecked"
        if not marks:
            mode = compute_mode_name(self.settings.default_compute_mode)
            return f"every free GPU passed the handover check (compute mode {mode})"
        by_index = {g.minor: g.index for g in self.booking.gpus.values()}
        return "; ".join(
            f"GPU {by_index.get(m, m)} {r.state} since {_when(r.since)}"
            + (f" (pids {list(r.pids)})" if r.pids else "")
            + f": {r.reason}"
            for m, r in sorted(marks.items())
        )


def _when(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))
