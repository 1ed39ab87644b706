"""The GPUs' XID and double-bit ECC marks outlive the sidecar: at start the marks the state store
kept are put on the GPUs again (before the core reads their health), and from then on every such mark
or reset is kept. It decides which marks count and applies them through its two ports; it never
books, drains or resets a GPU (core/booking.py, core/handover.py, core/maintenance.py do).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from isolator.model import GpuHealth, GpuRecord, HealthEvent, HealthMark

LOG = logging.getLogger(__name__)


class MarkedInventory(Protocol):
    """What the rule uses of the inventory (isolator/gpu/nvml.py's ``Inventory``, the shipped fake)."""

    @property
    def records(self) -> tuple[GpuRecord, ...]: ...

    def mark_unhealthy(self, index: int, reason: str, xid: int = 0, when: float = 0.0, source: str = "xid") -> None: ...

    def on_health_change(self, callback: Callable[[HealthEvent], None]) -> None: ...


class MarkStore(Protocol):
    """Where the marks are kept (isolator/host/state.py's ``StateStore``, the shipped fake)."""

    def health_marks(self) -> Sequence[HealthMark]: ...

    def put_health_mark(self, mark: HealthMark) -> None: ...

    def drop_health_mark(self, uuid: str) -> None: ...


def to_restore(marks: Sequence[HealthMark], records: Sequence[GpuRecord]) -> list[tuple[int, HealthMark]]:
    """(GPU index, its mark) for each kept mark of a GPU managed now; a mark of a GPU not managed (or not
    visible) now waits in the store for it."""
    by_uuid = {r.gpu.uuid: r.gpu.index for r in records if r.gpu.uuid}
    return [(by_uuid[m.uuid], m) for m in marks if m.uuid in by_uuid]


def lasting_mark(uuid: str, health: GpuHealth, lasting: Collection[str]) -> HealthMark | None:
    """The mark to keep for a GPU of this health: one when it is unhealthy for a ``lasting`` reason (only
    a reset clears it); None when it is healthy, or unhealthy for a passing reason (a lost GPU, NVML not
    answering), which the next probe sees again by itself."""
    if health.healthy or health.source not in lasting:
        return None
    return HealthMark(uuid, health.source, health.reason, health.last_xid, health.last_xid_time)


class HealthMarks:
    """Keeps the inventory's lasting marks in the store, both ways. ``lasting``: the health sources only
    a reset clears (isolator/gpu/health.py ``RESET_CLEARS``: an XID, a double-bit ECC error)."""

    def __init__(self, inventory: MarkedInventory, store: MarkStore, lasting: Collection[str]) -> None:
        self.inventory = inventory
        self.store = store
        self.lasting = frozenset(lasting)

    def start(self) -> None:
        """Put the kept marks on the GPUs again, then follow every change of health."""
        for index, mark in to_restore(self.store.health_marks(), self.inventory.records):
            LOG.warning("GPU %d (%s) stays unhealthy: %s, recorded before this start", index, mark.uuid, mark.reason)
            self.inventory.mark_unhealthy(index, mark.reason, mark.xid, mark.at, mark.source)
        self.inventory.on_health_change(self.follow)

    def follow(self, event: HealthEvent) -> None:
        """A GPU's health changed: keep its mark, or drop it. A failure is logged: the mark stays in
        memory, and only a restart would forget it."""
        try:
            record = next((r for r in self.inventory.records if r.gpu.index == event.index), None)
            if record is None:
                raise LookupError("not managed by this sidecar")
            mark = lasting_mark(event.uuid, record.health, self.lasting)
            if mark is not None:
                self.store.put_health_mark(mark)
            elif record.health.healthy:
                self.store.drop_health_mark(event.uuid)
        except Exception as exc:
            LOG.error("failed to record the health of GPU %d (%s): %s", event.index, event.uuid, exc)
