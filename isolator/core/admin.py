"""The views behind ``gpu-isolator`` (docs/cli.md): gpus, topology, containers, describe, release,
volume, health. They read; only ``release`` changes anything.

A nested container is never recorded (it uses its top-level container's GPUs), so it is found
through the traces it leaves: its driver-volume user record and, in Mesos's layout, a child cgroup
``<parent>/mesos/<child>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from isolator.core import usage as usage_view
from isolator.core.context import Core
from isolator.errors import CgroupVanished, FailedPrecondition, IsolatorError, NotFound
from isolator.model import (
    ContainerId,
    ContainerInfo,
    ContainerRecord,
    Description,
    EndedDrain,
    GpuInfo,
    GpuList,
    HealthCheck,
    MaintenanceChange,
    Mode,
    Released,
    Share,
    ShareMode,
    TopologyLink,
    TopologyView,
    Undrained,
    VolumeReport,
)
from isolator.policy import attributes, drift
from isolator.policy import devices as devrules
from isolator.policy import mig as migunits
from isolator.policy.affinity import Affinity
from isolator.policy.shares import SharedGpu

LOG = logging.getLogger(__name__)


class Admin:
    """The admin views: gpus, topology, containers, describe, release, volume, health (part of IsolatorService)."""

    core: Core  # set by IsolatorService, which composes the three parts over one Core

    # ---- GPUs -------------------------------------------------------------------------------------

    def list_gpus(self) -> GpuList:
        inv = self.core.inventory
        holders = self.core.store.holders()
        mig_holders = {u: str(c) for u, (c, _m) in self.core.store.mig_holders().items()}
        marks = self.core.handover.view()
        resets = dict(self.core.handover.resets)
        maintenance = self.core.maintenance.view()
        sharers: dict[int, list[tuple[str, int]]] = {}
        for c, (m, n, _mode) in sorted(self.core.store.share_holders().items(), key=lambda kv: kv[0].chain()):
            sharers.setdefault(m, []).append((str(c), n))
        with self.core.booking.lock:
            shared = self.core.booking.shared
        gpus = []
        for r in inv.records:
            g = r.gpu
            holder = holders.get(g.minor) if g.uuid else None
            drain = marks.get(g.minor) if g.uuid else None
            # Drained past --drain-timeout: unhealthy, with the drain's reason when NVML gives none.
            sick = drain is not None and drain.timed_out
            out = maintenance.get(g.uuid) if g.uuid else None
            gpus.append(
                GpuInfo(
                    index=g.index,
                    # A GPU whose identity could not be read has no minor; its empty UUID says so.
                    minor=max(g.minor, 0),
                    uuid=g.uuid,
                    name=g.name,
                    pci_bus_id=g.pci_bus_id,
                    memory_total_bytes=g.memory_total,
                    numa_node=-1 if g.numa_node is None else g.numa_node,
                    cpu_affinity=g.cpu_affinity,
                    healthy=r.usable and not sick,
                    last_xid=r.health.last_xid,
                    last_xid_time=r.health.last_xid_time,
                    health_reason=r.status or (f"drain timed out: {drain.reason}" if sick and drain else ""),
                    holder=str(holder) if holder is not None else "",
                    mig_enabled=r.mig_enabled,
                    mig_devices=migunits.device_views(r.mig_devices, mig_holders) if r.mig_enabled else (),
                    drain_state=drain.state if drain is not None else "",
                    drain_since=drain.since if drain is not None else 0.0,
                    drain_pids=drain.pids if drain is not None else (),
                    drain_reason=drain.reason if drain is not None else "",
                    drain_memory_used_bytes=drain.memory_used if drain is not None else 0,
                    last_reset=resets.get(g.minor, ()) if g.uuid else (),
                    maintenance=out is not None,
                    maintenance_reason=out.reason if out is not None else "",
                    maintenance_since=out.since if out is not None else 0.0,
                    maintenance_by=out.by if out is not None else "",
                    **self._share_view(g.minor, shared, sharers),
                )
            )
        return GpuList(inv.driver_version, inv.cuda_driver_version, tuple(gpus))

    def _share_view(
        self, minor: int, shared: dict[int, SharedGpu], sharers: dict[int, list[tuple[str, int]]]
    ) -> dict[str, Any]:
        gpu = shared.get(minor)
        holders = tuple(sharers.get(minor, ()))
        if gpu is None and not holders:
            return {}
        return {
            "shares_total": gpu.shares if gpu is not None else 0,
            "shares_held": sum(n for _h, n in holders),
            "share_mode": gpu.mode if gpu is not None else "",
            "share_holders": holders,
            "mps_state": self.core.mps.state(minor) if gpu is not None and gpu.mode == ShareMode.MPS else "",
            "mps_restarts": self.core.mps.restarts[minor] if gpu is not None and gpu.mode == ShareMode.MPS else 0,
        }

    def agent_flags(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """The agent's ``--resources`` entries and ``--attributes`` pairs for the GPUs this sidecar manages
        now, with its --shared-gpus: ``gpu-isolator resources`` and ``attributes`` asking the sidecar."""
        inv = self.core.inventory
        with self.core.booking.lock:
            shared = dict(self.core.booking.shared)
        resources, pairs = attributes.agent_flags(inv.records, shared, inv.driver_version, inv.cuda_driver_version)
        return resources, tuple(pairs)

    def topology(self) -> TopologyView:
        topo = self.core.inventory.topology()
        indices = [g.index for g in topo.gpus]
        links = []
        for i, a in enumerate(indices):
            for b in indices[i + 1 :]:
                link = topo.link(a, b)
                links.append(TopologyLink(a, b, link.smi, link.nvlink_lanes))
        return TopologyView(
            indices=tuple(indices),
            links=tuple(links),
            numa_nodes=tuple(-1 if g.numa_node is None else g.numa_node for g in topo.gpus),
            cpu_affinity=tuple(g.cpu_affinity for g in topo.gpus),
        )

    # ---- containers -------------------------------------------------------------------------------

    def list_containers(self, usage: bool = True) -> list[ContainerInfo]:
        """Top-level containers sorted by ID, each followed by its nested containers (depth first);
        with ``usage``, what each one's processes use of the devices it holds (core/usage.py)."""
        records = self.core.store.load()
        volume_of = self._volume_users()
        used = usage_view.container_use(self.core, records.values()) if usage else {}
        out = []
        for cid, rec in sorted(records.items(), key=lambda kv: kv[0].chain()):
            out.append(dataclasses.replace(self._info(cid, rec), usage=used.get(cid, ())))
            for child in self._nested_ids(cid, volume_of):
                out.append(self._nested_info(child, rec, volume_of))
        return out

    def _info(self, cid: ContainerId, rec: ContainerRecord) -> ContainerInfo:
        gpus = self.core.gpus
        held = rec.holding
        minors = [m for m in sorted(held.gpus) if m in gpus]
        return ContainerInfo(
            container_id=cid,
            gpu_uuids=tuple(gpus[m].uuid for m in minors),
            gpu_minors=tuple(sorted(held.gpus)),
            gpu_indices=tuple(gpus[m].index for m in minors),
            cgroup=rec.cgroup,
            mode=rec.mode,
            volume_version=rec.volume_version,
            state=rec.state,
            created=rec.created,
            mig_uuids=tuple(sorted(held.mig_uuids)),
            **self._share_info(held.share),
        )

    def _share_info(self, share: Share | None) -> dict[str, Any]:
        if share is None:
            return {}
        gpu = self.core.gpus.get(share.gpu)
        with self.core.booking.lock:
            total = self.core.booking.shared.get(share.gpu)
        return {
            "shares": share.count,
            "shares_total": total.shares if total is not None else 0,
            "share_mode": share.mode,
            "share_gpu_minor": share.gpu,
            "share_gpu_index": gpu.index if gpu is not None else -1,
            "share_gpu_uuid": gpu.uuid if gpu is not None else "",
        }

    def _nested_info(self, cid: ContainerId, root: ContainerRecord, volume_of: dict[str, str]) -> ContainerInfo:
        info = self._info(cid, root)
        return ContainerInfo(
            container_id=cid,
            gpu_uuids=info.gpu_uuids,
            gpu_minors=info.gpu_minors,
            gpu_indices=info.gpu_indices,
            cgroup=self._rules_cgroup(cid)[1],
            mode=info.mode,
            volume_version=volume_of.get(cid.key(), ""),
            state=info.state,
            created=info.created,
            mig_uuids=info.mig_uuids,
            **self._share_info(root.holding.share),
        )

    def _volume_users(self) -> dict[str, str]:
        """Container key (``ContainerId.key()``) -> driver version of the volume it uses."""
        try:
            return self.core.volume_users()
        except Exception as exc:  # a display view: an unreadable volume root must not hide containers
            LOG.warning("failed to read the driver volumes' users: %s", exc)
            return {}

    def _nested_ids(self, root: ContainerId, volume_of: dict[str, str]) -> list[ContainerId]:
        found: set[tuple[str, ...]] = set()
        prefix = root.key() + "."
        for user in volume_of:
            if user.startswith(prefix):
                with contextlib.suppress(IsolatorError):
                    found.add(ContainerId.from_key(user).chain())
        found.update(self._child_cgroups(root))
        return [ContainerId.from_chain(chain) for chain in sorted(found)]

    def _child_cgroups(self, cid: ContainerId) -> set[tuple[str, ...]]:
        """Chains of the cgroups Mesos made for nested containers below ``cid`` (``<cid>/mesos/<child>``)."""
        out: set[tuple[str, ...]] = set()
        for name in self.core.cgroups.nested_names(cid):
            try:
                child = ContainerId.parse(name, cid)
            except IsolatorError:
                continue
            out.add(child.chain())
            out |= self._child_cgroups(child)
        return out

    def _rules_cgroup(self, cid: ContainerId) -> tuple[ContainerId, str]:
        """The container whose cgroup governs ``cid``'s device access (``KernelGrants.governing``), and its path."""
        target = self.core.grants.governing(cid)
        return target, self.core.cgroups.cgroup_path(target)

    def _find(self, cid: ContainerId) -> tuple[ContainerRecord, ContainerInfo]:
        """The record governing ``cid`` and its view; NotFound for a container we do not know."""
        rec = self.core.store.get(cid.root)
        if rec is not None and not cid.nested:
            used = usage_view.container_use(self.core, (rec,)).get(cid, ())
            return rec, dataclasses.replace(self._info(cid, rec), usage=used)
        if rec is not None:
            volume_of = self._volume_users()
            if cid in self._nested_ids(cid.root, volume_of):
                return rec, self._nested_info(cid, rec, volume_of)
        raise NotFound(f"unknown container {cid}")

    def describe_container(self, container_id: ContainerId) -> Description:
        core = self.core
        with core.locks.hold(container_id):
            rec, info = self._find(container_id)
            target, cgroup = self._rules_cgroup(container_id)
            in_force = core.cgroups.in_force(target)
            # Both sides shown sorted, each rule once (policy.drift compares them as given).
            recorded, kernel = _sorted_rules(rec.rules), _sorted_rules(in_force.rules)
            found = drift.compare(recorded, rec.holding, dataclasses.replace(in_force, rules=kernel), core.gpus)
            try:
                pids = tuple(sorted(core.cgroups.pids(target)))
            except CgroupVanished:
                pids = ()
            volume_of = self._volume_users()
            nested = [] if container_id.nested else self._nested_ids(container_id, volume_of)
            local, current = self._affinity(rec)
        listed = {g.minor: g for g in self.list_gpus().gpus if g.uuid}
        return Description(
            container=info,
            recorded_rules=tuple(str(r) for r in recorded),
            kernel_rules=tuple(str(r) for r in kernel),
            kernel_source=in_force.source,
            rules_cgroup=cgroup,
            rules_agree=found.rules_agree,
            only_recorded=tuple(str(r) for r in found.missing),
            only_kernel=tuple(str(r) for r in found.extra),
            kernel_gpu_minors=found.granted,
            pids=pids,
            gpus=tuple(listed[m] for m in sorted(rec.holding.granted) if m in listed),
            nested=tuple(self._nested_info(c, rec, volume_of) for c in nested),
            cpu_affinity=core.settings.cpu_affinity,
            local_cpus=local.cpu_list if local is not None else "",
            local_numa_nodes=local.mem_list if local is not None else "",
            cpuset_recorded_cpus=rec.cpus,
            cpuset_recorded_mems=rec.mems,
            cpuset_cpus=current.cpu_list if current is not None else "",
            cpuset_mems=current.mem_list if current is not None else "",
            cpuset_cgroup=core.cpusets.path(container_id) if current is not None else "",
        )

    def _affinity(self, rec: ContainerRecord) -> tuple[Affinity | None, Affinity | None]:
        """The GPUs' locality on this machine (None: none, or nothing left) and the cpuset in force."""
        core = self.core
        try:
            local = core.cpuset.locality(rec.holding.gpus, core.grants.mig_of(rec))
        except IsolatorError:
            local = None
        current = core.cpusets.current(rec.container_id)
        return local, current

    def release(self, container_id: ContainerId, force: bool) -> Released:
        core = self.core
        if container_id.nested:
            raise FailedPrecondition(
                f"container {container_id} is nested and holds no GPUs of its own; "
                f"release its top-level container {container_id.root}"
            )
        with core.locks.hold(container_id):
            rec = core.require(container_id)
            cgroup = core.cgroups.cgroup_path(container_id)
            try:
                pids = core.cgroups.pids(container_id)
            except CgroupVanished:
                pids = ()
            if pids and not force:
                raise FailedPrecondition(
                    f"container {container_id} still has processes {list(pids)} in "
                    f"'{cgroup}'; use --force to release anyway"
                )
            if pids and core.settings.mode == Mode.STANDALONE:
                # A forced release must not leave running processes with access: revoke, keep the cgroup.
                core.grants.apply(container_id, frozenset(), units=())
                action = "revoked-kept-cgroup"
                did = f"revoked their GPU access in '{cgroup}' and kept the cgroup for its processes {list(pids)}"
            else:
                core.grants.cleanup(container_id, keep_busy_cpuset=bool(pids))
                action = "removed-cgroup"
                did = (
                    f"removed our device rules from '{cgroup}'"
                    if core.settings.mode == Mode.MESOS
                    else f"removed the cgroup '{cgroup}'"
                )
                if pids:
                    did += f" (its processes {list(pids)} keep running without GPU access)"
            core.drop(container_id, rec)
        core.release_volume(container_id)
        minors = tuple(sorted(rec.holding.gpus))
        detail = f"released GPUs {list(minors)} of container {container_id}: {did}"
        LOG.warning("admin: %s", detail)
        return Released(
            container=container_id,
            released_gpu_uuids=tuple(core.gpus[m].uuid for m in minors if m in core.gpus),
            released_gpu_minors=minors,
            pids=tuple(pids),
            action=action,
            cgroup=cgroup,
            detail=detail,
        )

    def undrain(self, gpu: str) -> Undrained:
        """Return a draining GPU to the pool now (``gpu-isolator undrain GPU``): by index, UUID or minor:N."""
        core = self.core
        found = core.handover.find(gpu)
        holders = core.store.holders()
        if found.minor in holders:
            raise FailedPrecondition(f"GPU {gpu} is held by container {holders[found.minor]}; it is not draining")
        with core.booking.lock:
            sharers = core.booking.share_holders(found.minor) if found.minor in core.booking.shared else {}
        if sharers:
            # The override resets the compute mode and clocks: under its sharers that would take an MPS
            # GPU out of EXCLUSIVE_PROCESS (issue 41 item 6). Its handover check runs after the last one.
            held = ", ".join(f"container {key}: {n} gpu_shares" for key, n in sorted(sharers.items()))
            raise FailedPrecondition(
                f"GPU {gpu} ({found.uuid}) has sharers ({held}); the handover override would reset its compute"
                " mode and clocks under them, and its check runs after the last sharer leaves"
            )
        units = sorted({str(c) for c, parent in core.store.mig_holders().values() if parent == found.minor})
        if units:
            # The same reset under the holders of its MIG devices: their work runs on this GPU.
            raise FailedPrecondition(
                f"GPU {gpu} ({found.uuid}) has MIG devices held (container {', '.join(units)}); the handover"
                " override would reset its compute mode and clocks under them, and its check runs after the last"
                " one leaves"
            )
        done = core.handover.undrain(found)
        if found.uuid in core.maintenance.view():
            # Two states, two names (docs/operations.md section 7): the override does not end a drain.
            note = "; it stays drained for maintenance (gpu-isolator undrain GPU ends that)"
            done = dataclasses.replace(done, detail=done.detail + note)
        return done

    def maintenance_drain(self, gpu: str, reason: str, caller: str) -> MaintenanceChange:
        """Take a GPU out of service (``gpu-isolator drain GPU --reason TEXT``): by index, UUID or minor:N."""
        return self.core.maintenance.drain(gpu, reason, caller)

    def maintenance_undrain(self, gpu: str, caller: str, reason: str = "") -> MaintenanceChange:
        """End a maintenance drain (``gpu-isolator undrain GPU [--reason TEXT]``); it goes to the history."""
        return self.core.maintenance.undrain(gpu, caller, reason)

    def maintenance_history(self) -> list[EndedDrain]:
        """The ended maintenance drains, oldest end first (``gpu-isolator drain-history``)."""
        return self.core.maintenance.history()

    # ---- volume and health ------------------------------------------------------------------------

    def volume(self) -> VolumeReport:
        volumes = self.core.volumes
        if not volumes.volume_root:
            raise FailedPrecondition("no volume root is configured (see --volume-root)")
        return VolumeReport(
            driver_version=self.core.inventory.driver_version,
            volume_root=str(volumes.volume_root),
            volumes=tuple(volumes.volumes()),
        )

    def health(self) -> list[HealthCheck]:
        core = self.core
        checks = [self._nvml_check()]
        checks.append(HealthCheck("cgroups", True, f"{core.cgroups.version} devices, {core.settings.mode} mode"))
        try:
            result = core.store.check()
            count = len(core.store.load())
            detail = f"'{core.store.path}': {result}; {count} container{'' if count == 1 else 's'}"
            if core.rebuilt:
                detail += f"; rebuilt from the kernel at start: {', '.join(map(str, core.rebuilt))}"
            checks.append(HealthCheck("state", result == "ok", detail))
        except IsolatorError as exc:
            checks.append(HealthCheck("state", False, exc.message))
        try:
            pending = self.inconsistencies()
            agree = "records and kernel agree"
            checks.append(HealthCheck("consistency", not pending, "; ".join(pending) if pending else agree))
        except IsolatorError as exc:
            checks.append(HealthCheck("consistency", False, exc.message))
        # The handover check (docs/handover.md): not ok once a GPU drained past --drain-timeout.
        marks = core.handover.view()
        checks.append(HealthCheck("handover", not any(r.timed_out for r in marks.values()), core.handover.describe()))
        # An operator's maintenance drains (docs/operations.md): shown, never failing (they are on purpose).
        checks.append(HealthCheck("maintenance", True, core.maintenance.describe()))
        # The MPS control daemons of GPUs shared in mps mode with sharers (docs/sharing.md): a sharer
        # with no daemon behind it is not healthy.
        ok, detail = core.mps.check(core.mps_wanted())
        checks.append(HealthCheck("mps", ok, detail))
        return checks

    def _nvml_check(self) -> HealthCheck:
        core = self.core
        if not core.gpus:
            return HealthCheck("nvml", True, "no GPUs managed ('--resources gpus:0': this node has none)")
        try:
            seen = core.inventory.device_count()  # a live call, as nvidia-smi -L
        except Exception as exc:
            return HealthCheck("nvml", False, f"NVML does not answer: {exc}")
        sick = len(core.gpus) - len(core.inventory.healthy())
        managed = len(core.gpus)
        gpus = "1 GPU" if managed == 1 else f"{managed} GPUs"
        detail = f"driver {core.inventory.driver_version}, {gpus} managed, NVML sees {seen}, {sick} not usable"
        return HealthCheck("nvml", bool(core.inventory.driver_version), detail)

    def inconsistencies(self) -> list[str]:
        """Records whose kernel rules do not grant exactly the recorded GPUs (what Recover would fix)."""
        core = self.core
        out = []
        for cid in sorted(core.store.load(), key=ContainerId.chain):
            with core.locks.hold(cid):
                rec = core.store.get(cid)
                if rec is None:
                    continue
                in_force = core.cgroups.in_force(cid)
            finding = drift.compare(rec.rules, rec.holding, in_force, core.gpus).gpu_finding()
            if finding is not None:
                out.append(f"container {cid}: {finding}")
        return out


def _sorted_rules(rules: Iterable[devrules.DeviceRule]) -> tuple[devrules.DeviceRule, ...]:
    return tuple(sorted(devrules.normalize(rules), key=lambda r: r.sort_key()))
