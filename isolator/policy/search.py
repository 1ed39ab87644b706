"""The topology search: the best set of GPUs for a request on a fabric, by the objective below, within
a work budget counted in candidates (never in seconds). Pure and deterministic.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from isolator.policy.fabric import NO_PAIRS, Fabric, _bits

# The search budget in expanded partial sets (SearchLimits); see docs/allocator.md, "Search budget".
DEFAULT_MAX_CANDIDATES = 2_500

# A partial set that will take all of its pool but at most FINISH_DROP GPUs, in at most FINISH_MAX
# ways, is finished by trying each way (exact tier sums, no bound needed).
FINISH_DROP = 3
FINISH_MAX = 120


@dataclass(frozen=True)
class SearchLimits:
    """The search's work budget, counted in candidates examined (never in seconds, so the
    same input gives the same answer at any load and on any machine). When the budget runs out the
    best set found so far (never worse than the greedy start) is returned with ``exact=False``.

    The default is chosen so that the worst decision measured on the shipped hosts and on 16- and
    32-GPU hosts stays under the decision-time goal (docs/allocator.md, "Search budget")."""

    max_candidates: int = DEFAULT_MAX_CANDIDATES


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
