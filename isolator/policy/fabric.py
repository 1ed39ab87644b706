"""The GPUs' fabric: how well each pair of GPUs is connected (go-gpuallocator's scores, and the tiers
the search compares), the host's groups (sockets, NVSwitch partitions, NVLink quads) and its
symmetries. Pure: a Topology in, plain data out.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from isolator.errors import InvalidTopology
from isolator.model import Link, PcieLevel, Topology

LOG = logging.getLogger(__name__)

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
