"""Which GPUs a container gets: the `first-fit` and `topology` policies, and an in-memory book.

Pure: plain data in, plain data out; no NVML, no files, no cgroups. GPUs are named by their device
minor (``/dev/nvidia<minor>``, what the kernel, the state store and Mesos's ``195.<minor>`` use).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from isolator.errors import (
    GpusExhausted,
    GpusNotAllocated,
    GpusNotAvailable,
    InvalidArgument,
    InvalidTopology,
    UnknownGpus,
)
from isolator.model import Link, PcieLevel, Topology, checked_gpu_count

LOG = logging.getLogger(__name__)

FIRST_FIT = "first-fit"
TOPOLOGY = "topology"
POLICIES = (TOPOLOGY, FIRST_FIT)

# go-gpuallocator's link weights (k8s-topology.md §1.3): one PCIe-level link per pair plus 100 per
# NVLink lane, so one lane outweighs any PCIe relationship and the PCIe level breaks ties. We keep
# the scale so that scores can be compared with the published fixtures (F1-F3).
PCIE_POINTS = {
    PcieLevel.INTERNAL: 60,
    PcieLevel.SINGLE: 50,
    PcieLevel.MULTIPLE: 40,
    PcieLevel.HOSTBRIDGE: 30,
    PcieLevel.NODE: 20,
    PcieLevel.SYSTEM: 10,
}
NVLINK_POINTS = 100
# go-nvml maps lane counts above 18 to EighteenNVLINKLinks; 18 is also H100's lane count.
MAX_LANES = 18

# With fewer than two GPUs a set has no pairs; it then has no slowest link to compare.
NO_PAIRS = -1

# How many equally good sets the search keeps for the tie-breaks (NUMA spread, what is left).
# Symmetric hosts (NVSwitch) have thousands of equal sets; past this many the later ones add little.
MAX_TIES = 64


def pair_points(link: Link) -> int:
    """The score of one GPU pair: PCIe points plus 100 per NVLink lane (capped at 18 lanes)."""
    lanes = min(max(int(link.nvlink_lanes), 0), MAX_LANES)
    return PCIE_POINTS.get(_level(link.pcie), PCIE_POINTS[PcieLevel.SYSTEM]) + NVLINK_POINTS * lanes


def _level(value: object) -> PcieLevel:
    try:
        return PcieLevel(value)  # type: ignore[arg-type]  # inventories may hold anything here
    except (ValueError, TypeError):
        return PcieLevel.SYSTEM  # an unknown level is treated as the slowest, never as a crash


@dataclass(frozen=True)
class Fabric:
    """The pair-score matrix of a host, built once from its Topology (not per request).

    Positions are the GPUs sorted by minor. Inventory defects never raise here: a missing pair is the
    slowest link (SYS, no NVLink), a pair given in both directions with different values takes the
    weaker one, links naming unknown GPUs are dropped; each such repair is listed in ``repairs``.
    Only duplicate minors are refused, because they would make isolation ambiguous.
    """

    minors: tuple[int, ...]
    numa: tuple[int | None, ...]
    score: tuple[tuple[int, ...], ...]
    repairs: tuple[str, ...] = ()
    position: Mapping[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, topology: Topology) -> Fabric:
        gpus = sorted(topology.gpus, key=lambda g: g.minor)
        minors = tuple(g.minor for g in gpus)
        if len(set(minors)) != len(minors):
            dup = sorted({m for m in minors if minors.count(m) > 1})
            raise InvalidTopology(reason=f"minor numbers {dup} appear on more than one GPU")
        by_index = {g.index: pos for pos, g in enumerate(gpus)}
        n = len(gpus)
        default = pair_points(Link())
        matrix = [[0 if i == j else default for j in range(n)] for i in range(n)]
        seen: dict[tuple[int, int], int] = {}
        repairs: list[str] = []
        for key, link in topology.links.items():
            try:
                a, b = key
                pa, pb = by_index[a], by_index[b]
                points = pair_points(link)
            except (KeyError, TypeError, ValueError, AttributeError):
                repairs.append(f"ignored link {key!r}: it does not name two GPUs of this host")
                continue
            if pa == pb:
                repairs.append(f"ignored link {key!r}: a GPU has no link to itself")
                continue
            pair = (min(pa, pb), max(pa, pb))
            if pair in seen and seen[pair] != points:
                # Asymmetric inventory (k8s-device-plugin #448 panics here): trust the weaker side.
                repairs.append(f"link {key!r} differs by direction ({seen[pair]} vs {points}); using the weaker")
                points = min(points, seen[pair])
            seen[pair] = points
            matrix[pa][pb] = matrix[pb][pa] = points
        for i in range(n):
            for j in range(i + 1, n):
                if (i, j) not in seen:
                    repairs.append(f"no link between minors {minors[i]} and {minors[j]}; assuming SYS")
        for line in repairs:
            LOG.warning("topology: %s", line)
        return cls(
            minors=minors,
            numa=tuple(g.numa_node for g in gpus),
            score=tuple(tuple(row) for row in matrix),
            repairs=tuple(repairs),
            position={m: p for p, m in enumerate(minors)},
        )

    def pair(self, a: int, b: int) -> int:
        """The score between minors ``a`` and ``b``."""
        return self.score[self.position[a]][self.position[b]]

    def set_score(self, minors: Iterable[int]) -> tuple[int, int]:
        """``(sum of pair scores, slowest pair)`` of a set of minors; slowest is NO_PAIRS below 2 GPUs."""
        pos = [self.position[m] for m in minors]
        total, slowest = 0, NO_PAIRS
        for i, a in enumerate(pos):
            row = self.score[a]
            for b in pos[i + 1 :]:
                s = row[b]
                total += s
                slowest = s if slowest == NO_PAIRS else min(slowest, s)
        return total, slowest

    def numa_nodes(self, minors: Iterable[int]) -> int:
        return len({self.numa[self.position[m]] for m in minors} - {None})


@dataclass(frozen=True)
class SearchLimits:
    """Bounds on the exact search. ``max_nodes`` is deterministic (same input, same answer on any
    machine); ``deadline_s`` is the wall-clock safety net. Either one ends the search early, and the
    best set found so far (never worse than the greedy start) is returned with ``exact=False``."""

    max_nodes: int = 50_000
    deadline_s: float = 0.004


@dataclass(frozen=True)
class Choice:
    """What a policy picked. ``gpus`` are the new minors (ascending); the scores describe the
    whole resulting set (what the container already held plus ``gpus``)."""

    gpus: tuple[int, ...]
    policy: str
    score: int = 0
    slowest: int = NO_PAIRS
    exact: bool = True
    nodes: int = 0


@dataclass(frozen=True)
class UpdatePlan:
    """A container's GPU change: minors to add and minors to release (one of them is empty)."""

    add: tuple[int, ...] = ()
    release: tuple[int, ...] = ()
    choice: Choice | None = None


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
    well with them, and they are never returned again. The result has exactly ``count`` distinct
    minors from ``available``, or a typed error: InvalidGpuCount, GpusExhausted, UnknownGpus.
    """
    n = checked_gpu_count(count)
    if policy not in POLICIES:
        raise InvalidArgument(f"unknown allocation policy {policy!r} (known: {', '.join(POLICIES)})")
    held = _known(fabric, holding)
    free = _known(fabric, available) - held
    if n > len(free):
        raise GpusExhausted(requested=n, available=len(free))
    if n == 0:
        return _describe(fabric, (), held, policy, exact=True, nodes=0)
    if policy == FIRST_FIT:
        # Mesos's NvidiaGpuAllocator: the first `count` elements of an ordered set (lowest minors).
        return _describe(fabric, tuple(sorted(free)[:n]), held, policy, exact=True, nodes=0)
    pos = fabric.position
    found = _topology_search(
        fabric.score,
        fabric.numa,
        fixed=sorted(pos[m] for m in held),
        cands=sorted(pos[m] for m in free),
        k=n,
        limits=limits or SearchLimits(),
    )
    return _describe(
        fabric, tuple(fabric.minors[p] for p in found.chosen), held, policy, exact=found.exact, nodes=found.nodes
    )


def plan_update(
    fabric: Fabric,
    holding: Iterable[int],
    available: Iterable[int],
    target: object,
    policy: str = TOPOLOGY,
    *,
    limits: SearchLimits | None = None,
) -> UpdatePlan:
    """Grow or shrink a container from what it holds to ``target`` GPUs.

    Grow adds to what is held (Mesos overwrites the set and leaks the old GPUs, mesos §2.15.1).
    Shrink keeps the best-connected ``target`` of the held GPUs, judged like an allocation from
    the held set, and releases the rest; under first-fit it keeps the lowest minors and releases
    the highest. Both are deterministic.
    """
    n = checked_gpu_count(target)
    held = _known(fabric, holding)
    if n == len(held):
        return UpdatePlan()
    if n > len(held):
        choice = choose(fabric, available, n - len(held), policy, holding=held, limits=limits)
        return UpdatePlan(add=choice.gpus, choice=choice)
    if policy == FIRST_FIT:
        keep = tuple(sorted(held)[:n])
        choice = _describe(fabric, keep, frozenset(), policy, exact=True, nodes=0)
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
    fabric: Fabric, new: tuple[int, ...], held: frozenset[int], policy: str, *, exact: bool, nodes: int
) -> Choice:
    total, slowest = fabric.set_score((*held, *new))
    return Choice(gpus=tuple(sorted(new)), policy=policy, score=total, slowest=slowest, exact=exact, nodes=nodes)


# ---- the topology search -------------------------------------------------------------------------
#
# Objective, lexicographic, for the resulting set S = fixed + chosen:
#   1. the slowest pair in S, highest first: a ring collective runs at its slowest link
#      (nccl-tests #178: 208 GB/s on an NVLink pair, 20 GB/s once a PCIe-only GPU joins);
#   2. the sum of pair scores (go-gpuallocator's score);
#   3. fewer NUMA nodes;
#   4. what is left for later requests, best first: the total score of the pairs among the
#      remaining free GPUs, then the sum over them of each one's best remaining partner (the
#      insight behind go-gpuallocator's partitions, without sacrificing the current request for a
#      guess about the sizes of future ones). For a single GPU this is the whole decision: take the
#      GPU whose loss hurts the remaining pairs least, i.e. the least connected one, which fills
#      partly used groups before breaking whole ones (k8s-device-plugin #1193, go-gpuallocator #18);
#   5. the lowest minors, so that the answer is deterministic.
# Search: the best slowest link is found by trying thresholds from the highest pair score down and
# asking for a set whose pairs all reach it (a clique); within the first threshold that has one,
# branch and bound maximises the sum. A greedy set seeds the bound and is the fallback answer.


@dataclass
class _Found:
    chosen: tuple[int, ...]
    exact: bool
    nodes: int


class _Stop(Exception):
    pass


class _Budget:
    def __init__(self, limits: SearchLimits) -> None:
        self.nodes = 0
        self.max_nodes = limits.max_nodes
        self.deadline = time.perf_counter() + limits.deadline_s
        # The best (slowest link, sum, sets) seen so far, for an early stop.
        self.partial: tuple[int, int, list[tuple[int, ...]]] | None = None

    def tick(self) -> None:
        self.nodes += 1
        if self.nodes >= self.max_nodes or (self.nodes & 15 == 0 and time.perf_counter() >= self.deadline):
            raise _Stop


def _topology_search(
    score: tuple[tuple[int, ...], ...],
    numa: tuple[int | None, ...],
    fixed: list[int],
    cands: list[int],
    k: int,
    limits: SearchLimits,
) -> _Found:
    budget = _Budget(limits)
    if k == len(cands):
        return _Found(tuple(cands), True, 0)
    greedy = _greedy(score, fixed, cands, k)
    best_min, best_sum = _key(score, fixed, greedy)
    ties: list[tuple[int, ...]] = [greedy]
    exact = True
    if len(fixed) + k < 2:
        ties = [(c,) for c in cands]  # one GPU, nothing held: no pairs, what is left decides
    else:
        # Thresholds: every pair score a result could have as its slowest link, above the greedy's.
        fixed_min = _key(score, fixed, ())[0] if len(fixed) >= 2 else None
        values = {score[a][b] for a in cands for b in (*fixed, *cands) if a != b}
        thresholds = sorted((v for v in values if v >= best_min), reverse=True)
        if fixed_min is not None:
            thresholds = [t for t in thresholds if t <= fixed_min]
        try:
            for t in thresholds:
                found = _best_clique(score, fixed, cands, k, t, best_sum if t == best_min else -1, budget)
                if found:
                    best_min, best_sum, ties = t, found[0], found[1]
                    break
        except _Stop:
            exact = False
            # A clique found at a threshold above the greedy's is better even if the sum search was cut.
            if budget.partial is not None and budget.partial[:2] >= (best_min, best_sum):
                best_min, best_sum, ties = budget.partial
    chosen = _tie_break(score, numa, fixed, cands, ties)
    return _Found(chosen, exact, budget.nodes)


def _key(score: tuple[tuple[int, ...], ...], fixed: list[int], chosen: Iterable[int]) -> tuple[int, int]:
    members = [*fixed, *chosen]
    total, slowest = 0, NO_PAIRS
    for i, a in enumerate(members):
        for b in members[i + 1 :]:
            s = score[a][b]
            total += s
            slowest = s if slowest == NO_PAIRS else min(slowest, s)
    return slowest, total


def _greedy(score: tuple[tuple[int, ...], ...], fixed: list[int], cands: list[int], k: int) -> tuple[int, ...]:
    """A good set fast: start from the best pair (or the held GPUs), add the best-linked GPU."""
    chosen: list[int] = []
    pool = list(cands)
    if not fixed and k >= 2:
        a, b = max(
            ((a, b) for i, a in enumerate(pool) for b in pool[i + 1 :]),
            key=lambda p: (score[p[0]][p[1]], -p[0], -p[1]),
        )
        chosen = [a, b]
        pool = [c for c in pool if c not in (a, b)]
    elif not fixed:
        return (pool[0],)
    while len(chosen) < k:
        members = [*fixed, *chosen]
        c = max(pool, key=lambda c: (min(score[c][m] for m in members), sum(score[c][m] for m in members), -c))
        chosen.append(c)
        pool.remove(c)
    return tuple(sorted(chosen))


def _best_clique(
    score: tuple[tuple[int, ...], ...],
    fixed: list[int],
    cands: list[int],
    k: int,
    t: int,
    floor: int,
    budget: _Budget,
) -> tuple[int, list[tuple[int, ...]]] | None:
    """The highest sum over k-sets whose pairs (with ``fixed``) all score at least ``t``, and up to
    MAX_TIES sets reaching it; None when no such set has a sum of at least ``floor``."""
    base = _key(score, fixed, ())[1]
    # Candidates that link to every held GPU at t or better, with their gain towards the held set.
    pool = [c for c in cands if all(score[c][f] >= t for f in fixed)]
    if len(pool) < k:
        return None
    gains = {c: sum(score[c][f] for f in fixed) for c in pool}
    # Each candidate's partners, best first, for the bound below.
    ranked = {c: sorted((d for d in pool if d != c), key=lambda d: -score[c][d]) for c in pool}
    best = [floor]
    ties: list[tuple[int, ...]] = []
    chosen: list[int] = []

    def dfs(pool: list[int], gains: dict[int, int], total: int, left: int) -> None:
        budget.tick()
        if left == 0:
            if total > best[0]:
                best[0] = total
                ties.clear()
            if total == best[0] and len(ties) < MAX_TIES:
                ties.append(tuple(sorted(chosen)))
                budget.partial = (t, best[0], list(ties))
            return
        # Most promising first, so that good sums are found early and prune the rest.
        order = sorted(pool, key=lambda c: -gains[c])
        # Each pick adds its gain plus its pairs with the other picks; a GPU's share of those pairs
        # is at most half the sum of its best `left - 1` scores into the pool (a pair is shared by
        # two picks). The bound on a branch is the best `left` of these potentials.
        inpool = set(pool)
        potential = {}
        for c in order:
            top = 0
            want = left - 1
            for d in ranked[c]:
                if want == 0:
                    break
                if d in inpool:
                    top += score[c][d]
                    want -= 1
            potential[c] = 2 * gains[c] + top
        for i, c in enumerate(order):
            rest = order[i + 1 :]
            if len(rest) < left - 1:
                break
            bound = total + (potential[c] + sum(sorted((potential[r] for r in rest), reverse=True)[: left - 1])) // 2
            # Keep equal sums while collecting ties; afterwards only a strictly better sum helps.
            if bound < best[0] or (bound == best[0] and len(ties) >= MAX_TIES):
                continue
            row = score[c]
            nxt = [r for r in rest if row[r] >= t]
            if len(nxt) < left - 1:
                continue
            chosen.append(c)
            dfs(nxt, {r: gains[r] + row[r] for r in nxt}, total + gains[c], left - 1)
            chosen.pop()

    dfs(pool, gains, base, k)
    if not ties:
        return None
    return best[0], ties


def _tie_break(
    score: tuple[tuple[int, ...], ...],
    numa: tuple[int | None, ...],
    fixed: list[int],
    cands: list[int],
    ties: list[tuple[int, ...]],
) -> tuple[int, ...]:
    if len(ties) == 1:
        return ties[0]
    partners = {c: sorted((d for d in cands if d != c), key=lambda d: -score[c][d]) for c in cands}
    degree = {c: sum(score[c][d] for d in cands if d != c) for c in cands}
    pool_total = sum(degree.values()) // 2

    def leftover(chosen: tuple[int, ...]) -> tuple[int, int]:
        taken = set(chosen)
        best_partner = 0
        for c in cands:
            if c in taken:
                continue
            for d in partners[c]:
                if d not in taken:
                    best_partner += score[c][d]
                    break
        inner = sum(score[a][b] for i, a in enumerate(chosen) for b in chosen[i + 1 :])
        remaining = pool_total - sum(degree[c] for c in chosen) + inner
        return best_partner, remaining

    def rank(chosen: tuple[int, ...]) -> tuple[int, int, int, tuple[int, ...]]:
        nodes = len({numa[p] for p in (*fixed, *chosen)} - {None})
        bp, rem = leftover(chosen)
        return (-nodes, rem, bp, tuple(-p for p in chosen))

    return max(ties, key=rank)


# ---- the book ------------------------------------------------------------------------------------


class Allocator:
    """Which GPUs of a host are free, allocated and healthy, and a policy to choose among them.

    In memory only: the durable record is isolator.state, and the service writes it before it
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
    def available(self) -> frozenset[int]:
        """Free and healthy: what a new request may get."""
        return self.total - self._allocated - self._unhealthy

    def set_healthy(self, minor: int, healthy: bool) -> None:
        _known(self.fabric, (minor,))
        (self._unhealthy.discard if healthy else self._unhealthy.add)(minor)

    def allocate(self, count: object, *, holding: Iterable[int] = ()) -> Choice:
        n = checked_gpu_count(count)
        free = self.available
        if n > len(free):
            raise GpusExhausted(
                f"Requested {n} gpus but only {len(free)} available"
                + (f" ({len(self._unhealthy - self._allocated)} more are unhealthy)" if self._unhealthy else ""),
                requested=n,
                available=len(free),
            )
        choice = choose(self.fabric, free, n, self.policy, holding=holding, limits=self.limits)
        self._allocated.update(choice.gpus)
        return choice

    def allocate_set(self, minors: Iterable[int]) -> frozenset[int]:
        """Allocate exactly these GPUs, all or nothing (Mesos's allocate(set))."""
        want = _known(self.fabric, minors)
        taken = sorted(want & self._allocated)
        if taken:
            raise GpusNotAvailable(gpus=taken, reason="already allocated")
        sick = sorted(want & self._unhealthy)
        if sick:
            raise GpusNotAvailable(gpus=sick, reason="unhealthy")
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

    def plan_update(self, holding: Iterable[int], target: object) -> UpdatePlan:
        """Plan a grow or shrink for a container holding ``holding``; books nothing."""
        return plan_update(self.fabric, holding, self.available, target, self.policy, limits=self.limits)
