"""Which GPUs a container gets: the `first-fit` and `topology` policies, and an in-memory book.

Pure: plain data in, plain data out; no NVML, no files, no cgroups. GPUs are named by their device
minor (``/dev/nvidia<minor>``, what the kernel, the state store and Mesos's ``195.<minor>`` use).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
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

# The tolerance of "best now" (docs/allocator.md, "Look-ahead"): on a pair joined by NVLink the
# traffic runs over the lanes, so the PCIe level below the CPU's root complex (same board, PIX, PXB,
# PHB) does not change what the pair can do; NODE and SYS still count (they cross host bridges or
# sockets). A pair's *tier* is its score with those four levels made equal on NVLink pairs. PCIe-only
# pairs keep their exact level: there the PCIe path is the data path.
TIER_CLASS = {60: 30, 50: 30, 40: 30, 30: 30, 20: 20, 10: 10}

# With fewer than two GPUs a set has no pairs; it then has no slowest link to compare.
NO_PAIRS = -1

# The search budget in expanded partial sets (SearchLimits); see docs/allocator.md, "Search budget".
DEFAULT_MAX_CANDIDATES = 2_500

# A partial set that will take all of its pool but at most FINISH_DROP GPUs, in at most FINISH_MAX
# ways, is finished by trying each way (exact tier sums, no bound needed).
FINISH_DROP = 3
FINISH_MAX = 120

# Bisections tried exactly up to this many GPUs in a group (C(16, 8) / 2 = 6,435 splits); larger
# groups without a natural split are halved greedily (still deterministic).
EXACT_BISECTION_MAX = 16


def pair_points(link: Link) -> int:
    """The score of one GPU pair: PCIe points plus 100 per NVLink lane (capped at 18 lanes)."""
    lanes = min(max(int(link.nvlink_lanes), 0), MAX_LANES)
    return PCIE_POINTS.get(_level(link.pcie), PCIE_POINTS[PcieLevel.SYSTEM]) + NVLINK_POINTS * lanes


def pair_tier(link: Link) -> int:
    """The pair's score up to the tolerance: PIX, PXB, PHB and same board are one class on an
    NVLink pair (the lanes carry the traffic); exact on PCIe-only pairs."""
    lanes = min(max(int(link.nvlink_lanes), 0), MAX_LANES)
    points = PCIE_POINTS.get(_level(link.pcie), PCIE_POINTS[PcieLevel.SYSTEM])
    return NVLINK_POINTS * lanes + (TIER_CLASS[points] if lanes else points)


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
    # The score up to the tolerance (pair_tier), same layout as ``score``.
    tier: tuple[tuple[int, ...], ...] = ()
    # The host's groups (docs/allocator.md, "Look-ahead"): bit masks over positions, each of two or
    # more GPUs, the whole host first; ``ancestors[p]`` are the groups holding position p.
    groups: tuple[int, ...] = ()
    ancestors: tuple[tuple[int, ...], ...] = ()
    # Per position, its partners by tier as (tier, bit mask of the positions at that tier), best
    # tier first; and the most the exact score of a pair exceeds its tier (for the search's bounds).
    by_tier: tuple[tuple[tuple[int, int], ...], ...] = ()
    max_gap: int = 0
    # The groups as position tuples (same order as ``groups``).
    members: tuple[tuple[int, ...], ...] = ()
    # Per position, the lower positions interchangeable with it (the search's symmetry rule).
    twins: tuple[frozenset[int], ...] = ()
    # Mirror images (the search's symmetry rule for whole groups): for two sibling groups that the
    # host maps onto each other in minor order, the swap as (position, its image) pairs, ascending.
    mirrors: tuple[tuple[tuple[int, int], ...], ...] = ()
    # Per position, the sum of its exact scores to every other GPU.
    row_sum: tuple[int, ...] = ()

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
        tiers = [[0 if i == j else pair_tier(Link()) for j in range(n)] for i in range(n)]
        seen: dict[tuple[int, int], int] = {}
        repairs: list[str] = []
        for key, link in topology.links.items():
            try:
                a, b = key
                pa, pb = by_index[a], by_index[b]
                points = pair_points(link)
                tier = pair_tier(link)
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
                if seen[pair] < points:
                    points, tier = seen[pair], tiers[pa][pb]
            seen[pair] = points
            matrix[pa][pb] = matrix[pb][pa] = points
            tiers[pa][pb] = tiers[pb][pa] = tier
        for i in range(n):
            for j in range(i + 1, n):
                if (i, j) not in seen:
                    repairs.append(f"no link between minors {minors[i]} and {minors[j]}; assuming SYS")
        for line in repairs:
            LOG.warning("topology: %s", line)
        tier_rows = tuple(tuple(row) for row in tiers)
        groups = host_groups(tier_rows)
        numa = tuple(g.numa_node for g in gpus)
        members = tuple(tuple(p for p in range(n) if g >> p & 1) for g in groups)
        return cls(
            minors=minors,
            numa=numa,
            score=tuple(tuple(row) for row in matrix),
            repairs=tuple(repairs),
            position={m: p for p, m in enumerate(minors)},
            tier=tier_rows,
            groups=groups,
            ancestors=tuple(tuple(i for i, g in enumerate(groups) if g >> p & 1) for p in range(n)),
            by_tier=tuple(_by_tier(tier_rows[c], c) for c in range(n)),
            max_gap=max((matrix[a][b] - tiers[a][b] for a in range(n) for b in range(a)), default=0),
            members=members,
            twins=_twins(matrix, tiers, numa, groups),
            mirrors=_mirrors(matrix, tiers, numa, groups, members),
            row_sum=tuple(sum(row) for row in matrix),
        )

    def group_minors(self) -> list[tuple[int, ...]]:
        """The host's groups as minors, the whole host first (for docs, logs and tests)."""
        return [tuple(m for p, m in enumerate(self.minors) if g >> p & 1) for g in self.groups]

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

    def tier_score(self, minors: Iterable[int]) -> tuple[int, int]:
        """``(slowest pair tier, sum of pair tiers)``: the "now" quality up to the tolerance."""
        pos = [self.position[m] for m in minors]
        total, slowest = 0, NO_PAIRS
        for i, a in enumerate(pos):
            row = self.tier[a]
            for b in pos[i + 1 :]:
                t = row[b]
                total += t
                slowest = t if slowest == NO_PAIRS else min(slowest, t)
        return slowest, total


def _by_tier(row: tuple[int, ...], me: int) -> tuple[tuple[int, int], ...]:
    masks: dict[int, int] = {}
    for d, value in enumerate(row):
        if d != me:
            masks[value] = masks.get(value, 0) | 1 << d
    return tuple(sorted(masks.items(), reverse=True))


def host_groups(tier: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """The host's groups, as bit masks over positions: the whole host, then recursively the parts
    it falls into. A group whose pairs are all alike (one NVSwitch socket) has no parts. Otherwise
    its parts are the connected components of its pairs better than its weakest pair (sockets,
    boards, PCIe switches); when that leaves it whole (DGX-1's cube mesh, where NV2 links cross the
    sockets), it is halved where the halves' slowest pair, then their total, is best (DGX-1's two
    NVLink quads, then inside a quad the two NV2 pairs that leave no NV1 pair behind)."""
    n = len(tier)
    out: list[int] = []

    def visit(group: list[int]) -> None:
        if len(group) < 2:
            return
        out.append(sum(1 << p for p in group))
        for part in _parts(tier, group):
            visit(part)

    visit(list(range(n)))
    return tuple(out)


def _parts(tier: tuple[tuple[int, ...], ...], group: list[int]) -> list[list[int]]:
    values = [tier[a][b] for i, a in enumerate(group) for b in group[i + 1 :]]
    low = min(values)
    if low == max(values):
        return []
    # Connected components of the pairs better than the weakest.
    parts: list[list[int]] = []
    seen: set[int] = set()
    for start in group:
        if start in seen:
            continue
        comp, stack = [], [start]
        seen.add(start)
        while stack:
            a = stack.pop()
            comp.append(a)
            for b in group:
                if b not in seen and tier[a][b] > low:
                    seen.add(b)
                    stack.append(b)
        parts.append(sorted(comp))
    if len(parts) > 1:
        return parts
    return _bisect(tier, group)


def _bisect(tier: tuple[tuple[int, ...], ...], group: list[int]) -> list[list[int]]:
    def quality(half: list[int]) -> tuple[int, int]:
        lo, total = None, 0
        for i, a in enumerate(half):
            for b in half[i + 1 :]:
                t = tier[a][b]
                total += t
                lo = t if lo is None or t < lo else lo
        return (lo if lo is not None else 10**9), total

    size = len(group) // 2
    first, rest = group[0], group[1:]
    if len(group) <= EXACT_BISECTION_MAX:
        best_key, best = None, None
        # ``first`` stays in the larger (or, for even groups, the first) half: each split once.
        for mates in itertools.combinations(rest, len(group) - size - 1):
            a = [first, *mates]
            b = [p for p in rest if p not in mates]
            (la, sa), (lb, sb) = quality(a), quality(b)
            key = (min(la, lb), sa + sb)
            if best_key is None or key > best_key:
                best_key, best = key, (a, b)
        assert best is not None
        return [sorted(best[0]), sorted(best[1])]
    # Large group with no natural split: grow one half from its first GPU, best-linked first.
    half = [first]
    pool = list(rest)
    while len(half) < len(group) - size:
        c = max(pool, key=lambda c: (min(tier[c][h] for h in half), sum(tier[c][h] for h in half), -c))
        half.append(c)
        pool.remove(c)
    return [sorted(half), sorted(pool)]


@dataclass(frozen=True)
class SearchLimits:
    """The search's work budget, counted in candidates examined (never in seconds, so the
    same input gives the same answer at any load and on any machine). When the budget runs out the
    best set found so far (never worse than the greedy start) is returned with ``exact=False``.

    The default is chosen so that the worst decision measured on the shipped hosts and on 16- and
    32-GPU hosts stays under the decision-time goal (docs/allocator.md, "Search budget")."""

    max_candidates: int = DEFAULT_MAX_CANDIDATES


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


# ---- the topology search -------------------------------------------------------------------------
#
# Objective (docs/allocator.md has the cases behind each rule), for the resulting set S = held +
# chosen out of the free GPUs F, compared in this order:
#   1. the slowest pair's tier, highest first (a ring collective runs at its slowest link:
#      nccl-tests #178); a tier is the pair score up to the stated tolerance (pair_tier);
#   2. the sum of pair tiers;
#   3. fewer NUMA nodes;
#   4. look-ahead: what the choice breaks of the host's groups that are wholly free in F, the
#      largest groups first (keep whole sockets, NVSwitch partitions, NVLink quads and the pairs
#      inside them; take from groups already broken);
#   5. the slowest pair's exact score, then the exact sum (go-gpuallocator's score);
#   6. take the GPUs least connected to the rest of F (the sum of their scores into F, lowest);
#   7. the lowest minors (the sorted tuple, smallest first): the stated tie rule.
# Search: the best slowest tier is found by trying tier thresholds from the top down and asking for a
# set whose pairs all reach it (a clique); within the first threshold that has one, a depth-first
# branch and bound maximises rules 2-7 together. Every bound is a true upper bound, so the search
# is exact when it finishes. It counts its work in candidates examined (each partial set costs one
# plus the GPUs it may still grow by); when the count passes the budget it returns the best set
# found so far (never worse than the greedy start) with exact=False. Nothing reads a clock.


@dataclass
class _Found:
    chosen: tuple[int, ...]
    exact: bool
    work: int


class _Stop(Exception):
    pass


def _topology_search(fabric: Fabric, fixed: list[int], cands: list[int], k: int, limits: SearchLimits) -> _Found:
    if k == len(cands):
        return _Found(tuple(cands), True, 0)
    search = _Search(fabric, fixed, cands, k, limits.max_candidates)
    return search.run()


class _Search:
    def __init__(self, fabric: Fabric, fixed: list[int], cands: list[int], k: int, max_candidates: int) -> None:
        self.score = fabric.score
        self.tier = fabric.tier
        self.fixed = fixed
        self.cands = cands
        self.k = k
        self.max_candidates = max_candidates
        self.work = 0
        free = 0
        for c in cands:
            free |= 1 << c
        # Groups wholly free now, and for each candidate the ones it would break (by size rank).
        sizes = sorted({g.bit_count() for g in fabric.groups}, reverse=True)
        rank = {s: i for i, s in enumerate(sizes)}
        self.n_ranks = len(sizes)
        intact = {i for i, g in enumerate(fabric.groups) if g & ~free == 0}
        self.breaks = {
            c: tuple((i, rank[fabric.groups[i].bit_count()]) for i in fabric.ancestors[c] if i in intact) for c in cands
        }
        # NUMA nodes as bits (None is no node).
        ids = {v: i for i, v in enumerate(sorted({x for x in fabric.numa if x is not None}))}
        self.numa_bit = [0 if x is None else 1 << ids[x] for x in fabric.numa]
        self.fixed_numa = 0
        for f in fixed:
            self.fixed_numa |= self.numa_bit[f]
        # Each candidate's exact scores into the other candidates: its row sum less what goes to GPUs
        # that are not candidates (few, on a mostly free host).
        others = [d for d in range(len(fabric.minors)) if not free >> d & 1]
        self.deg = {c: fabric.row_sum[c] - sum(self.score[c][d] for d in others) for c in cands}
        self.max_gap = fabric.max_gap
        self.members = fabric.members
        self.fixed_sum = sum(self.score[a][b] for i, a in enumerate(fixed) for b in fixed[i + 1 :])
        self.fixed_tsum = sum(self.tier[a][b] for i, a in enumerate(fixed) for b in fixed[i + 1 :])
        self.fixed_min = min((self.score[a][b] for i, a in enumerate(fixed) for b in fixed[i + 1 :]), default=None)
        self.fixed_tmin = min((self.tier[a][b] for i, a in enumerate(fixed) for b in fixed[i + 1 :]), default=None)
        self.best_key: tuple[int, ...] | None = None
        # Set by the first offer (run() always offers the greedy set first), and by each threshold's
        # search before its first node.
        self.best_set: tuple[int, ...]
        self._t: int
        self._open: bool
        # Every GPU's partners by tier, best first, for the bound (masked by the pool where used).
        self.by_tier = fabric.by_tier
        # Interchangeable candidates (the search's symmetry rule): for each, the lower ones it can
        # be swapped with without changing any rule's value.
        self.lower = fabric.twins
        # The mirrors this request leaves intact: both halves' free and held GPUs map onto each other.
        free_set, held_set = set(cands), set(fixed)
        self.mirrors = [
            m
            for m in fabric.mirrors
            if all((a in free_set) == (b in free_set) and (a in held_set) == (b in held_set) for a, b in m)
        ]

    # -- the complete key of a set (rules 1-6; rule 7 is the set itself) --

    def key(self, chosen: tuple[int, ...]) -> tuple[int, ...]:
        members = [*self.fixed, *chosen]
        tmin, tsum, rmin, rsum = None, 0, None, 0
        for i, a in enumerate(members):
            for b in members[i + 1 :]:
                t, r = self.tier[a][b], self.score[a][b]
                tsum += t
                rsum += r
                tmin = t if tmin is None or t < tmin else tmin
                rmin = r if rmin is None or r < rmin else rmin
        numa = self.fixed_numa
        dmg = [0] * self.n_ranks
        broken: set[int] = set()
        for c in chosen:
            numa |= self.numa_bit[c]
            for g, r in self.breaks[c]:
                if g not in broken:
                    broken.add(g)
                    dmg[r] += 1
        return (
            NO_PAIRS if tmin is None else tmin,
            tsum,
            -numa.bit_count(),
            *(-d for d in dmg),
            NO_PAIRS if rmin is None else rmin,
            rsum,
            -sum(self.deg[c] for c in chosen),
        )

    def offer(self, chosen: tuple[int, ...]) -> None:
        key = self.key(chosen)
        if self.best_key is None or key > self.best_key or (key == self.best_key and chosen < self.best_set):
            self.best_key, self.best_set = key, chosen

    def run(self) -> _Found:
        greedy = _greedy(self.tier, self.fixed, self.cands, self.k)
        self.offer(greedy)
        if len(self.cands) > self.k and len(self.fixed) + self.k >= 2:
            # More starts: the greedy set inside each smallest group that still holds enough free
            # GPUs (on structured hosts the answer is usually there, and a good start prunes most).
            free = set(self.cands)
            counts = [(len(free.intersection(self.members[i])), i) for i in range(len(self.members))]
            fits = [c for c in counts if self.k <= c[0] < len(self.cands)]
            if fits:
                smallest = min(c[0] for c in fits)
                for count, i in fits:
                    if count == smallest:
                        inside = sorted(free.intersection(self.members[i]))
                        self.offer(_greedy(self.tier, self.fixed, inside, self.k))
        if len(self.fixed) + self.k < 2:
            # One GPU, nothing held: no pairs; rules 3, 4, 6 and 7 decide, over every candidate.
            for c in self.cands:
                self.offer((c,))
            return _Found(self.best_set, True, len(self.cands))
        assert self.best_key is not None
        floor = self.best_key[0]
        values = {self.tier[a][b] for a in self.cands for b in (*self.fixed, *self.cands) if a != b}
        thresholds = sorted((v for v in values if v >= floor), reverse=True)
        if self.fixed_tmin is not None:
            thresholds = [t for t in thresholds if t <= self.fixed_tmin]
        exact = True
        try:
            for t in thresholds:
                if self._clique_search(t):
                    break
        except _Stop:
            exact = False
        return _Found(self.best_set, exact, self.work)

    # -- branch and bound over the sets whose pairs all reach tier t --

    def _clique_search(self, t: int) -> bool:
        """Search the sets of slowest tier >= t; True when one was found (then it is the answer)."""
        tier = self.tier
        pool = [c for c in self.cands if all(tier[c][f] >= t for f in self.fixed)]
        if len(pool) < self.k:
            return False
        # A member of such a set pairs at t or better with k-1 others of the pool: drop those that
        # cannot, until none is left to drop (then too few left means no such set).
        while True:
            inpool = _bits(pool)
            partners = [self._partners(c, t, inpool) for c in pool]
            keep = [c for i, c in enumerate(pool) if partners[i] >= self.k - 1]
            if len(keep) < self.k:
                return False
            if len(keep) == len(pool):
                break
            pool = keep
        # When every pair of the pool reaches t, no branch needs the threshold filter.
        self._open = min(partners) == len(pool) - 1
        gains = {c: sum(tier[c][f] for f in self.fixed) for c in pool}
        raw_gains = {c: sum(self.score[c][f] for f in self.fixed) for c in pool}
        self._t = t
        self._dfs(
            [], pool, gains, raw_gains, self.fixed_tsum, self.fixed_sum, self.fixed_min, self.fixed_numa, 0,
            [0] * self.n_ranks, 0,
        )  # fmt: skip
        assert self.best_key is not None
        return self.best_key[0] >= t

    def _partners(self, c: int, t: int, inpool: int) -> int:
        """How many GPUs of the pool (a bit mask) pair with ``c`` at tier ``t`` or better."""
        mask = 0
        for value, members in self.by_tier[c]:
            if value < t:
                break
            mask |= members
        return (mask & inpool).bit_count()

    def _dfs(
        self,
        chosen: list[int],
        pool: list[int],
        gains: dict[int, int],
        raw_gains: dict[int, int],
        tsum: int,
        rsum: int,
        rmin: int | None,
        numa: int,
        broken: int,
        dmg: list[int],
        degsum: int,
    ) -> None:
        # Work is counted in candidates examined: a partial set costs one plus the GPUs it may grow by.
        self.work += 1 + len(pool)
        if self.work > self.max_candidates:
            raise _Stop
        left = self.k - len(chosen)  # at least 1: the last pick completes sets without a node of its own
        if self.mirrors and self._mirrored(chosen, pool):
            return
        tier = self.tier
        if len(pool) == left:
            # One completion (its key says whether its pairs reach the threshold; one below it
            # cannot displace a set that does).
            self.offer(tuple(sorted([*chosen, *pool])))
            return
        if len(pool) == left + 1:
            self._leave_one_out(chosen, pool, gains, tsum)
            return
        # Potential of each candidate: twice its gain plus its best left-1 tiers into the pool
        # (each pair among later picks is shared by two picks, hence the halving below).
        inpool = _bits(pool)
        potential = {}
        for c in pool:
            top, want = 0, left - 1
            if want:
                for value, mask in self.by_tier[c]:
                    count = (mask & inpool).bit_count()
                    if count >= want:
                        top += want * value
                        break
                    top += count * value
                    want -= count
            potential[c] = 2 * gains[c] + top
        # Most promising first, so that good sets are found early and bound the rest.
        order = sorted(pool, key=lambda c: (-potential[c], c))
        members = len(self.fixed) + len(chosen)
        new_pairs = left * members + left * (left - 1) // 2
        # The incumbent only bounds this threshold once it reaches it (the greedy start may not).
        best = self.best_key if self.best_key is not None and self.best_key[0] >= self._t else None
        t = self._t
        if left == 1:
            # The last pick: each candidate completes a set; no partial set to grow.
            passed: set[int] = set()
            for c in order:
                if self.lower[c] and not passed.isdisjoint(self.lower[c]):
                    continue  # a lower interchangeable GPU was left out: a mirror of a set seen
                passed.add(c)
                bound = tsum + gains[c]
                if best is not None:
                    if bound < best[1]:
                        break  # ``order`` runs by gain here (potential = 2 * gain)
                    if bound == best[1] and not self._may_tie(
                        chosen, c, [], 1, numa, broken, dmg, rmin, rsum, degsum, tsum, bound, new_pairs
                    ):
                        continue
                self.offer(tuple(sorted([*chosen, c])))
                best = self.best_key if self.best_key is not None and self.best_key[0] >= t else None
            return
        # Prefix sums of the potentials in ``order``: the bound of child i without the tier filter,
        # which never grows with i, so once it falls below the best no later child can reach it.
        acc = [0, *itertools.accumulate(potential[c] for c in order)]
        for i, c in enumerate(order):
            rest = order[i + 1 :]
            if len(rest) < left - 1:
                break
            if best is not None and tsum + (acc[i + left] - acc[i]) // 2 < best[1]:
                break
            if self.lower[c] and not self.lower[c].isdisjoint(order[:i]):
                continue  # a lower interchangeable GPU is left out here: a mirror of a set seen
            row = tier[c]
            if self._open:
                nxt = rest
                bound = tsum + (acc[i + left] - acc[i]) // 2
            else:
                nxt = [r for r in rest if row[r] >= t]
                if len(nxt) < left - 1:
                    continue
                # ``order`` runs by potential, highest first, so nxt's best left-1 come first.
                bound = tsum + (potential[c] + sum([potential[r] for r in nxt[: left - 1]])) // 2
            if best is not None:
                if bound < best[1]:
                    continue
                if bound == best[1] and not self._may_tie(
                    chosen, c, nxt, left, numa, broken, dmg, rmin, rsum, degsum, tsum, bound, new_pairs
                ):
                    continue
            # Extend.
            cbroken, cdmg = broken, dmg
            for g, r in self.breaks[c]:
                if not cbroken >> g & 1:
                    if cdmg is dmg:
                        cdmg = list(dmg)
                    cbroken |= 1 << g
                    cdmg[r] += 1
            srow = self.score[c]
            crmin = rmin
            for m in (*self.fixed, *chosen):
                v = srow[m]
                crmin = v if crmin is None or v < crmin else crmin
            chosen.append(c)
            self._dfs(
                chosen,
                nxt,
                {r: gains[r] + row[r] for r in nxt},
                {r: raw_gains[r] + srow[r] for r in nxt},
                tsum + gains[c],
                rsum + raw_gains[c],
                crmin,
                numa | self.numa_bit[c],
                cbroken,
                cdmg,
                degsum + self.deg[c],
            )
            chosen.pop()
            best = self.best_key if self.best_key is not None and self.best_key[0] >= t else None

    def _mirrored(self, chosen: list[int], pool: list[int]) -> bool:
        """True when every set below this node is the mirror image of a lower one (so not the
        answer, by rule 7): for some mirror, at the lowest GPU whose membership differs from its
        image's, this node has already left that GPU out and taken its image."""
        taken, open_ = set(chosen), set(pool)
        for swap in self.mirrors:
            for a, b in swap:
                if a in open_ or b in open_:
                    break  # undecided here: this mirror cannot rule the node out
                if (a in taken) != (b in taken):
                    if b in taken:
                        return True
                    break
        return False

    def _leave_one_out(self, chosen: list[int], pool: list[int], gains: dict[int, int], tsum: int) -> None:
        """The completions of ``chosen`` by all of ``pool`` but one GPU, tried exactly: a completion's
        tier sum is the pool's whole sum less what the left-out GPU takes with it. Those whose pairs
        all reach the threshold and whose sum is the best go to ``offer`` for rules 3-7."""
        tier = self.tier
        t = self._t
        whole = tsum + sum(gains.values())
        outs = set(pool)
        for i, a in enumerate(pool):
            row = tier[a]
            for b in pool[i + 1 :]:
                whole += row[b]
                if row[b] < t:
                    # Only a GPU on every pair below the threshold may be the one left out.
                    outs &= {a, b}
        self.work += len(outs)
        top, sets = None, []
        for x in outs:
            value = whole - gains[x] - sum(tier[x][p] for p in pool)
            if top is None or value > top:
                top, sets = value, [x]
            elif value == top:
                sets.append(x)
        if top is None or (self.best_key is not None and self.best_key[0] >= t and top < self.best_key[1]):
            return
        for x in sets:
            self.offer(tuple(sorted([*chosen, *(p for p in pool if p != x)])))

    def _may_tie(
        self,
        chosen: list[int],
        c: int,
        nxt: list[int],
        left: int,
        numa: int,
        broken: int,
        dmg: list[int],
        rmin: int | None,
        rsum: int,
        degsum: int,
        tsum: int,
        bound: int,
        new_pairs: int,
    ) -> bool:
        """With the tier sum at most equal to the best, can this branch still beat the best on the
        later rules? Each bound below is optimistic, so False proves it cannot."""
        best = self.best_key
        assert best is not None
        numa_c = (numa | self.numa_bit[c]).bit_count()
        cdmg = list(dmg)
        for g, r in self.breaks[c]:
            if not broken >> g & 1:
                cdmg[r] += 1
        srow = self.score[c]
        crmin = rmin
        for m in (*self.fixed, *chosen):
            v = srow[m]
            crmin = v if crmin is None or v < crmin else crmin
        rest_degs = sorted(self.deg[r] for r in nxt)[: left - 1]
        ub = (
            bound,
            -numa_c,
            *(-d for d in cdmg),
            # The slowest pair is at most any pair of the set, e.g. c with its best next partner.
            (max(srow[r] for r in nxt) if crmin is None else crmin),
            rsum + (bound - tsum) + self.max_gap * new_pairs,
            -(degsum + self.deg[c] + sum(rest_degs)),
        )
        rest = best[1:]
        if ub < rest:
            return False
        if ub > rest:
            return True
        # Equal at best: only a lexicographically smaller set could win (rule 7).
        smallest = tuple(sorted([*chosen, c, *sorted(nxt)[: left - 1]]))
        return smallest < self.best_set


def _twins(
    score: list[list[int]], tier: list[list[int]], numa: Sequence[int | None], groups: tuple[int, ...]
) -> tuple[frozenset[int], ...]:
    """For each position, the lower positions interchangeable with it: the same tier and exact score
    to every other GPU, the same NUMA node and the same groups. Swapping two such GPUs in a set
    changes no rule's value, so the best set holds the lowest free members of each class (rule 7),
    and a set that holds one but leaves out a lower free one need not be searched. The relation is
    transitive (equal rows outside the pair make the pair's own entries equal too), so each class
    is checked against its first member only."""
    n = len(score)
    classes: list[list[int]] = []
    for c in range(n):
        mine = tuple(g >> c & 1 for g in groups)
        for cls in classes:
            a = cls[0]
            if (
                numa[a] == numa[c]
                and tuple(g >> a & 1 for g in groups) == mine
                and all(tier[a][x] == tier[c][x] and score[a][x] == score[c][x] for x in range(n) if x != a and x != c)
            ):
                cls.append(c)
                break
        else:
            classes.append([c])
    lower: list[frozenset[int]] = [frozenset()] * n
    for cls in classes:
        for c in cls:
            lower[c] = frozenset(x for x in cls if x < c)
    return tuple(lower)


def _mirrors(
    score: list[list[int]],
    tier: list[list[int]],
    numa: Sequence[int | None],
    groups: tuple[int, ...],
    members: tuple[tuple[int, ...], ...],
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Sibling groups that the host maps onto each other: for a group whose parts are exactly two of
    the same size, the swap of the parts in minor order (i-th onto i-th), kept when it preserves
    every pair's tier and exact score, which GPUs share a NUMA node and the set of groups. Such a
    swap changes no rule's value of a set whose free and held GPUs it maps onto themselves, so the
    best set is never above its image in rule 7's order."""
    n = len(score)
    out = []
    for whole in members:
        parts = [m for m in members if set(m) < set(whole) and not any(set(m) < set(o) < set(whole) for o in members)]
        if len(parts) != 2 or len(parts[0]) != len(parts[1]):
            continue
        image = list(range(n))
        for i, a in enumerate(parts[0]):
            b = parts[1][i]
            image[a], image[b] = b, a
        if any(
            tier[image[x]][image[y]] != tier[x][y]
            or score[image[x]][image[y]] != score[x][y]
            or (numa[image[x]] == numa[image[y]]) != (numa[x] == numa[y])
            for x in range(n)
            for y in range(n)
        ):
            continue
        if {_bits(image[p] for p in m) for m in members} != set(groups):
            continue
        pairs = sorted({(min(p, image[p]), max(p, image[p])) for p in range(n) if image[p] != p})
        out.append(tuple(pairs))
    return tuple(out)


def _bits(positions: Iterable[int]) -> int:
    """A set of positions as a bit mask (bit ``c`` set for each position ``c``)."""
    mask = 0
    for c in positions:
        mask |= 1 << c
    return mask


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
    # Each candidate's weakest and total link to the members so far, kept up to date as they grow.
    members = [*fixed, *chosen]
    weakest = {c: min(score[c][m] for m in members) for c in pool}
    total = {c: sum(score[c][m] for m in members) for c in pool}
    while len(chosen) < k:
        c = max(pool, key=lambda c: (weakest[c], total[c], -c))
        chosen.append(c)
        pool.remove(c)
        row = score[c]
        for d in pool:
            weakest[d] = min(weakest[d], row[d])
            total[d] += row[d]
    return tuple(sorted(chosen))


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

    def plan_update(self, holding: Iterable[int], target: object) -> UpdatePlan:
        """Plan a grow or shrink for a container holding ``holding``; books nothing. Every held GPU
        must be on this host (UnknownGpus) and allocated (GpusNotAllocated)."""
        held = self._check_held(holding)
        try:
            return plan_update(self.fabric, held, self.available, target, self.policy, limits=self.limits)
        except GpusExhausted as exc:
            note = self._maintenance_note()
            if not note:
                raise
            raise GpusExhausted(exc.message + note, **exc.fields) from None
