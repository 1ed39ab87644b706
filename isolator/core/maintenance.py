"""An operator's maintenance drain (``gpu-isolator drain GPU --reason TEXT``, docs/operations.md): a
healthy GPU taken out of service on purpose, as ``kubectl cordon`` does to a node.

It owns the marks (GPU UUID -> why, since when, who asked), persisted in the state store before they
count, and puts them into the books through ``Booking``'s methods; it never chooses GPUs, and never
takes a GPU from its holder: a drained GPU is only never granted anew, whole or as a MIG device on it.
Not the handover check (core/handover.py), which the sidecar sets and clears by itself after each release.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from isolator.core.booking import Booking
from isolator.core.ports import Clock, GpuInventory, RecordStore
from isolator.errors import FailedPrecondition, InvalidArgument, NotFound
from isolator.model import DrainRecord, EndedDrain, Gpu, MaintenanceChange, MaintenanceMark

LOG = logging.getLogger(__name__)

MAX_REASON = 512


class _Handover(Protocol):
    def find(self, name: str) -> Gpu: ...

    def view(self) -> dict[int, DrainRecord]: ...


class _Core(Protocol):
    """What the maintenance drain uses of ``isolator.core.context.Core`` (which builds it)."""

    clock: Clock
    store: RecordStore
    booking: Booking
    inventory: GpuInventory

    @property
    def handover(self) -> _Handover: ...

    @property
    def gpus(self) -> dict[int, Gpu]: ...


def label(gpu: Gpu) -> str:
    """How a refusal names a drained GPU: ``GPU 3 (GPU-...)``, its NVML index as nvidia-smi numbers it."""
    return f"GPU {gpu.index} ({gpu.uuid})"


def checked_reason(reason: str, required: bool = True) -> str:
    """A drain's reason (required) or its end's (``required=False``: "" when none is given)."""
    text = reason.strip()
    if not text and not required:
        return ""
    if not text:
        raise InvalidArgument(
            "a drain needs a reason (--reason TEXT): it is shown in gpus, describe and health, so whoever"
            " finds the GPU out of service knows why and whom to ask"
        )
    if len(text) > MAX_REASON:
        raise InvalidArgument(f"the reason is {len(text)} characters; at most {MAX_REASON}")
    # str.isprintable: C0 and C1 controls (NEL, 8-bit CSI), line and paragraph separators (U+2028, which
    # str.splitlines splits at) and format characters (a right-to-left override that shows the reason
    # reversed in gpus, describe and health) are refused with the tab and the newline.
    if not text.replace(" ", "x").isprintable():
        raise InvalidArgument("the reason must be one line of printable text (no control characters)")
    return text


class Maintenance:
    def __init__(self, core: _Core) -> None:
        self.core = core
        self.marks: dict[str, MaintenanceMark] = {}  # GPU UUID -> its drain; under core.booking.lock
        self._changing = threading.Lock()  # one drain or undrain at a time: store row and books in step

    def load(self) -> None:
        """The persisted drains, at start (before the books are first filled). A drained GPU this host
        does not show any more keeps its row: it is drained again when it comes back."""
        rows = self.core.store.maintenance()
        managed = {g.uuid for g in self.core.gpus.values()}
        with self.core.booking.lock:
            self.marks = dict(rows)
        for uuid, mark in sorted(rows.items()):
            if uuid in managed:
                since = _when(mark.since)
                LOG.info("GPU %s stays drained for maintenance (since %s, %s): %s", uuid, since, mark.by, mark.reason)
            else:
                LOG.warning("GPU %s is drained for maintenance but not managed here; the drain stays recorded", uuid)

    def apply(self) -> None:
        """Put the marks into the books (after they were rebuilt). Call with ``core.booking.lock`` held."""
        booking = self.core.booking
        booking.lock.require("maintenance.apply")
        for gpu in booking.gpus.values():
            if gpu.uuid in self.marks:
                booking.drain_for_maintenance(gpu.minor, label(gpu))

    # ---- the admin calls --------------------------------------------------------------------------

    def drain(self, name: str, reason: str, by: str) -> MaintenanceChange:
        core = self.core
        text = checked_reason(reason)
        gpu = core.handover.find(name)
        if not gpu.uuid:
            raise FailedPrecondition(f"GPU {name} has no UUID NVML could read; it cannot be drained by it")
        with self._changing:
            old = self.marks.get(gpu.uuid)
            mark = MaintenanceMark(gpu.uuid, text, old.since if old else core.clock.time(), by)
            # Recorded first: a drain the store did not take would end at the next restart unseen.
            core.store.set_maintenance(mark)
            with core.booking.lock:
                self.marks[gpu.uuid] = mark
                core.booking.drain_for_maintenance(gpu.minor, label(gpu))
        holders = self._holders(gpu)
        if old is None:
            detail = f"{_name(gpu)} drained for maintenance: no new grants of it"
        else:
            since = _when(old.since)
            detail = f"{_name(gpu)} was already drained for maintenance (since {since}, {old.by}); reason now"
        detail += f": {text}"
        if len(holders) == 1:
            detail += f"; {holders[0]} keeps it until it ends"
        elif holders:
            detail += f"; {', '.join(holders)} keep it until they end"
        LOG.info("admin (%s): %s", by, detail)  # an operator's decision, not an error
        return MaintenanceChange(
            gpu.index, gpu.minor, gpu.uuid, True, old is not None, text, mark.since, by, detail, tuple(holders)
        )

    def undrain(self, name: str, by: str, reason: str = "") -> MaintenanceChange:
        """End a drain; it is kept in the history with who ended it, when, and ``reason`` if given."""
        core = self.core
        why = checked_reason(reason, required=False)
        try:
            gpu = core.handover.find(name)
        except NotFound:
            if name not in self.view():
                raise
            return self._undrain_unmanaged(name, by, why)
        with self._changing:
            old = self.marks.get(gpu.uuid)
            if old is None:
                handover = core.handover.view().get(gpu.minor)
                if handover is not None:
                    raise FailedPrecondition(
                        f"{_name(gpu)} is not drained for maintenance; the handover check keeps it out"
                        f" ({handover.state} since {_when(handover.since)}: {handover.reason})."
                        f" It returns by itself once nothing runs on it; 'gpu-isolator undrain --handover {name}'"
                        " returns it now, whatever still runs on it"
                    )
                detail = f"{_name(gpu)} was not drained for maintenance; nothing to do"
                return MaintenanceChange(gpu.index, gpu.minor, gpu.uuid, False, False, "", 0.0, "", detail)
            core.store.end_maintenance(self._ended(old, by, why))
            with core.booking.lock:
                self.marks.pop(gpu.uuid, None)
                core.booking.end_maintenance(gpu.minor)
        detail = f"{_name(gpu)} is back in service (it was drained since {_when(old.since)}, {old.by}: {old.reason})"
        if why:
            detail += f"; ended: {why}"
        still = self._still_out(gpu)
        if still:
            detail += f"; still not handed out: {still}"
        LOG.info("admin (%s): %s", by, detail)
        holders = tuple(self._holders(gpu))
        return MaintenanceChange(
            gpu.index, gpu.minor, gpu.uuid, False, True, old.reason, old.since, old.by, detail, holders
        )

    def _ended(self, mark: MaintenanceMark, by: str, why: str) -> EndedDrain:
        return EndedDrain(mark.uuid, mark.reason, mark.since, mark.by, self.core.clock.time(), by, why)

    def history(self) -> list[EndedDrain]:
        """The ended drains, oldest end first (``gpu-isolator drain-history``)."""
        return self.core.store.maintenance_history()

    def _undrain_unmanaged(self, uuid: str, by: str, why: str = "") -> MaintenanceChange:
        """End the recorded drain of a GPU this sidecar does not manage now (left out by a changed
        --nvidia-gpu-devices, or gone from the host): by its UUID, the one name it still has here.
        Otherwise the drain could only be ended once the GPU is managed again, and it would come back
        drained. Index and minor stay 0: the GPU has neither here."""
        with self._changing:
            old = self.marks.get(uuid)
            if old is None:
                raise NotFound(f"no managed GPU '{uuid}' (give its index, its UUID or minor:<N>)")
            self.core.store.end_maintenance(self._ended(old, by, why))
            with self.core.booking.lock:
                self.marks.pop(uuid, None)
        detail = (
            f"the drain of GPU {uuid}, not managed here, is ended (it was drained since {_when(old.since)},"
            f" {old.by}: {old.reason})"
        )
        LOG.info("admin (%s): %s", by, detail)
        return MaintenanceChange(0, 0, uuid, False, True, old.reason, old.since, old.by, detail)

    # ---- views ----------------------------------------------------------------------------------

    def view(self) -> dict[str, MaintenanceMark]:
        with self.core.booking.lock:
            return dict(self.marks)

    def describe(self) -> str:
        """One line for the Health view."""
        marks = self.view()
        by_uuid = {g.uuid: g for g in self.core.gpus.values()}
        drained = [(by_uuid[u], m) for u, m in marks.items() if u in by_uuid]
        # Recorded drains of GPUs not managed now are shown too: they apply again when the GPU does.
        elsewhere = sorted((u, m) for u, m in marks.items() if u not in by_uuid)
        if not drained and not elsewhere:
            return "no GPU drained for maintenance"
        lines = [
            f"GPU {g.index} drained for maintenance since {_when(m.since)} ({m.by}): {m.reason}"
            for g, m in sorted(drained, key=lambda gm: gm[0].index)
        ]
        lines += [
            f"GPU {u} (not managed here; it comes back drained, 'gpu-isolator undrain {u}' ends that) drained for"
            f" maintenance since {_when(m.since)} ({m.by}): {m.reason}"
            for u, m in elsewhere
        ]
        return "; ".join(lines)

    def _holders(self, gpu: Gpu) -> list[str]:
        """Containers holding the GPU whole, a MIG device on it or shares of it (they keep it)."""
        store = self.core.store
        out = set()
        whole = store.holders().get(gpu.minor)
        if whole is not None:
            out.add(f"container {whole}")
        for cid, parent in store.mig_holders().values():
            if parent == gpu.minor:
                out.add(f"container {cid}")
        for cid, (minor, _shares, _mode) in store.share_holders().items():
            if minor == gpu.minor:
                out.add(f"container {cid}")
        return sorted(out)

    def _still_out(self, gpu: Gpu) -> str:
        """What else keeps the GPU from new grants after an undrain (the handover check, its health)."""
        reasons = []
        handover = self.core.handover.view().get(gpu.minor)
        if handover is not None:
            reasons.append(f"the handover check ({handover.state}: {handover.reason})")
        if gpu.index not in self.core.inventory.healthy():
            reasons.append("it is unhealthy (gpu-isolator gpus says why)")
        return "; ".join(reasons)


def _name(gpu: Gpu) -> str:
    return f"GPU {gpu.index} (minor {gpu.minor}, {gpu.uuid})"


def _when(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))
