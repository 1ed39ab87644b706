"""Which GPUs a container gets: the `first-fit` and `topology` policies, and an in-memory book.

Pure: plain data in, plain data out; no NVML, no files, no cgroups. GPUs are named by their device
minor (``/dev/nvidia<minor>``, what the kernel, the state store and Mesos's ``195.<minor>`` use).
The fabric's scores are in isolator/policy/fabric.py, the topology search in isolator/policy/search.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

from isolator.errors import GpusExhausted, GpusNotAllocated, GpusNotAvailable, InvalidArgument, UnknownGpus
from isolator.model import Topology, checked_gpu_count
from isolator.policy.fabric import NO_PAIRS, Fabric, pair_points, pair_tier
from isolator.policy.search import SearchLimits, _topology_search

__all__ = [
    "FIRST_FIT",
    "NO_PAIRS",
    "POLICIES",
    "TOPOLOGY",
    "Allocator",
    "Choice",
    "Fabric",
    "SearchLimits",
    "UpdatePlan",
    "choose",
    "pair_points",
    "pair_tier",
    "plan_update",
]

LOG = logging.getLogger(__name__)

FIRST_FIT = "first-fit"
TOPOLOGY = "topology"
POLICIES = (TOPOLOGY, FIRST_FIT)


@dataclass(frozen=True)
class Choice:
    """What a policy picked. ``gpus`` are the new minors (ascending); the scores describe the
    whole resulting set (what the container already held plus ``gpus``)."""

    gpus: tuple[int, ...]
    policy: str
    score: int = 0
    slowest: int = NO_PAIRS
    exact: bool = True
    work: int = 0


@dataclass(frozen=True)
class UpdatePlan:
    """A container's GPU change: minors to add and minors to release (one of them is empty)."""

    add: tuple[int, ...] = ()
    release: tuple[int, ...] = ()
    choice: Choice | None = None
    why: str = ""  # a shrink: why these are released (for the log)


# ---- the policies ----------------------------------------------------------------------------


def choose(
    fabric: Fabric,
    available: Iterable[int],
    count: object,
    policy: str = TOPOLOGY,
    *,
    holding: Iterable[int] = (),
    limits: SearchLimits | None = None,
) -> Choice:
    """Pick ``count`` GPUs out of ``available`` (free and healthy minors).

    ``holding`` are minors the container already has (a grow): the new GPUs are chosen to connect
    well with them. A held GPU cannot also be available (InvalidArgument). The result has exactly
    ``count`` distinct minors from ``available``, or a typed error: InvalidGpuCount, GpusExhausted,
    UnknownGpus, InvalidArgument.
    """
    n = checked_gpu_count(count)
    if policy not in POLICIES:
        raise InvalidArgument(f"unknown allocation policy {policy!r} (known: {', '.join(POLICIES)})")
    held = _known(fabric, holding)
    free = _known(fabric, available)
    both = sorted(held & free)
    if both:
        raise InvalidArgument(f"GPUs {both} are given as both held and available")
    if n > len(free):
        raise GpusExhausted(requested=n, available=len(free))
    if n == 0:
        return _describe(fabric, (), held, policy, exact=True, work=0)
    if policy == FIRST_FIT:
        # Mesos's NvidiaGpuAllocator: the first `count` elements of an ordered set (lowest minors).
        return _describe(fabric, tuple(sorted(free)[:n]), held, policy, exact=True, work=0)
    pos = fabric.position
    found = _topology_search(
        fabric,
        fixed=sorted(pos[m] for m in held),
        cands=sorted(pos[m] for m in free),
        k=n,
        limits=limits or SearchLimits(),
    )
    return _describe(
        fabric, tuple(fabric.minors[p] for p in found.chosen), held, policy, exact=found.exact, work=found.work
    )


def plan_update(
    fabric: Fabric,
    holding: Iterable[int],
    available: Iterable[int],
    target: object,
    policy: str = TOPOLOGY,
    *,
    limits: SearchLimits | None = None,
    in_use: Iterable[int] = (),
) -> UpdatePlan:
    """Grow or shrink a container from what it holds to ``target`` GPUs.

    Grow adds to what is held (Mesos overwrites the set and leaks the old GPUs, mesos §2.15.1).
    Shrink keeps the GPUs its processes still use (``in_use``, of those held: a task group whose
    short task ended keeps the GPU its remaining task runs on): all of them when they fit, the rest
    of what is kept chosen as a grow from them; when more are used than may be kept, the
    best-connected ``target`` of those used. When none or all of the held GPUs are used, the use
    says nothing and today's rule decides: the best-connected ``target`` of the held GPUs, judged
    like an allocation from the held set (under first-fit the lowest minors). All deterministic.
    """
    n = checked_gpu_count(target)
    held = _known(fabric, holding)
    if n == len(held):
        return UpdatePlan()
    if n > len(held):
        choice = choose(fabric, available, n - len(held), policy, holding=held, limits=limits)
        return UpdatePlan(add=choice.gpus, choice=choice)
    used = frozenset(in_use) & held
    if used and used != held and n > 0:
        return _shrink_to_used(fabric, held, used, n, policy, limits)
    why = "every GPU it holds is in use" if used == held else "no process of its uses any GPU it holds"
    if n == 0:
        why = "it keeps none"
    plan = _shrink(fabric, held, n, policy, limits)
    return replace(plan, why=f"{why}: the {policy} rule keeps {list(plan.choice.gpus) if plan.choice else []}")


def _shrink_to_used(
    fabric: Fabric, held: frozenset[int], used: frozenset[int], n: int, policy: str, limits: SearchLimits | None
) -> UpdatePlan:
    """Keep the GPUs in use: all of them and the best to go with them, or the best ``n`` of them."""
    if len(used) <= n:
        keep = used
        if n > len(used):
            keep |= frozenset(choose(fabric, held - used, n - len(used), policy, holding=used, limits=limits).gpus)
        choice = _describe(fabric, tuple(sorted(keep)), frozenset(), policy, exact=True, work=0)
        release = tuple(sorted(held - keep))
        why = f"no process of its uses them; it keeps the GPUs its processes use {sorted(used)}"
        return UpdatePlan(release=release, choice=choice, why=why)
    plan = _shrink(fabric, used, n, policy, limits)
    release = tuple(sorted(held - frozenset(plan.choice.gpus if plan.choice else ())))
    why = f"more GPUs are in use {sorted(used)} than it may keep: the {policy} rule keeps the best of those"
    return UpdatePlan(release=release, choice=plan.choice, why=why)


def _shrink(fabric: Fabric, held: frozenset[int], n: int, policy: str, limits: SearchLimits | None) -> UpdatePlan:
    """Today's rule: the best-connected ``n`` of ``held`` (first-fit: the lowest minors)."""
    if policy == FIRST_FIT:
        keep = tuple(sorted(held)[:n])
        choice = _describe(fabric, keep, frozenset(), policy, exact=True, work=0)
    else:
        # Among equally connected sets to keep, the tie-break prefers releasing GPUs that still pair
        # well with each other (what is left, here, is what is released).
        choice = choose(fabric, held, n, policy, limits=limits)
    release = tuple(sorted(held - set(choice.gpus)))
    return UpdatePlan(release=release, choice=choice)


def _known(fabric: Fabric, minors: Iterable[int]) -> frozenset[int]:
    out = frozenset(minors)
    unknown = sorted(m for m in out if m not in fabric.position)
    if unknown:
        raise UnknownGpus(gpus=unknown, known=list(fabric.minors))
    return out


def _describe(
    fabric: Fabric, new: tuple[int, ...], held: frozenset[int], policy: str, *, exact: bool, work: int
) -> Choice:
    total, slowest = fabric.set_score((*held, *new))
    return Choice(gpus=tuple(sorted(new)), policy=policy, score=total, slowest=slowest, exact=exact, work=work)


# ---- the book ------------------------------------------------------------------------------------


class Allocator:
    """Which GPUs of a host are free, allocated and healthy, and a policy to choose among them.

    In memory only: the durable record is isolator.host.state, and the service writes it before it
    applies rules. Mirrors Mesos's NvidiaGpuAllocator (total/allocate/deallocate, all-or-nothing)
    so that Mesos's Allocator test steps apply.
    """

    def __init__(self, topology: Topology, policy: str = TOPOLOGY, limits: SearchLimits | None = None) -> None:
        if policy not in POLICIES:
            raise InvalidArgument(f"unknown allocation policy {policy!r} (known: {', '.join(POLICIES)})")
        self.fabric = Fabric.of(topology)
        self.policy = policy
        self.limits = limits or SearchLimits()
        self._allocated: set[int] = set()
        self._unhealthy: set[int] = set()
        self._draining: set[int] = set()  # free but failing the handover check (docs/handover.md)
        # Drained by an operator for maintenance (gpu-isolator drain, docs/operations.md): minor -> how
        # refusals name it ("GPU 3 (GPU-...)"). Never granted anew; a holder keeps it.
        self._maintenance: dict[int, str] = {}

    @property
    def total(self) -> frozenset[int]:
        return frozenset(self.fabric.minors)

    @property
    def allocated(self) -> frozenset[int]:
        return frozenset(self._allocated)

    @property
    def unhealthy(self) -> frozenset[int]:
        return frozenset(self._unhealthy)

    @property
    def draining(self) -> frozenset[int]:
        return frozenset(self._draining)

    @property
    def maintenance(self) -> frozenset[int]:
        return frozenset(self._maintenance)

    @property
    def available(self) -> frozenset[int]:
        """Free, healthy, not draining and not drained for maintenance: what a new request may get."""
        return self.total - self._allocated - self._unhealthy - self._draining - self._maintenance.keys()

    def set_healthy(self, minor: int, healthy: bool) -> None:
        _known(self.fabric, (minor,))
        (self._unhealthy.discard if healthy else self._unhealthy.add)(minor)

    def set_draining(self, minor: int, draining: bool) -> None:
        """A GPU something still runs on after its container (docs/handover.md) is not handed out."""
        _known(self.fabric, (minor,))
        (self._draining.add if draining else self._draining.discard)(minor)

    def set_maintenance(self, minor: int, label: str | None) -> None:
        """Drain ``minor`` for maintenance (``label``: how refusals name it), or end it (None)."""
        _known(self.fabric, (minor,))
        if label is None:
            self._maintenance.pop(minor, None)
        else:
            self._maintenance[minor] = label

    def _maintenance_note(self) -> str:
        """What a refusal adds when GPUs drained for maintenance would have served it."""
        out = sorted(set(self._maintenance) - self._allocated)
        if not out:
            return ""
        names = ", ".join(self._maintenance[m] for m in out)
        return f" ({len(out)} more drained for maintenance: {names}; gpu-isolator undrain ends it)"

    def allocate(self, count: object, *, holding: Iterable[int] = ()) -> Choice:
        """Choose and book ``count`` GPUs. ``holding``: the GPUs the container already has (a grow);
        each must be on this host (UnknownGpus), allocated (GpusNotAllocated) and healthy
        (GpusNotAvailable), or nothing is booked."""
        n = checked_gpu_count(count)
        held = self._check_held(holding)
        if held and self._unhealthy & held:
            raise GpusNotAvailable(gpus=sorted(self._unhealthy & held), reason="unhealthy")
        free = self.available
        if n > len(free):
            draining = self._draining - self._allocated - self._unhealthy
            raise GpusExhausted(
                f"Requested {n} gpus but only {len(free)} available"
                + (f" ({len(self._unhealthy - self._allocated)} more are unhealthy)" if self._unhealthy else "")
                + (f" ({len(draining)} more are draining: {sorted(draining)})" if draining else "")
                + self._maintenance_note(),
                requested=n,
                available=len(free),
            )
        choice = choose(self.fabric, free, n, self.policy, holding=held, limits=self.limits)
        self._allocated.update(choice.gpus)
        return choice

    def _check_held(self, holding: Iterable[int]) -> frozenset[int]:
        held = _known(self.fabric, holding)
        unheld = sorted(held - self._allocated)
        if unheld:
            raise GpusNotAllocated(gpus=unheld)
        return held

    def allocate_set(self, minors: Iterable[int]) -> frozenset[int]:
        """Allocate exactly these GPUs, all or nothing (Mesos's allocate(set))."""
        want = _known(self.fabric, minors)
        taken = sorted(want & self._allocated)
        if taken:
            raise GpusNotAvailable(gpus=taken, reason="already allocated")
        sick = sorted(want & self._unhealthy)
        if sick:
            raise GpusNotAvailable(gpus=sick, reason="unhealthy")
        busy = sorted(want & self._draining)
        if busy:
            raise GpusNotAvailable(gpus=busy, reason="draining")
        out = sorted(want & self._maintenance.keys())
        if out:
            names = ", ".join(self._maintenance[m] for m in out)
            raise GpusNotAvailable(gpus=out, reason=f"drained for maintenance: {names}")
        self._allocated |= want
        return want

    def restore(self, minors: Iterable[int]) -> frozenset[int]:
        """Mark recorded GPUs allocated at recovery, healthy or not; never one already allocated."""
        want = _known(self.fabric, minors)
        taken = sorted(want & self._allocated)
        if taken:
            raise GpusNotAvailable(gpus=taken, reason="already allocated")
        self._allocated |= want
        return want

    def deallocate(self, minors: Iterable[int]) -> frozenset[int]:
        """Free these GPUs, all or nothing; a double free or an unknown GPU is refused."""
        want = frozenset(minors)
        missing = sorted(want - self._allocated)
        if missing:
            raise GpusNotAllocated(gpus=missing)
        self._allocated -= want
        return want

    def plan_update(self, holding: Iterable[int], target: object, in_use: Iterable[int] = ()) -> UpdatePlan:
        """Plan a grow or shrink for a container holding ``holding`` (a shrink keeps the GPUs
        ``in_use`` where it can, see ``plan_update``); books nothing. Every held GPU must be on this
        host (UnknownGpus) and allocated (GpusNotAllocated)."""
        held = self._check_held(holding)
        try:
            return plan_update(
                self.fabric, held, self.available, target, self.policy, limits=self.limits, in_use=in_use
            )
        except GpusExhausted as exc:
            note = self._maintenance_note()
            if not note:
                raise
            raise GpusExhausted(exc.message + note, **exc.fields) from None
