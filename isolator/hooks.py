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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from isolator import devices as devrules
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

    def _rules(self, minors: frozenset[int]) -> tuple[devrules.DeviceRule, ...]:
        if not self._gpus:
            return tuple(devrules.MESOS_DEFAULT_WHITELIST)  # no GPUs here: no control devices either
        control = self.host_devices.control_devices(modeset=self.settings.modeset)
        mig = self._mig_devices(minors)
        caps_major = self.host_devices.caps_major() if mig else None
        return devrules.container_rules(control, sorted(minors), mig_devices=mig, caps_major=caps_major)

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

    def _device_mounts(self, rootfs: str, minors: frozenset[int]) -> list[Mount]:
        """Bind mounts of exactly the allocated GPUs and the control devices (Mesos exposes every
        /dev/nvidia*, unallocated GPUs and nvidia-modeset included: defect §2.15.6)."""
        if not self._gpus:
            return []
        names = [f"nvidia{m}" for m in sorted(minors)]
        control = self.host_devices.control_devices(modeset=self.settings.modeset)
        names += [os.path.relpath(n.path, self.settings.dev_root) for n in control.numbers()]
        mounts = []
        for name in names:
            source = os.path.join(self.settings.dev_root, name)
            mounts.append(Mount(target=os.path.join(rootfs, "dev", name), source=source, flags=MS_BIND))
        for mig in self._mig_devices(minors):
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
        image_plan = self._image_plan(config)
        with self._lock:
            if self.store.get(container_id) is not None:
                raise AlreadyExists(f"container {container_id} has already been prepared")
            choice = self.allocator.allocate(count)
            minors = frozenset(choice.gpus)
            undo: list[Callable[[], object]] = [lambda: self.allocator.deallocate(minors)]
            try:
                rules = self._rules(minors)
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
                    )
                )
                undo.append(lambda: self._forget(container_id))
                undo.append(lambda: self.controller.cleanup(container_id))
                crashpoint("prepare.recorded")
                self.controller.prepare(container_id)
                crashpoint("prepare.cgroup")
                self.controller.apply(container_id, rules)
                crashpoint("prepare.applied")
                info = self._launch_info(container_id, config, minors, image_plan, undo)
            except BaseException:
                self._undo(container_id, undo)
                raise
            LOG.info("prepared %s (%s)", self._describe(container_id, minors), choice.policy)
            return info

    def _launch_info(
        self,
        cid: ContainerId,
        config: ContainerConfig,
        minors: frozenset[int],
        image_plan: Any,
        undo: list[Callable[[], object]],
    ) -> LaunchInfo | None:
        if not config.has_image:
            return None  # the host's /dev and libraries, access gated by the cgroup (Mesos)
        mounts = self._device_mounts(config.rootfs, minors)
        env: tuple[tuple[str, str], ...] = ()
        if image_plan is not None:
            mounts_v, env = self._volume(cid, config, image_plan, undo)
            mounts = mounts_v + mounts
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
                info = self._launch_info(cid, config, minors, image_plan, undo)
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
        with self._lock:
            rec = self._require(container_id)
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

    def _apply(self, cid: ContainerId, minors: frozenset[int]) -> None:
        rules = self._rules(minors)
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
                sick = sorted(m for m in rec.gpus if m in self.allocator.unhealthy)
                if sick:
                    return self._limitation(container_id, sick)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._changed.wait(timeout=remaining if remaining is not None else 5.0)

    def _limitation(self, cid: ContainerId, sick: list[int]) -> dict[str, Any]:
        reasons = {}
        for r in self._inv.records:
            if r.gpu.minor in sick:
                reasons[r.gpu.minor] = f"{r.gpu.uuid}: {r.status or 'unhealthy'}"
        detail = "; ".join(f"GPU {m} ({reasons.get(m, 'unhealthy')})" for m in sick)
        return {
            "resources": [{"name": "gpus", "type": "SCALAR", "scalar": {"value": len(sick)}, "role": "*"}],
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
        return {"gpu_uuids": [self._gpus[m].uuid for m in sorted(rec.gpus) if m in self._gpus], "state": rec.state}

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
            self.store.remove(container_id)
            self.allocator.deallocate(rec.gpus & self.allocator.allocated)
            self._changed.notify_all()
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
        return frozenset(
            m for m in self._gpus if devrules.permits(rules, devrules.DeviceRule.char(NVIDIA_MAJOR, m, "rw"))
        )

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
            records = {cid: rec.gpus for cid, rec in self.store.load().items()}
            kernel: dict[ContainerId, frozenset[int]] = {}
            for cid in records:
                if self.settings.mode == "standalone":
                    self._restore_cgroup(cid, records[cid])
                granted = self.kernel_grants(cid)
                if granted is not None:
                    kernel[cid] = granted
            running = None if self.settings.mode == "standalone" else [s.container_id.root for s in states]
            actions = reconcile(records, kernel, running, [o for o in orphans if not o.nested])
            result = RecoverResult()
            for action in actions:
                cid = action.container_id
                if action.kind in (Kind.REVOKE, Kind.REAPPLY):
                    self._apply(cid, records.get(cid, frozenset()))
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
            self._sync_health()
            live = self.store.load()
            for rec in live.values():
                self.allocator.restore(rec.gpus & self.allocator.total)
            result.recovered = len(live)
            if self.volumes is not None:
                self.volumes.reconcile(str(c) for c in live)
            self._changed.notify_all()
            LOG.info("recovered %d containers, released %d", result.recovered, result.released)
            return result

    # ---- admin ------------------------------------------------------------------------------------

    def list_gpus(self) -> dict[str, Any]:
        view = super().list_gpus()
        holders = self.store.holders()
        for gpu in view["gpus"]:
            holder = holders.get(gpu.get("minor", -1))
            gpu["holder"] = str(holder) if holder is not None else ""
        return view

    def list_containers(self) -> list[dict[str, Any]]:
        out = []
        for cid, rec in sorted(self.store.load().items(), key=lambda kv: kv[0].chain()):
            out.append(self._container_view(cid, rec))
        return out

    def _container_view(self, cid: ContainerId, rec: ContainerRecord) -> dict[str, Any]:
        return {
            "container_id": _cid_dict(cid),
            "gpu_uuids": [self._gpus[m].uuid for m in sorted(rec.gpus) if m in self._gpus],
            "gpu_minors": sorted(rec.gpus),
            "cgroup": rec.cgroup,
            "mode": rec.mode,
            "volume_version": rec.volume_version,
            "state": rec.state,
            "created": rec.created,
        }

    def describe_container(self, container_id: ContainerId) -> dict[str, Any]:
        rec = self._require(container_id)
        recorded = [line for line in rec.rules.splitlines() if line]
        try:
            kernel = [str(r) for r in self.controller.current(container_id)]
            pids = list(self.controller.pids(container_id))
        except CgroupVanished:
            kernel, pids = [], []
        agree = set(devrules.normalize(devrules.parse_rules(recorded))) == set(
            devrules.normalize(devrules.parse_rules(kernel))
        )
        return {
            "container": self._container_view(container_id, rec),
            "recorded_rules": recorded,
            "kernel_rules": kernel,
            "rules_agree": agree,
            "pids": pids,
        }

    def release(self, container_id: ContainerId, force: bool) -> dict[str, Any]:
        with self._lock:
            rec = self._require(container_id)
            try:
                pids = self.controller.pids(container_id)
            except CgroupVanished:
                pids = ()
            if pids and not force:
                raise FailedPrecondition(
                    f"container {container_id} still has processes {list(pids)} in "
                    f"'{self.controller.cgroup_path(container_id)}'; use --force to release anyway"
                )
            if pids and self.settings.mode == "standalone":
                # A forced release must not leave running processes with access: revoke, keep the cgroup.
                self._apply(container_id, frozenset())
            else:
                self.controller.cleanup(container_id)
            self.store.remove(container_id)
            self.allocator.deallocate(rec.gpus & self.allocator.allocated)
            self._changed.notify_all()
        self._release_volume(container_id)
        uuids = [self._gpus[m].uuid for m in sorted(rec.gpus) if m in self._gpus]
        detail = f"released GPUs {sorted(rec.gpus)} of container {container_id}"
        if pids:
            detail += f"; revoked device access of running processes {list(pids)}"
        LOG.warning("admin: %s", detail)
        return {"released_gpu_uuids": uuids, "detail": detail}

    def volume(self) -> dict[str, Any]:
        if self.volumes is None:
            raise FailedPrecondition("no volume root is configured")
        vols = self.volumes.volumes()
        current = self._inv.driver_version
        return {"driver_version": current, "volumes": vols}

    def health(self) -> list[tuple[str, bool, str]]:
        checks: list[tuple[str, bool, str]] = []
        try:
            driver = self._inv.driver_version
            n = len(self._inv.records)
            sick = len(self._gpus) - len(self._inv.healthy())
            checks.append(("nvml", bool(driver), f"driver {driver}, {n} GPUs, {sick} not usable"))
        except Exception as exc:
            checks.append(("nvml", False, str(exc)))
        checks.append(("cgroups", True, f"{self.controller.version} devices, {self.settings.mode} mode"))
        try:
            result = self.store.check()
            checks.append(("state", result == "ok", f"{result}; {len(self.store.load())} containers"))
        except IsolatorError as exc:
            checks.append(("state", False, exc.message))
        pending = self.inconsistencies()
        checks.append(("consistency", not pending, "; ".join(pending) if pending else "records and kernel agree"))
        return checks

    def inconsistencies(self) -> list[str]:
        out = []
        with self._lock:
            for cid, rec in self.store.load().items():
                try:
                    kernel = self.controller.current(cid)
                except CgroupVanished:
                    out.append(f"container {cid}: its cgroup is gone")
                    continue
                granted = frozenset(
                    m for m in self._gpus if devrules.permits(kernel, devrules.DeviceRule.char(NVIDIA_MAJOR, m, "rw"))
                )
                if granted != rec.gpus:
                    out.append(f"container {cid}: recorded GPUs {sorted(rec.gpus)}, kernel grants {sorted(granted)}")
        return out

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._lock:
            yield

    def close(self) -> None:
        super().close()
        with contextlib.suppress(Exception):
            self.store.close()


def _cid_dict(cid: ContainerId) -> dict[str, Any]:
    out: dict[str, Any] = {"value": cid.value}
    if cid.parent is not None:
        out["parent"] = _cid_dict(cid.parent)
    return out
