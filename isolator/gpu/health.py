"""The GPUs' health, watched: XID and double-bit ECC events mark a GPU unhealthy; a rescan
(``request_rescan``: kernel device events from isolator/gpu/uevents.py, a failed event wait, or the
periodic probe noticing a lost GPU or a MIG mode change) re-initialises NVML, reads the GPUs again
by UUID and marks them unhealthy (gone) or healthy again (back, or reset since their XID).

``HealthWatch`` is the inventory's health half (isolator/gpu/nvml.py's ``Inventory`` extends it): it
owns the event thread and the records' health, and reads the GPUs again through the inventory's
reader. NVML is reached only through isolator/gpu/nvmlcall.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from isolator.errors import NvmlError
from isolator.gpu import nvmlcall as nv
from isolator.model import GpuHealth, GpuRecord, HealthEvent

LOG = logging.getLogger(__name__)

# The event types k8s-device-plugin registers (k8s-topology.md section 2.4). XIDs outside the
# ignored list and double-bit ECC errors mark a GPU unhealthy; single-bit errors are corrected by
# the hardware and only logged.
WATCHED_EVENTS = nv.EVENT_XID | nv.EVENT_DOUBLE_BIT_ECC | nv.EVENT_SINGLE_BIT_ECC

# Why a GPU is unhealthy, which decides what makes it healthy again (``HealthWatch._rescan_now``).
HEALTH_XID = "xid"  # an XID: healthy again only after the GPU was reset (unbound, driver reloaded)
HEALTH_ECC = "ecc"  # a double-bit ECC error: likewise
HEALTH_ABSENT = "absent"  # NVML no longer enumerates it: healthy when it is back
HEALTH_NVML = "nvml"  # NVML failed (event wait, init): unknown until an event wait works again
HEALTH_REGISTER = "register"  # could not be registered for events: retried by the next rescan
RESET_CLEARS = (HEALTH_XID, HEALTH_ECC)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class HealthWatch:
    """The records' health and the thread that watches it (the inventory's health half)."""

    driver_version: str  # the inventory's, read again by a rescan

    def __init__(self, *, ignored_xids: Iterable[int], poll_ms: int, probe_s: float, retry_s: float) -> None:
        self.ignored_xids = frozenset(ignored_xids)
        self.poll_ms = poll_ms
        self.probe_s = probe_s  # how often the GPUs are probed for loss or a MIG mode change (0: never)
        self.retry_s = retry_s  # pause before re-initialising NVML after it failed
        self._lock = threading.RLock()
        self._records: dict[int, GpuRecord] = {}
        self._handles: dict[int, object] = {}
        self._callbacks: list[Callable[[HealthEvent], None]] = []
        self._open = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: object | None = None
        self._rescan = threading.Event()
        self._rescan_reasons: list[str] = []
        self._reset: set[str] = set()  # UUIDs reset (gone, or the driver went away) since marked
        self._answering = True  # False from a failed event wait or re-initialisation until a wait works
        self.rescans = 0  # completed rescans, for callers that wait on one

    # ---- what the inventory reads (isolator/gpu/nvml.py) ---------------------------------------

    def healthy(self) -> frozenset[int]:
        raise NotImplementedError

    def _read_gpu(self, index: int, mig_minors: dict[str, int]) -> tuple[GpuRecord, object | None]:
        raise NotImplementedError

    def _mig_minors(self) -> dict[str, int]:
        raise NotImplementedError

    # ---- the watch ---------------------------------------------------------------------------

    def on_health_change(self, callback: Callable[[HealthEvent], None]) -> None:
        """Call ``callback(HealthEvent)`` (on the event thread) whenever a GPU's health changes."""
        with self._lock:
            self._callbacks.append(callback)

    @property
    def nvml_answering(self) -> bool:
        """False while NVML does not answer (driver unloaded, event wait failing): from the failure
        until an event wait works again. The daemon's gRPC health follows it."""
        return self._answering

    def bus_ids(self) -> frozenset[str]:
        """The managed GPUs' PCI addresses (sysfs form), for matching kernel device events."""
        with self._lock:
            return frozenset(r.gpu.pci_bus_id for r in self._records.values() if r.gpu.pci_bus_id)

    def _set_health(self, index: int, health: GpuHealth) -> None:
        """Record ``health`` for GPU ``index`` and tell subscribers when its usability changed."""
        with self._lock:
            record = self._records.get(index)
            if record is None:
                return
            self._records[index] = replace(record, health=health)
        self._announce({index: record})

    def _announce(self, before: dict[int, GpuRecord]) -> None:
        """Call the callbacks for every GPU of ``before`` whose usability differs now."""
        events = []
        with self._lock:
            callbacks = list(self._callbacks)
            for index, old in sorted(before.items()):
                new = self._records.get(index)
                if new is None or (new.usable == old.usable and new.status == old.status):
                    continue
                if new.usable:
                    LOG.warning("GPU %d (%s) is healthy again", index, new.gpu.uuid)
                else:
                    LOG.error("GPU %d (%s) is unhealthy: %s", index, new.gpu.uuid, new.status)
                h = new.health
                events.append(HealthEvent(index, new.gpu.uuid, new.usable, new.status, h.last_xid, h.last_xid_time))
        for event in events:
            for cb in callbacks:
                try:
                    cb(event)
                except Exception:
                    LOG.exception("health callback %r failed", cb)

    def mark_unhealthy(
        self, index: int, reason: str, xid: int = 0, when: float = 0.0, source: str = HEALTH_XID
    ) -> None:
        with self._lock:
            record = self._records.get(index)
            if record is None:
                return
            health = GpuHealth(
                healthy=False,
                reason=reason,
                last_xid=xid or record.health.last_xid,
                last_xid_time=when or record.health.last_xid_time,
                source=source,
            )
        self._set_health(index, health)

    def _lose_sight(self, reason: str) -> None:
        """NVML failed: every healthy GPU's health is unknown until a rescan succeeds."""
        self._answering = False
        with self._lock:
            indices = [i for i, r in self._records.items() if r.health.healthy]
        for index in indices:
            self.mark_unhealthy(index, reason, source=HEALTH_NVML)

    def request_rescan(self, reason: str, reset_bus: str = "", reset_all: bool = False) -> None:
        """Read the GPUs again on the health thread, soon. ``reset_bus`` names a GPU (PCI address)
        that was reset, ``reset_all`` says the driver was: their XID and ECC marks are history."""
        with self._lock:
            self._rescan_reasons.append(reason)
            for r in self._records.values():
                if r.gpu.uuid and (reset_all or (reset_bus and r.gpu.pci_bus_id == reset_bus)):
                    self._reset.add(r.gpu.uuid)
        self._rescan.set()

    def device_changed(self, change: Any) -> None:
        """An isolator.gpu.uevents.Change: the uevent watch's callback."""
        self.request_rescan(change.reason, change.reset_bus, change.reset_all)

    def start_health_watch(self) -> None:
        """Register for XID and ECC events on every GPU read and watch them on a background thread.

        As k8s-device-plugin does: a GPU that cannot be registered is unhealthy at once, except
        when NVML says events are not supported (too old to health-check: warn and go on).
        """
        if self._thread is not None:
            return
        self._event_set = self._register_events()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="nvml-events", daemon=True)
        self._thread.start()

    def _register_events(self) -> object:
        event_set = nv.call("nvmlEventSetCreate", op="create event set")
        with self._lock:
            handles = dict(self._handles)
        for index, handle in handles.items():
            try:
                supported = nv.call("nvmlDeviceGetSupportedEventTypes", handle)
                nv.call("nvmlDeviceRegisterEvents", handle, WATCHED_EVENTS & supported, event_set)
            except NvmlError as exc:
                if nv.code(exc) == nv.NOT_SUPPORTED:
                    LOG.warning("GPU %d is too old to support health checking", index)
                else:
                    self.mark_unhealthy(index, f"cannot watch for XID events: {nv.cause(exc)}", source=HEALTH_REGISTER)
        return event_set

    def _free_event_set(self) -> None:
        if self._event_set is not None:
            try:
                nv.call("nvmlEventSetFree", self._event_set)
            except NvmlError as exc:
                LOG.warning("failed to free the NVML event set: %s", nv.cause(exc))
            self._event_set = None

    def _watch(self) -> None:
        next_probe = time.monotonic() + self.probe_s
        while not self._stop.is_set():
            if self._rescan.is_set():
                self._rescan.clear()
                self._rescan_now()
            if self.probe_s and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self.probe_s
                self._probe()
            if self._event_set is None:
                # NVML is down (driver unloaded?): try again after a pause, or sooner on a uevent.
                if self._rescan.wait(self.retry_s):
                    continue
                self.request_rescan("retrying NVML")
                continue
            try:
                data = nv.call("nvmlEventSetWait", self._event_set, self.poll_ms)
            except NvmlError as exc:
                if nv.code(exc) == nv.TIMEOUT:
                    self._sight_regained()
                    continue
                if self._stop.is_set():
                    break
                # Blind to XIDs, nothing handed out is known to be sound (k8s-device-plugin marks
                # every device unhealthy here too); unlike it, re-initialise NVML and recover.
                self._lose_sight(f"health unknown: NVML event wait failed: {nv.cause(exc)}")
                self._stop.wait(self.retry_s)
                self.request_rescan(f"event wait failed: {nv.cause(exc)}")
                continue
            self._sight_regained()
            self._handle_event(data)

    def _sight_regained(self) -> None:
        """An event wait worked: GPUs whose health was unknown only for NVML's sake are healthy."""
        self._answering = True
        with self._lock:
            blind = [i for i, r in self._records.items() if r.health.source == HEALTH_NVML and i in self._handles]
            if not blind:
                return
            before = {i: self._records[i] for i in blind}
            for i in blind:
                old = self._records[i].health
                self._records[i] = replace(
                    self._records[i], health=GpuHealth(last_xid=old.last_xid, last_xid_time=old.last_xid_time)
                )
        self._announce(before)

    def _probe(self) -> None:
        """A cheap look for what no event announces: a lost GPU or a changed MIG mode."""
        with self._lock:
            items = [(i, self._handles.get(i), r) for i, r in self._records.items() if r.gpu.uuid]
        for index, handle, record in items:
            if handle is None:
                if record.health.source == HEALTH_ABSENT:
                    continue  # still gone; a uevent or the next rescan brings it back
                self.request_rescan(f"GPU {index} has no NVML handle")
                return
            try:
                uuid = _text(nv.call("nvmlDeviceGetUUID", handle))
                mode = self._mig_mode(handle)
            except NvmlError as exc:
                self.request_rescan(f"GPU {index} does not answer: {nv.cause(exc)}")
                return
            if uuid != record.gpu.uuid or (mode is not None and mode != record.mig_enabled):
                self.request_rescan(f"GPU {index} changed (MIG mode or identity)")
                return

    @staticmethod
    def _mig_mode(handle: object) -> bool | None:
        try:
            current, _pending = nv.call("nvmlDeviceGetMigMode", handle)
        except NvmlError as exc:
            if nv.absent(exc):
                return None
            raise
        return bool(current == nv.DEVICE_MIG_ENABLE)

    def rescan(self) -> bool:
        """Re-initialise NVML and read the managed GPUs again, matched by UUID (their NVML index
        may have changed); True when NVML answered. Runs on the caller's thread: the health thread
        does it for ``request_rescan``; without that thread, callers may call it directly."""
        return self._rescan_now()

    def _rescan_now(self) -> bool:
        with self._lock:
            reasons, self._rescan_reasons = self._rescan_reasons, []
            before = dict(self._records)
        LOG.info("reading the GPUs again: %s", "; ".join(dict.fromkeys(reasons)) or "requested")
        self._free_event_set()
        if self._open:
            try:
                nv.call("nvmlShutdown")
            except NvmlError as exc:
                LOG.debug("nvmlShutdown before re-initialising: %s", nv.cause(exc))
            self._open = False
        try:
            nv.call("nvmlInit")
            self._open = True
            self.driver_version = _text(nv.call("nvmlSystemGetDriverVersion"))
            present: dict[str, tuple[int, object]] = {}
            for i in range(int(nv.call("nvmlDeviceGetCount"))):
                try:
                    handle = nv.call("nvmlDeviceGetHandleByIndex", i)
                    present[_text(nv.call("nvmlDeviceGetUUID", handle))] = (i, handle)
                except NvmlError as exc:
                    LOG.warning("GPU at NVML index %d does not answer: %s", i, nv.cause(exc))
        except NvmlError as exc:
            with self._lock:
                self._reset.update(r.gpu.uuid for r in self._records.values())
                self._handles = {}
            self._lose_sight(f"health unknown: NVML unavailable: {nv.cause(exc)}")
            self.rescans += 1
            return False
        mig_minors = self._mig_minors()
        with self._lock:
            handles: dict[int, object] = {}
            for index, old in before.items():
                uuid = old.gpu.uuid
                if not uuid:
                    continue
                if uuid not in present:
                    self._reset.add(uuid)
                    gone = "not visible to NVML: unbound from the driver, removed or lost"
                    health = old.health if not old.health.healthy and old.health.source in RESET_CLEARS else None
                    self._records[index] = replace(
                        old, health=health or replace(old.health, healthy=False, reason=gone, source=HEALTH_ABSENT)
                    )
                    continue
                now_index, handle = present[uuid]
                fresh, _ = self._read_gpu(now_index, mig_minors)
                fresh = replace(fresh, gpu=replace(fresh.gpu, index=index))
                if fresh.gpu.minor != old.gpu.minor:
                    fresh = replace(fresh, errors=(*fresh.errors, f"minor changed from {old.gpu.minor}"))
                if fresh.mig_enabled != old.mig_enabled:
                    LOG.warning("GPU %d: MIG mode is now %s", index, "enabled" if fresh.mig_enabled else "disabled")
                health = old.health
                # Back, or reset since its XID/ECC error. "Health unknown" (HEALTH_NVML) waits for an
                # event wait that works (``_watch``): NVML answering nvmlInit is not enough.
                if not health.healthy and (
                    health.source in (HEALTH_ABSENT, HEALTH_REGISTER)
                    or (health.source in RESET_CLEARS and uuid in self._reset)
                ):
                    health = GpuHealth(last_xid=health.last_xid, last_xid_time=health.last_xid_time)
                self._reset.discard(uuid)
                self._records[index] = replace(fresh, health=health)
                handles[index] = handle
            self._handles = handles
        try:
            self._event_set = self._register_events()
        except NvmlError as exc:
            self._lose_sight(f"health unknown: {exc.message}")
        self.rescans += 1
        self._announce(before)
        return True

    def _handle_event(self, data: Any) -> None:
        kind = data.eventType
        if kind == nv.EVENT_SINGLE_BIT_ECC:
            LOG.info("single-bit ECC error corrected on a GPU; it stays healthy")
            return
        if kind not in (nv.EVENT_XID, nv.EVENT_DOUBLE_BIT_ECC):
            LOG.info("skipping NVML event type %#x", kind)
            return
        ecc = kind == nv.EVENT_DOUBLE_BIT_ECC
        xid = 0 if ecc else int(data.eventData)
        what = "double-bit ECC error" if ecc else f"XID {xid}"
        source = HEALTH_ECC if ecc else HEALTH_XID
        try:
            uuid = _text(nv.call("nvmlDeviceGetUUID", data.device))
        except NvmlError as exc:
            why = f"{what} on a GPU whose UUID cannot be read: {nv.cause(exc)}"
            for index in self.healthy():
                self.mark_unhealthy(index, why, xid, time.time(), source)
            return
        with self._lock:
            found = next((i for i, r in self._records.items() if r.gpu.uuid == uuid), None)
        if found is None:
            LOG.info("%s on GPU %s, which this sidecar does not manage", what, uuid)
            return
        if not ecc and xid in self.ignored_xids:
            LOG.info("GPU %d: XID %d is an application error; it stays healthy", found, xid)
            return
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        where = f" (GPU instance {gi}, compute instance {ci})" if gi != 0xFFFFFFFF and not ecc else ""
        self.mark_unhealthy(found, f"{what}{where}", xid, time.time(), source)
