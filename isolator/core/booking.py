"""Which GPUs and MIG devices are held: the allocator, the MIG holdings, the shares of shared GPUs
(docs/sharing.md) and the GPUs' health in it.

One job, one lock of its own (``lock``, an OwnedLock): every method that reads or changes the books
checks that its caller holds it, so a decision and its booking happen in one short section, never
across I/O (an fsync, a cgroup write, an NVML query). The MIG devices themselves are read from the
inventory each time, so a GPU read again after a device event offers what NVML reports now.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from isolator.core.locks import OwnedLock
from isolator.core.ports import Inventory
from isolator.errors import IsolatorError
from isolator.model import Gpu, MigDevice, Topology
from isolator.policy import mig as migunits
from isolator.policy import shares as sharing
from isolator.policy.allocator import Allocator, Choice


def mig_devices_of(inventory: Inventory, minors: frozenset[int]) -> tuple[MigDevice, ...]:
    """The MIG devices of the GPUs ``minors`` that are in MIG mode, as the inventory reports them now."""
    out: list[MigDevice] = []
    for rec in inventory.records:
        if rec.gpu.minor in minors and rec.mig_enabled:
            out.extend(rec.mig_devices)
    return tuple(out)


class Booking:
    def __init__(
        self, inventory: Inventory, topology: Topology, policy: str, shared: tuple[sharing.ShareSpec, ...] = ()
    ) -> None:
        self.lock = OwnedLock("booking")
        self.inventory = inventory
        self.policy = policy
        self.gpus: dict[int, Gpu] = {g.minor: g for g in topology.gpus}
        self.allocator = Allocator(topology, policy)
        # MIG units (docs/mig.md): the held MIG devices (UUID -> parent minor) and the parents booked
        # in the whole-GPU allocator because some of their MIG devices are held.
        self.mig_held: dict[str, int] = {}
        self.mig_booked: set[int] = set()
        # Shares (docs/sharing.md): the operator's --shared-gpus, and the book of their holders. A
        # shared GPU is booked in the whole-GPU allocator for as long as it is shared, so that it is
        # never also handed out whole.
        self.share_specs = shared
        self.shares = sharing.ShareBook({})
        self._book_shared(self.resolve_shared(shared))

    def reset(self, topology: Topology) -> None:
        """Empty books over ``topology`` (start-up booking rebuilds them from the records)."""
        self.lock.require("reset")
        self.gpus = {g.minor: g for g in topology.gpus}
        self.allocator = Allocator(topology, self.policy)
        self.mig_held = {}
        self.mig_booked = set()
        self.shares = sharing.ShareBook({})
        self._book_shared(self.resolve_shared(self.share_specs))

    def set_health(self, healthy_indices: Iterable[int]) -> None:
        """Every GPU healthy or not, by NVML index, as the inventory says."""
        self.lock.require("set_health")
        healthy = set(healthy_indices)
        for gpu in self.gpus.values():
            self.allocator.set_healthy(gpu.minor, gpu.index in healthy)

    def set_gpu_health(self, index: int, healthy: bool) -> None:
        self.lock.require("set_gpu_health")
        for gpu in self.gpus.values():
            if gpu.index == index:
                self.allocator.set_healthy(gpu.minor, healthy)

    @property
    def mig(self) -> dict[str, MigDevice]:
        """Every MIG device of a managed GPU in MIG mode, by UUID, as the inventory reports it now."""
        return {d.uuid: d for d in mig_devices_of(self.inventory, frozenset(self.gpus))}

    @property
    def mig_mode(self) -> frozenset[int]:
        """Minors of the managed GPUs in MIG mode (with or without MIG devices)."""
        return frozenset(r.gpu.minor for r in self.inventory.records if r.mig_enabled) & frozenset(self.gpus)

    def hold_mig(self, held: Iterable[tuple[str, int]], restore: bool = False) -> None:
        """Mark MIG devices held and book their parents against whole-GPU use."""
        self.lock.require("hold_mig")
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
        self.lock.require("free_mig")
        for uuid in uuids:
            self.mig_held.pop(uuid, None)
        idle = frozenset(self.mig_booked - set(self.mig_held.values()))
        if idle:
            self.allocator.deallocate(idle & self.allocator.allocated)
            self.mig_booked -= idle

    def choose_mig(self, request: dict[str, int]) -> tuple[MigDevice, ...]:
        """MIG devices for ``request`` (resource -> count), held on return; none for an empty request."""
        self.lock.require("choose_mig")
        if not request:
            return ()
        devices = list(self.mig.values())
        whole = self.allocator.allocated - self.mig_booked
        usable = self.inventory.healthy()
        blocked = {d.parent_minor for d in devices if d.parent_minor in whole}
        blocked |= {d.parent_minor for d in devices if d.parent_index not in usable}
        blocked |= set(self.allocator.unhealthy) | set(self.allocator.draining)
        units = migunits.choose(request, devices, set(self.mig_held), blocked).devices
        self.hold_mig((d.uuid, d.parent_minor) for d in units)
        return units

    def allocate_whole(self, count: int) -> Choice:
        """Whole GPUs, taking GPUs that are not in MIG mode first (docs/mig.md)."""
        self.lock.require("allocate_whole")
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

    # ---- shares of GPUs (docs/sharing.md) ---------------------------------------------------------

    def resolve_shared(self, specs: tuple[sharing.ShareSpec, ...]) -> dict[int, sharing.SharedGpu]:
        """``--shared-gpus`` over the managed GPUs as the inventory reports them now (ConfigError for a
        GPU not managed or in MIG mode)."""
        mig = {r.gpu.minor for r in self.inventory.records if r.mig_enabled}
        managed = [(g.index, g.minor, g.minor in mig) for g in self.gpus.values()]
        return sharing.resolve(specs, managed, {g.minor: g.numa_node for g in self.gpus.values()})

    def _book_shared(self, shared: Mapping[int, sharing.SharedGpu]) -> None:
        leaving = frozenset(self.shares.shared) - frozenset(shared)
        joining = frozenset(shared) - frozenset(self.shares.shared)
        if leaving:
            self.allocator.deallocate(leaving)
        if joining:
            self.allocator.restore(joining)  # healthy or not, draining or not: kept from whole use
        self.shares.shared = dict(shared)

    @property
    def shared(self) -> dict[int, sharing.SharedGpu]:
        """The shared GPUs by minor."""
        return dict(self.shares.shared)

    @property
    def whole_held(self) -> frozenset[int]:
        """GPUs held whole by a container (not booked for MIG devices or for sharing)."""
        return self.allocator.allocated - self.mig_booked - frozenset(self.shares.shared)

    def share(self, specs: tuple[sharing.ShareSpec, ...]) -> dict[int, sharing.SharedGpu]:
        """Share the GPUs of ``specs`` from now on (a reload); RoleChangeRefused, changing nothing,
        when that would switch a held GPU between whole and shared, change the mode of a GPU with
        sharers or cut it into fewer shares than are held. Returns the new shared GPUs."""
        self.lock.require("share")
        new = self.resolve_shared(specs)
        sharing.check_roles(self.shares.shared, new, self.whole_held | self.mig_booked, self.shares.held())
        self._book_shared(new)
        self.share_specs = specs
        return new

    def place_shares(self, holder: str, count: int, near: Iterable[int] | None = None) -> sharing.Placement:
        """Choose and book ``count`` shares for ``holder`` on one shared GPU that is healthy and not
        draining (sharing.place: the fewest shares held, then ``near`` NUMA nodes, then the lowest minor)."""
        self.lock.require("place_shares")
        return self.shares.place(holder, count, self.allocator.unhealthy | self.allocator.draining, near)

    def restore_shares(self, holder: str, minor: int, count: int) -> None:
        """Book a recorded holding at start-up (FailedPrecondition when the flags cannot hold it)."""
        self.lock.require("restore_shares")
        self.shares.restore(holder, minor, count)

    def free_shares(self, holder: str) -> tuple[int, bool] | None:
        """Free ``holder``'s shares: (the GPU, whether it was the last holder), None when it held none."""
        self.lock.require("free_shares")
        if self.shares.of(holder) is None:
            return None
        minor, _n = self.shares.release(holder)
        return minor, not self.shares.holders(minor)

    def share_holders(self, minor: int) -> dict[str, int]:
        """Holders of shared GPU ``minor`` (container key -> shares)."""
        self.lock.require("share_holders")
        return self.shares.holders(minor)

    def shares_held(self) -> dict[int, int]:
        """Shares held per shared GPU."""
        self.lock.require("shares_held")
        return self.shares.held()
