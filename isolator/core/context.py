"""The core's composition: the edges, the settings, and the objects with one job each that the hooks,
recovery and the admin views share: the locks (core/locks.py), the booking of GPUs (core/booking.py),
the kernel grant (core/grant.py), change notifications (core/changes.py) and the handover check
(core/handover.py); plus the few steps on a container's record (forgetting it, its driver volume).

Locking (isolator/core/locks.py): a container's hooks hold ``locks.hold(cid)`` across their slow
work; the books are touched only under ``booking.lock``, briefly, never across I/O; recovery holds
``locks.exclusive()``. Each object checks its own contract. Ordering rules that keep the sidecar
safe across crashes:
  * GPUs are recorded in the state store before any rule grants them, and revoked in the kernel
    before the record lets them go (never grant what is not recorded);
  * a failure half-way through Prepare undoes what was done, so nothing stays allocated or applied;
  * Cleanup is idempotent and fine for containers never prepared or never known.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field

from isolator.core.absent import NoUsers, NoVolumes
from isolator.core.booking import Booking
from isolator.core.changes import Changes
from isolator.core.cpuset import CpusetGrant
from isolator.core.grant import KernelGrants
from isolator.core.handover import Handover
from isolator.core.locks import ContainerLocks
from isolator.core.maintenance import Maintenance
from isolator.core.mps import Mps, ServerPlan
from isolator.core.ports import (
    CgroupBackend,
    Clock,
    Cpusets,
    CpuTopology,
    DeviceNodes,
    DriverVolumes,
    Filesystem,
    GpuInventory,
    HealthEvent,
    MpsDaemons,
    Processes,
    RecordStore,
    UserDb,
)
from isolator.crashpoints import crashpoint
from isolator.devicerule import DeviceRule
from isolator.errors import IsolatorError, NotFound
from isolator.model import (
    CgroupVersion,
    ContainerId,
    ContainerRecord,
    Gpu,
    Holding,
    Mode,
    RecordState,
    ShareMode,
    key_root,
)
from isolator.policy import drift
from isolator.policy.affinity import Affinity
from isolator.policy.shares import ShareSpec

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """How the core behaves. ``mode``: mesos (Mesos owns the cgroups) or standalone (we do); a string
    (the daemon's configuration) is taken as its ``Mode``."""

    mode: Mode | str = Mode.STANDALONE
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
    # --shared-gpus (docs/sharing.md): GPUs cut into shares, by NVML index.
    shared_gpus: tuple[ShareSpec, ...] = ()
    # --share-placement: spread (sharers apart) or pack (fill a GPU before opening the next).
    share_placement: str = "spread"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))


@dataclass(frozen=True)
class Edges:
    """The machine as the core sees it; ``isolator.daemon.main`` wires the real ones."""

    inventory: GpuInventory
    cgroups: CgroupBackend
    devices: DeviceNodes
    store: RecordStore
    volumes: DriverVolumes | None
    processes: Processes
    filesystem: Filesystem
    clock: Clock
    cpus: CpuTopology | None = None  # what the machine has online; None: no affinity at all
    cpusets: Cpusets | None = None  # the cpuset hierarchy, when one is bound
    mps: MpsDaemons | None = None  # nvidia-cuda-mps-control, for GPUs shared in mps mode (docs/sharing.md)
    users: UserDb = field(default_factory=NoUsers)  # user names -> uids (a sharer's user, docs/sharing.md)


class FailedAfterAnswer:
    """Prepares that answered before their grant was durable and in force, then failed to make it so
    (core/prepare.py, ``answers_early``): the container's Isolate fails with the error, its Cleanup
    forgets it. At most ``KEPT`` (the oldest go first): the agent cleans up each such container."""

    KEPT = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: collections.OrderedDict[ContainerId, BaseException] = collections.OrderedDict()

    def put(self, cid: ContainerId, error: BaseException) -> None:
        with self._lock:
            self._errors[cid] = error
            while len(self._errors) > self.KEPT:
                self._errors.popitem(last=False)

    def get(self, cid: ContainerId) -> BaseException | None:
        with self._lock:
            return self._errors.get(cid)

    def forget(self, cid: ContainerId) -> None:
        with self._lock:
            self._errors.pop(cid, None)


class Core:
    def __init__(self, edges: Edges, settings: Settings) -> None:
        self.edges = edges
        self.settings = settings
        self.inventory = edges.inventory
        self.cgroups = edges.cgroups
        self.store = edges.store
        # No volume root: a null object that refuses to build one (core/absent.py).
        self.volumes: DriverVolumes = edges.volumes if edges.volumes is not None else NoVolumes()
        self.clock = edges.clock
        self.locks = ContainerLocks()
        self.rebuilt: list[ContainerId] = []  # records rebuilt from the kernel at start (lost state)
        self.repairs = 0  # kernel rules re-applied by the drift audit since start
        self.changes = Changes()  # what a Watch waits on: health changes, containers gone
        self.failed_after_answer = FailedAfterAnswer()  # a Prepare's failure for its Isolate to report
        # Which GPUs and MIG devices are held (core/booking.py), under its own checked lock.
        self.booking = Booking(
            edges.inventory, edges.inventory.topology(), settings.policy, settings.shared_gpus, settings.share_placement
        )
        # What the kernel grants each container: its cpuset (core/cpuset.py) and its devices
        # cgroups (core/grant.py), which let the cpuset go with the rest at cleanup.
        self.cpuset = CpusetGrant(
            booking=self.booking,
            locks=self.locks,
            cpu_affinity=settings.cpu_affinity,
            cpus=edges.cpus,
            cpusets=edges.cpusets,
        )
        self.grants = KernelGrants(
            booking=self.booking,
            locks=self.locks,
            inventory=edges.inventory,
            cgroups=edges.cgroups,
            devices=edges.devices,
            store=edges.store,
            mode=settings.mode,
            cpuset=self.cpuset,
        )
        # Released GPUs back to the pool only once NVML shows them clear (core/handover.py).
        self.cpusets = self.cpuset.cpusets  # a null object without a cpuset hierarchy (core/absent.py)
        self.handover = Handover(
            settings=settings,
            clock=edges.clock,
            inventory=edges.inventory,
            store=edges.store,
            booking=self.booking,
            changes=self.changes,
        )
        # An operator's maintenance drains (core/maintenance.py), read before the books are first filled.
        self.maintenance = Maintenance(self)
        self.maintenance.load()
        # One control daemon per shared GPU in mps mode; a failed start sets the default compute mode back.
        self.mps = Mps(edges.mps, edges.inventory, settings.default_compute_mode)
        self.mps.on_lost = self._record_mps_loss
        # Sharers whose Prepare has not ended (under the booking lock): their client comes after it,
        # so a daemon lost meanwhile does not end them (docs/sharing.md, "MPS").
        self.mps_preparing: set[str] = set()
        # Ended sharers whose record failed (key -> why): tried again at each pass (_record_ends).
        self._unrecorded_ends: dict[str, str] = {}
        # Sharers of a lost daemon, recorded when it was found and ended once it is set up again
        # (end_lost_mps_sharers), key -> why.
        self._lost_sharers: dict[str, str] = {}
        self._ends_lock = threading.Lock()
        with self.booking.lock:
            self.sync_health()
        edges.inventory.on_health_change(self._on_health_change)

    @property
    def gpus(self) -> dict[int, Gpu]:
        """The managed GPUs by minor: the booking's (one copy, rebuilt with the books at start-up)."""
        return self.booking.gpus

    # ---- health -----------------------------------------------------------

    def sync_health(self) -> None:
        """Copy the inventory's health, the drain marks and the maintenance drains into the books. Call
        with the booking lock held."""
        self.booking.lock.require("sync_health")
        self.booking.set_health(self.inventory.healthy())
        self.handover.apply_marks()
        self.maintenance.apply()

    def _on_health_change(self, event: HealthEvent) -> None:
        with self.booking.lock:
            self.booking.set_gpu_health(event.index, bool(event.healthy))
        self.changes.notify()

    # ---- shared steps -----------------------------------------------------------------------------

    def describe(self, cid: ContainerId, minors: frozenset[int]) -> str:
        gpus = ", ".join(f"{m} ({self.gpus[m].uuid})" for m in sorted(minors) if m in self.gpus)
        return f"container {cid} (cgroup '{self.cgroups.cgroup_path(cid.root)}', GPUs [{gpus}])"

    def compare_with_kernel(self, cid: ContainerId, rec: ContainerRecord) -> drift.Drift:
        """The record against the rules in force on its cgroup (the one comparison: policy.drift)."""
        return drift.compare(rec.rules, rec.holding, self.cgroups.in_force(cid), self.gpus)

    def grant_recorded_gpus(self, cid: ContainerId, rec: ContainerRecord, when: str) -> None:
        """Make the kernel grant the recorded GPUs (whole, plus MIG devices, whose parents' nodes are
        what the comparison sees of them) if it grants others; logged, ``when`` naming the moment.
        The caller holds the container's lock."""
        found = self.compare_with_kernel(cid, rec)
        if found.gpus_agree:
            return
        LOG.warning(
            "%s: the kernel grants %s GPUs %s (%s), recorded %s; applying the record",
            when,
            cid,
            list(found.granted) if found.present else "nothing of ours",
            found.source,
            list(found.recorded),
        )
        self.grants.apply(cid, rec.holding.gpus)

    def require(self, cid: ContainerId) -> ContainerRecord:
        rec = self.store.get(cid)
        if rec is None:
            raise NotFound(f"unknown container {cid}")
        return rec

    def new_record(
        self,
        cid: ContainerId,
        holding: Holding,
        *,
        rules: tuple[DeviceRule, ...],
        state: RecordState = RecordState.PREPARED,
        cpuset: Affinity | None = None,
    ) -> ContainerRecord:
        """The record of a container holding ``holding`` under our settings, now: the one place the
        core builds one (prepare, and recovery's rebuild of a lost record)."""
        return ContainerRecord(
            cid,
            holding,
            mode=Mode(self.settings.mode),
            cgroup=self.cgroups.cgroup_path(cid),
            cgroup_version=CgroupVersion(self.cgroups.version).number,
            state=state,
            created=self.clock.time(),
            rules=rules,
            cpus=cpuset.cpu_list if cpuset is not None else "",
            mems=cpuset.mem_list if cpuset is not None else "",
        )

    def drop(self, cid: ContainerId, rec: ContainerRecord) -> None:
        """Forget a container whose rules are already gone: its record, then what it holds; wake watchers.

        Its whole GPUs go back to the pool only through the handover check (docs/handover.md): out
        of it in the same section that frees them, back once NVML shows nothing left on them. So
        does a shared GPU whose last sharer it was, before anyone shares it again."""
        self.store.remove(cid)
        with self.booking.lock:
            released = self.booking.free(cid.key(), rec.holding)
            self.handover.mark_pending(released)
        self.changes.notify(cid)
        if released:
            crashpoint("handover.pending")
        self._stop_idle_mps(rec.holding, released)
        self.handover.check(released)

    def _stop_idle_mps(self, holding: Holding, released: frozenset[int]) -> None:
        """Stop the MPS server of a shared GPU whose last sharer just let it go: it would be a process
        on the GPU, so it is stopped before the handover check looks."""
        share = holding.share
        if share is not None and share.gpu in released and share.mode == ShareMode.MPS and share.gpu in self.gpus:
            minor = share.gpu
            self.mps.stop(self.gpus[minor], lambda: self.idle_share(minor))

    def mps_plan(self, minor: int) -> ServerPlan:
        """What shared GPU ``minor``'s MPS daemon must hold: one share's limits for every server, and
        the server of its sharers' uid (one uid: placement keeps a single-user MPS GPU's sharers to
        one; none started while that uid is not known)."""
        with self.booking.lock:
            shared = self.booking.shared[minor]
            uids = self.booking.share_users(minor)
        uid = next(iter(uids)) if len(uids) == 1 else None
        return ServerPlan.of(shared, self.gpus[minor].memory_total, uid)

    def sharer_uid(self, container_id: ContainerId, user: str) -> int | None:
        """The uid a sharer's tasks run as: its container's user as Mesos sends it in Prepare, or the
        agent's own (root: the agent's cgroup isolators need it) when it sends none. None for a name
        this host does not know; such a sharer is not placed on a single-user MPS GPU."""
        if not user:
            return 0
        uid = self.edges.users.uid(user)
        if uid is None:
            LOG.warning("container %s: its user %r is not known on this host", container_id, user)
        return uid

    def idle_share(self, minor: int) -> bool:
        """Whether shared GPU ``minor`` has no sharer now."""
        with self.booking.lock:
            return not self.booking.share_holders(minor)

    def supervise_mps(self) -> None:
        """Each shared GPU in mps mode with sharers has a live MPS control daemon; every other GPU
        (no sharer, time-sliced, no longer shared after a reload or a restart) has none. Without
        nvidia-cuda-mps-control (core/absent.py) nothing runs, and a recorded mps sharer is logged as
        having no daemon."""
        wanted = self.mps_wanted()
        self.mps.supervise(
            [(g, self.mps_plan(g.minor)) for g in wanted],
            [g for g in self.gpus.values() if g not in wanted],
            self.idle_share,
        )
        # A server in FAULT (docs/sharing.md, "Faults"): its GPU's sharers end, new ones are kept off;
        # recorded, so that they stay ended across a restart even once the server is ACTIVE again.
        faults = self.mps.faults()  # asked before the booking lock: core/mps.py takes that one under its own
        with self.booking.lock:
            ended = self.booking.set_mps_faults(faults)
            ends = {h: self.booking.mps_ended[h] for h in ended}
        for holder in ended:
            LOG.error("container %s: ended, its GPU's MPS server is in FAULT", holder)
        self._record_ends(ends)  # also tries again any end whose record failed before
        if ended:
            self.changes.notify()  # their Watches answer the limitation now
        self.end_lost_mps_sharers()

    def _record_mps_loss(self, minor: int, why: str) -> None:
        """core/mps.py's ``on_lost``, before the daemon that lost them is started or set again: shared
        GPU ``minor``'s sharers are lost (their clients failed with its server, measured; any that
        connected before a new daemon held its limits ran without them), but those whose Prepare has
        not ended (``mps_preparing``: their client comes after). Recorded first, so that a sidecar
        killed before they are ended (``end_lost_mps_sharers``, once the daemon is set up) still ends
        them at its start (``Recovery.book``). Never raises: a record that fails is logged and tried
        again at the next pass, and the daemon is set up all the same."""
        with self.booking.lock:
            lost = [
                h
                for h in sorted(self.booking.share_holders(minor))
                if h not in self.mps_preparing and h not in self.booking.mps_ended
            ]
        with self._ends_lock:
            for holder in lost:
                self._lost_sharers.setdefault(holder, why)
        self._record_ends({h: why for h in lost})

    def unspare(self, holder: str) -> None:
        """A sharer's Prepare has its daemon set up (or ended): a loss found from now on ends it too."""
        with self.booking.lock:
            self.mps_preparing.discard(holder)

    def end_lost_mps_sharers(self) -> None:
        """The sharers of each MPS daemon found lost (``_record_mps_loss``) end, as in a FAULT, once
        it is set up again: exactly those it lost, never one placed since (served by the new daemon)."""
        with self._ends_lock:
            lost, self._lost_sharers = self._lost_sharers, {}
        if not lost:
            return
        with self.booking.lock:
            ended = self.booking.end_holders(lost)
        for holder in ended:
            LOG.error("container %s: ended, its GPU's MPS control daemon was lost under it", holder)
        if ended:
            self.changes.notify()

    def _record_ends(self, ends: dict[str, str]) -> None:
        """Record ended sharers (key -> why) with any whose record failed before, outside the booking
        lock; a failure (a full disk) is logged and they are kept for the next try. Never raises."""
        with self._ends_lock:
            for holder, why in ends.items():
                self._unrecorded_ends.setdefault(holder, why)
            pending = dict(self._unrecorded_ends)
            if not pending:
                return
            try:
                self.store.end_mps_sharers({ContainerId.from_key(h): why for h, why in pending.items()})
            except Exception as exc:  # any failure of the disk: the daemon is set up all the same
                LOG.error(
                    "ended sharers %s are not recorded (tried again at the next pass; a restart before"
                    " then would not end them): %s",
                    ", ".join(sorted(pending)),
                    exc.message if isinstance(exc, IsolatorError) else f"{type(exc).__name__}: {exc}",
                )
                return
            for holder in pending:
                self._unrecorded_ends.pop(holder, None)

    def end_mps_clients(self, cid: ContainerId, holding: Holding) -> None:
        """Before a sharer in mps mode loses its shares (Cleanup, an Update to 0): its processes that
        are clients of the GPU's MPS server are ended with ``terminate_client`` (core/mps.py). Under
        Mesos a Cleanup comes after the agent killed the container's processes, so there is usually
        none left; an Update to 0 may find live ones."""
        share = holding.share
        if share is None or share.mode != ShareMode.MPS or share.gpu not in self.gpus:
            return
        try:
            pids = frozenset(self.cgroups.pids(cid))
        except Exception as exc:  # its cgroup may be gone already: nothing of it runs there
            LOG.warning("container %s: cannot list its processes to end their MPS clients: %s", cid, exc)
            return
        self.mps.end_clients(self.gpus[share.gpu], pids)

    def mps_wanted(self) -> list[Gpu]:
        """The GPUs shared in mps mode that have sharers now (each needs its MPS control daemon), by minor."""
        with self.booking.lock:
            held = self.booking.shares_held()
            shared = self.booking.shared
        wanted = {m for m, g in shared.items() if g.mode == ShareMode.MPS and held.get(m) and m in self.gpus}
        return [self.gpus[m] for m in sorted(wanted)]

    def release(self, cid: ContainerId, holding: Holding) -> None:
        """Give back part of what a running container held (a shrinking Update), already revoked:
        through the handover check too, since a process that opened a GPU before the revocation
        keeps using it (the devices cgroup checks at open(2) only)."""
        with self.booking.lock:
            released = self.booking.free(cid.key(), holding)
            self.handover.mark_pending(released)
        self._stop_idle_mps(holding, released)  # an Update that took a last sharer's shares to 0
        self.handover.check(released)

    def release_volume(self, cid: ContainerId) -> None:
        """Forget ``cid`` as a user of the driver volume; a top-level container takes the records of
        its nested containers with it (they cannot outlive it, and may have died unseen)."""
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
        for vol in self.volumes.volumes():
            for user in vol.get("users", ()):
                out[str(user)] = str(vol.get("driver_version", ""))
        return out
