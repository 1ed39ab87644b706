"""What the hooks, recovery and the admin views share: the edges, the allocator, the locks, and the
few steps all three take (the rule set of a set of GPUs, granting it, forgetting a container).

Locking (isolator/core/locks.py): a container's hooks hold ``locks.hold(cid)`` across their slow
work; the allocator and the GPUs' health are touched only under ``alloc``, briefly, never across
I/O; recovery holds ``locks.exclusive()``. Ordering rules that keep the sidecar safe across crashes:
  * GPUs are recorded in the state store before any rule grants them, and revoked in the kernel
    before the record lets them go (never grant what is not recorded);
  * a failure half-way through Prepare undoes what was done, so nothing stays allocated or applied;
  * Cleanup is idempotent and fine for containers never prepared or never known.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from isolator.core.booking import Booking, mig_devices_of
from isolator.core.changes import Changes
from isolator.core.handover import Handover
from isolator.core.locks import ContainerLocks
from isolator.core.ports import (
    CgroupBackend,
    Clock,
    Cpusets,
    CpuTopology,
    DeviceNodes,
    Filesystem,
    HealthEvent,
    Inventory,
    Processes,
    StateStore,
    VolumeBuilder,
)
from isolator.crashpoints import crashpoint
from isolator.errors import AffinityEmpty, AffinityUnknown, CgroupBusy, CgroupVanished, IsolatorError, NotFound
from isolator.model import ContainerId, ContainerRecord, Gpu, MigDevice, key_root
from isolator.policy import affinity as affinities
from isolator.policy import devices as devrules
from isolator.policy import mig as migunits
from isolator.policy.devices import NVIDIA_MAJOR

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """How the core behaves. ``mode``: mesos (Mesos owns the cgroups) or standalone (we do)."""

    mode: str = "standalone"
    policy: str = "topology"
    # Mesos's cgroups isolator may place the pid in the devices cgroup concurrently with our isolate
    # (isolate runs on every isolator in parallel), so mesos mode waits a little before declaring
    # the pid misplaced.
    isolate_settle_s: float = 2.0
    # --cpu-affinity (docs/affinity.md): off, hint (the environment) or enforce (also a cpuset).
    # The daemon's default is hint (isolator/daemon/config.py); in-process cores default to off.
    cpu_affinity: str = "off"
    # The handover check (docs/handover.md): released GPUs are handed out again only when NVML shows
    # no process on them and less memory in use than the threshold; after the timeout a GPU still
    # draining is reported unhealthy (0: never). Compute mode is set back to this nvmlComputeMode_t.
    drain_check: bool = True
    drain_memory_bytes: int = 256 << 20
    drain_timeout_s: float = 600.0
    default_compute_mode: int = 0


@dataclass(frozen=True)
class Edges:
    """The machine as the core sees it; ``isolator.daemon.main`` wires the real ones."""

    inventory: Inventory
    cgroups: CgroupBackend
    devices: DeviceNodes
    store: StateStore
    volumes: VolumeBuilder | None
    processes: Processes
    filesystem: Filesystem
    clock: Clock
    cpus: CpuTopology | None = None  # what the machine has online; None: no affinity at all
    cpusets: Cpusets | None = None  # the cpuset hierarchy, when one is bound


@dataclass(frozen=True)
class Grant:
    """A container's grant as data: the devices cgroup rules, and the device nodes (relative to the
    dev root) bound into an image container: exactly the allocated GPUs, the control devices and
    the MIG caps (Mesos exposes every /dev/nvidia*: defect §2.15.6)."""

    rules: tuple[devrules.DeviceRule, ...]
    nodes: tuple[str, ...]


class Core:
    def __init__(self, edges: Edges, settings: Settings) -> None:
        self.edges = edges
        self.settings = settings
        self.inventory = edges.inventory
        self.cgroups = edges.cgroups
        self.store = edges.store
        self.volumes = edges.volumes
        self.clock = edges.clock
        self.cpusets = edges.cpusets
        self.locks = ContainerLocks()
        self.rebuilt: list[ContainerId] = []  # records rebuilt from the kernel at start (lost state)
        self.repairs = 0  # kernel rules re-applied by the drift audit since start
        self.changes = Changes()  # what a Watch waits on: health changes, containers gone
        topology = edges.inventory.topology()
        self.gpus: dict[int, Gpu] = {g.minor: g for g in topology.gpus}
        # Which GPUs and MIG devices are held (core/booking.py), under its own checked lock.
        self.booking = Booking(edges.inventory, topology, settings.policy)
        self.handover = Handover(self)
        with self.booking.lock:
            self.sync_health()
        edges.inventory.on_health_change(self._on_health_change)

    # ---- health -----------------------------------------------------------

    def sync_health(self) -> None:
        """Copy the inventory's health and the drain marks into the books. Call with the booking lock held."""
        self.booking.lock.require("sync_health")
        self.booking.set_health(self.inventory.healthy())
        self.handover.apply_marks()

    def _on_health_change(self, event: HealthEvent) -> None:
        with self.booking.lock:
            self.booking.set_gpu_health(event.index, bool(event.healthy))
        self.changes.notify()

    def mig_of(self, rec: ContainerRecord | None) -> tuple[MigDevice, ...]:
        """The MIG devices a record holds that the inventory knows (an unknown UUID grants nothing)."""
        if rec is None:
            return ()
        known = self.booking.mig
        out = []
        for uuid in sorted(rec.mig_uuids):
            dev = known.get(uuid)
            if dev is None:
                LOG.warning("container %s holds MIG device %s, unknown to the inventory", rec.container_id, uuid)
                continue
            out.append(dev)
        return tuple(out)

    # ---- shared steps -----------------------------------------------------------------------------

    def grant(self, minors: frozenset[int], units: Iterable[MigDevice] = ()) -> Grant:
        """What a container holding GPU ``minors`` whole and MIG devices ``units`` is granted, with the
        dev root and the inventory's MIG view read once: the full allow-list (a whole GPU in MIG mode
        brings every MIG device's caps; a unit brings its GI and CI caps and its parent's node, which
        the driver requires, docs/mig.md) and the device nodes an image container is given."""
        if not self.gpus:
            return Grant(tuple(devrules.MESOS_DEFAULT_WHITELIST), ())  # no GPUs here: no control devices either
        units = tuple(units)
        devices = self.edges.devices
        control = devices.control_devices()
        mig = self.mig_devices(minors) + units
        caps_major = devices.caps_major() if mig else None
        gpus = sorted(minors | migunits.parents(units))
        rules = devrules.container_rules(control, gpus, mig_devices=mig, caps_major=caps_major)
        nodes = [f"nvidia{m}" for m in gpus]
        nodes += [posixpath.relpath(n.path, devices.dev_root) for n in control.numbers()]
        nodes += [f"nvidia-caps/nvidia-cap{minor}" for dev in mig for minor in dev.caps_minors]
        return Grant(rules, tuple(nodes))

    def rules(self, minors: frozenset[int], units: Iterable[MigDevice] = ()) -> tuple[devrules.DeviceRule, ...]:
        """The allow-list alone (``grant``'s rules)."""
        return self.grant(minors, units).rules

    def mig_devices(self, minors: frozenset[int]) -> tuple[MigDevice, ...]:
        return mig_devices_of(self.inventory, minors)

    def granted(self, rules: tuple[devrules.DeviceRule, ...]) -> list[int]:
        """The GPU minors ``rules`` let a process read and write."""
        return sorted(m for m in self.gpus if devrules.permits(rules, devrules.DeviceRule.char(NVIDIA_MAJOR, m, "rw")))

    def describe(self, cid: ContainerId, minors: frozenset[int]) -> str:
        gpus = ", ".join(f"{m} ({self.gpus[m].uuid})" for m in sorted(minors) if m in self.gpus)
        return f"container {cid} (cgroup '{self.cgroups.cgroup_path(cid.root)}', GPUs [{gpus}])"

    def require(self, cid: ContainerId) -> ContainerRecord:
        rec = self.store.get(cid)
        if rec is None:
            raise NotFound(f"unknown container {cid}")
        return rec

    def apply(self, cid: ContainerId, minors: frozenset[int], units: tuple[MigDevice, ...] | None = None) -> None:
        """Make the kernel grant exactly ``minors`` and MIG ``units`` to ``cid`` (None: the MIG devices
        its record holds), then record the rules granted."""
        rules = self.rules(minors, self.mig_of(self.store.get(cid)) if units is None else units)
        self.cgroups.apply(cid, rules)
        if self.settings.mode == "mesos" and not cid.nested:
            self._apply_nested(cid, rules)  # in the kernel before the record, as the container's own
        crashpoint("apply.kernel")
        self.store.update(cid, rules="\n".join(map(str, rules)))

    def governing(self, cid: ContainerId) -> ContainerId:
        """The container whose cgroup governs ``cid``'s device access and holds its pid.

        A nested container has its own when Mesos made one: on v1 with ``share_cgroups=false``
        (``<root>/<parent>/mesos/<child>``), on v2 always (``…/mesos/<child>/leaf``, not below the
        parent's leaf). Otherwise its closest ancestor with a cgroup of its own governs, as Mesos's
        cgroups isolator places it (``findCgroupInfo``): below a nested container with
        ``share_cgroups=false``, a sharing or DEBUG container runs in that one's cgroup, not the
        top-level one's.
        """
        node: ContainerId | None = cid
        while node is not None and node.nested:
            if self.cgroups.exists(node):
                return node
            node = node.parent
        return cid.root

    def nested_cgroups(self, cid: ContainerId) -> list[ContainerId]:
        """The nested containers below ``cid`` that have a cgroup of their own, parents first."""
        out: list[ContainerId] = []
        for name in sorted(self.cgroups.nested_names(cid)):
            try:
                child = ContainerId.parse(name, cid)
            except IsolatorError:
                continue
            if self.cgroups.exists(child):
                out.append(child)
            out.extend(self.nested_cgroups(child))
        return out

    def _apply_nested(self, cid: ContainerId, rules: tuple[devrules.DeviceRule, ...]) -> None:
        """Nested containers with cgroups of their own follow their top-level container's rules.

        v2: their programs are not below ours, so nothing else would revoke a GPU there. v1: the
        kernel propagates removals down by itself, but a grant must pass through the ``mesos``
        cgroup in between (a copy of the parent's list taken when Mesos made it). A nested cgroup
        that cannot take the new rules is left with no GPUs, never with more than its parent.
        """
        for child in self.nested_cgroups(cid):
            try:
                try:
                    self.apply_nested(child, rules)
                except CgroupVanished:
                    raise
                except IsolatorError as exc:
                    LOG.error("nested container %s could not follow its top-level container's rules: %s", child, exc)
                    self.cgroups.apply(child, self.rules(frozenset()))
            except CgroupVanished:
                # Mesos removed it meanwhile (the nested container ended): nothing is granted there.
                LOG.info("nested container %s is gone; its cgroup needs no rules", child)

    def apply_nested(self, child: ContainerId, rules: tuple[devrules.DeviceRule, ...]) -> None:
        """Apply ``rules`` to a nested container's own cgroup (on v1 through the ``mesos`` one above it)."""
        self.cgroups.apply_nested(child, rules)

    def cleanup_cgroups(self, cid: ContainerId, keep_busy_cpuset: bool = False) -> None:
        """Remove our rules from a top-level container's cgroup, and in mesos mode first from the
        cgroups of its own of its nested containers: Mesos cleans those up first, but when it did not
        (an orphan, a forced release) they must not keep granting the GPUs freed next (v2: their
        programs are not below the parent's leaf, so nothing else would revoke them). Then the
        container's cpuset, if it has one."""
        if self.settings.mode == "mesos":
            for child in reversed(self.nested_cgroups(cid)):
                self.cgroups.cleanup(child)
        self.cgroups.cleanup(cid)
        if self.cpusets is not None and not cid.nested:
            try:
                self.cpusets.remove(cid)  # ours in both modes (docs/affinity.md); after the GPUs' rules
            except CgroupBusy as exc:
                if not keep_busy_cpuset:
                    raise
                # A forced release of a container whose processes run on: they keep their CPUs; the
                # start-up reconciliation removes the cpuset once it is empty.
                LOG.warning("container %s: its cpuset stays for its processes: %s", cid, exc.message)

    def drop(self, cid: ContainerId, rec: ContainerRecord) -> None:
        """Forget a container whose rules are already gone: its record, then its GPUs; wake watchers.

        Its whole GPUs go back to the pool only through the handover check (docs/handover.md): out
        of it in the same section that frees them, back once NVML shows nothing left on them."""
        self.store.remove(cid)
        with self.booking.lock:
            released = rec.gpus & self.booking.allocator.allocated
            self.booking.allocator.deallocate(released)
            self.booking.free_mig(rec.mig_uuids)
            self.handover.mark_pending(released)
        self.changes.notify(cid)
        if released:
            crashpoint("handover.pending")
        self.handover.check(released)

    def release_gpus(self, minors: frozenset[int]) -> None:
        """Give back GPUs a running container no longer holds (a shrinking Update): through the
        handover check too, since a process that opened one before the revocation keeps using it
        (the devices cgroup checks at open(2) only)."""
        with self.booking.lock:
            self.booking.allocator.deallocate(minors)
            self.handover.mark_pending(minors)
        self.handover.check(minors)

    def release_volume(self, cid: ContainerId) -> None:
        """Forget ``cid`` as a user of the driver volume; a top-level container takes the records of
        its nested containers with it (they cannot outlive it, and may have died unseen)."""
        if self.volumes is None:
            return
        try:
            keys = [cid.key()]
            if not cid.nested:
                keys += [u for u in self.volume_users() if key_root(u) == keys[0] and u != keys[0]]
            for key in keys:
                self.volumes.release(key, self.inventory.driver_version)
        except Exception as exc:  # the container is gone either way; a stale user file is harmless
            LOG.warning("failed to release the volume of container %s: %s", cid, exc)

    def volume_users(self) -> dict[str, str]:
        """Every driver-volume user (a container's ``key()``) -> the driver version of its volume."""
        out: dict[str, str] = {}
        if self.volumes is not None:
            for vol in self.volumes.volumes():
                for user in vol.get("users", ()):
                    out[str(user)] = str(vol.get("driver_version", ""))
        return out

    # ---- CPU affinity (docs/affinity.md) ---------------------------------------------------------

    @property
    def enforcing(self) -> bool:
        """Whether containers are held to their GPUs' CPUs with a cpuset (``--cpu-affinity enforce``)."""
        return self.settings.cpu_affinity == "enforce" and self.cpusets is not None

    def affinity(
        self, cid: ContainerId, minors: frozenset[int], units: Iterable[MigDevice] = ()
    ) -> affinities.Affinity | None:
        """The CPUs and memory nodes local to ``minors`` (and MIG ``units``' parents) on this machine.

        None when affinity is off or the container has no GPUs. Enforcing, a locality that leaves
        nothing or is unknown is refused (``AffinityEmpty``/``AffinityUnknown``); hinting, it is
        logged and no hint is given.
        """
        if self.settings.cpu_affinity == "off" or self.edges.cpus is None:
            return None
        try:
            return self.locality(minors, units)
        except (AffinityEmpty, AffinityUnknown) as exc:
            if self.enforcing:
                LOG.error("container %s: refused: %s", cid, exc.message)
                raise
            LOG.warning("container %s: no CPU affinity hint: %s", cid, exc.message)
            return None

    def locality(self, minors: frozenset[int], units: Iterable[MigDevice] = ()) -> affinities.Affinity | None:
        """``affinity.decide`` for these GPUs on this machine, whatever the mode (the admin views)."""
        if self.edges.cpus is None:
            return None
        held = sorted(minors | migunits.parents(tuple(units)))
        gpus = [
            affinities.GpuLocality(m, self.gpus[m].numa_node, self.gpus[m].cpu_affinity) for m in held if m in self.gpus
        ]
        return affinities.decide(gpus, self.edges.cpus.machine())

    def apply_cpuset(self, cid: ContainerId, aff: affinities.Affinity, before: frozenset[int] | None = None) -> None:
        """Hold ``cid``'s cpuset to ``aff`` (recorded first by the caller), saying so when it narrows
        the CPUs the container could use before (``before``: the cpuset's parent's when None)."""
        assert self.cpusets is not None
        if before is None:
            before = self.cpusets.allowed(cid) or (self.edges.cpus.machine().cpus if self.edges.cpus else frozenset())
        self.cpusets.apply(cid.root, aff.cpus, aff.mems)
        lost = affinities.narrowed(before, aff.cpus)
        if lost:
            LOG.info(
                "container %s: cpuset '%s' narrows it from CPUs %s to %s, memory nodes %s (local to its GPUs)",
                cid,
                self.cpusets.path(cid),
                affinities.format_list(before),
                aff.cpu_list,
                aff.mem_list,
            )

    @staticmethod
    def recorded_affinity(rec: ContainerRecord | None) -> affinities.Affinity | None:
        if rec is None or not rec.cpus:
            return None
        return affinities.Affinity(affinities.parse_list(rec.cpus), affinities.parse_list(rec.mems))
