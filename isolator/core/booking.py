"""Which GPUs and MIG devices are held: the allocator, the MIG holdings, the shares of shared GPUs
(docs/sharing.md) and the GPUs' health in it. The hooks book, free and restore a container's
``Holding`` whole (``book``, ``resize``, ``free``, ``restore``); the kinds one by one stay in here.

One job, one lock of its own (``lock``, an OwnedLock): every method that changes the books checks
that its caller holds it, so a decision and its booking happen in one short section, never across
I/O (an fsync, a cgroup write, an NVML query). ``Booking`` is the only way to the books: the
allocator inside is private, and the views below (``total``, ``allocated``...) are snapshots. The
MIG devices themselves are read from the inventory each time, so a GPU read again after a device
event offers what NVML reports now.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from isolator.core.locks import OwnedLock
from isolator.core.ports import GpuInventory
from isolator.errors import FailedPrecondition, IsolatorError
from isolator.model import Gpu, Holding, MigDevice, Share, ShareMode, Topology
from isolator.policy import mig as migunits
from isolator.policy import shares as sharing
from isolator.policy.allocator import Allocator, Choice, UpdatePlan
from isolator.policy.request import Request


def mig_devices_of(inventory: GpuInventory, minors: frozenset[int]) -> tuple[MigDevice, ...]:
    """The MIG devices of the GPUs ``minors`` that are in MIG mode, as the inventory reports them now."""
    out: list[MigDevice] = []
    for rec in inventory.records:
        if rec.gpu.minor in minors and rec.mig_enabled:
            out.extend(rec.mig_devices)
    return tuple(out)


class Booking:
    def __init__(
        self,
        inventory: GpuInventory,
        topology: Topology,
        policy: str,
        shared: tuple[sharing.ShareSpec, ...] = (),
        share_placement: str = sharing.SPREAD,
    ) -> None:
        self.lock = OwnedLock("booking")
        self.inventory = inventory
        self.policy = policy
        self.gpus: dict[int, Gpu] = {g.minor: g for g in topology.gpus}
        self._allocator = Allocator(topology, policy)
        # MIG units (docs/mig.md): the held MIG devices (UUID -> parent minor) and the parents booked
        # in the whole-GPU allocator because some of their MIG devices are held.
        self.mig_held: dict[str, int] = {}
        self.mig_booked: set[int] = set()
        # Shares (docs/sharing.md): the operator's --shared-gpus, and the book of their holders. A
        # shared GPU is booked in the whole-GPU allocator for as long as it is shared, so that it is
        # never also handed out whole.
        self.share_specs = shared
        self.share_placement = share_placement  # --share-placement: spread or pack (sharing.place)
        self._shares = sharing.ShareBook({}, share_placement)
        self._book_shared(self.resolve_shared(shared))
        # MPS faults (docs/sharing.md): shared GPUs whose MPS server is in FAULT (minor -> which
        # server), kept off new sharers until it is ACTIVE again; and the sharers a fault ended
        # (holder key -> why), whose Watch answers a limitation until their Cleanup.
        self.mps_faults: dict[int, str] = {}
        self.mps_ended: dict[str, str] = {}

    def reset(self, topology: Topology) -> None:
        """Empty books over ``topology`` (start-up booking rebuilds them from the records)."""
        self.lock.require("reset")
        self.gpus = {g.minor: g for g in topology.gpus}
        self._allocator = Allocator(topology, self.policy)
        self.mig_held = {}
        self.mig_booked = set()
        self._shares = sharing.ShareBook({}, self.share_placement)
        self._book_shared(self.resolve_shared(self.share_specs))

    # ---- views (snapshots; read them under the lock to act on them) ------------------------------

    @property
    def total(self) -> frozenset[int]:
        """Every managed GPU's minor."""
        return self._allocator.total

    @property
    def allocated(self) -> frozenset[int]:
        """Held whole, by a container or as the parent of held MIG devices."""
        return self._allocator.allocated

    @property
    def available(self) -> frozenset[int]:
        """Free, healthy and not draining: what a new request may get."""
        return self._allocator.available

    @property
    def unhealthy(self) -> frozenset[int]:
        return self._allocator.unhealthy

    @property
    def draining(self) -> frozenset[int]:
        return self._allocator.draining

    # ---- changes (call with the lock held) ---------------------------------------------------------

    # ---- holdings: what the hooks, recovery and Core.drop book and free, whole ---------------------

    def book(self, holder: str, request: Request, near: Iterable[int] | None = None, uid: int | None = 0) -> Holding:
        """Book what a new container ``holder`` (its key) asks for, all or nothing: shares of one GPU
        (placed ``near`` those NUMA nodes, for a sharer running as ``uid``: root unless told, see ``place_shares``), or
        whole GPUs and MIG units (whole GPUs not in MIG mode first). An empty request books nothing.
        The request obeys the one-kind rule (policy/request.py)."""
        self.lock.require("book")
        if request.shares:
            placed = self.place_shares(holder, request.shares, near, size=request.share_size, uid=uid, by_user=True)
            cut = self._shares.shared[placed.minor].shares
            return Holding(share=Share(placed.minor, placed.shares, placed.mode, uid, cut))
        choice = self.allocate_whole(request.gpus)
        try:
            units = self.choose_mig(dict(request.mig))
        except BaseException:
            self._allocator.deallocate(choice.gpus)
            raise
        return Holding(frozenset(choice.gpus), frozenset((d.uuid, d.parent_minor) for d in units))

    def resize(
        self, holder: str, holding: Holding, request: Request, in_use: frozenset[int] = frozenset()
    ) -> tuple[Holding, Holding, str]:
        """An update of ``holder`` (its key), holding ``holding``, to ``request`` (checked by
        ``request.check_update``): (grown, shrunk). What it grows by is booked here, all or nothing:
        whole GPUs, MIG units of each profile asked (chosen as Prepare chooses them), more shares of
        the GPU it shares (SharesExhausted naming that GPU when it has no room: shares never move).
        What it shrinks by is only chosen (whole GPUs: those its processes do not use, ``in_use``,
        policy/allocator.py's ``plan_update``; the MIG units of a profile with the highest UUIDs, so
        the choice is the same every time): the caller revokes it first, then ``free``s it. The third
        value says why those whole GPUs go ("" when none do)."""
        self.lock.require("resize")
        plan = self._allocator.plan_update(holding.gpus, request.gpus, in_use)
        add, release = frozenset(plan.add), frozenset(plan.release)
        _kept, drop, more = self._resize_mig(holding, request.mig)
        if add:
            self._allocator.allocate_set(add)
        try:
            units = self.choose_mig(more)
        except BaseException:
            self._allocator.deallocate(add)
            raise
        grown_mig = frozenset((d.uuid, d.parent_minor) for d in units)
        grown, shrunk = Holding(add, grown_mig), Holding(release, drop)
        if holding.share is not None and request.share_size:
            self._check_unit(holder, holding.share, request.share_size)
        if holding.share is not None and request.shares != holding.shares:
            if request.shares > holding.shares:
                grown = Holding(share=self._grow_shares(holder, holding.share, request.shares))
            else:
                shrunk = Holding(share=holding.share.resized(holding.shares - request.shares))
        return grown, shrunk, plan.why if release else ""

    def _resize_mig(
        self, holding: Holding, asked: Mapping[str, int]
    ) -> tuple[frozenset[tuple[str, int]], frozenset[tuple[str, int]], dict[str, int]]:
        """A holding's MIG units against the counts ``asked`` per resource: (kept, dropped, more to
        choose per resource). Of a profile with too many, the units with the highest UUIDs go; a unit the
        inventory no longer reports is kept (its profile unknown, it is neither counted nor let go)."""
        known = self.mig
        by_name: dict[str, list[tuple[str, int]]] = {}
        kept: set[tuple[str, int]] = set()
        for uuid, parent in sorted(holding.mig):
            dev = known.get(uuid)
            if dev is None:
                kept.add((uuid, parent))  # unknown to the inventory now (so granted nothing): never guessed at
                continue
            by_name.setdefault(migunits.resource_name(dev.profile) or dev.profile, []).append((uuid, parent))
        more: dict[str, int] = {}
        for name in sorted(set(by_name) | set(asked)):
            have, want = by_name.get(name, []), asked.get(name, 0)
            kept.update(have[:want])
            if want > len(have):
                more[name] = want - len(have)
        return frozenset(kept), holding.mig - kept, more

    def _check_unit(self, holder: str, share: Share, size: int) -> None:
        """An update naming a ``gpu-share-<size>`` unit names the unit the holder has: one share of a
        GPU cut ``size`` ways (FailedPrecondition otherwise: shares never move to another GPU)."""
        gpu = self._shares.shared.get(share.gpu)
        total = gpu.shares if gpu is not None else 0
        if total != size or share.count != 1:
            raise FailedPrecondition(
                f"container {holder} holds {share.count} of the {total} shares of GPU {self._name(share.gpu)};"
                f" an update to {sharing.unit_name(size)}:1 would move it to another GPU, and shares never move"
            )

    def _grow_shares(self, holder: str, share: Share, count: int) -> Share:
        """Book ``count`` shares in all for ``holder`` on the GPU it shares already, or refuse
        (SharesExhausted naming the GPU, the shares asked and those free), changing nothing.
        Returns the shares added."""
        gpu = self._shares.shared.get(share.gpu)
        if gpu is not None and gpu.mode is ShareMode.MPS:
            # One limit per MPS server: every sharer of an mps GPU holds one share (docs/sharing.md).
            raise sharing.MpsShareCount(
                f"container {holder} asks for {count} {sharing.RESOURCE} but holds {share.count} of GPU"
                f" {self._name(share.gpu)}, shared in mps mode, where each sharer holds exactly one share"
                " (MPS sets one limit per server)",
                requested=count,
            )
        free = (gpu.shares if gpu is not None else 0) - self._shares.held().get(share.gpu, 0)
        blocked = self._allocator.unhealthy | self._allocator.draining | self._allocator.maintenance
        blocked |= frozenset(self.mps_faults)
        extra = count - share.count
        if gpu is None or extra > free or share.gpu in blocked:
            why = (
                "unhealthy, draining, drained for maintenance or its MPS server in FAULT"
                if share.gpu in blocked
                else f"{max(free, 0)} free"
            )
            raise sharing.SharesExhausted(
                f"container {holder} asks for {count} {sharing.RESOURCE} but holds {share.count} of GPU"
                f" {self._name(share.gpu)}, which has {why} for the {extra} more (shares never move"
                " to another GPU)",
                requested=count,
                free=max(free, 0),
            )
        uid = self._shares.user(holder)
        self._shares.release(holder)
        self._shares.restore(holder, share.gpu, count, uid=uid)
        return Share(share.gpu, extra, share.mode, share.uid, share.cut)

    def _name(self, minor: int) -> str:
        gpu = self.gpus.get(minor)
        return f"{gpu.index} ({gpu.uuid})" if gpu is not None else f"minor {minor}"

    def free(self, holder: str, holding: Holding) -> frozenset[int]:
        """Let what ``holder`` holds go: its whole GPUs, its MIG units (a parent none of whose units is
        held is free as a whole again) and its shares. Returns the GPUs free as a whole now that it
        used: its whole GPUs, and its shared GPU when it was the last sharer (while sharers remain,
        the GPU is theirs to share). Those go through the handover check (Core.drop, Core.release)."""
        self.lock.require("free")
        if holding.share is not None and self._shares.holders(holding.share.gpu).get(holder) == holding.share.count:
            self.mps_ended.pop(holder, None)  # all of its shares go: the fault's limitation with them
        released = holding.gpus & self._allocator.allocated
        self._allocator.deallocate(released)
        self.free_mig(holding.mig_uuids)  # also lets a parent no unit holds any more go (as ever)
        freed = self.free_shares(holder, holding.share.count) if holding.share is not None else None
        if freed is not None and freed[1]:
            released |= {freed[0]}
        return released

    def restore(self, holder: str, holding: Holding) -> Holding:
        """Book a recorded holding again at start-up, healthy or not (FailedPrecondition when the
        flags cannot hold its shares). Returns what was booked: whole GPUs this host lacks are not."""
        self.lock.require("restore")
        known = holding.gpus & self._allocator.total
        self._allocator.restore(known)
        self.hold_mig(holding.mig, restore=True)
        if holding.share is not None:
            share = holding.share
            gpu = self._shares.shared.get(share.gpu)
            if share.cut is not None and gpu is not None and gpu.shares != share.cut:
                # Its limits and its offer unit were made from 1/cut; another cut would change what it
                # holds under it (issue 41 item 6): the start stops (exit 78), as for a mode switch.
                raise FailedPrecondition(
                    f"container {holder} holds {share.count} {sharing.RESOURCE} of GPU {share.gpu} cut {share.cut}"
                    f" ways, which the flags now cut {gpu.shares} ways (a GPU with sharers keeps its cut)"
                )
            self.restore_shares(holder, share.gpu, share.count, share.mode, uid=share.uid)
        return holding.with_gpus(known)

    # ---- the kinds, one by one (call with the lock held) -------------------------------------------

    def allocate_set(self, minors: Iterable[int]) -> frozenset[int]:
        """Book exactly these GPUs, all or nothing (a grow's chosen GPUs)."""
        self.lock.require("allocate_set")
        return self._allocator.allocate_set(minors)

    def deallocate(self, minors: Iterable[int]) -> frozenset[int]:
        """Free these GPUs, all or nothing; a double free is refused."""
        self.lock.require("deallocate")
        return self._allocator.deallocate(minors)

    def plan_update(self, holding: Iterable[int], target: object) -> UpdatePlan:
        """A grow or shrink for a container holding ``holding``; books nothing."""
        self.lock.require("plan_update")
        return self._allocator.plan_update(holding, target)

    def set_mps_faults(self, faults: Mapping[int, str]) -> list[str]:
        """The shared GPUs whose MPS server is in FAULT now (minor -> which server). Every holder of a
        GPU that newly faulted is ended (``mps_ended``; its Watch answers a limitation until its
        Cleanup, even once the server is ACTIVE again: its clients failed). Returns their keys."""
        self.lock.require("set_mps_faults")
        ended = []
        for minor in sorted(set(faults) - set(self.mps_faults)):
            for holder in sorted(self._shares.holders(minor)):
                if holder in self.mps_ended:
                    continue  # ended already (its daemon lost, another fault): its first reason stays
                self.mps_ended[holder] = (
                    f"its MPS server on GPU {self._name(minor)} failed: {faults[minor]} (a fatal GPU fault in a"
                    " client of the server; NVIDIA: every client of the GPU fails and must exit before the server"
                    " takes new ones)"
                )
                ended.append(holder)
        self.mps_faults = {m: faults[m] for m in faults if m in self._shares.shared}
        return ended

    def end_holders(self, ends: Mapping[str, str]) -> list[str]:
        """End each holder of ``ends`` (key -> why) that still holds shares and is not ended already
        (``mps_ended``). Returns the keys of those it ended now."""
        self.lock.require("end_holders")
        ended = []
        for holder, why in sorted(ends.items()):
            if self._shares.of(holder) is not None and holder not in self.mps_ended:
                self.mps_ended[holder] = why
                ended.append(holder)
        return ended

    def set_draining(self, minor: int, draining: bool) -> None:
        """Keep a GPU out of the pool (or let it back in) for the handover check (docs/handover.md)."""
        self.lock.require("set_draining")
        self._allocator.set_draining(minor, draining)

    def set_health(self, healthy_indices: Iterable[int]) -> None:
        """Every GPU healthy or not, by NVML index, as the inventory says."""
        self.lock.require("set_health")
        healthy = set(healthy_indices)
        for gpu in self.gpus.values():
            self._allocator.set_healthy(gpu.minor, gpu.index in healthy)

    def drain_for_maintenance(self, minor: int, label: str) -> None:
        """An operator's maintenance drain (core/maintenance.py): no new grant of GPU ``minor``, whole or
        a MIG device on it; whoever holds it keeps it. ``label`` names it in refusals."""
        self.lock.require("drain_for_maintenance")
        self._allocator.set_maintenance(minor, label)

    def end_maintenance(self, minor: int) -> None:
        self.lock.require("end_maintenance")
        self._allocator.set_maintenance(minor, None)

    def set_gpu_health(self, index: int, healthy: bool) -> None:
        self.lock.require("set_gpu_health")
        for gpu in self.gpus.values():
            if gpu.index == index:
                self._allocator.set_healthy(gpu.minor, healthy)

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
        new = frozenset(p for _u, p in held if p not in self.mig_booked and p in self._allocator.total)
        if new:
            if restore:
                self._allocator.restore(new)
            else:
                self._allocator.allocate_set(new)
            self.mig_booked.update(new)

    def free_mig(self, uuids: Iterable[str]) -> None:
        """Free MIG devices; a parent none of whose devices is held any more is free as a whole again."""
        self.lock.require("free_mig")
        for uuid in uuids:
            self.mig_held.pop(uuid, None)
        idle = frozenset(self.mig_booked - set(self.mig_held.values()))
        if idle:
            self._allocator.deallocate(idle & self._allocator.allocated)
            self.mig_booked -= idle

    def choose_mig(self, request: dict[str, int]) -> tuple[MigDevice, ...]:
        """MIG devices for ``request`` (resource -> count), held on return; none for an empty request."""
        self.lock.require("choose_mig")
        if not request:
            return ()
        devices = list(self.mig.values())
        whole = self._allocator.allocated - self.mig_booked
        usable = self.inventory.healthy()
        blocked = {d.parent_minor for d in devices if d.parent_minor in whole}
        blocked |= {d.parent_minor for d in devices if d.parent_index not in usable}
        blocked |= set(self._allocator.unhealthy) | set(self._allocator.draining)
        blocked |= set(self._allocator.maintenance)
        try:
            units = migunits.choose(request, devices, set(self.mig_held), blocked).devices
        except migunits.MigExhausted as exc:
            drained = sorted({d.parent_minor for d in devices} & self._allocator.maintenance)
            if not drained:
                raise
            names = ", ".join(f"GPU {self.gpus[m].index} ({self.gpus[m].uuid})" for m in drained if m in self.gpus)
            raise migunits.MigExhausted(
                f"{exc.message}; drained for maintenance: {names} (gpu-isolator undrain ends it)", **exc.fields
            ) from None
        self.hold_mig((d.uuid, d.parent_minor) for d in units)
        return units

    def allocate_whole(self, count: int) -> Choice:
        """Whole GPUs, taking GPUs that are not in MIG mode first (docs/mig.md)."""
        self.lock.require("allocate_whole")
        mig_gpus = self.mig_mode & self._allocator.available
        if count and mig_gpus:
            self._allocator.allocate_set(mig_gpus)
            try:
                return self._allocator.allocate(count)
            except IsolatorError:
                pass
            finally:
                self._allocator.deallocate(mig_gpus)
        return self._allocator.allocate(count)

    # ---- shares of GPUs (docs/sharing.md) ---------------------------------------------------------

    def resolve_shared(self, specs: tuple[sharing.ShareSpec, ...]) -> dict[int, sharing.SharedGpu]:
        """``--shared-gpus`` over the managed GPUs as the inventory reports them now (ConfigError for a
        GPU not managed or in MIG mode)."""
        mig = {r.gpu.minor for r in self.inventory.records if r.mig_enabled}
        managed = [(g.index, g.minor, g.minor in mig) for g in self.gpus.values()]
        return sharing.resolve(specs, managed, {g.minor: g.numa_node for g in self.gpus.values()})

    def _book_shared(self, shared: Mapping[int, sharing.SharedGpu]) -> None:
        leaving = frozenset(self._shares.shared) - frozenset(shared)
        joining = frozenset(shared) - frozenset(self._shares.shared)
        if leaving:
            self._allocator.deallocate(leaving)
        if joining:
            self._allocator.restore(joining)  # healthy or not, draining or not: kept from whole use
        self._shares.shared = dict(shared)

    @property
    def shared(self) -> dict[int, sharing.SharedGpu]:
        """The shared GPUs by minor."""
        return dict(self._shares.shared)

    @property
    def whole_held(self) -> frozenset[int]:
        """GPUs held whole by a container (not booked for MIG devices or for sharing)."""
        return self._allocator.allocated - self.mig_booked - frozenset(self._shares.shared)

    def share(self, specs: tuple[sharing.ShareSpec, ...]) -> dict[int, sharing.SharedGpu]:
        """Share the GPUs of ``specs`` from now on (a reload); RoleChangeRefused, changing nothing,
        when that would switch a held GPU between whole and shared, change the mode of a GPU with
        sharers or cut it into fewer shares than are held. Returns the new shared GPUs."""
        self.lock.require("share")
        new = self.resolve_shared(specs)
        sharing.check_roles(self._shares.shared, new, self.whole_held | self.mig_booked, self._shares.held())
        self._book_shared(new)
        self.share_specs = specs
        return new

    def place_shares(
        self,
        holder: str,
        count: int,
        near: Iterable[int] | None = None,
        *,
        size: int = 0,
        uid: int | None = None,
        by_user: bool = False,
    ) -> sharing.Placement:
        """Choose and book ``count`` shares for ``holder`` on one shared GPU that is healthy, not draining
        and not drained for maintenance (sharing.place: the fewest shares held, then ``near`` NUMA
        nodes, then the lowest minor). A maintenance drain keeps a shared GPU's sharers, as it keeps a
        whole GPU's holder, and grants it to no one new (core/maintenance.py)."""
        self.lock.require("place_shares")
        drained = self._allocator.maintenance
        faulted = frozenset(self.mps_faults)
        blocked = self._allocator.unhealthy | self._allocator.draining | drained | faulted
        try:
            return self._shares.place(holder, count, blocked, near, size=size, uid=uid, by_user=by_user)
        except sharing.SharesExhausted as exc:
            shared_drained = sorted(frozenset(self._shares.shared) & drained)
            shared_faulted = sorted(frozenset(self._shares.shared) & faulted)
            if not shared_drained and not shared_faulted:
                raise
            message = exc.message
            if shared_drained:
                names = ", ".join(f"GPU {self._name(m)}" for m in shared_drained)
                message += f"; drained for maintenance: {names} (gpu-isolator undrain ends it)"
            if shared_faulted:
                names = ", ".join(f"GPU {self._name(m)}: {self.mps_faults[m]}" for m in shared_faulted)
                message += (
                    f"; MPS server in FAULT: {names} (new sharers are kept off it until every client of the"
                    " fault has exited and the server is ACTIVE again)"
                )
            raise sharing.SharesExhausted(message, **exc.fields) from None

    def restore_shares(
        self, holder: str, minor: int, count: int, mode: ShareMode | None = None, uid: int | None = None
    ) -> None:
        """Book a recorded holding at start-up (FailedPrecondition when the flags cannot hold it,
        also when they share its GPU in another mode than ``mode``, the recorded one), with the uid
        its sharer runs as (None: not recorded)."""
        self.lock.require("restore_shares")
        self._shares.restore(holder, minor, count, mode, uid)

    def free_shares(self, holder: str, count: int | None = None) -> tuple[int, bool] | None:
        """Free ``count`` of ``holder``'s shares (None: all of them; an update's shrink frees fewer):
        (the GPU, whether it has no holder left), None when it held none."""
        self.lock.require("free_shares")
        held = self._shares.of(holder)
        if held is None:
            return None
        uid = self._shares.user(holder)
        minor, n = self._shares.release(holder)
        if count is not None and count < n:
            self._shares.restore(holder, minor, n - count, uid=uid)
        return minor, not self._shares.holders(minor)

    def share_holders(self, minor: int) -> dict[str, int]:
        """Holders of shared GPU ``minor`` (container key -> shares)."""
        self.lock.require("share_holders")
        return self._shares.holders(minor)

    def share_users(self, minor: int) -> frozenset[int | None]:
        """The uids shared GPU ``minor``'s sharers run as (None: one not recorded); empty without sharers."""
        self.lock.require("share_users")
        return self._shares.users().get(minor, frozenset())

    def shares_held(self) -> dict[int, int]:
        """Shares held per shared GPU."""
        self.lock.require("shares_held")
        return self._shares.held()
