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

import collections
import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from isolator.core.locks import ContainerLocks
from isolator.core.ports import (
    CgroupBackend,
    Clock,
    DeviceNodes,
    Filesystem,
    HealthEvent,
    Inventory,
    Processes,
    StateStore,
    VolumeBuilder,
)
from isolator.daemon.crashpoints import crashpoint
from isolator.errors import CgroupVanished, IsolatorError, NotFound
from isolator.model import ContainerId, ContainerRecord, Gpu, MigDevice, key_root
from isolator.policy import devices as devrules
from isolator.policy import mig as migunits
from isolator.policy.allocator import Allocator, Choice
from isolator.policy.devices import NVIDIA_MAJOR

LOG = logging.getLogger(__name__)

# How many cleaned-up containers Watch still recognises (a few minutes of a busy agent's churn; the
# module's one extra poll comes within a watch period of the cleanup).
ENDED_KEPT = 4096


@dataclass(frozen=True)
class Settings:
    """How the core behaves. ``mode``: mesos (Mesos owns the cgroups) or standalone (we do)."""

    mode: str = "standalone"
    policy: str = "topology"
    # Mesos's cgroups isolator may place the pid in the devices cgroup concurrently with our isolate
    # (isolate runs on every isolator in parallel), so mesos mode waits a little before declaring
    # the pid misplaced.
    isolate_settle_s: float = 2.0


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


class Core:
    def __init__(self, edges: Edges, settings: Settings) -> None:
        self.edges = edges
        self.settings = settings
        self.inventory = edges.inventory
        self.cgroups = edges.cgroups
        self.store = edges.store
        self.volumes = edges.volumes
        self.clock = edges.clock
        self.locks = ContainerLocks()
        self.rebuilt: list[ContainerId] = []  # records rebuilt from the kernel at start (lost state)
        self.repairs = 0  # kernel rules re-applied by the drift audit since start
        self.alloc = threading.Lock()  # the allocator and health: short sections, no I/O inside
        self._changed = threading.Condition(threading.Lock())
        self._generation = 0
        # Callbacks told of changes without a thread waiting (the server's Watch): by top-level
        # container, or under None for every change.
        self._listeners: dict[ContainerId | None, dict[int, Callable[[], None]]] = {}
        self._tokens = itertools.count()
        # Top-level containers Mesos cleaned up lately, oldest first (bounded): the command module
        # polls Watch once more after each Cleanup, which is answered "no limitation" quietly for
        # these, and NOT_FOUND for a container never seen (docs/mesos-agent.md, section 4).
        self._ended: collections.OrderedDict[ContainerId, None] = collections.OrderedDict()
        topology = edges.inventory.topology()
        self.gpus: dict[int, Gpu] = {g.minor: g for g in topology.gpus}
        self.allocator = Allocator(topology, settings.policy)
        # MIG units (docs/mig.md): the held MIG devices (UUID -> parent minor) and the parents booked
        # in the whole-GPU allocator because some of their MIG devices are held; both change under
        # ``alloc`` only. The devices themselves are read from the inventory each time (``mig``), so
        # a GPU read again after a device event offers what NVML reports now.
        self.mig_held: dict[str, int] = {}
        self.mig_booked: set[int] = set()
        with self.alloc:
            self.sync_health()
        edges.inventory.on_health_change(self._on_health_change)

    # ---- health and change notification -----------------------------------------------------------

    def sync_health(self) -> None:
        """Copy the inventory's health into the allocator. Call with ``alloc`` held."""
        healthy_indices = self.inventory.healthy()
        for gpu in self.gpus.values():
            self.allocator.set_healthy(gpu.minor, gpu.index in healthy_indices)

    def _on_health_change(self, event: HealthEvent) -> None:
        with self.alloc:
            for gpu in self.gpus.values():
                if gpu.index == event.index:
                    self.allocator.set_healthy(gpu.minor, bool(event.healthy))
        self.notify()

    def notify(self, container: ContainerId | None = None) -> None:
        """Wake the Watches: of ``container`` when only it changed (it went away), else all of them
        (a GPU's health changed, recovery)."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()
            if container is None:
                told = [cb for group in self._listeners.values() for cb in group.values()]
            else:
                told = [*self._listeners.get(container.root, {}).values(), *self._listeners.get(None, {}).values()]
        for callback in told:
            try:
                callback()
            except Exception:  # a listener's bug must not stop a hook
                LOG.exception("change listener failed")

    def subscribe(self, callback: Callable[[], None], container: ContainerId | None = None) -> Callable[[], None]:
        """Call ``callback`` (from the notifying thread; it must not block) on each change that may
        concern ``container`` (every change when None) until the returned function is called.

        The non-blocking twin of ``wait_for_change``: a waiter costs an entry here, not a thread.
        """
        key = None if container is None else container.root
        token = next(self._tokens)
        with self._changed:
            self._listeners.setdefault(key, {})[token] = callback

        def unsubscribe() -> None:
            with self._changed:
                group = self._listeners.get(key)
                if group is not None:
                    group.pop(token, None)
                    if not group:
                        del self._listeners[key]

        return unsubscribe

    def listeners(self) -> int:
        """How many subscriptions are open (tests and the load bench)."""
        with self._changed:
            return sum(len(group) for group in self._listeners.values())

    def generation(self) -> int:
        with self._changed:
            return self._generation

    def wait_for_change(self, seen: int, timeout: float) -> None:
        """Return once something changed after generation ``seen``, or after ``timeout`` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self._generation != seen, timeout=timeout)

    # ---- MIG units (call with ``alloc`` held) ------------------------------------------------------

    @property
    def mig(self) -> dict[str, MigDevice]:
        """Every MIG device of a managed GPU in MIG mode, by UUID, as the inventory reports it now."""
        return {d.uuid: d for d in self.mig_devices(frozenset(self.gpus))}

    @property
    def mig_mode(self) -> frozenset[int]:
        """Minors of the managed GPUs in MIG mode (with or without MIG devices)."""
        return frozenset(r.gpu.minor for r in self.inventory.records if r.mig_enabled) & frozenset(self.gpus)

    def hold_mig(self, held: Iterable[tuple[str, int]], restore: bool = False) -> None:
        """Mark MIG devices held and book their parents against whole-GPU use."""
        held = list(held)
        self.mig_held.update(held)
        new = frozenset(p for _u, p in held if p not in self.mig_booked and p in self.allocator.total)
        if new:
            if restore:
                self.allocator.restore(new)
            else:
                self.allocator.allocate_set(new)
            self.mig_booked.update(new)

    def free_mig(self, uuids: Iterable[str]) -> None:
        """Free MIG devices; a parent none of whose devices is held any more is free as a whole again."""
        for uuid in uuids:
            self.mig_held.pop(uuid, None)
        idle = frozenset(self.mig_booked - set(self.mig_held.values()))
        if idle:
            self.allocator.deallocate(idle & self.allocator.allocated)
            self.mig_booked -= idle

    def choose_mig(self, request: dict[str, int]) -> tuple[MigDevice, ...]:
        """MIG devices for ``request`` (resource -> count), held on return; none for an empty request."""
        if not request:
            return ()
        devices = list(self.mig.values())
        whole = self.allocator.allocated - self.mig_booked
        usable = self.inventory.healthy()
        blocked = {d.parent_minor for d in devices if d.parent_minor in whole}
        blocked |= {d.parent_minor for d in devices if d.parent_index not in usable}
        blocked |= set(self.allocator.unhealthy)
        units = migunits.choose(request, devices, set(self.mig_held), blocked).devices
        self.hold_mig((d.uuid, d.parent_minor) for d in units)
        return units

    def allocate_whole(self, count: int) -> Choice:
        """Whole GPUs, taking GPUs that are not in MIG mode first (docs/mig.md)."""
        mig_gpus = self.mig_mode & self.allocator.available
        if count and mig_gpus:
            self.allocator.allocate_set(mig_gpus)
            try:
                return self.allocator.allocate(count)
            except IsolatorError:
                pass
            finally:
                self.allocator.deallocate(mig_gpus)
        return self.allocator.allocate(count)

    def mig_of(self, rec: ContainerRecord | None) -> tuple[MigDevice, ...]:
        """The MIG devices a record holds that the inventory knows (an unknown UUID grants nothing)."""
        if rec is None:
            return ()
        known = self.mig
        out = []
        for uuid in sorted(rec.mig_uuids):
            dev = known.get(uuid)
            if dev is None:
                LOG.warning("container %s holds MIG device %s, unknown to the inventory", rec.container_id, uuid)
                continue
            out.append(dev)
        return tuple(out)

    # ---- shared steps -----------------------------------------------------------------------------

    def rules(self, minors: frozenset[int], units: Iterable[MigDevice] = ()) -> tuple[devrules.DeviceRule, ...]:
        """The full allow-list of a container holding GPU ``minors`` whole and MIG devices ``units``:
        a whole GPU in MIG mode brings every MIG device's caps; a unit brings its GI and CI caps and
        its parent's node, which the driver requires (docs/mig.md)."""
        if not self.gpus:
            return tuple(devrules.MESOS_DEFAULT_WHITELIST)  # no GPUs here: no control devices either
        units = tuple(units)
        control = self.edges.devices.control_devices()
        mig = self.mig_devices(minors) + units
        caps_major = self.edges.devices.caps_major() if mig else None
        nodes = sorted(minors | migunits.parents(units))
        return devrules.container_rules(control, nodes, mig_devices=mig, caps_major=caps_major)

    def mig_devices(self, minors: frozenset[int]) -> tuple[MigDevice, ...]:
        out: list[MigDevice] = []
        for rec in self.inventory.records:
            if rec.gpu.minor in minors and rec.mig_enabled:
                out.extend(rec.mig_devices)
        return tuple(out)

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

    def cleanup_cgroups(self, cid: ContainerId) -> None:
        """Remove our rules from a top-level container's cgroup, and in mesos mode first from the
        cgroups of its own of its nested containers: Mesos cleans those up first, but when it did not
        (an orphan, a forced release) they must not keep granting the GPUs freed next (v2: their
        programs are not below the parent's leaf, so nothing else would revoke them)."""
        if self.settings.mode == "mesos":
            for child in reversed(self.nested_cgroups(cid)):
                self.cgroups.cleanup(child)
        self.cgroups.cleanup(cid)

    def mark_ended(self, cid: ContainerId) -> None:
        """Remember that Mesos cleaned up ``cid`` (the last ENDED_KEPT of them)."""
        with self._changed:
            self._ended.pop(cid, None)
            self._ended[cid] = None
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)

    def forget_ended(self, cid: ContainerId) -> None:
        with self._changed:
            self._ended.pop(cid, None)

    def recently_ended(self, cid: ContainerId) -> bool:
        with self._changed:
            return cid in self._ended

    def drop(self, cid: ContainerId, rec: ContainerRecord) -> None:
        """Forget a container whose rules are already gone: its record, then its GPUs; wake watchers."""
        self.store.remove(cid)
        with self.alloc:
            self.allocator.deallocate(rec.gpus & self.allocator.allocated)
            self.free_mig(rec.mig_uuids)
        self.notify(cid)

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
