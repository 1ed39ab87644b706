"""The isolator hooks with Mesos's semantics, orchestrating the allocator, state, devices and volumes.

Orchestration only: decisions come from pure modules (allocator, devices.container_rules,
reconcile, volumes.inject), the machine is reached through the edges handed to the constructor.
Ordering rules that keep the sidecar safe across crashes:
  * GPUs are recorded in the state store before any rule grants them, and revoked in the kernel
    before the record lets them go (never grant what is not recorded);
  * a failure half-way through Prepare undoes what was done, so nothing stays allocated or applied;
  * Cleanup is idempotent and fine for containers never prepared or never known.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from isolator import devices as devrules
from isolator import mig as migunits
from isolator.allocator import Allocator
from isolator.cgroups.base import DeviceController
from isolator.crashpoints import crashpoint
from isolator.errors import (
    AlreadyExists,
    CgroupVanished,
    FailedPrecondition,
    InvalidArgument,
    IsolatorError,
    NotFound,
    from_code,
)
from isolator.model import (
    ContainerConfig,
    ContainerId,
    ContainerState,
    LaunchInfo,
    MigDevice,
    Mount,
    RecoverResult,
    Resource,
    Topology,
    gpu_count,
)
from isolator.reconcile import Kind, reconcile
from isolator.service import Service
from isolator.state import ContainerRecord, StateStore

LOG = logging.getLogger(__name__)

NVIDIA_MAJOR = 195
MS_BIND = 4096
MAX_PID = 1 << 22  # PID_MAX_LIMIT on 64-bit Linux
# Mesos's cgroups isolator may place the pid in the devices cgroup concurrently with our isolate
# (isolate runs on every isolator in parallel), so mesos mode waits a little before declaring the
# pid misplaced.
ISOLATE_SETTLE_S = 2.0


class Inventory(Protocol):
    """What the hooks need from isolator.nvml.Inventory."""

    driver_version: str
    cuda_driver_version: str

    def topology(self) -> Topology: ...

    def healthy(self) -> frozenset[int]: ...

    def usage(self, index: int) -> Any: ...

    def on_health_change(self, callback: Callable[[Any], None]) -> None: ...

    @property
    def records(self) -> tuple[Any, ...]: ...


class Volumes(Protocol):
    """What the hooks need from volumes.manager.VolumeManager."""

    def acquire(self, container_id: str, driver_version: str) -> Any: ...

    def release(self, container_id: str, driver_version: str | None = None) -> tuple[str, ...]: ...

    def reconcile(self, live: Any) -> tuple[str, ...]: ...

    def volumes(self) -> list[dict[str, Any]]: ...


class EmptyInventory:
    """A host with no GPUs to manage (``gpus:0``, or no NVML and none requested): every container
    gets the standard devices only."""

    driver_version = ""
    cuda_driver_version = ""
    records: tuple[Any, ...] = ()

    def topology(self) -> Topology:
        return Topology(gpus=())

    def healthy(self) -> frozenset[int]:
        return frozenset()

    def usage(self, index: int) -> Any:
        raise NotFound(f"GPU {index} is not managed by this sidecar")

    def on_health_change(self, callback: Callable[[Any], None]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class HookSettings:
    mode: str = "standalone"
    dev_root: str = "/dev"
    modeset: bool = False


def _volume_error(exc: Exception) -> IsolatorError:
    return from_code(getattr(exc, "code", "INTERNAL"), str(exc))


class IsolatorService(Service):
    """The hooks. One lock guards the allocator, the store and the rules: a container's GPUs, its
    record and its kernel rules change together or not at all."""

    def __init__(
        self,
        inventory: Inventory,
        controller: DeviceController,
        host_devices: devrules.HostDevices,
        store: StateStore,
        volumes: Volumes | None,
        settings: HookSettings,
        policy: str = "topology",
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(inventory)  # type: ignore[arg-type]
        self._inv = inventory
        self.controller = controller
        self.host_devices = host_devices
        self.store = store
        self.volumes = volumes
        self.settings = settings
        self.clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        topology = inventory.topology()
        self._gpus = {g.minor: g for g in topology.gpus}
        self.allocator = Allocator(topology, policy)
        # MIG units (docs/mig.md): every MIG device of a managed GPU in MIG mode, by UUID, and the
        # parent minors booked in the whole-GPU allocator while any of their MIG devices is held.
        self._mig = {d.uuid: d for d in self._mig_devices(frozenset(self._gpus))}
        self._mig_booked: set[int] = set()
        self._sync_health()
        inventory.on_health_change(self._on_health_change)
        self._restore()

    # ---- start-up ---------------------------------------------------------------------------------

    def _restore(self) -> None:
        """Book every recorded GPU before the first request, so nothing is handed out twice even
        on the bridge route, where Mesos never calls Recover."""
        with self._lock:
            for rec in self.store.load().values():
                known = rec.gpus & self.allocator.total
                if known != rec.gpus:
                    LOG.warning(
                        "container %s records GPUs %s that this host does not have; keeping %s",
                        rec.container_id,
                        sorted(rec.gpus - known),
                        sorted(known),
                    )
                self.allocator.restore(known)
                self._book_mig(rec.mig_parents, restore=True)

    def _book_mig(self, parents: frozenset[int], restore: bool = False) -> None:
        """Book parent GPUs in the whole-GPU allocator while MIG devices on them are held."""
        new = frozenset(m for m in parents if m not in self._mig_booked and m in self.allocator.total)
        if new:
            if restore:
                self.allocator.restore(new)
            else:
                self.allocator.allocate_set(new)
            self._mig_booked.update(new)

    def _unbook_mig(self) -> None:
        """Give back parents whose MIG devices are all free again (call after the store changed)."""
        held = {parent for _cid, parent in self.store.mig_holders().values()}
        free = frozenset(self._mig_booked - held)
        if free:
            self.allocator.deallocate(free & self.allocator.allocated)
            self._mig_booked -= free

    def _choose_mig(self, request: dict[str, int]) -> tuple[MigDevice, ...]:
        if not request:
            return ()
        held = set(self.store.mig_holders())
        whole = self.allocator.allocated - self._mig_booked
        usable = self._inv.healthy()
        blocked = {d.parent_minor for d in self._mig.values() if d.parent_minor in whole}
        blocked |= {d.parent_minor for d in self._mig.values() if d.parent_index not in usable}
        blocked |= set(self.allocator.unhealthy)
        choice = migunits.choose(request, list(self._mig.values()), held, blocked)
        return choice.devices

    def _mig_of(self, rec: ContainerRecord | None) -> tuple[MigDevice, ...]:
        """The MIG devices a record holds that the inventory knows (an unknown UUID grants nothing)."""
        if rec is None:
            return ()
        out = []
        for uuid in sorted(rec.mig_uuids):
            dev = self._mig.get(uuid)
            if dev is None:
                LOG.warning(
                    "container %s holds MIG device %s, which the inventory no longer lists", rec.container_id, uuid
                )
                continue
            out.append(dev)
        return tuple(out)

    def _allocate_whole(self, count: int) -> Any:
        """Whole GPUs, taking GPUs that are not in MIG mode first (docs/mig.md)."""
        mig_gpus = frozenset(d.parent_minor for d in self._mig.values()) & self.allocator.available
        if count and mig_gpus:
            self.allocator.allocate_set(mig_gpus)
            try:
                return self.allocator.allocate(count)
            except IsolatorError:
                pass
            finally:
                self.allocator.deallocate(mig_gpus)
        return self.allocator.allocate(count)

    def _sync_health(self) -> None:
        healthy_indices = self._inv.healthy()
        for gpu in self._gpus.values():
            self.allocator.set_healthy(gpu.minor, gpu.index in healthy_indices)

    def _on_health_change(self, event: Any) -> None:
        with self._lock:
            for gpu in self._gpus.values():
                if gpu.index == event.index:
                    self.allocator.set_healthy(gpu.minor, bool(event.healthy))
            self._changed.notify_all()

    # ---- helpers ----------------------------------------------------------------------------------

    def _rules(self, minors: frozenset[int], units: tuple[MigDevice, ...] = ()) -> tuple[devrules.DeviceRule, ...]:
        """Whole GPUs (with every MIG device of one in MIG mode) and MIG units: each unit's GI and
        CI caps nodes and its parent's node, which the driver requires (docs/mig.md)."""
        if not self._gpus:
            return tuple(devrules.MESOS_DEFAULT_WHITELIST)  # no GPUs here: no control devices either
        control = self.host_devices.control_devices(modeset=self.settings.modeset)
        mig = self._mig_devices(minors) + tuple(units)
        caps_major = self.host_devices.caps_major() if mig else None
        nodes = sorted(minors | migunits.parents(units))
        return devrules.container_rules(control, nodes, mig_devices=mig, caps_major=caps_major)

    def _mig_devices(self, minors: frozenset[int]) -> tuple[MigDevice, ...]:
        out: list[MigDevice] = []
        for rec in self._inv.records:
            if rec.gpu.minor in minors and getattr(rec, "mig_enabled", False):
                out.extend(rec.mig_devices)
        return tuple(out)

    def _describe(self, cid: ContainerId, minors: frozenset[int]) -> str:
        gpus = ", ".join(f"{m} ({self._gpus[m].uuid})" for m in sorted(minors) if m in self._gpus)
        return f"container {cid} (cgroup '{self.controller.cgroup_path(cid.root)}', GPUs [{gpus}])"

    def _require(self, cid: ContainerId) -> ContainerRecord:
        rec = self.store.get(cid)
        if rec is None:
            raise NotFound(f"unknown container {cid}")
        return rec

    def _device_mounts(self, rootfs: str, minors: frozenset[int], units: tuple[MigDevice, ...] = ()) -> list[Mount]:
        """Bind mounts of exactly the allocated GPUs and the control devices (Mesos exposes every
        /dev/nvidia*, unallocated GPUs and nvidia-modeset included: defect §2.15.6)."""
        if not self._gpus:
            return []
        names = [f"nvidia{m}" for m in sorted(minors | migunits.parents(units))]
        control = self.host_devices.control_devices(modeset=self.settings.modeset)
        names += [os.path.relpath(n.path, self.settings.dev_root) for n in control.numbers()]
        mounts = []
        for name in names:
            source = os.path.join(self.settings.dev_root, name)
            mounts.append(Mount(target=os.path.join(rootfs, "dev", name), source=source, flags=MS_BIND))
        for mig in self._mig_devices(minors) + tuple(units):
            for minor in mig.caps_minors:
                name = f"nvidia-caps/nvidia-cap{minor}"
                source = os.path.join(self.settings.dev_root, name)
                mounts.append(Mount(target=os.path.join(rootfs, "dev", name), source=source, flags=MS_BIND))
        return mounts

    def _image_plan(self, config: ContainerConfig) -> Any:
        """Decide on the volume before anything is allocated, so a refusal leaves nothing behind."""
        from volumes.errors import VolumeError
        from volumes.inject import DriverFacts, Image, check_cuda, should_inject

        if not config.has_image:
            return None
        if not os.path.isdir(config.rootfs):
            raise InvalidArgument(f"the container's rootfs '{config.rootfs}' does not exist")
        image = Image(env=config.image_env, labels=dict(config.image_labels))
        facts = DriverFacts(self._inv.driver_version, self._inv.cuda_driver_version)
        try:
            inject, _reason = should_inject(image)
            if inject:
                check_cuda(image, facts, config.rootfs)
        except VolumeError as exc:
            raise _volume_error(exc) from exc
        return (image, facts) if inject else None

    # ---- hooks ------------------------------------------------------------------------------------

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        if container_id.nested:
            return self._prepare_nested(container_id, config)
        count = gpu_count(config.resources)
        mig_request = migunits.requests(config.resources)
        image_plan = self._image_plan(config)
        with self._lock:
            if self.store.get(container_id) is not None:
                raise AlreadyExists(f"container {container_id} has already been prepared")
            choice = self._allocate_whole(count)
            minors = frozenset(choice.gpus)
            undo: list[Callable[[], object]] = [lambda: self.allocator.deallocate(minors)]
            try:
                units = self._choose_mig(mig_request)
                self._book_mig(migunits.parents(units))
                undo.append(self._unbook_mig)
                rules = self._rules(minors, units)
                self.store.record(
                    ContainerRecord(
                        container_id,
                        gpus=minors,
                        mode=self.settings.mode,
                        cgroup=self.controller.cgroup_path(container_id),
                        cgroup_version=1 if self.controller.version == "v1" else 2,
                        state="prepared",
                        created=self.clock(),
                        rules="\n".join(map(str, rules)),
                        mig=frozenset((d.uuid, d.parent_minor) for d in units),
                    )
                )
                undo.append(lambda: self._forget(container_id))
                undo.append(lambda: self.controller.cleanup(container_id))
                crashpoint("prepare.recorded")
                self.controller.prepare(container_id)
                crashpoint("prepare.cgroup")
                self.controller.apply(container_id, rules)
                crashpoint("prepare.applied")
                info = self._launch_info(container_id, config, minors, image_plan, undo, units)
            except BaseException:
                self._undo(container_id, undo)
                raise
            mig_note = f", MIG devices [{migunits.visible_devices(units)}]" if units else ""
            LOG.info("prepared %s (%s)%s", self._describe(container_id, minors), choice.policy, mig_note)
            return info

    def _launch_info(
        self,
        cid: ContainerId,
        config: ContainerConfig,
        minors: frozenset[int],
        image_plan: Any,
        undo: list[Callable[[], object]],
        units: tuple[MigDevice, ...] = (),
    ) -> LaunchInfo | None:
        # MIG holders learn which devices are theirs (docs/mig.md), with or without an image.
        visible = (("NVIDIA_VISIBLE_DEVICES", migunits.visible_devices(units)),) if units else ()
        if not config.has_image:
            # The host's /dev and libraries, access gated by the cgroup (Mesos).
            return LaunchInfo(environment=visible) if visible else None
        mounts = self._device_mounts(config.rootfs, minors, units)
        env: tuple[tuple[str, str], ...] = ()
        if image_plan is not None:
            mounts_v, env = self._volume(cid, config, image_plan, undo)
            mounts = mounts_v + mounts
        env = tuple((k, v) for k, v in env if k != "NVIDIA_VISIBLE_DEVICES") + visible
        return LaunchInfo(environment=env, mounts=tuple(mounts))

    def _volume(
        self, cid: ContainerId, config: ContainerConfig, image_plan: Any, undo: list[Callable[[], object]]
    ) -> tuple[list[Mount], tuple[tuple[str, str], ...]]:
        from volumes.errors import VolumeError
        from volumes.inject import plan_injection

        if self.volumes is None:
            raise FailedPrecondition("the image asks for the driver volume but no volume root is configured")
        image, facts = image_plan
        try:
            volume = self.volumes.acquire(str(cid), facts.driver_version)
            undo.append(lambda: self._release_volume(cid))
            crashpoint("prepare.volume")
            injection = plan_injection(config.rootfs, image, volume.path, facts)
        except VolumeError as exc:
            raise _volume_error(exc) from exc
        if injection is None:
            return [], ()
        if not cid.nested:
            self.store.update(cid, volume_version=volume.driver_version)
        mounts = []
        for spec in injection.mounts:
            if spec.mkdir:
                os.makedirs(spec.target, exist_ok=True)
            mounts.append(Mount(target=spec.target, source=spec.source, flags=spec.flags))
        return mounts, tuple(sorted(injection.env.items()))

    def _prepare_nested(self, cid: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        # Mesos: DEBUG containers inherit everything from their parent; other nested containers get
        # the volume and device nodes for their own rootfs and use their top-level container's GPUs.
        if config.container_class == "DEBUG":
            return None
        image_plan = self._image_plan(config)
        with self._lock:
            root = self.store.get(cid.root)
            minors = root.gpus if root is not None else frozenset()
            undo: list[Callable[[], object]] = []
            try:
                info = self._launch_info(cid, config, minors, image_plan, undo, self._mig_of(root))
            except BaseException:
                self._undo(cid, undo)
                raise
            LOG.info("prepared nested %s", self._describe(cid, minors))
            return info

    def _undo(self, cid: ContainerId, undo: list[Callable[[], object]]) -> None:
        for step in reversed(undo):
            try:
                step()
            except Exception:
                LOG.exception("failed to undo part of prepare for container %s", cid)

    def _forget(self, cid: ContainerId) -> None:
        with contextlib.suppress(NotFound):
            self.store.remove(cid)

    def _drop(self, cid: ContainerId, rec: ContainerRecord) -> None:
        """Forget a container whose rules are already gone: its record, then its GPUs; wake watchers.
        Call with the lock held."""
        self.store.remove(cid)
        self.allocator.deallocate(rec.gpus & self.allocator.allocated)
        self._unbook_mig()
        self._changed.notify_all()

    def _release_volume(self, cid: ContainerId) -> None:
        if self.volumes is not None:
            try:
                self.volumes.release(str(cid), self._inv.driver_version)
            except Exception as exc:  # the container is gone either way; a stale user file is harmless
                LOG.warning("failed to release the volume of container %s: %s", cid, exc)

    def isolate(self, container_id: ContainerId, pid: int) -> None:
        if pid <= 1 or pid >= MAX_PID:
            raise InvalidArgument(f"pid {pid} is not a valid container pid")
        if not os.path.exists(f"/proc/{pid}"):
            raise FailedPrecondition(f"pid {pid} does not exist (the container's init is gone)")
        target = container_id.root if container_id.nested and self.controller.version == "v1" else container_id
        with self._lock:
            rec = self._require(container_id.root)
            if self.settings.mode == "standalone":
                self.controller.add_pid(target, pid)
                crashpoint("isolate.placed")
            else:
                self._wait_for_pid(target, pid)
            if not container_id.nested and rec.state == "prepared":
                self.store.update(container_id, state="isolated")
        LOG.info("isolated pid %d in %s", pid, self._describe(container_id, rec.gpus))

    def _wait_for_pid(self, cid: ContainerId, pid: int) -> None:
        deadline = time.monotonic() + ISOLATE_SETTLE_S
        while True:
            if pid in self.controller.pids(cid):
                return
            if time.monotonic() >= deadline:
                raise FailedPrecondition(
                    f"pid {pid} is not in the cgroup '{self.controller.cgroup_path(cid)}' of container {cid}"
                )
            time.sleep(0.02)

    def update(self, container_id: ContainerId, resources: list[Resource]) -> None:
        if container_id.nested:
            raise FailedPrecondition(f"update is not supported for nested containers ({container_id})")
        target = gpu_count(resources)
        wanted = migunits.requests(resources)
        with self._lock:
            rec = self._require(container_id)
            held: dict[str, int] = {}
            for dev in self._mig_of(rec):
                name = migunits.resource_name(dev.profile) or dev.profile
                held[name] = held.get(name, 0) + 1
            if wanted != held:
                raise FailedPrecondition(
                    f"container {container_id} holds MIG devices {held or '{}'}; MIG holdings are fixed at launch "
                    f"(update asks for {wanted or '{}'})"
                )
            plan = self.allocator.plan_update(rec.gpus, target)
            add, release = frozenset(plan.add), frozenset(plan.release)
            if add:
                # Grow: book, record, then grant (never grant what is not recorded).
                self.allocator.allocate_set(add)
                try:
                    self.store.add_gpus(container_id, add)
                    crashpoint("update.grown")
                    self._apply(container_id, rec.gpus | add)
                except BaseException:
                    with contextlib.suppress(IsolatorError):
                        self.store.remove_gpus(container_id, add)
                    self.allocator.deallocate(add)
                    raise
            if release:
                # Shrink: revoke, then let the record and the allocator go.
                self._apply(container_id, rec.gpus - release)
                crashpoint("update.revoked")
                self.store.remove_gpus(container_id, release)
                self.allocator.deallocate(release)
            final = (rec.gpus | add) - release
            LOG.info("updated %s to %d GPUs", self._describe(container_id, frozenset(final)), target)

    def _apply(self, cid: ContainerId, minors: frozenset[int], units: tuple[MigDevice, ...] | None = None) -> None:
        """Grant ``minors`` whole plus MIG ``units`` (None: the MIG devices ``cid``'s record holds)."""
        rules = self._rules(minors, self._mig_of(self.store.get(cid)) if units is None else units)
        self.controller.apply(cid, rules)
        crashpoint("apply.kernel")
        self.store.update(cid, rules="\n".join(map(str, rules)))

    def watch(self, container_id: ContainerId, timeout: float | None) -> dict[str, Any] | None:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._lock:
            while True:
                rec = self.store.get(container_id.root)
                if rec is None:
                    if container_id.nested:
                        return None
                    raise NotFound(f"unknown container {container_id}")
                sick = sorted(m for m in rec.gpus | rec.mig_parents if m in self.allocator.unhealthy)
                if sick:
                    return self._limitation(container_id, sick, rec)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._changed.wait(timeout=remaining if remaining is not None else 5.0)

    def _limitation(self, cid: ContainerId, sick: list[int], rec: ContainerRecord | None = None) -> dict[str, Any]:
        """An XID on a GPU limits every container on it: holders of the GPU and of its MIG devices."""
        reasons = {}
        for r in self._inv.records:
            if r.gpu.minor in sick:
                reasons[r.gpu.minor] = f"{r.gpu.uuid}: {r.status or 'unhealthy'}"
        detail = "; ".join(f"GPU {m} ({reasons.get(m, 'unhealthy')})" for m in sick)
        whole = [m for m in sick if rec is None or m in rec.gpus]
        resources = []
        if whole:
            resources.append({"name": "gpus", "type": "SCALAR", "scalar": {"value": len(whole)}, "role": "*"})
        units: dict[str, list[str]] = {}
        for dev in self._mig_of(rec):
            if dev.parent_minor in sick:
                units.setdefault(migunits.resource_name(dev.profile) or dev.profile, []).append(dev.uuid)
        for name, uuids in sorted(units.items()):
            resources.append({"name": name, "type": "SCALAR", "scalar": {"value": len(uuids)}, "role": "*"})
        if units:
            detail += "; its MIG devices " + ", ".join(u for us in units.values() for u in us)
        return {
            "resources": resources,
            "message": f"container {cid} holds a GPU that became unhealthy: {detail}",
            "reason": "REASON_CONTAINER_LIMITATION",
        }

    def usage(self, container_id: ContainerId) -> dict[str, Any]:
        rec = self._require(container_id.root)
        gpus = []
        for minor in sorted(rec.gpus):
            gpu = self._gpus.get(minor)
            if gpu is None:
                continue
            u = self._inv.usage(gpu.index)
            gpus.append(
                {
                    "uuid": gpu.uuid,
                    "minor": minor,
                    "memory_used_bytes": u.memory_used,
                    "memory_total_bytes": u.memory_total,
                    "utilization_percent": u.gpu_utilization,
                }
            )
        return {"statistics": {"timestamp": self.clock()}, "gpus": gpus}

    def status(self, container_id: ContainerId) -> dict[str, Any]:
        rec = self._require(container_id.root)
        uuids = [self._gpus[m].uuid for m in sorted(rec.gpus) if m in self._gpus]
        return {"gpu_uuids": uuids + sorted(rec.mig_uuids), "state": rec.state}

    def cleanup(self, container_id: ContainerId) -> None:
        if container_id.nested:
            self._release_volume(container_id)
            return
        with self._lock:
            rec = self.store.get(container_id)
            if rec is None:
                # Mesos calls cleanup for containers it never prepared with us (MESOS-6059).
                LOG.info("ignoring cleanup of unknown container %s", container_id)
                self._release_volume(container_id)
                return
            self.controller.cleanup(container_id)
            crashpoint("cleanup.cgroup")
            self._drop(container_id, rec)
        crashpoint("cleanup.record")
        self._release_volume(container_id)
        LOG.info("cleaned up %s", self._describe(container_id, rec.gpus))

    # ---- recovery ---------------------------------------------------------------------------------

    def kernel_grants(self, cid: ContainerId) -> frozenset[int] | None:
        """GPU minors the kernel grants ``cid`` (v1 devices.list, v2 our program), None if no cgroup."""
        try:
            rules = self.controller.recover(cid)
        except CgroupVanished:
            return None
        return frozenset(self._granted(rules))

    def _restore_cgroup(self, cid: ContainerId, gpus: frozenset[int]) -> None:
        """Standalone mode owns its cgroups: make a recorded container's cgroup whole after a crash.

        A kill between recording and creating the cgroup (prepare), or between removing it and
        forgetting the record (cleanup), leaves a record without rules: the cgroup is made again
        with the recorded rules. A v1 cgroup caught between mkdir and its deny-all still allows
        every device; ``prepare`` (idempotent) turns it into a whitelist first.
        """
        try:
            self.controller.pids(cid)
        except CgroupVanished:
            self.controller.prepare(cid)
            self._apply(cid, gpus)
            LOG.warning("recover: made the missing cgroup of %s again", self._describe(cid, gpus))
            return
        self.controller.prepare(cid)

    def recover(self, states: list[ContainerState], orphans: list[ContainerId]) -> RecoverResult:
        with self._lock:
            # A MIG holder's cgroup grants its MIG devices' parents' nodes: those count as recorded.
            loaded = self.store.load()
            records = {cid: rec.gpus | rec.mig_parents for cid, rec in loaded.items()}
            kernel: dict[ContainerId, frozenset[int]] = {}
            for cid in records:
                if self.settings.mode == "standalone":
                    self._restore_cgroup(cid, loaded[cid].gpus)
                granted = self.kernel_grants(cid)
                if granted is not None:
                    kernel[cid] = granted
            running = None if self.settings.mode == "standalone" else [s.container_id.root for s in states]
            actions = reconcile(records, kernel, running, [o for o in orphans if not o.nested])
            result = RecoverResult()
            for action in actions:
                cid = action.container_id
                if action.kind in (Kind.REVOKE, Kind.REAPPLY):
                    rec = self.store.get(cid)
                    self._apply(cid, rec.gpus if rec is not None else frozenset())
                elif action.kind is Kind.RELEASE:
                    with contextlib.suppress(CgroupVanished):
                        self.controller.cleanup(cid)
                    self.store.remove(cid)
                    result.released += 1
                    self._release_volume(cid)
                elif action.kind is Kind.MARK_ORPHAN and cid in records:
                    self.store.update(cid, state="orphan")
                result.notes.append(f"{action.kind.value} {cid}: {action.reason}")
                crashpoint("recover.action")
            # Rebuild the allocator from what the store now says.
            self.allocator = Allocator(self._inv.topology(), self.allocator.policy)
            self._mig_booked = set()
            self._sync_health()
            live = self.store.load()
            for rec in live.values():
                self.allocator.restore(rec.gpus & self.allocator.total)
                self._book_mig(rec.mig_parents, restore=True)
            result.recovered = len(live)
            if self.volumes is not None:
                self.volumes.reconcile(str(c) for c in live)
            self._changed.notify_all()
            LOG.info("recovered %d containers, released %d", result.recovered, result.released)
            return result

    def reap_vanished(self) -> list[ContainerId]:
        """Release containers whose Mesos cgroup is gone (mesos mode only).

        The command-module route never forwards Recover or orphans, and skips cleanup for containers
        it has no context for (reference §A.1.8), so a container destroyed while the agent was down
        would hold its GPUs for ever. Mesos removes a container's cgroup when it destroys it; a
        record whose cgroup no longer exists therefore belongs to a dead container. Run periodically.
        """
        if self.settings.mode != "mesos":
            return []
        reaped = []
        with self._lock:
            for cid, rec in self.store.load().items():
                if os.path.isdir(self.controller.cgroup_path(cid)):
                    continue
                with contextlib.suppress(CgroupVanished):
                    self.controller.cleanup(cid)
                self._drop(cid, rec)
                reaped.append(cid)
                LOG.warning(
                    "released %s: its cgroup is gone (destroyed without a cleanup)", self._describe(cid, rec.gpus)
                )
        for cid in reaped:
            self._release_volume(cid)
        return reaped

    # ---- admin ------------------------------------------------------------------------------------
    # Views for `gpu-isolator` (docs/cli.md documents the shapes). They read; only release changes
    # anything. A nested container is never recorded (it uses its top-level container's GPUs), so it
    # is found through the traces it leaves: its driver-volume user record and, in Mesos's layout, a
    # child cgroup `<parent>/mesos/<child>`.

    def list_gpus(self) -> dict[str, Any]:
        view = super().list_gpus()
        holders = self.store.holders()
        mig_holders = {u: str(c) for u, (c, _m) in self.store.mig_holders().items()}
        for gpu in view["gpus"]:
            holder = holders.get(gpu.get("minor", -1)) if gpu.get("uuid") else None
            gpu["holder"] = str(holder) if holder is not None else ""
            for dev in gpu.get("mig_devices", ()):
                dev["holder"] = mig_holders.get(dev["uuid"], "")
        return view

    def list_containers(self) -> list[dict[str, Any]]:
        """Top-level containers sorted by ID, each followed by its nested containers (depth first)."""
        records = self.store.load()
        volume_of = self._volume_users()
        out = []
        for cid, rec in sorted(records.items(), key=lambda kv: kv[0].chain()):
            out.append(self._container_view(cid, rec))
            for child in self._nested_ids(cid, volume_of):
                out.append(self._nested_view(child, rec, volume_of))
        return out

    def _container_view(self, cid: ContainerId, rec: ContainerRecord) -> dict[str, Any]:
        minors = [m for m in sorted(rec.gpus) if m in self._gpus]
        return {
            "container_id": _cid_dict(cid),
            "id": str(cid),
            "nested": False,
            "gpu_uuids": [self._gpus[m].uuid for m in minors],
            "gpu_minors": sorted(rec.gpus),
            "gpu_indices": [self._gpus[m].index for m in minors],
            "mig_uuids": sorted(rec.mig_uuids),
            "cgroup": rec.cgroup,
            "mode": rec.mode,
            "volume_version": rec.volume_version,
            "state": rec.state,
            "created": rec.created,
        }

    def _nested_view(self, cid: ContainerId, root: ContainerRecord, volume_of: dict[str, str]) -> dict[str, Any]:
        view = self._container_view(cid, root)
        view.update(nested=True, cgroup=self._rules_cgroup(cid)[1], volume_version=volume_of.get(str(cid), ""))
        return view

    def _volume_users(self) -> dict[str, str]:
        """Container ID (``a.b`` form) -> driver version of the volume it uses."""
        if self.volumes is None:
            return {}
        out: dict[str, str] = {}
        try:
            for vol in self.volumes.volumes():
                for user in vol.get("users", ()):
                    out[user] = str(vol.get("driver_version", ""))
        except Exception as exc:  # a display view: an unreadable volume root must not hide containers
            LOG.warning("failed to read the driver volumes' users: %s", exc)
        return out

    def _nested_ids(self, root: ContainerId, volume_of: dict[str, str]) -> list[ContainerId]:
        found: set[tuple[str, ...]] = set()
        prefix = str(root) + "."
        for user in volume_of:
            if user.startswith(prefix):
                # The volume's record is the '.'-joined chain: a child ID containing '.' reads as deeper.
                with contextlib.suppress(IsolatorError):
                    found.add(_parse_chain(user.split("."), None).chain())
        found.update(self._child_cgroups(root))
        return [_parse_chain(list(chain), None) for chain in sorted(found)]

    def _child_cgroups(self, cid: ContainerId) -> set[tuple[str, ...]]:
        """Chains of the cgroups Mesos made for nested containers below ``cid`` (``<cid>/mesos/<child>``)."""
        out: set[tuple[str, ...]] = set()
        top = getattr(self.controller, "container_dir", self.controller.cgroup_path)(cid)
        try:
            names = os.listdir(os.path.join(top, "mesos"))
        except OSError:
            return out
        for name in names:
            try:
                child = ContainerId.parse(name, cid)
            except IsolatorError:
                continue
            if os.path.isdir(os.path.join(top, "mesos", name)):
                out.add(child.chain())
                out |= self._child_cgroups(child)
        return out

    def _rules_cgroup(self, cid: ContainerId) -> tuple[ContainerId, str]:
        """The container whose cgroup governs ``cid``'s device access, and that cgroup's path.

        A nested container has its own when Mesos made one (v1: the kernel copies the parent's list
        into it at creation); otherwise, and always on v2 where a parent's program applies to its
        descendants, the top-level container's governs.
        """
        if cid.nested and self.controller.version == "v1":
            path = self.controller.cgroup_path(cid)
            if os.path.isdir(path):
                return cid, path
        return cid.root, self.controller.cgroup_path(cid.root)

    def _find(self, cid: ContainerId) -> tuple[ContainerRecord, dict[str, Any]]:
        """The record governing ``cid`` and its view; NotFound for a container we do not know."""
        rec = self.store.get(cid.root)
        if rec is not None and not cid.nested:
            return rec, self._container_view(cid, rec)
        if rec is not None:
            volume_of = self._volume_users()
            if cid in self._nested_ids(cid.root, volume_of):
                return rec, self._nested_view(cid, rec, volume_of)
        raise NotFound(f"unknown container {cid}")

    def _kernel_rules(self, cid: ContainerId) -> tuple[tuple[devrules.DeviceRule, ...], str]:
        """The rules in force for ``cid``'s cgroup and where they were read from."""
        path = self.controller.cgroup_path(cid)
        if not os.path.isdir(path):
            return (), f"none: the cgroup '{path}' does not exist"
        attached = getattr(self.controller, "attached_ids", None)
        if attached is None:
            return tuple(self.controller.current(cid)), f"devices.list of '{path}'"
        ids = attached(cid)
        if not ids:
            return (), f"none: no device program of ours is attached to '{path}'"
        # v2 programs cannot be read back as rules; the checkpoint is what the attached program was built from.
        progs = ", ".join(str(i) for i in ids)
        return tuple(self.controller.current(cid)), f"device program {progs} on '{path}' (rules from its checkpoint)"

    def _granted(self, rules: tuple[devrules.DeviceRule, ...]) -> list[int]:
        return sorted(m for m in self._gpus if devrules.permits(rules, devrules.DeviceRule.char(NVIDIA_MAJOR, m, "rw")))

    def describe_container(self, container_id: ContainerId) -> dict[str, Any]:
        with self._lock:
            rec, view = self._find(container_id)
            target, cgroup = self._rules_cgroup(container_id)
            recorded = _sorted_rules(devrules.parse_rules(line for line in rec.rules.splitlines() if line))
            kernel, source = self._kernel_rules(target)
            kernel = _sorted_rules(kernel)
            try:
                pids = sorted(self.controller.pids(target))
            except CgroupVanished:
                pids = []
            volume_of = self._volume_users()
            nested = [] if container_id.nested else self._nested_ids(container_id, volume_of)
        listed = {g["minor"]: g for g in self.list_gpus()["gpus"] if g.get("uuid")}
        only_recorded = [str(r) for r in recorded if not devrules.permits(kernel, r)]
        only_kernel = [str(r) for r in kernel if not devrules.permits(recorded, r)]
        return {
            "container": view,
            "recorded_rules": [str(r) for r in recorded],
            "kernel_rules": [str(r) for r in kernel],
            "kernel_source": source,
            "rules_cgroup": cgroup,
            "rules_agree": not only_recorded and not only_kernel and not source.startswith("none"),
            "only_recorded": only_recorded,
            "only_kernel": only_kernel,
            "kernel_gpu_minors": self._granted(kernel),
            "pids": pids,
            "gpus": [listed[m] for m in sorted(rec.gpus) if m in listed],
            "nested": [self._nested_view(c, rec, volume_of) for c in nested],
        }

    def release(self, container_id: ContainerId, force: bool) -> dict[str, Any]:
        if container_id.nested:
            raise FailedPrecondition(
                f"container {container_id} is nested and holds no GPUs of its own; "
                f"release its top-level container {container_id.root}"
            )
        with self._lock:
            rec = self._require(container_id)
            cgroup = self.controller.cgroup_path(container_id)
            try:
                pids = self.controller.pids(container_id)
            except CgroupVanished:
                pids = ()
            if pids and not force:
                raise FailedPrecondition(
                    f"container {container_id} still has processes {list(pids)} in "
                    f"'{cgroup}'; use --force to release anyway"
                )
            if pids and self.settings.mode == "standalone":
                # A forced release must not leave running processes with access: revoke, keep the cgroup.
                self._apply(container_id, frozenset(), units=())
                action = "revoked-kept-cgroup"
                did = f"revoked their GPU access in '{cgroup}' and kept the cgroup for its processes {list(pids)}"
            else:
                self.controller.cleanup(container_id)
                action = "removed-cgroup"
                did = (
                    f"removed our device rules from '{cgroup}'"
                    if self.settings.mode == "mesos"
                    else f"removed the cgroup '{cgroup}'"
                )
                if pids:
                    did += f" (its processes {list(pids)} keep running without GPU access)"
            self._drop(container_id, rec)
        self._release_volume(container_id)
        minors = sorted(rec.gpus)
        uuids = [self._gpus[m].uuid for m in minors if m in self._gpus]
        detail = f"released GPUs {minors} of container {container_id}: {did}"
        LOG.warning("admin: %s", detail)
        return {
            "container": str(container_id),
            "released_gpu_uuids": uuids,
            "released_gpu_minors": minors,
            "pids": list(pids),
            "action": action,
            "cgroup": cgroup,
            "detail": detail,
        }

    def volume(self) -> dict[str, Any]:
        if self.volumes is None:
            raise FailedPrecondition("no volume root is configured (see --volume-root)")
        vols = self.volumes.volumes()
        return {
            "driver_version": self._inv.driver_version,
            "volume_root": str(getattr(self.volumes, "volume_root", "")),
            "volumes": vols,
        }

    def health(self) -> list[tuple[str, bool, str]]:
        checks = [self._nvml_check()]
        checks.append(("cgroups", True, f"{self.controller.version} devices, {self.settings.mode} mode"))
        try:
            result = self.store.check()
            checks.append(
                ("state", result == "ok", f"'{self.store.path}': {result}; {len(self.store.load())} containers")
            )
        except IsolatorError as exc:
            checks.append(("state", False, exc.message))
        try:
            pending = self.inconsistencies()
            checks.append(("consistency", not pending, "; ".join(pending) if pending else "records and kernel agree"))
        except IsolatorError as exc:
            checks.append(("consistency", False, exc.message))
        return checks

    def _nvml_check(self) -> tuple[str, bool, str]:
        if not self._gpus:
            return ("nvml", True, "no GPUs managed (gpus:0, or auto-discovery found no NVML)")
        try:
            count = getattr(self._inv, "device_count", None)
            seen = f", NVML sees {count()}" if count is not None else ""  # a live call: nvidia-smi -L
        except Exception as exc:
            return ("nvml", False, f"NVML does not answer: {exc}")
        sick = len(self._gpus) - len(self._inv.healthy())
        detail = f"driver {self._inv.driver_version}, {len(self._gpus)} GPUs managed{seen}, {sick} not usable"
        return ("nvml", bool(self._inv.driver_version), detail)

    def inconsistencies(self) -> list[str]:
        """Records whose kernel rules do not grant exactly the recorded GPUs (what Recover would fix)."""
        out = []
        with self._lock:
            for cid, rec in sorted(self.store.load().items(), key=lambda kv: kv[0].chain()):
                kernel, source = self._kernel_rules(cid)
                if source.startswith("none"):
                    out.append(f"container {cid}: {source[len('none: ') :]}")
                    continue
                granted = self._granted(kernel)
                if granted != sorted(rec.gpus | rec.mig_parents):
                    out.append(f"container {cid}: recorded GPUs {sorted(rec.gpus)}, kernel grants {granted}")
        return out

    def close(self) -> None:
        super().close()
        with contextlib.suppress(Exception):
            self.store.close()


def _cid_dict(cid: ContainerId) -> dict[str, Any]:
    out: dict[str, Any] = {"value": cid.value}
    if cid.parent is not None:
        out["parent"] = _cid_dict(cid.parent)
    return out


def _parse_chain(values: list[str], parent: ContainerId | None) -> ContainerId:
    node = parent
    for value in values:
        node = ContainerId.parse(value, node)
    if node is None:
        raise NotFound("empty container ID")
    return node


def _sorted_rules(rules: Any) -> tuple[devrules.DeviceRule, ...]:
    return tuple(sorted(devrules.normalize(rules), key=lambda r: r.sort_key()))
