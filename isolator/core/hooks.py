"""The Mesos isolator hooks: prepare, isolate, update, watch, usage, status, cleanup.

Each hook holds its container's lock (isolator/core/locks.py) for its whole run, and the
allocation lock only for the decision on the shared GPUs. Decisions come from pure modules
(allocator, devices.container_rules, volumes.inject); the machine is reached through the edges.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
from collections.abc import Callable
from dataclasses import dataclass

from isolator.core import mps as mpsdaemons
from isolator.core.context import Core
from isolator.core.grant import Grant
from isolator.crashpoints import crashpoint
from isolator.errors import (
    AlreadyExists,
    CgroupVanished,
    ContainerGone,
    FailedPrecondition,
    InvalidArgument,
    IsolatorError,
    NotFound,
    PermissionDenied,
    from_code,
)
from isolator.model import (
    UNKNOWN_CALLER,
    ContainerConfig,
    ContainerId,
    ContainerRecord,
    ContainerStatus,
    GpuUsage,
    LaunchInfo,
    Limitation,
    MigDevice,
    Mount,
    Resource,
    Usage,
    check_rootfs,
    gpu_count,
)
from isolator.policy import mig as migunits
from isolator.policy import shares as sharing
from isolator.policy.affinity import Affinity, format_list
from volumes.errors import VolumeError
from volumes.inject import DriverFacts, Image, check_cuda, should_inject, volume_injection

LOG = logging.getLogger(__name__)

MS_BIND = 4096
MAX_PID = 1 << 22  # PID_MAX_LIMIT on 64-bit Linux
WATCH_POLL_S = 5.0  # how often an unbounded Watch looks again even without a notification

Undo = list[Callable[[], object]]


@dataclass(frozen=True)
class ImagePlan:
    """What ``prepare`` decided about the driver volume before allocating anything."""

    image: Image
    facts: DriverFacts
    reason: str  # why it takes the volume (should_inject): decided once, before anything is allocated


@dataclass(frozen=True)
class MpsClient:
    """An MPS sharer's part of its launch: the host pipe directory, its shares of ``total``, the GPU's memory."""

    pipe_dir: str
    shares: int
    total: int
    memory_bytes: int


def _below(path: str, top: str) -> bool:
    return path.startswith(top.rstrip("/") + "/")


def _volume_error(exc: VolumeError) -> IsolatorError:
    return from_code(exc.code, str(exc))


class Hooks:
    """A container's lifecycle: prepare, isolate, update, watch, usage, status, cleanup (part of IsolatorService)."""

    core: Core  # set by IsolatorService, which composes the three parts over one Core

    # ---- prepare ----------------------------------------------------------------------------------

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        if container_id.nested:
            return self._prepare_nested(container_id, config)
        core = self.core
        count = gpu_count(config.resources)
        mig_request = migunits.requests(config.resources)
        share_count = sharing.share_request(config.resources)
        if share_count and (count or mig_request):
            # One kind per container: under MPS its CUDA would reach every GPU through the MPS
            # daemon of its shared one, and a whole GPU beside a share gains nothing (docs/sharing.md).
            raise InvalidArgument(
                f"container {container_id} asks for {sharing.RESOURCE} together with whole GPUs or MIG devices;"
                " a container holds shares of one GPU, or whole GPUs and MIG devices, not both"
            )
        image_plan = self._image_plan(config)
        holder = container_id.key()
        with core.locks.hold(container_id):
            if core.store.get(container_id) is not None:
                raise AlreadyExists(f"container {container_id} has already been prepared")
            core.changes.forget_ended(container_id)
            self._refuse_populated(container_id)
            if count or mig_request or share_count:
                core.handover.recheck()  # a draining GPU that is clear now may be chosen (docs/handover.md)
            near = core.grants.task_nodes(container_id) if share_count else None
            with core.booking.lock:
                placed = core.booking.place_shares(holder, share_count, near) if share_count else None
                try:
                    choice = core.booking.allocate_whole(count)
                except BaseException:
                    core.booking.free_shares(holder)
                    raise
                try:
                    units = core.booking.choose_mig(mig_request)
                except BaseException:
                    core.booking.allocator.deallocate(choice.gpus)
                    core.booking.free_shares(holder)
                    raise
            minors = frozenset(choice.gpus)
            shared = frozenset((placed.minor,)) if placed is not None else frozenset()
            undo: Undo = [lambda: self._deallocate(minors, units, holder)]
            try:
                aff = core.grants.affinity(container_id, minors | shared, units)
                held = aff if core.grants.enforcing else None  # recorded with the GPUs, applied after their rules
                grant = core.grants.compute(minors | shared, units)
                rules = grant.rules
                core.store.record(
                    ContainerRecord(
                        container_id,
                        gpus=minors,
                        mode=core.settings.mode,
                        cgroup=core.cgroups.cgroup_path(container_id),
                        cgroup_version=1 if core.cgroups.version == "v1" else 2,
                        state="prepared",
                        created=core.clock.time(),
                        rules=rules,
                        mig=frozenset((d.uuid, d.parent_minor) for d in units),
                        cpus=held.cpu_list if held is not None else "",
                        mems=held.mem_list if held is not None else "",
                        share_gpu=placed.minor if placed is not None else -1,
                        shares=placed.shares if placed is not None else 0,
                        share_mode=placed.mode if placed is not None else "",
                    )
                )
                undo.append(lambda: self._forget(container_id))
                undo.append(lambda: core.grants.revoke(container_id))
                crashpoint("prepare.recorded")
                core.grants.create(container_id)
                crashpoint("prepare.cgroup")
                core.grants.write(container_id, rules)
                crashpoint("prepare.applied")
                if held is not None and core.cpusets is not None:
                    undo.append(lambda: core.grants.remove_cpuset(container_id))
                    crashpoint("cpuset.recorded")
                    core.grants.apply_cpuset(container_id, held)
                if placed is not None and placed.mode == sharing.MPS:
                    core.mps.ensure(core.gpus[placed.minor])  # fail closed: no sharer without its daemon
                info = self._launch_info(
                    container_id,
                    config,
                    grant,
                    image_plan,
                    undo,
                    units,
                    aff,
                    self._mps_client(core.store.get(container_id)),
                )
            except BaseException:
                self._undo(container_id, undo)
                raise
        mig_note = f", MIG devices [{migunits.visible_devices(units)}]" if units else ""
        if placed is not None:
            mig_note += f", {placed.shares} of the {placed.total} shares of GPU {placed.minor} ({placed.mode})"
        LOG.info("prepared %s (%s)%s", core.describe(container_id, minors | shared), choice.policy, mig_note)
        return info

    def _refuse_populated(self, cid: ContainerId) -> None:
        """A cgroup that already holds processes would hand them the new GPUs without any Isolate
        (left behind by a forced release, or made by someone else under our root): refuse it."""
        cgroups = self.core.cgroups
        if not cgroups.exists(cid):
            return
        try:
            squatters = cgroups.pids(cid)
        except CgroupVanished:
            return
        if squatters:
            raise FailedPrecondition(
                f"the cgroup '{cgroups.cgroup_path(cid)}' of container {cid} already has processes "
                f"{list(squatters)}; they would get its GPUs without an Isolate (end them, or remove the cgroup)"
            )

    def _prepare_nested(self, cid: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        # Mesos: DEBUG containers inherit everything from their parent; other nested containers get
        # the volume and device nodes for their own rootfs and use their top-level container's GPUs.
        # Both get the top-level container's rules in a cgroup of their own where the agent made one.
        core = self.core
        if config.container_class == "DEBUG":
            with core.locks.hold(cid):
                root = self._require_top_level(cid)
                self._rules_for_nested(
                    cid, config, lambda: core.grants.compute(root.gpus | root.shared, core.grants.mig_of(root))
                )
            return None
        image_plan = self._image_plan(config)
        with core.locks.hold(cid):
            root = self._require_top_level(cid)
            minors = root.gpus | root.shared
            undo: Undo = []
            try:
                units = core.grants.mig_of(root)
                grant = core.grants.compute(minors, units)  # /dev and the MIG view read once for both uses
                if self._rules_for_nested(cid, config, lambda: grant):
                    undo.append(lambda: core.grants.revoke(cid))
                aff = core.grants.affinity(cid, minors, units) if core.settings.cpu_affinity != "off" else None
                info = self._launch_info(cid, config, grant, image_plan, undo, units, aff, self._mps_client(root))
            except BaseException:
                self._undo(cid, undo)
                raise
        LOG.info("prepared nested %s", core.describe(cid, minors))
        return info

    def _require_top_level(self, cid: ContainerId) -> ContainerRecord:
        # Mesos prepares a top-level container (with every isolator) before anything nested in it;
        # a nested container whose top-level one we never prepared is one we cannot account for.
        rec = self.core.store.get(cid.root)
        if rec is None:
            raise FailedPrecondition(
                f"nested container {cid}: its top-level container {cid.root} was never prepared with this sidecar"
            )
        return rec

    def _rules_for_nested(self, cid: ContainerId, config: ContainerConfig, grant: Callable[[], Grant]) -> bool:
        """Give a nested container that has a devices cgroup of its own its top-level container's rules.

        Mesos makes ``<root>/<parent>/mesos/<child>`` (v1, and v2 with ``/leaf``) before module
        isolators prepare, and puts the pid there: on v1 only when ``share_cgroups`` is false (1.10+),
        whitelisted with its defaults alone, so the GPUs would be denied; on v2 (master) for every
        nested container, outside our program on the parent's leaf, so nothing of ours would apply.
        The caller has found the top-level container's record (``_require_top_level``); ``grant``
        gives its grant, computed only when a cgroup of its own needs it. Call with the container's
        lock held.
        """
        core = self.core
        if core.settings.mode != "mesos":
            return False  # standalone: nested containers run in their top-level container's cgroup
        if not core.cgroups.exists(cid):
            if not config.share_cgroups:
                raise FailedPrecondition(
                    f"nested container {cid} asks for cgroups of its own (share_cgroups=false) but "
                    f"'{core.cgroups.cgroup_path(cid)}' does not exist; is Mesos's cgroups/devices isolator enabled?"
                )
            return False  # shares its parent's cgroup, whose rules are already in force
        core.grants.create(cid)
        core.grants.apply_nested(cid, grant().rules)
        return True

    def _image_plan(self, config: ContainerConfig) -> ImagePlan | None:
        """Decide on the volume before anything is allocated, so a refusal leaves nothing behind."""
        if not config.has_image:
            return None
        check_rootfs(config.rootfs)  # absolute and normalized: everything below resolves in it
        if not self.core.edges.filesystem.is_dir(config.rootfs):
            raise InvalidArgument(f"the container's rootfs '{config.rootfs}' does not exist")
        inv = self.core.inventory
        image = Image(env=config.image_env, labels=dict(config.image_labels))
        facts = DriverFacts(inv.driver_version, inv.cuda_driver_version)
        try:
            inject, reason = should_inject(image)
            if inject:
                check_cuda(image, facts, config.rootfs)
        except VolumeError as exc:
            raise _volume_error(exc) from exc
        return ImagePlan(image, facts, reason) if inject else None

    def _launch_info(
        self,
        cid: ContainerId,
        config: ContainerConfig,
        grant: Grant,
        image_plan: ImagePlan | None,
        undo: Undo,
        units: tuple[MigDevice, ...] = (),
        aff: Affinity | None = None,
        mps: MpsClient | None = None,
    ) -> LaunchInfo | None:
        # MIG holders are told which devices are theirs (docs/mig.md), with or without an image.
        visible = (("NVIDIA_VISIBLE_DEVICES", migunits.visible_devices(units)),) if units else ()
        # --cpu-affinity hint/enforce: the GPUs' local CPUs and NUMA nodes (docs/affinity.md); to a
        # command task through task_environment, like the volume's PATH (its executor's is not its own).
        local = aff.environment() if aff is not None else ()
        # An MPS sharer: the pipe directory and its limits (docs/sharing.md), the same way.
        if mps is not None:
            pipe = mps.pipe_dir if not config.has_image else mpsdaemons.CONTAINER_PIPE_DIR
            local += mpsdaemons.environment(pipe, mps.shares, mps.total, mps.memory_bytes)
        if not config.has_image:
            # The host's /dev and libraries, access gated by the cgroup (Mesos).
            if config.command_task and local:
                return LaunchInfo(environment=visible, task_environment=local)
            return LaunchInfo(environment=visible + local) if visible or local else None
        mounts = self._device_mounts(config.rootfs, grant)
        if mps is not None:
            # The daemon's pipe directory at CUDA's default path in the image, writable (clients make
            # their own pipes there), as k8s-device-plugin mounts it.
            rel = mpsdaemons.CONTAINER_PIPE_DIR.lstrip("/")
            target = self.core.edges.filesystem.make_dirs_in(config.rootfs, rel)
            mounts.append(Mount(target=target, source=mps.pipe_dir, flags=MS_BIND))
        env: tuple[tuple[str, str], ...] = ()
        if image_plan is not None:
            mounts_v, env = self._volume(cid, config, image_plan, undo)
            mounts = mounts_v + mounts
        env = tuple((k, v) for k, v in env if k != "NVIDIA_VISIBLE_DEVICES") + visible + local
        if config.command_task:
            # Mesos's isolator: a command task's environment goes in task_environment, which the
            # command executor applies over the image's own (docker/runtime puts the image's PATH
            # there); in `environment` the image's PATH and LD_LIBRARY_PATH would win over ours.
            return LaunchInfo(task_environment=env, mounts=tuple(mounts))
        return LaunchInfo(environment=env, mounts=tuple(mounts))

    def _mps_client(self, rec: ContainerRecord | None) -> MpsClient | None:
        """What an MPS sharer's launch needs; None for anyone else."""
        if rec is None or not rec.shares or rec.share_mode != sharing.MPS:
            return None
        core = self.core
        gpu = core.gpus[rec.share_gpu]
        with core.booking.lock:
            total = core.booking.shared[rec.share_gpu].shares
        return MpsClient(core.mps.pipe_dir(gpu), rec.shares, total, gpu.memory_total)

    def _device_mounts(self, rootfs: str, grant: Grant) -> list[Mount]:
        """Bind mounts of the grant's nodes: exactly the allocated GPUs, the control devices and the MIG
        caps (Mesos exposes every /dev/nvidia*, unallocated GPUs and nvidia-modeset included: §2.15.6)."""
        core = self.core
        dev_root = core.edges.devices.dev_root
        # Targets resolved inside the image (``dev`` may be a link in it): never a host path.
        target = core.edges.filesystem.mount_target
        return [
            Mount(target=target(rootfs, f"dev/{name}"), source=posixpath.join(dev_root, name), flags=MS_BIND)
            for name in grant.nodes
        ]

    def _volume(
        self, cid: ContainerId, config: ContainerConfig, plan: ImagePlan, undo: Undo
    ) -> tuple[list[Mount], tuple[tuple[str, str], ...]]:
        core = self.core
        if core.volumes is None:
            raise FailedPrecondition("the image asks for the driver volume but no volume root is configured")
        try:
            volume = core.volumes.acquire(cid.key(), plan.facts.driver_version)
            undo.append(lambda: core.release_volume(cid))
            crashpoint("prepare.volume")
        except VolumeError as exc:
            raise _volume_error(exc) from exc
        injection = volume_injection(config.rootfs, plan.image, volume.path, plan.reason)  # decided in _image_plan
        if not cid.nested:
            core.store.update(cid, volume_version=volume.driver_version)
        mounts = []
        for spec in injection.mounts:
            target = spec.target
            if spec.mkdir:
                # Made inside the image as if it were '/', and mounted where that resolved to (an
                # image's `usr -> /X` must not make the sidecar create /X/local/nvidia on the host).
                rel = posixpath.relpath(spec.target, config.rootfs)
                target = core.edges.filesystem.make_dirs_in(config.rootfs, rel)
            mounts.append(Mount(target=target, source=spec.source, flags=spec.flags))
        return mounts, tuple(sorted(injection.env.items()))

    def _deallocate(self, minors: frozenset[int], units: tuple[MigDevice, ...] = (), holder: str = "") -> None:
        with self.core.booking.lock:
            self.core.booking.allocator.deallocate(minors)
            self.core.booking.free_mig(d.uuid for d in units)
            if holder:
                self.core.booking.free_shares(holder)

    def _undo(self, cid: ContainerId, undo: Undo) -> None:
        for step in reversed(undo):
            try:
                step()
            except Exception:
                LOG.exception("failed to undo part of prepare for container %s", cid)

    def _forget(self, cid: ContainerId) -> None:
        with contextlib.suppress(NotFound):
            self.core.store.remove(cid)

    # ---- isolate ----------------------------------------------------------------------------------

    def isolate(self, container_id: ContainerId, pid: int, caller: int | None = None) -> None:
        core = self.core
        if pid <= 1 or pid >= MAX_PID:
            raise InvalidArgument(f"pid {pid} is not a valid container pid")
        if not core.edges.processes.exists(pid):
            raise FailedPrecondition(f"pid {pid} does not exist (the container's init is gone)")
        if core.edges.processes.kernel_thread(pid):
            raise FailedPrecondition(f"pid {pid} is a kernel thread; only a container's own processes are isolated")
        with core.locks.hold(container_id):
            rec = core.require(container_id.root)
            target = core.grants.governing(container_id)
            if core.settings.mode == "standalone":
                self._move(container_id, target, pid, caller)
                crashpoint("isolate.placed")
            else:
                self._wait_for_pid(target, pid)
            self._join_cpuset(container_id, rec, pid)
            if not container_id.nested and rec.state == "prepared":
                core.store.update(container_id, state="isolated")
        LOG.info("isolated pid %d in %s", pid, core.describe(container_id, rec.gpus))

    def _move(self, cid: ContainerId, target: ContainerId, pid: int, caller: int | None) -> None:
        """Standalone mode places the container's init itself. The pid rule: never the sidecar or an
        ancestor of it, never a process in another cgroup under our root (another container's, or
        one we do not know); a process already in this container may be moved; any other must be
        the caller's (``_check_caller``). The process is held by a pidfd from the check to after the
        move, so the pid that was written named the process that was checked (if it exited
        meanwhile, the move is refused)."""
        core = self.core
        procs = core.edges.processes
        if pid in procs.sidecar_pids():
            raise FailedPrecondition(f"pid {pid} is the sidecar or one of its ancestors; it is never isolated")
        pinned = procs.pin(pid)
        if pinned is None:
            raise FailedPrecondition(f"pid {pid} does not exist (the container's init is gone)")
        try:
            where = core.cgroups.cgroup_of(pid)
            root = core.cgroups.root_path()
            own = core.cgroups.cgroup_path(cid.root)
            if where is None:
                version = core.cgroups.version
                raise FailedPrecondition(f"pid {pid} is gone, or its {version} devices cgroup cannot be read")
            in_container = where == own or _below(where, own)
            if _below(where, root) and not in_container:
                raise FailedPrecondition(
                    f"pid {pid} is in the cgroup '{where}' under our root, not in container {cid}'s; "
                    "a process of another container or of a cgroup we do not know is never moved"
                )
            if not in_container and caller is not None:
                self._check_caller(cid, pid, where, caller)
            core.cgroups.add_pid(target, pid)
            if not pinned.alive():
                raise FailedPrecondition(
                    f"pid {pid} exited while it was being isolated; its number may now name another process"
                )
        finally:
            pinned.close()

    def _join_cpuset(self, cid: ContainerId, rec: ContainerRecord, pid: int) -> None:
        """Put the pid in its top-level container's cpuset (mesos mode: ours, beside Mesos's cgroups;
        a nested container's pid comes from the agent, not from its parent, so it is placed too).
        A cpuset lost to a crash is made again from the record first."""
        core = self.core
        aff = core.grants.recorded_affinity(rec)
        if aff is None or core.cpusets is None:
            return
        before = core.edges.cpus.allowed_of(pid) if core.edges.cpus is not None else None
        current = core.cpusets.current(cid.root)
        if current is None or current != aff:
            core.grants.apply_cpuset(cid.root, aff)
        core.cpusets.join(cid.root, pid)
        lost = (before or frozenset()) - aff.cpus
        if lost:
            LOG.info(
                "pid %d of container %s could run on CPUs %s; its GPUs' cpuset '%s' holds it to %s",
                pid,
                cid,
                format_list(before or ()),
                core.cpusets.path(cid),
                aff.cpu_list,
            )

    def _check_caller(self, cid: ContainerId, pid: int, where: str, caller: int) -> None:
        """A process from outside the container is moved only if it is the caller's: the caller
        itself, one of its descendants, or a process in the caller's own cgroup (a launcher's
        sibling, e.g. the container a Mesos launcher forked beside the bridge executable). Anything
        else (a process someone placed in a cgroup of its own) is refused (issue 26)."""
        core = self.core
        if caller == UNKNOWN_CALLER:
            raise PermissionDenied(
                f"pid {pid} is not in container {cid}'s cgroup and the caller's own pid is unknown (a"
                " connection that did not pass the socket's gate); only a caller's own processes are moved"
            )
        if pid == caller or core.edges.processes.descends_from(pid, caller):
            return
        mine = core.cgroups.cgroup_of(caller)
        if mine is not None and mine == where:
            return
        raise PermissionDenied(
            f"pid {pid} (cgroup '{where}') is not the caller's: neither the caller (pid {caller}, cgroup"
            f" '{mine or 'unknown'}') nor one of its descendants, nor in its cgroup, nor in container {cid}'s"
            " cgroup; a process of someone else is never moved into a container"
        )

    def _wait_for_pid(self, cid: ContainerId, pid: int) -> None:
        clock = self.core.clock
        deadline = clock.monotonic() + self.core.settings.isolate_settle_s
        while True:
            if pid in self.core.cgroups.pids(cid):
                return
            if clock.monotonic() >= deadline:
                raise FailedPrecondition(
                    f"pid {pid} is not in the cgroup '{self.core.cgroups.cgroup_path(cid)}' of container {cid}"
                )
            clock.sleep(0.02)

    # ---- update -----------------------------------------------------------------------------------

    def update(self, container_id: ContainerId, resources: list[Resource]) -> None:
        core = self.core
        if container_id.nested:
            raise FailedPrecondition(f"update is not supported for nested containers ({container_id})")
        target = gpu_count(resources)
        wanted = migunits.requests(resources)
        wanted_shares = sharing.share_request(resources)
        with core.locks.hold(container_id):
            rec = core.require(container_id)
            if wanted_shares != rec.shares or (rec.shares and target):
                raise FailedPrecondition(
                    f"container {container_id} holds {rec.shares} {sharing.RESOURCE}; shares are fixed at launch"
                    f" and never mixed with whole GPUs (update asks for {wanted_shares} {sharing.RESOURCE},"
                    f" {target} gpus)"
                )
            held: dict[str, int] = {}
            for dev in core.grants.mig_of(rec):
                name = migunits.resource_name(dev.profile) or dev.profile
                held[name] = held.get(name, 0) + 1
            if wanted != held:
                raise FailedPrecondition(
                    f"container {container_id} holds MIG devices {held or '{}'}; MIG holdings are fixed at "
                    f"launch (update asks for {wanted or '{}'})"
                )
            if target > len(rec.gpus):
                core.handover.recheck()
            with core.booking.lock:
                plan = core.booking.allocator.plan_update(rec.gpus, target)
                add, release = frozenset(plan.add), frozenset(plan.release)
                if add:
                    core.booking.allocator.allocate_set(add)
            try:
                # Decided before anything changes: an enforced locality that leaves nothing refuses the update.
                moved = (
                    core.grants.affinity(container_id, (rec.gpus | add) - release) if core.grants.enforcing else None
                )
            except BaseException:
                if add:
                    self._deallocate(add)
                raise
            if add:
                # Grow: book, record, then grant (never grant what is not recorded).
                recorded = False
                try:
                    core.store.add_gpus(container_id, add)
                    recorded = True
                    crashpoint("update.grown")
                    core.grants.apply(container_id, rec.gpus | add)
                except BaseException:
                    self._undo_grow(container_id, rec.gpus, add, recorded)
                    raise
            if release:
                # Shrink: revoke, then let the record and the allocator go.
                core.grants.apply(container_id, rec.gpus - release)
                crashpoint("update.revoked")
                core.store.remove_gpus(container_id, release)
                core.release_gpus(release)
            final = (rec.gpus | add) - release
            if core.grants.enforcing and (add or release):
                self._move_cpuset(container_id, rec, moved)
        LOG.info("updated %s to %d GPUs", core.describe(container_id, frozenset(final)), target)

    def _move_cpuset(self, cid: ContainerId, rec: ContainerRecord, held: Affinity | None) -> None:
        """After an update: record the cpuset of the GPUs now held, then write it. A container left
        with no GPUs is let go back to what its parent allows (it is left alone, as without GPUs)."""
        core = self.core
        assert core.cpusets is not None
        old = core.grants.recorded_affinity(rec)
        if held is None:
            if old is None or core.edges.cpus is None:
                return
            machine = core.edges.cpus.machine()
            held = Affinity(core.cpusets.allowed(cid) or machine.cpus, machine.mems)
        if old == held:
            return
        core.store.set_cpuset(cid, held.cpu_list, held.mem_list)
        crashpoint("cpuset.recorded")
        core.grants.apply_cpuset(cid, held, before=old.cpus if old is not None else None)
        if old is None:
            # It had no GPUs, so no cpuset: its processes join the one just made.
            for member in [cid, *core.grants.nested_cgroups(cid)] if core.cgroups.exists(cid) else []:
                with contextlib.suppress(CgroupVanished):
                    for pid in core.cgroups.pids(member):
                        core.cpusets.join(cid, pid)

    def _undo_grow(self, cid: ContainerId, kept: frozenset[int], add: frozenset[int], recorded: bool) -> None:
        """Take back a grow that failed half-way: revoke in the kernel, then forget, then free.

        The kernel may already grant ``add`` (the rules were applied, their record failed), so they
        are revoked first; a GPU whose revocation fails stays recorded and booked, never free while
        granted.
        """
        core = self.core
        units = core.grants.mig_of(core.store.get(cid))  # MIG holdings never change in an update
        if recorded:
            try:
                core.grants.write(cid, core.grants.rules(kept, units))
            except CgroupVanished:
                pass  # no cgroup, no grant: nothing to revoke
            except Exception:
                LOG.exception(
                    "failed to revoke GPUs %s of %s after a failed update; they stay booked", sorted(add), cid
                )
                return
            try:
                core.store.remove_gpus(cid, add)
            except IsolatorError as exc:
                LOG.error(
                    "failed to forget GPUs %s of %s after a failed update; they stay booked: %s", sorted(add), cid, exc
                )
                return
            with contextlib.suppress(IsolatorError):
                core.store.update(cid, rules=core.grants.rules(kept, units))
        self._deallocate(add)

    # ---- watch, usage, status ---------------------------------------------------------------------

    def watch(self, container_id: ContainerId, timeout: float | None) -> Limitation | None:
        """A limitation once a GPU the container holds becomes unhealthy; None at ``timeout``."""
        core = self.core
        deadline = None if timeout is None else core.clock.monotonic() + max(timeout, 0.0)
        while True:
            seen = core.changes.generation()
            rec = core.store.get(container_id.root)
            if rec is None:
                if container_id.nested:
                    return None
                if core.changes.recently_ended(container_id):
                    # The module polls Watch once more after each Cleanup; the bridge answers that
                    # poll "no limitation", an open gRPC Watch ends NOT_FOUND.
                    raise ContainerGone(container=str(container_id))
                raise NotFound(f"unknown container {container_id}")
            with core.booking.lock:
                sick = sorted(
                    m for m in rec.gpus | rec.mig_parents | rec.shared if m in core.booking.allocator.unhealthy
                )
            if sick:
                return self._limitation(container_id, sick, rec)
            remaining = None if deadline is None else deadline - core.clock.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            core.changes.wait_for_change(seen, remaining if remaining is not None else WATCH_POLL_S)

    def _limitation(self, cid: ContainerId, sick: list[int], rec: ContainerRecord) -> Limitation:
        """An XID on a GPU limits every container on it: holders of the GPU and of its MIG devices."""
        reasons = {}
        for r in self.core.inventory.records:
            if r.gpu.minor in sick:
                reasons[r.gpu.minor] = f"{r.gpu.uuid}: {r.status or 'unhealthy'}"
        detail = "; ".join(f"GPU {m} ({reasons.get(m, 'unhealthy')})" for m in sick)
        units: dict[str, list[str]] = {}
        for dev in self.core.grants.mig_of(rec):
            if dev.parent_minor in sick:
                units.setdefault(migunits.resource_name(dev.profile) or dev.profile, []).append(dev.uuid)
        if units:
            detail += "; its MIG devices " + ", ".join(u for us in units.values() for u in us)
        # A sharer loses its shares (the limitation's resources: ``gpu_shares``, beside the MIG units).
        lost = [(name, len(uuids)) for name, uuids in sorted(units.items())]
        if rec.shares and rec.share_gpu in sick:
            detail += f"; its {rec.shares} {sharing.RESOURCE} of GPU {rec.share_gpu} ({rec.share_mode})"
            lost.append((sharing.RESOURCE, rec.shares))
        return Limitation(
            gpus=len([m for m in sick if m in rec.gpus]),
            message=f"container {cid} holds a GPU that became unhealthy: {detail}",
            mig=tuple(lost),
        )

    def usage(self, container_id: ContainerId) -> Usage:
        core = self.core
        rec = core.require(container_id.root)
        gpus = []
        for minor in sorted(rec.gpus | rec.shared):
            gpu = core.gpus.get(minor)
            if gpu is None:
                continue
            u = core.inventory.usage(gpu.index)
            gpus.append(GpuUsage(gpu.uuid, minor, u.memory_used, u.memory_total, u.gpu_utilization))
        return Usage(timestamp=core.clock.time(), gpus=tuple(gpus))

    def status(self, container_id: ContainerId) -> ContainerStatus:
        core = self.core
        rec = core.require(container_id.root)
        uuids = tuple(core.gpus[m].uuid for m in sorted(rec.gpus | rec.shared) if m in core.gpus)
        return ContainerStatus(uuids + tuple(sorted(rec.mig_uuids)), rec.state)

    # ---- cleanup ----------------------------------------------------------------------------------

    def cleanup(self, container_id: ContainerId) -> None:
        core = self.core
        if container_id.nested:
            if core.settings.mode == "mesos":
                with core.locks.hold(container_id):
                    core.grants.revoke(container_id)  # our rules in its own cgroup, if any
            core.release_volume(container_id)
            return
        with core.locks.hold(container_id):
            rec = core.store.get(container_id)
            if rec is not None:
                core.grants.cleanup(container_id)
                crashpoint("cleanup.cgroup")
                core.drop(container_id, rec)
            core.changes.mark_ended(container_id)
        if rec is None:
            # Mesos calls cleanup for containers it never prepared with us (MESOS-6059).
            LOG.info("ignoring cleanup of unknown container %s", container_id)
            core.release_volume(container_id)
            return
        crashpoint("cleanup.record")
        core.release_volume(container_id)
        LOG.info("cleaned up %s", core.describe(container_id, rec.gpus))
