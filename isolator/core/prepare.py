"""Prepare: a container's GPUs booked, recorded, granted in the kernel, and its launch decided.

Holds the container's lock for its whole run and the booking lock only for the choice of GPUs; a
failure half-way undoes what was done, in reverse. Decisions come from pure modules (allocator,
devices, volumes.inject, policy.launch); the machine is reached through the edges.
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
from isolator.core.steps import Steps
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
    ContainerRecord,
    Holding,
    LaunchInfo,
    MigDevice,
    Mode,
    Mount,
    ShareMode,
    check_rootfs,
)
from isolator.policy import launch
from isolator.policy import mig as migunits
from isolator.policy import request as requests
from isolator.policy.affinity import Affinity
from volumes.errors import VolumeError
from volumes.inject import DriverFacts, Image, check_cuda, should_inject, volume_injection

LOG = logging.getLogger(__name__)

MS_RDONLY = 1
MS_BIND = 4096

Undo = list[Callable[[], object]]


@dataclass(frozen=True)
class ImagePlan:
    """What ``prepare`` decided about the driver volume before allocating anything."""

    image: Image
    facts: DriverFacts
    reason: str  # why it takes the volume (should_inject): decided once, before anything is allocated


def answers_early(mode: Mode, config: ContainerConfig, holding: Holding) -> bool:
    """Whether a Prepare may answer before its grant is durable and in force: under a Mesos agent
    (the launch path, issue 45), when its launch info is decided by the choice of GPUs alone. Not
    for a sharer (its launch info needs the MPS daemon started and its limits set: fail closed),
    nor for an image (its mounts are made in the rootfs)."""
    return mode is Mode.MESOS and holding.share is None and not config.has_image


@dataclass(frozen=True)
class MpsClient:
    """An MPS sharer's part of its launch: the host pipe directory, its shares of ``total``, the GPU's memory."""

    pipe_dir: str
    shares: int
    total: int
    memory_bytes: int


def _volume_error(exc: VolumeError) -> IsolatorError:
    return from_code(exc.code, str(exc))


class PrepareHook:
    """Prepare, for a top-level or a nested container (part of IsolatorService, through ``hooks.Hooks``)."""

    core: Core  # set by IsolatorService, which composes the parts over one Core

    def prepare(
        self,
        container_id: ContainerId,
        config: ContainerConfig,
        answer: Callable[[LaunchInfo | None], None] | None = None,
    ) -> LaunchInfo | None:
        """With ``answer``, a Prepare that can answer does so once its GPUs are chosen, before its grant is on
        disk and in force (``answers_early``); the caller must then wait for the container's Isolate,
        which answers only once they are (docs/mesos-agent.md, "Prepare answers before its grant is
        in force"). A failure after that answer is kept for the Isolate to report."""
        if container_id.nested:
            return self._prepare_nested(container_id, config)
        core = self.core
        request = requests.for_prepare(container_id, config.resources)
        image_plan = self._image_plan(config)
        holder = container_id.key()
        steps = Steps(core.clock.monotonic)
        with core.locks.hold(container_id):
            if core.store.has(container_id):
                raise AlreadyExists(f"container {container_id} has already been prepared")
            if core.changes.recently_ended(container_id):
                # Mesos never reuses a container ID (a UUID): a Prepare after its Cleanup is a stale
                # call that outlived its caller, or one the Cleanup overtook (docs/reliability.md).
                raise FailedPrecondition(
                    f"container {container_id} was cleaned up; a Prepare after its Cleanup is stale"
                    " and is refused (Mesos never reuses a container ID)"
                )
            self._refuse_populated(container_id)
            if not request.empty:
                core.handover.recheck()  # a draining GPU that is clear now may be chosen (docs/handover.md)
            near = core.cpuset.task_nodes(container_id) if request.shares else None
            uid = core.sharer_uid(container_id, config.user) if request.shares else None
            with core.booking.lock:
                holding = core.booking.book(holder, request, near, uid)
                if holding.share is not None:
                    core.mps_preparing.add(holder)
            steps.mark("booking")
            undo: Undo = [lambda: self._unbook(holder, holding)]
            answered = False
            info: LaunchInfo | None = None
            try:
                units = core.grants.mig_units(container_id, holding)
                aff = core.cpuset.affinity(container_id, holding.granted, units)
                held = aff if core.cpuset.enforcing else None  # recorded with the GPUs, applied after their rules
                grant = core.grants.compute(holding.granted, units)
                rules = grant.rules
                rec = core.new_record(container_id, holding, rules=rules, cpuset=held)
                steps.mark("choice")
                early = answer is not None and answers_early(Mode(core.settings.mode), config, holding)
                if early:
                    # The agent's cgroup is checked first (it exists, it is a whitelist: a refusal
                    # still comes from Prepare); nothing is granted there before the record. Nothing
                    # of the launch info waits on the disk or the kernel: the caller has it now, and
                    # waits for Isolate, which takes this container's lock after us.
                    core.grants.create(container_id)
                    info = self._launch_info(container_id, config, grant, image_plan, undo, units, aff)
                    steps.mark("launch info")
                    assert answer is not None
                    answer(info)
                    answered = True
                    steps.mark("answer")
                core.store.record(rec)
                steps.mark("state commit")
                undo.append(lambda: self._forget(container_id))
                undo.append(lambda: core.grants.revoke(container_id))
                crashpoint("prepare.recorded")
                if not early:
                    core.grants.create(container_id)
                crashpoint("prepare.cgroup")
                core.grants.write(container_id, rules)
                crashpoint("prepare.applied")
                if held is not None:
                    undo.append(lambda: core.cpuset.remove_cpuset(container_id))
                    crashpoint("cpuset.recorded")
                    core.cpuset.apply_cpuset(container_id, held)
                steps.mark("rules")
                share = holding.share
                if share is not None and share.mode is ShareMode.MPS:
                    # Fail closed: no sharer without its daemon and the limits set on it (docs/sharing.md).
                    # Its client comes after this: a loss found before its daemon is set up, by this
                    # call or by a pass, ends the GPU's other sharers, never this one; one found after
                    # ends it too (Core.mps_preparing, left under the daemon's lock).
                    try:
                        core.mps.ensure(
                            core.gpus[share.gpu], core.mps_plan(share.gpu), served=lambda: core.unspare(holder)
                        )
                    finally:
                        core.end_lost_mps_sharers()  # a daemon found dead under others, started again or not
                if not early:
                    info = self._launch_info(
                        container_id,
                        config,
                        grant,
                        image_plan,
                        undo,
                        units,
                        aff,
                        self._mps_client(rec),  # what was just recorded: no read back (issue 45)
                    )
                    steps.mark("launch info")
            except BaseException as exc:
                self._undo(container_id, undo)
                if answered:
                    # The caller has its answer and goes on to Isolate, which must fail with this.
                    core.failed_after_answer.put(container_id, exc)
                raise
            finally:
                if holding.share is not None:
                    core.unspare(holder)
        mig_note = f", MIG devices [{migunits.visible_devices(units)}]" if units else ""
        if holding.share is not None:
            share = holding.share
            with core.booking.lock:
                total = core.booking.shared[share.gpu].shares
            mig_note += f", {share.count} of the {total} shares of GPU {share.gpu} ({share.mode})"
        # The handler's own time, step by step, on the line an operator (and the agent bench) reads anyway.
        LOG.info(
            "prepared %s (%s)%s in %s",
            core.describe(container_id, holding.granted),
            core.booking.policy,
            mig_note,
            steps,
        )
        return info

    def prepare_early(
        self, container_id: ContainerId, config: ContainerConfig, answer: Callable[[LaunchInfo | None], None]
    ) -> LaunchInfo | None:
        return self.prepare(container_id, config, answer)

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
                held = root.holding
                self._rules_for_nested(cid, config, lambda: core.grants.of(root.container_id, held))
            return None
        image_plan = self._image_plan(config)
        with core.locks.hold(cid):
            root = self._require_top_level(cid)
            minors = root.holding.granted
            undo: Undo = []
            try:
                units = core.grants.mig_units(root.container_id, root.holding)
                grant = core.grants.compute(minors, units)  # /dev and the MIG view read once for both uses
                if self._rules_for_nested(cid, config, lambda: grant):
                    undo.append(lambda: core.grants.revoke(cid))
                aff = core.cpuset.affinity(cid, minors, units) if core.settings.cpu_affinity != "off" else None
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
        if core.settings.mode is not Mode.MESOS:
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
        """What the launch gets (decided in isolator/policy/launch.py); an image's mounts are made here."""
        visible, local = launch.visible_env(units), launch.locality_env(aff)
        if mps is not None:
            # An MPS sharer: the pipe directory and its limits (docs/sharing.md), the same way as the
            # locality (a command task's through task_environment).
            pipe = mps.pipe_dir if not config.has_image else mpsdaemons.CONTAINER_PIPE_DIR
            local += mpsdaemons.environment(pipe, mps.shares, mps.total, mps.memory_bytes)
        if not config.has_image:
            return launch.on_host(config.command_task, visible, local)
        mounts = self._device_mounts(config.rootfs, grant)
        if mps is not None:
            # The daemon's pipe directory at CUDA's default path in the image, read-only: a client
            # connects to the daemon's sockets and FIFOs, which a read-only mount leaves usable
            # (mount(2) refuses writes to regular files and directories only), and a root user in the
            # image cannot rewrite the daemon's files or plant sockets where the sidecar's commands
            # go (issue 41). The launcher applies MS_RDONLY with a remount, as for the driver volume.
            rel = mpsdaemons.CONTAINER_PIPE_DIR.lstrip("/")
            target = self.core.edges.filesystem.make_dirs_in(config.rootfs, rel)
            mounts.append(Mount(target=target, source=mps.pipe_dir, flags=MS_BIND | MS_RDONLY))
        env: tuple[tuple[str, str], ...] = ()
        if image_plan is not None:
            mounts_v, env = self._volume(cid, config, image_plan, undo)
            mounts = mounts_v + mounts
        return launch.in_image(config.command_task, mounts, env, visible, local)

    def _mps_client(self, rec: ContainerRecord | None) -> MpsClient | None:
        """What an MPS sharer's launch needs; None for anyone else."""
        share = rec.holding.share if rec is not None else None
        if share is None or share.mode is not ShareMode.MPS:
            return None
        core = self.core
        gpu = core.gpus[share.gpu]
        with core.booking.lock:
            total = core.booking.shared[share.gpu].shares
        return MpsClient(core.mps.pipe_dir(gpu), share.count, total, gpu.memory_total)

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

    def _unbook(self, holder: str, holding: Holding) -> None:
        """Give back what a prepare that failed half-way booked: never granted, so no handover check."""
        with self.core.booking.lock:
            self.core.booking.free(holder, holding)

    def _undo(self, cid: ContainerId, undo: Undo) -> None:
        for step in reversed(undo):
            try:
                step()
            except Exception:
                LOG.exception("failed to undo part of prepare for container %s", cid)

    def _forget(self, cid: ContainerId) -> None:
        with contextlib.suppress(NotFound):
            self.core.store.remove(cid)
