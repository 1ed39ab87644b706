"""The kernel grant: what a container may open, computed once as data (``Grant``: the devices cgroup
rules and the device nodes), and the one object that puts it in the kernel and takes it back: the
container's devices cgroup and the cgroups of its own of its nested containers. Its cpuset is the
other half (core/cpuset.py), let go here with the rest at cleanup.

Lock contract (checked, isolator/core/locks.py): every method that writes to the kernel (``create``,
``write``, ``apply``, ``apply_nested``, ``revoke``, ``cleanup``) must be called with the container's
lock held (``locks.hold(cid)``; recovery: ``locks.exclusive()``) and without the booking lock (a
cgroup write is I/O, never done inside a booking decision); each raises ``LockNotHeld`` otherwise,
before touching anything. Computing a grant and reading the kernel (``compute``, ``rules``,
``governing``, ``nested_cgroups``) need no lock.
Ordering: ``apply`` writes the kernel before it records the rules granted; the caller records the
GPUs before any rule grants them and revokes them here before their record lets them go.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from isolator.core.booking import Booking, mig_devices_of
from isolator.core.cpuset import CpusetGrant
from isolator.core.locks import ContainerLocks, require_kernel_write
from isolator.core.ports import CgroupBackend, DeviceNodes, GpuInventory, RecordStore
from isolator.crashpoints import crashpoint
from isolator.errors import CgroupVanished, IsolatorError
from isolator.model import ContainerId, ContainerRecord, Holding, MigDevice, Mode
from isolator.policy import devices as devrules
from isolator.policy import mig as migunits

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grant:
    """A container's grant as data: the devices cgroup rules, and the device nodes (relative to the
    dev root) bound into an image container: exactly the allocated GPUs, the control devices and
    the MIG caps (Mesos exposes every /dev/nvidia*: defect §2.15.6)."""

    rules: tuple[devrules.DeviceRule, ...]
    nodes: tuple[str, ...]


class KernelGrants:
    """Computes grants and applies or revokes them in the kernel (devices cgroups; the cpuset through ``cpuset``)."""

    def __init__(
        self,
        *,
        booking: Booking,
        locks: ContainerLocks,
        inventory: GpuInventory,
        cgroups: CgroupBackend,
        devices: DeviceNodes,
        store: RecordStore,
        mode: Mode | str,
        cpuset: CpusetGrant,
    ) -> None:
        self.booking = booking  # the managed GPUs (``booking.gpus``) and the inventory's MIG view
        self.locks = locks
        self.inventory = inventory
        self.cgroups = cgroups
        self.devices = devices
        self.store = store
        self.mode = mode
        self.cpuset = cpuset

    def _require(self, cid: ContainerId, what: str) -> None:
        """The lock contract: the container's lock held, the booking lock not."""
        require_kernel_write(self.locks, self.booking.lock, cid, what)

    # ---- the grant as data ------------------------------------------------------------------------

    def compute(self, minors: frozenset[int], units: Iterable[MigDevice] = ()) -> Grant:
        """What a container holding GPU ``minors`` whole and MIG devices ``units`` is granted, with the
        dev root and the inventory's MIG view read once: the full allow-list (a whole GPU in MIG mode
        brings every MIG device's caps; a unit brings its GI and CI caps and its parent's node, which
        the driver requires, docs/mig.md) and the device nodes an image container is given."""
        if not self.booking.gpus:
            return Grant(tuple(devrules.MESOS_DEFAULT_WHITELIST), ())  # no GPUs here: no control devices either
        units = tuple(units)
        devices = self.devices
        control = devices.control_devices()
        mig = mig_devices_of(self.inventory, minors) + units
        caps_major = devices.caps_major() if mig else None
        gpus = sorted(minors | migunits.parents(units))
        rules = devrules.container_rules(control, gpus, mig_devices=mig, caps_major=caps_major)
        nodes = [f"nvidia{m}" for m in gpus]
        nodes += [posixpath.relpath(n.path, devices.dev_root) for n in control.numbers()]
        nodes += [f"nvidia-caps/nvidia-cap{minor}" for dev in mig for minor in dev.caps_minors]
        return Grant(rules, tuple(nodes))

    def rules(self, minors: frozenset[int], units: Iterable[MigDevice] = ()) -> tuple[devrules.DeviceRule, ...]:
        """The allow-list alone (``compute``'s rules)."""
        return self.compute(minors, units).rules

    def of(self, cid: ContainerId, holding: Holding) -> Grant:
        """What ``cid`` holding ``holding`` is granted (``compute`` over its GPUs and MIG units)."""
        return self.compute(holding.granted, self.mig_units(cid, holding))

    def mig_units(self, cid: ContainerId, holding: Holding) -> tuple[MigDevice, ...]:
        """The MIG devices ``cid`` holds that the inventory knows (an unknown UUID grants nothing)."""
        known = self.booking.mig
        out = []
        for uuid in sorted(holding.mig_uuids):
            dev = known.get(uuid)
            if dev is None:
                LOG.warning("container %s holds MIG device %s, unknown to the inventory", cid, uuid)
                continue
            out.append(dev)
        return tuple(out)

    def mig_of(self, rec: ContainerRecord | None) -> tuple[MigDevice, ...]:
        """The MIG devices a record holds that the inventory knows (none without a record)."""
        return self.mig_units(rec.container_id, rec.holding) if rec is not None else ()

    # ---- the devices cgroups ----------------------------------------------------------------------

    def create(self, cid: ContainerId) -> None:
        """Make ``cid``'s cgroup ours to restrict (standalone: created denying everything; mesos: Mesos's)."""
        self._require(cid, "create")
        self.cgroups.prepare(cid)

    def write(self, cid: ContainerId, rules: tuple[devrules.DeviceRule, ...]) -> None:
        """Put exactly ``rules`` in ``cid``'s cgroup, recording nothing (a Prepare records them first;
        a revocation's record follows, or is the record already)."""
        self._require(cid, "write")
        self.cgroups.apply(cid, rules)

    def apply(
        self,
        cid: ContainerId,
        minors: frozenset[int],
        units: tuple[MigDevice, ...] | None = None,
        shared: frozenset[int] | None = None,
    ) -> None:
        """Make the kernel grant exactly ``minors``, MIG ``units`` (None: the MIG devices its record
        holds) and the ``shared`` GPU (None: its record's) to ``cid``, then record the rules granted."""
        self._require(cid, "apply")
        rec = self.store.get(cid)
        # A sharer's GPU comes from its record unless an Update releasing its shares says otherwise.
        if shared is None:
            shared = rec.holding.shared if rec is not None else frozenset()
        rules = self.rules(minors | shared, self.mig_of(rec) if units is None else units)
        self.cgroups.apply(cid, rules)
        if self.mode == Mode.MESOS and not cid.nested:
            self._apply_nested(cid, rules)  # in the kernel before the record, as the container's own
        crashpoint("apply.kernel")
        self.store.update(cid, rules=rules)

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
                    self.cgroups.apply_nested(child, rules)
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
        self._require(child, "apply_nested")
        self.cgroups.apply_nested(child, rules)

    def revoke(self, cid: ContainerId) -> None:
        """Remove our rules from ``cid``'s own cgroup alone (idempotent; standalone: the cgroup too)."""
        self._require(cid, "revoke")
        self.cgroups.cleanup(cid)

    def cleanup(self, cid: ContainerId, keep_busy_cpuset: bool = False) -> None:
        """Remove our rules from a top-level container's cgroup, and in mesos mode first from the
        cgroups of its own of its nested containers: Mesos cleans those up first, but when it did not
        (an orphan, a forced release) they must not keep granting the GPUs freed next (v2: their
        programs are not below the parent's leaf, so nothing else would revoke them). Then the
        container's cpuset, if it has one."""
        self._require(cid, "cleanup")
        if self.mode == Mode.MESOS:
            for child in reversed(self.nested_cgroups(cid)):
                self.cgroups.cleanup(child)
        self.cgroups.cleanup(cid)
        if not cid.nested:
            self.cpuset.release(cid, keep_busy_cpuset)  # ours in both modes; after the GPUs' rules
