"""``FakeStore``: an in-memory state store (isolator.core.ports.RecordStore) with fault points.

Same refusals as the SQLite store (tests/contract/test_contracts.py runs one suite on both): a container
recorded twice, a GPU held twice, a writer on an unknown container, a shrink of GPUs not held,
an unknown state. Each call is atomic: it changes everything or nothing. ``faults`` fails a step
by name with a StateError, as a full disk or a read-only file would (isolator/testing/faults.py);
``lose_everything`` empties it, as a deleted state file would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from isolator.devicerule import DeviceRule
from isolator.errors import (
    ContainerAlreadyRecorded,
    ContainerNotRecorded,
    GpuAlreadyHeld,
    InvalidArgument,
    StateError,
)
from isolator.host.state import CGROUP_VERSIONS, STATES
from isolator.model import (
    ContainerId,
    ContainerRecord,
    DrainRecord,
    EndedDrain,
    HealthMark,
    Holding,
    MaintenanceMark,
    RecordState,
    Share,
    ShareMode,
)
from isolator.testing.faults import Faults


class FakeStore:
    def __init__(self, path: str = "<memory>") -> None:
        self.path = path
        self._lock = threading.Lock()
        self._records: dict[ContainerId, ContainerRecord] = {}
        self._drains: dict[int, DrainRecord] = {}
        self._maintenance: dict[str, MaintenanceMark] = {}
        self._health_marks: dict[str, HealthMark] = {}
        self._history: list[EndedDrain] = []  # ended maintenance drains, the audit trail
        self._mps_ended: dict[ContainerId, str] = {}  # sharers ended by a lost MPS server or daemon
        self.closed = False
        self.commits = 0  # successful writes: what the real store would fsync
        self.faults = Faults(lambda step, cid: StateError(op=step, path=self.path, cause="injected fault"))

    # ---- writes -------------------------------------------------------------------------------------

    def record(self, rec: ContainerRecord) -> None:
        self.faults.check("record", rec.container_id)
        if rec.state not in STATES:
            raise InvalidArgument(f"unknown container state {rec.state!r} (known: {', '.join(STATES)})")
        if rec.cgroup_version not in CGROUP_VERSIONS:
            raise InvalidArgument(f"cgroup version must be 1 or 2, not {rec.cgroup_version!r}")
        if bool(rec.cpus) != bool(rec.mems):
            raise InvalidArgument(f"container {rec.container_id}: a cpuset needs both CPUs and memory nodes")
        with self._lock:
            if rec.container_id in self._records:
                raise ContainerAlreadyRecorded(container=str(rec.container_id))
            held = rec.holding
            self._check_free(rec.container_id, held.gpus)
            self._check_mig_free(rec.container_id, held.mig)
            self._check_share(rec.container_id, held.share)
            holding = Holding(frozenset(held.gpus), frozenset(held.mig), held.share)
            self._records[rec.container_id] = replace(rec, holding=holding)
            self.commits += 1

    def add_gpus(self, cid: ContainerId, minors: Iterable[int]) -> ContainerRecord:
        self.faults.check("add_gpus", cid)
        want = frozenset(minors)
        with self._lock:
            rec = self._require(cid)
            self._check_free(cid, want)
            rec = self._records[cid] = replace(rec, holding=rec.holding.with_gpus(rec.holding.gpus | want))
            self.commits += 1
            return rec

    def remove_gpus(self, cid: ContainerId, minors: Iterable[int]) -> ContainerRecord:
        self.faults.check("remove_gpus", cid)
        want = frozenset(minors)
        with self._lock:
            rec = self._require(cid)
            held = rec.holding.gpus
            stray = sorted(want - held)
            if stray:
                raise InvalidArgument(f"container {cid} does not hold GPUs {stray} (it holds {sorted(held)})")
            rec = self._records[cid] = replace(rec, holding=rec.holding.with_gpus(held - want))
            self.commits += 1
            return rec

    def set_holding(self, cid: ContainerId, holding: Holding) -> ContainerRecord:
        self.faults.check("set_holding", cid)
        with self._lock:
            rec = self._require(cid)
            self._records[cid] = replace(rec, holding=Holding())
            try:
                self._check_free(cid, holding.gpus)
                self._check_mig_free(cid, holding.mig)
                self._check_share(cid, holding.share)
            except BaseException:
                self._records[cid] = rec
                raise
            rec = self._records[cid] = replace(
                rec, holding=Holding(frozenset(holding.gpus), frozenset(holding.mig), holding.share)
            )
            if holding.share is None:
                self._mps_ended.pop(cid, None)  # its end goes with its last share
            self.commits += 1
            return rec

    def update(
        self,
        cid: ContainerId,
        *,
        state: RecordState | None = None,
        rules: tuple[DeviceRule, ...] | None = None,
        volume_version: str | None = None,
        cgroup: str | None = None,
        lazy: bool = False,
    ) -> ContainerRecord:
        self.faults.check("update", cid)
        if state is not None and state not in STATES:
            raise InvalidArgument(f"unknown container state {state!r} (known: {', '.join(STATES)})")
        changes: dict[str, Any] = {"state": state, "rules": rules, "volume_version": volume_version, "cgroup": cgroup}
        with self._lock:
            rec = self._require(cid)
            rec = self._records[cid] = replace(rec, **{k: v for k, v in changes.items() if v is not None})
            self.commits += 0 if lazy else 1  # a lazy write is not fsynced
            return rec

    def set_cpuset(self, cid: ContainerId, cpus: str, mems: str) -> ContainerRecord:
        self.faults.check("set_cpuset", cid)
        if bool(cpus) != bool(mems):
            raise InvalidArgument(f"container {cid}: a cpuset needs both CPUs ({cpus!r}) and memory nodes ({mems!r})")
        with self._lock:
            rec = self._require(cid)
            rec = self._records[cid] = replace(rec, cpus=cpus, mems=mems)
            self.commits += 1
            return rec

    def remove(self, cid: ContainerId) -> ContainerRecord:
        self.faults.check("remove", cid)
        with self._lock:
            rec = self._require(cid)
            del self._records[cid]
            self._mps_ended.pop(cid, None)
            self.commits += 1
            return rec

    def set_drain(self, rec: DrainRecord) -> None:
        self.faults.check("set_drain")
        if isinstance(rec.minor, bool) or not isinstance(rec.minor, int) or rec.minor < 0:
            raise InvalidArgument(f"GPU minor {rec.minor!r} is not a non-negative integer")
        with self._lock:
            self._drains[rec.minor] = replace(rec, pids=tuple(rec.pids))
            self.commits += 1

    def clear_drain(self, minor: int) -> None:
        self.faults.check("clear_drain")
        with self._lock:
            self._drains.pop(minor, None)
            self.commits += 1

    def set_maintenance(self, mark: MaintenanceMark) -> None:
        self.faults.check("set_maintenance")
        if not mark.uuid or not mark.reason:
            raise InvalidArgument("a maintenance drain needs a GPU UUID and a reason")
        with self._lock:
            self._maintenance[mark.uuid] = mark
            self.commits += 1

    def clear_maintenance(self, uuid: str) -> None:
        self.faults.check("clear_maintenance")
        with self._lock:
            self._maintenance.pop(uuid, None)
            self.commits += 1

    def put_health_mark(self, mark: HealthMark) -> None:
        self.faults.check("put_health_mark")
        with self._lock:
            self._health_marks[mark.uuid] = mark
            self.commits += 1

    def drop_health_mark(self, uuid: str) -> None:
        self.faults.check("drop_health_mark")
        with self._lock:
            self._health_marks.pop(uuid, None)
            self.commits += 1

    def end_maintenance(self, ended: EndedDrain) -> None:
        self.faults.check("end_maintenance")
        if not ended.uuid or not ended.reason:
            raise InvalidArgument("an ended drain needs a GPU UUID and its reason")
        with self._lock:
            self._maintenance.pop(ended.uuid, None)
            self._history.append(ended)
            self.commits += 1

    def maintenance_history(self) -> list[EndedDrain]:
        self.faults.check("maintenance_history")
        with self._lock:
            return sorted(self._history, key=lambda e: e.ended)

    # ---- reads --------------------------------------------------------------------------------------

    def health_marks(self) -> list[HealthMark]:
        with self._lock:
            return list(self._health_marks.values())

    def maintenance(self) -> dict[str, MaintenanceMark]:
        self.faults.check("maintenance")
        with self._lock:
            return dict(self._maintenance)

    def drains(self) -> dict[int, DrainRecord]:
        self.faults.check("drains")
        with self._lock:
            return dict(self._drains)

    def get(self, cid: ContainerId) -> ContainerRecord | None:
        self.faults.check("get", cid)
        with self._lock:
            return self._records.get(cid)

    def has(self, cid: ContainerId) -> bool:
        self.faults.check("has", cid)
        with self._lock:
            return cid in self._records

    def load(self) -> dict[ContainerId, ContainerRecord]:
        self.faults.check("load")
        with self._lock:
            return dict(self._records)

    def holders(self) -> dict[int, ContainerId]:
        self.faults.check("holders")
        with self._lock:
            return {m: cid for cid, rec in self._records.items() for m in rec.holding.gpus}

    def share_holders(self) -> dict[ContainerId, tuple[int, int, str]]:
        self.faults.check("share_holders")
        with self._lock:
            shares = {c: r.holding.share for c, r in self._records.items()}
            return {c: (s.gpu, s.count, str(s.mode)) for c, s in shares.items() if s is not None}

    def end_mps_sharers(self, ends: dict[ContainerId, str]) -> None:
        if not ends:
            return
        self.faults.check("end_mps_sharers")
        with self._lock:
            for cid, why in ends.items():
                if cid in self._records:
                    self._mps_ended.setdefault(cid, why)
            self.commits += 1

    def mps_ended(self) -> dict[ContainerId, str]:
        self.faults.check("mps_ended")
        with self._lock:
            return dict(self._mps_ended)

    def mig_holders(self) -> dict[str, tuple[ContainerId, int]]:
        self.faults.check("mig_holders")
        with self._lock:
            return {u: (cid, m) for cid, rec in self._records.items() for u, m in rec.holding.mig}

    def check(self) -> str:
        self.faults.check("check")
        return "ok"

    def close(self) -> None:
        self.closed = True

    # ---- for tests ----------------------------------------------------------------------------------

    def lose_everything(self) -> None:
        with self._lock:
            self._records.clear()
            self._drains.clear()
            self._maintenance.clear()
            self._history.clear()
            self._mps_ended.clear()

    # ---- internals ----------------------------------------------------------------------------------

    def _require(self, cid: ContainerId) -> ContainerRecord:
        rec = self._records.get(cid)
        if rec is None:
            raise ContainerNotRecorded(container=str(cid))
        return rec

    def _check_free(self, cid: ContainerId, minors: frozenset[int]) -> None:
        for minor in sorted(minors):
            if isinstance(minor, bool) or not isinstance(minor, int) or minor < 0:
                raise InvalidArgument(f"GPU minor {minor!r} is not a non-negative integer")
            for other, rec in self._records.items():
                if minor in rec.holding.gpus or minor in rec.holding.mig_parents:  # never whole and through MIG
                    raise GpuAlreadyHeld(gpu=minor, container=str(cid), holder=str(other))
                if minor in rec.holding.shared:  # nor whole and shared (docs/sharing.md)
                    raise GpuAlreadyHeld(gpu=minor, container=str(cid), holder=str(other))

    def _check_share(self, cid: ContainerId, share: Share | None) -> None:
        if share is None:
            return
        minor, n = share.gpu, share.count
        if isinstance(minor, bool) or not isinstance(minor, int) or minor < 0:
            raise InvalidArgument(f"shared GPU minor {minor!r} is not a non-negative integer")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"share count {n!r} of GPU {minor} is not a positive integer")
        if share.mode not in tuple(ShareMode):
            raise InvalidArgument(f"unknown sharing mode {share.mode!r} of GPU {minor}")
        uid = share.uid
        if uid is not None and (isinstance(uid, bool) or not isinstance(uid, int) or uid < 0):
            raise InvalidArgument(f"uid {uid!r} of a sharer of GPU {minor} is not a non-negative integer")
        for other, held in self._records.items():
            if minor in held.holding.gpus:
                raise GpuAlreadyHeld(gpu=f"{minor} (shared)", container=str(cid), holder=str(other))

    def _check_mig_free(self, cid: ContainerId, mig: frozenset[tuple[str, int]]) -> None:
        for uuid, parent in sorted(mig):
            if not isinstance(uuid, str) or not uuid.startswith("MIG-") or isinstance(parent, bool):
                raise InvalidArgument(f"MIG device {uuid!r} is not a MIG UUID with a parent GPU minor")
            if not isinstance(parent, int) or parent < 0:
                raise InvalidArgument(f"parent GPU minor {parent!r} of {uuid} is not a non-negative integer")
            for other, rec in self._records.items():
                if uuid in rec.holding.mig_uuids:
                    raise GpuAlreadyHeld(gpu=uuid, container=str(cid), holder=str(other))
                if parent in rec.holding.gpus:
                    raise GpuAlreadyHeld(gpu=f"{parent} (parent of {uuid})", container=str(cid), holder=str(other))
