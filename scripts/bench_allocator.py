#!/usr/bin/env python3
"""The allocation policies side by side on a fixed-seed stream of requests per shipped simulated host.

Policies: `first-fit` (Mesos), a go-gpuallocator-style partition baseline written here from the
description in reference/k8s-topology.md §1.4 (a baseline only, not a product feature), and
`topology`. Hosts come from isolator/simhost/hosts/*.toml through the real inventory path (the
simulated host's fake NVML read by isolator.gpu.nvml.Inventory). Part of `make bench` (scripts/bench.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from isolator.model import Holding, Link, Topology  # noqa: E402
from isolator.policy.allocator import FIRST_FIT, TOPOLOGY, Fabric, choose  # noqa: E402
from isolator.simhost.host import HostSpec  # noqa: E402

SIZES = (1, 2, 4, 8)
SIZE_WEIGHTS = (0.4, 0.3, 0.2, 0.1)
PARTITION = "partition"
POLICY_NAMES = (FIRST_FIT, PARTITION, TOPOLOGY)

Policy = Callable[[frozenset[int], int], tuple[int, ...]]


# ---- the request stream ------------------------------------------------------------------------


def make_stream(n_gpus: int, seed: int, requests: int) -> list[tuple[str, int, int]]:
    """Events ('arrive', job, size) and ('depart', job, 0). The generator never lets the sizes of
    live jobs exceed the host, so a policy that refuses a request did so while enough GPUs were free."""
    rng = random.Random(seed)
    sizes = [s for s in SIZES if s <= n_gpus]
    weights = SIZE_WEIGHTS[: len(sizes)]
    live: dict[int, int] = {}
    events: list[tuple[str, int, int]] = []
    job = 0
    while job < requests:
        size = rng.choices(sizes, weights)[0]
        if live and (rng.random() < 0.4 or sum(live.values()) + size > n_gpus):
            gone = rng.choice(sorted(live))
            events.append(("depart", gone, 0))
            del live[gone]
            continue
        events.append(("arrive", job, size))
        live[job] = size
        job += 1
    return events


# ---- the partition baseline (go-gpuallocator's best effort, §1.4, as described) --------------------


def switch_blind(topology: Topology) -> Topology:
    """go-gpuallocator counts NVLinks only when the remote end is the peer GPU (D1), so on NVSwitch
    hosts it sees none. Without a host description, a host whose every pair has the same non-zero
    lane count is taken to be a switch fabric and loses its lanes for the baseline (with one,
    ``direct_lanes_only`` says exactly what the baseline sees)."""
    lanes = {link.nvlink_lanes for link in topology.links.values()}
    if len(lanes) == 1 and lanes != {0} and len(topology.gpus) > 2:
        return replace(topology, links={k: Link(v.pcie, 0) for k, v in topology.links.items()})
    return topology


class PartitionBaseline:
    """Split all available GPUs into groups of the requested size (the remainder as one padded group),
    keep the split with the highest total, return its best group. Size 1 takes the lowest index.
    Like the original it may return the padded group (D2): the request then comes back short.

    The exhaustive enumeration explodes on 16 GPUs (§1.5), so this uses the bitmask DP over "lowest
    free GPU + its group-mates", which has the same optimum, memoised per host and size across calls.
    """

    def __init__(self, topology: Topology, view: Topology | None = None) -> None:
        """``view``: the topology as go-gpuallocator sees it (default ``switch_blind(topology)``)."""
        self.fabric = Fabric.of(view if view is not None else switch_blind(topology))
        self.memo: dict[tuple[int, int, int], tuple[int, tuple[tuple[int, ...], ...]]] = {}

    def __call__(self, available: frozenset[int], size: int) -> tuple[int, ...]:
        free = sorted(available)
        if size <= 0 or len(free) < size:
            return ()
        if size == 1:
            return (free[0],)
        if size == len(free):
            return tuple(free)
        mask = sum(1 << m for m in free)
        short = len(free) % size
        _, groups = self._best(mask, size, short)
        best = max(groups, key=lambda grp: (self.fabric.set_score(grp)[0], [-m for m in grp]))
        return best  # may be the short (padded) group

    def _best(self, mask: int, size: int, short: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
        """Best partition of `mask` into groups of `size` plus, when `short` > 0, one group of `short`."""
        key = (mask, size, short)
        if key in self.memo:
            return self.memo[key]
        if mask == 0:
            return 0, ()
        members = [m for m in range(mask.bit_length()) if mask >> m & 1]
        first, rest = members[0], members[1:]
        best: tuple[int, tuple[tuple[int, ...], ...]] = (-1, ())
        options = [size] if len(members) - size >= short else []
        if short:
            options.append(short)
        for group_size in options:
            for mates in itertools.combinations(rest, group_size - 1):
                group = (first, *mates)
                left = mask & ~sum(1 << m for m in group)
                sub_total, sub_groups = self._best(left, size, 0 if group_size == short else short)
                total = sub_total + self.fabric.set_score(group)[0]
                if sub_total >= 0 and total > best[0]:
                    best = (total, (group, *sub_groups))
        self.memo[key] = best
        return best


def direct_lanes_only(topology: Topology, spec: HostSpec) -> Topology:
    """What go-gpuallocator sees (D1): lanes only where the remote end of a link is the peer GPU,
    as both ends report them; lanes through NVSwitches are invisible to it."""
    by_minor = {g.minor: g for g in spec.gpus}
    by_index = {g.index: g for g in spec.gpus}
    links = {}
    for (a, b), link in topology.links.items():
        ga, gb = by_minor[a], by_minor[b]
        lanes = min(ga.nvlink.get(gb.index, 0), by_index[gb.index].nvlink.get(ga.index, 0))
        links[(a, b)] = Link(link.pcie, lanes)
    return replace(topology, links=links)


def shipped_topologies(work: str | None = None) -> tuple[dict[str, Topology], dict[str, Topology]]:
    """Every shipped simulated host as the sidecar sees it, and as the partition baseline sees it.

    The topology comes through the real inventory path: the host's fake NVML (built from its TOML)
    loaded by pynvml and read by isolator.gpu.nvml.Inventory, exactly as the daemon reads it.
    """
    from isolator.gpu.nvml import Inventory
    from isolator.simhost.host import shipped_hosts
    from isolator.simhost.sim import SimulatedHost

    own = work is None
    work = work or tempfile.mkdtemp(prefix="gi-bench-alloc-", dir="/tmp")
    topologies: dict[str, Topology] = {}
    views: dict[str, Topology] = {}
    try:
        for name in shipped_hosts():
            host = SimulatedHost(name, os.path.join(work, name)).setup(make_devices=False)
            inventory = Inventory(
                library=host.library_path, proc_root=host.proc_root, sys_root=os.path.join(host.root, "sys")
            )
            with inventory.open():
                inventory.read()
                topology = inventory.topology()
            topologies[name] = topology
            views[name] = direct_lanes_only(topology, host.spec)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return topologies, views


# ---- the oracle: the best set available at each moment ---------------------------------------------


class Oracle:
    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.sets: dict[int, list[tuple[int, int, int]]] = {}
        for size in SIZES:
            if 2 <= size <= len(fabric.minors):
                rows = []
                for combo in itertools.combinations(fabric.minors, size):
                    total, slowest = fabric.set_score(combo)
                    rows.append((sum(1 << m for m in combo), total, slowest))
                self.sets[size] = rows

    def best(self, available: frozenset[int], size: int) -> tuple[int, int]:
        """(best sum, best slowest link) over the sets of `size` within `available`."""
        mask = sum(1 << m for m in available)
        fits = [(t, s) for (m, t, s) in self.sets[size] if m & mask == m]
        return max(t for t, _ in fits), max(s for _, s in fits)

    def remaining(self, free: frozenset[int]) -> int:
        return self.fabric.set_score(free)[0]


# ---- the run -------------------------------------------------------------------------------------


def _policies(topology: Topology, fabric: Fabric, view: Topology | None) -> dict[str, Policy]:
    return {
        FIRST_FIT: lambda avail, n: choose(fabric, avail, n, FIRST_FIT).gpus,
        PARTITION: PartitionBaseline(topology, view),
        TOPOLOGY: lambda avail, n: choose(fabric, avail, n, TOPOLOGY).gpus,
    }


def run(
    topologies: dict[str, Topology],
    seed: int = 20240611,
    requests: int = 400,
    baseline_views: dict[str, Topology] | None = None,
) -> dict:
    """Per host and policy: quality relative to the best available set, refusals, decision times.

    ``baseline_views``: per host, the topology the partition baseline sees (default: switch_blind).
    """
    out: dict[str, dict] = {}
    for name, topology in topologies.items():
        fabric = Fabric.of(topology)
        oracle = Oracle(fabric)
        events = make_stream(len(fabric.minors), seed, requests)
        out[name] = {"gpus": len(fabric.minors)}
        view = (baseline_views or {}).get(name)
        for policy_name, policy in _policies(topology, fabric, view).items():
            out[name][policy_name] = _simulate(fabric, oracle, events, policy)
    return out


def _simulate(fabric: Fabric, oracle: Oracle, events: list[tuple[str, int, int]], policy: Policy) -> dict:
    free = frozenset(fabric.minors)
    held: dict[int, tuple[int, ...]] = {}
    times: list[float] = []
    rel_score: list[float] = []
    rel_link: list[float] = []
    best_both = 0
    abs_score: list[int] = []
    abs_link: list[int] = []
    single_left: list[float] = []
    refused = granted_multi = arrivals = 0
    for kind, job, size in events:
        if kind == "depart":
            free |= frozenset(held.pop(job, ()))
            continue
        arrivals += 1
        start = time.perf_counter()
        try:
            got = policy(free, size)
        except Exception:
            got = ()
        times.append(time.perf_counter() - start)
        if len(got) != size or len(set(got)) != size or not set(got) <= free:
            refused += 1  # the stream guarantees enough free GPUs for every request
            continue
        if size == 1:
            possible = max(oracle.remaining(free - {m}) for m in free)
            single_left.append(oracle.remaining(free - set(got)) / possible if possible else 1.0)
        else:
            best_total, best_slowest = oracle.best(free, size)
            total, slowest = fabric.set_score(got)
            rel_score.append(total / best_total)
            rel_link.append(slowest / best_slowest)
            best_both += total == best_total and slowest == best_slowest
            abs_score.append(total)
            abs_link.append(slowest)
            granted_multi += 1
        held[job] = tuple(got)
        free -= frozenset(got)

    def mean(xs: list[float] | list[int]) -> float | None:
        return round(statistics.fmean(xs), 4) if xs else None

    ms = sorted(t * 1000 for t in times)
    return {
        "requests": arrivals,
        "refused_while_free": refused,
        "rel_score": mean(rel_score),
        "rel_slowest_link": mean(rel_link),
        "share_best": round(best_both / granted_multi, 4) if granted_multi else None,
        "mean_score": mean(abs_score),
        "mean_slowest_link": mean(abs_link),
        "single_rel_leftover": mean(single_left),
        "p50_ms": round(ms[len(ms) // 2], 3) if ms else None,
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3) if ms else None,
    }


# ---- the stream scenario (issue 19): mixes of sizes, what each policy leaves for later -------------

# Sizes per host size: 1/2/4 and 2/4 on hosts of up to 8 GPUs, 1/2/4/8 on 16.
STREAM_MIXES = {4: ((1, 2, 4), (2, 4)), 8: ((1, 2, 4), (2, 4)), 16: ((1, 2, 4, 8),)}


def stream_topologies(topologies: dict[str, Topology], views: dict[str, Topology] | None = None):
    """The hosts of the stream scenario: the shipped multi-GPU hosts plus a 16-GPU host of two
    DGX-1 boards (tests/topologies.py: joined_dgx1), whose baseline view is the topology itself."""
    from topologies import joined_dgx1

    hosts = {k: v for k, v in topologies.items() if len(v.gpus) > 1}
    hosts["dgx-1x2"] = joined_dgx1(2)
    seen = dict(views or {})
    seen.setdefault("dgx-1x2", hosts["dgx-1x2"])
    return hosts, seen


def make_mix_stream(n_gpus: int, sizes: tuple[int, ...], seed: int, arrivals: int) -> list[tuple[str, int, int]]:
    """Sizes drawn uniformly from ``sizes``; a live job departs with probability 1/2 or when the
    next size does not fit, so every arrival fits in the free GPUs."""
    rng = random.Random(seed)
    live: dict[int, int] = {}
    events: list[tuple[str, int, int]] = []
    job = 0
    size = rng.choice(sizes)
    while job < arrivals:
        if live and (rng.random() < 0.5 or sum(live.values()) + size > n_gpus):
            gone = rng.choice(sorted(live))
            events.append(("depart", gone, 0))
            del live[gone]
            continue
        events.append(("arrive", job, size))
        live[job] = size
        job += 1
        size = rng.choice(sizes)
    return events


def nvlink_quads(topology: Topology) -> list[int]:
    """Every 4-set of minors whose six pairs all have NVLink lanes, as bit masks."""
    minor = {g.index: g.minor for g in topology.gpus}
    lanes = {}
    for (a, b), link in topology.links.items():
        if a in minor and b in minor:
            lanes[frozenset((minor[a], minor[b]))] = link.nvlink_lanes
    minors = sorted(minor.values())
    quads = []
    for quad in itertools.combinations(minors, 4):
        if all(lanes.get(frozenset(p), 0) > 0 for p in itertools.combinations(quad, 2)):
            quads.append(sum(1 << m for m in quad))
    return quads


def _raw_key(fabric: Fabric, got: tuple[int, ...]) -> tuple[int, int]:
    total, slowest = fabric.set_score(got)
    return slowest, total


def stream(
    topologies: dict[str, Topology],
    views: dict[str, Topology] | None = None,
    seed: int = 20240611,
    arrivals: int = 1000,
) -> dict:
    """Per host, mix and policy: at each arrival whether the best set for that size was still free,
    the share of all-NVLink quads free at size-4 arrivals, the quality of the chosen set relative to
    the best set free at that moment, and (topology) how often its set was worse now than the
    partition baseline's on the same free GPUs, by exact score and by tier."""
    hosts, seen = stream_topologies(topologies, views)
    out: dict[str, dict] = {}
    for name, topology in hosts.items():
        fabric = Fabric.of(topology)
        n = len(fabric.minors)
        mixes = STREAM_MIXES.get(n)
        if not mixes:
            continue
        oracle = Oracle(fabric)
        quads = nvlink_quads(topology)
        best_empty = {s: oracle.best(frozenset(fabric.minors), s) for s in oracle.sets}
        out[name] = {"gpus": n, "nvlink_quads": len(quads)}
        for mix in mixes:
            events = make_mix_stream(n, mix, seed, arrivals)
            policies = _policies(topology, fabric, seen.get(name))
            baseline = policies[PARTITION]
            row = {}
            for policy_name, policy in policies.items():
                row[policy_name] = _stream_one(
                    fabric, oracle, quads, best_empty, events, policy, baseline if policy_name == TOPOLOGY else None
                )
            out[name]["/".join(map(str, mix))] = row
    return out


def _stream_one(fabric, oracle, quads, best_empty, events, policy, baseline) -> dict:
    free = frozenset(fabric.minors)
    held: dict[int, tuple[int, ...]] = {}
    best_free: list[int] = []
    quad_free: list[int] = []
    rel_score: list[float] = []
    rel_link: list[float] = []
    single_left: list[float] = []
    times: dict[int, list[float]] = {}
    worse_raw = worse_tier = compared = refused = 0
    for kind, job, size in events:
        if kind == "depart":
            free |= frozenset(held.pop(job, ()))
            continue
        mask = sum(1 << m for m in free)
        if size == 4 and quads:
            quad_free.append(any(q & mask == q for q in quads))
        if size >= 2:
            best_total, best_slowest = oracle.best(free, size)
            best_free.append((best_total, best_slowest) == best_empty[size])
        start = time.perf_counter()
        try:
            got = tuple(policy(free, size))
        except Exception:
            got = ()
        times.setdefault(size, []).append(time.perf_counter() - start)
        if len(got) != size or len(set(got)) != size or not set(got) <= free:
            refused += 1
            continue
        if size == 1:
            possible = max(oracle.remaining(free - {m}) for m in free)
            single_left.append(oracle.remaining(free - set(got)) / possible if possible else 1.0)
        else:
            total, slowest = fabric.set_score(got)
            rel_score.append(total / best_total)
            rel_link.append(slowest / best_slowest)
            if baseline is not None:
                theirs = tuple(baseline(free, size))
                if len(theirs) == size:
                    compared += 1
                    worse_raw += _raw_key(fabric, got) < _raw_key(fabric, theirs)
                    worse_tier += fabric.tier_score(got) < fabric.tier_score(theirs)
        held[job] = got
        free -= frozenset(got)

    def share(xs: list[int]) -> float | None:
        return round(sum(xs) / len(xs), 4) if xs else None

    def mean(xs: list[float]) -> float | None:
        return round(statistics.fmean(xs), 4) if xs else None

    def p99(xs: list[float]) -> float:
        ms = sorted(x * 1000 for x in xs)
        return round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3)

    everything = [t for ts in times.values() for t in ts]
    row = {
        "arrivals": sum(len(t) for t in times.values()),
        "refused_while_free": refused,
        "best_free": share(best_free),
        "quad_free_at_4": share(quad_free),
        "rel_score": mean(rel_score),
        "rel_slowest_link": mean(rel_link),
        "single_rel_leftover": mean(single_left),
        "p50_ms": round(sorted(everything)[len(everything) // 2] * 1000, 3) if everything else None,
        "p99_ms": p99(everything) if everything else None,
        "p99_ms_by_size": {s: p99(ts) for s, ts in sorted(times.items())},
    }
    if baseline is not None:
        row.update(compared_with_partition=compared, worse_than_partition=worse_raw, worse_tier=worse_tier)
    return row


STREAM_HEADERS = "policy      best.free quad@4  rel.sum rel.slow 1-GPU.left refused  p50 ms  p99 ms  worse(raw/tier)"


def stream_table(result: dict) -> str:
    lines = []
    for host, per in result.items():
        for mix, rows in per.items():
            if not isinstance(rows, dict):
                continue
            lines.append(f"\n{host} ({per['gpus']} GPUs, {per['nvlink_quads']} NVLink quads), sizes {mix}")
            lines.append("  " + STREAM_HEADERS)
            for policy in POLICY_NAMES:
                r = rows[policy]
                cells = [
                    policy.ljust(10),
                    *(
                        ("-" if r[k] is None else f"{r[k]:g}").rjust(w)
                        for k, w in (
                            ("best_free", 9),
                            ("quad_free_at_4", 7),
                            ("rel_score", 8),
                            ("rel_slowest_link", 8),
                            ("single_rel_leftover", 10),
                            ("refused_while_free", 7),
                            ("p50_ms", 7),
                            ("p99_ms", 7),
                        )
                    ),
                ]
                if "worse_than_partition" in r:
                    cells.append(f"{r['worse_than_partition']}/{r['worse_tier']} of {r['compared_with_partition']}")
                lines.append("  " + " ".join(cells))
    return "\n".join(lines)


# ---- single decisions: every fragmented pattern, and decision time on 16 and 32 GPUs ---------------


def fragmented(
    topologies: dict[str, Topology], views: dict[str, Topology] | None = None, samples: int = 300, seed: int = 7
) -> dict:
    """Per shipped host: every availability pattern (8 GPUs or fewer) or ``samples`` seeded ones
    (16), every size from 2 to one below the free count: how often topology's set is worse now than
    the partition baseline's (exact score; tier), and how often its search was cut by the budget."""
    rng = random.Random(seed)
    out = {}
    for name, topology in topologies.items():
        fabric = Fabric.of(topology)
        minors = fabric.minors
        if len(minors) < 3:
            continue
        base = PartitionBaseline(topology, (views or {}).get(name))
        if len(minors) <= 8:
            patterns = [frozenset(c) for r in range(3, len(minors) + 1) for c in itertools.combinations(minors, r)]
        else:
            patterns = [frozenset(m for m in minors if rng.random() < 0.7) for _ in range(samples)]
        worse_raw = worse_tier = cut = decisions = 0
        for free in patterns:
            for size in range(2, len(free)):
                ours = choose(fabric, free, size, TOPOLOGY)
                theirs = tuple(base(free, size))
                decisions += 1
                cut += not ours.exact
                if len(theirs) == size:
                    worse_raw += _raw_key(fabric, ours.gpus) < _raw_key(fabric, theirs)
                    worse_tier += fabric.tier_score(ours.gpus) < fabric.tier_score(theirs)
        out[name] = {"decisions": decisions, "worse_raw": worse_raw, "worse_tier": worse_tier, "budget_cut": cut}
    return out


def decision_times(patterns: int = 40, seed: int = 11) -> dict:
    """Decision time per request size on fragmented patterns of 16- and 32-GPU hosts (DGX-2, two
    and four DGX-1 boards): p50, p99, max in ms (wall) and p99, max of the thread's CPU time, the
    most work (candidates examined), and how many searches the budget cut (those return the best
    set found so far, deterministically)."""
    from topologies import dgx2, joined_dgx1

    rng = random.Random(seed)
    out = {}
    for name, topology in (("dgx-2", dgx2()), ("dgx-1x2", joined_dgx1(2)), ("dgx-1x4", joined_dgx1(4))):
        fabric = Fabric.of(topology)
        frees = [frozenset(fabric.minors)] + [
            frozenset(m for m in fabric.minors if rng.random() < rng.choice((0.5, 0.7, 0.9))) for _ in range(patterns)
        ]
        per: dict[int, list[float]] = {}
        cpu: dict[int, list[float]] = {}
        nodes: dict[int, int] = {}
        cut: dict[int, int] = {}
        for free in frees:
            for size in range(1, len(free) + 1):
                start, start_cpu = time.perf_counter(), time.thread_time()
                c = choose(fabric, free, size, TOPOLOGY)
                per.setdefault(size, []).append((time.perf_counter() - start) * 1000)
                cpu.setdefault(size, []).append((time.thread_time() - start_cpu) * 1000)
                nodes[size] = max(nodes.get(size, 0), c.work)
                cut[size] = cut.get(size, 0) + (not c.exact)
        rows = {}
        for size, ts in sorted(per.items()):
            ts.sort()
            cs = sorted(cpu[size])
            rows[size] = {
                "p50_ms": round(ts[len(ts) // 2], 3),
                "p99_ms": round(ts[min(len(ts) - 1, int(len(ts) * 0.99))], 3),
                # CPU time of the deciding thread: what the decision costs, without the time a
                # shared machine spends running something else.
                "p99_cpu_ms": round(cs[min(len(cs) - 1, int(len(cs) * 0.99))], 3),
                "max_cpu_ms": round(cs[-1], 3),
                "max_ms": round(ts[-1], 3),
                "max_work": nodes[size],
                "cut": cut[size],
                "decisions": len(ts),
            }
        out[name] = {"gpus": len(fabric.minors), "sizes": rows}
    return out


def state_recovery_seconds(count: int = 10_000) -> float:
    """Seconds to open the store and load `count` recorded containers (written beforehand)."""
    from isolator.host.state import ContainerRecord, StateStore
    from isolator.model import ContainerId

    with tempfile.TemporaryDirectory(prefix="gi-bench-") as directory:
        with StateStore(directory, durable=False) as store:
            for i in range(count):
                store.record(
                    ContainerRecord(ContainerId.parse(f"c{i}"), Holding(frozenset({i}) if i % 2 else frozenset()))
                )
        start = time.perf_counter()
        with StateStore(directory) as store:
            loaded = store.load()
        elapsed = time.perf_counter() - start
        assert len(loaded) == count
        return elapsed


COLUMNS = (
    ("policy", 10),
    ("rel_score", 9),
    ("rel_slowest_link", 9),
    ("share_best", 10),
    ("mean_score", 10),
    ("mean_slowest_link", 10),
    ("single_rel_leftover", 10),
    ("refused_while_free", 8),
    ("p50_ms", 8),
    ("p99_ms", 8),
)
HEADERS = ("policy", "rel.sum", "rel.slow", "best.share", "sum", "slowest", "1-GPU.left", "refused", "p50 ms", "p99 ms")


def table(result: dict) -> str:
    lines = []
    for host, per_policy in result.items():
        lines.append(f"\n{host} ({per_policy['gpus']} GPUs, {per_policy[TOPOLOGY]['requests']} requests)")
        lines.append("  " + " ".join(h.rjust(w) for h, (_, w) in zip(HEADERS, COLUMNS, strict=True)))
        for policy in POLICY_NAMES:
            row = per_policy[policy]
            cells = [policy.rjust(COLUMNS[0][1])]
            for key, width in COLUMNS[1:]:
                value = row[key]
                cells.append(("-" if value is None else f"{value:g}").rjust(width))
            lines.append("  " + " ".join(cells))
    return "\n".join(lines)


# ---- shares of GPUs (docs/sharing.md) -------------------------------------------------------------

SHARE_SIZES = (1, 2, 3, 4)
SHARES_PER_GPU = 4


def shares_stream(
    topologies: dict[str, Topology],
    arrivals: int = 1000,
    seed: int = 20240611,
    book: Callable[..., Any] | None = None,
    placement: str = "spread",
) -> dict:
    """Arrivals and departures of 1-4 shares on each shipped host whose upper half of GPUs is shared
    four ways, through the policy the sidecar books with (isolator.policy.shares.ShareBook, under
    ``placement``: spread or pack, --share-placement), against an independent oracle: no share granted
    twice (no GPU over its shares, no holder twice), no request refused while a shared GPU had room for
    it, and every placement on the GPU the policy's first rule names among those with room
    (``not_fewest``: spread, the fewest shares held; pack, the fewest left free after it), ties to a GPU
    on the request's NUMA node, then the lowest minor (``tie_broken_wrong``). Half the requests carry a
    NUMA node (as with --cpu-affinity), drawn from the host's nodes.

    Fragmentation, from the oracle's own count of what each GPU holds, at every arrival before it is
    placed: ``largest_fit`` (the largest request that still fits one GPU, mean over arrivals),
    ``whole_free`` (shared GPUs holding nothing, mean) and ``full_fit`` (the share of arrivals at which
    a whole GPU's worth, 4 shares, still fit). The same seed for every policy.
    ``book``: another book class to judge (the tests check that the oracle catches a wrong one)."""
    from isolator.model import ShareMode
    from isolator.policy.shares import ShareBook, SharedGpu, SharesExhausted
    from isolator.simhost.host import load_host

    out: dict[str, dict] = {}
    for name, topology in sorted(topologies.items()):
        mig = {g.index for g in load_host(name).gpus if g.mig} if name in _shipped() else set()
        gpus = sorted((g for g in topology.gpus if g.index not in mig), key=lambda g: g.minor)  # MIG: not shared
        shared = {
            g.minor: SharedGpu(g.minor, g.index, SHARES_PER_GPU, ShareMode.TIME_SLICE, g.numa_node)
            for g in gpus[len(gpus) // 2 :]
        }
        nodes = sorted({g.numa for g in shared.values() if g.numa is not None}) or [0]
        rng = random.Random(f"{seed}-{name}")
        books = (book or ShareBook)(shared, placement)
        live: list[str] = []
        held = dict.fromkeys(shared, 0)
        owner: dict[str, tuple[int, int]] = {}
        counts = {"arrivals": 0, "placed": 0, "refused_no_room": 0}
        bad = {"granted_twice": 0, "refused_with_room": 0, "not_fewest": 0, "tie_broken_wrong": 0}
        seconds: list[float] = []
        largest: list[int] = []
        whole: list[int] = []
        while counts["arrivals"] < arrivals:
            if live and rng.random() < 0.45:
                gone = live.pop(rng.randrange(len(live)))
                minor, n = books.release(gone)
                held[minor] -= n
                del owner[gone]
                continue
            n = rng.choice(SHARE_SIZES)
            near = [rng.choice(nodes)] if rng.random() < 0.5 else None
            holder = f"c{counts['arrivals']}"
            counts["arrivals"] += 1
            room = [g for g in shared.values() if g.shares - held[g.minor] >= n]
            largest.append(max(g.shares - held[g.minor] for g in shared.values()))
            whole.append(sum(1 for m in shared if held[m] == 0))
            started = time.perf_counter()
            try:
                got = books.place(holder, n, (), near)
            except SharesExhausted:
                seconds.append(time.perf_counter() - started)
                counts["refused_no_room"] += 1
                bad["refused_with_room"] += 1 if room else 0
                continue
            seconds.append(time.perf_counter() - started)
            counts["placed"] += 1
            # The policy's first rule, from the oracle's own counts: spread the fewest held, pack the fewest left.
            rank = {
                g.minor: held[g.minor] if placement == "spread" else g.shares - held[g.minor] - n
                for g in shared.values()
            }
            fewest = min(rank[g.minor] for g in room) if room else None
            if not room or rank[got.minor] != fewest:
                bad["not_fewest"] += 1
            else:
                ties = [g for g in room if rank[g.minor] == fewest]
                if near is not None and any(g.numa in near for g in ties):
                    ties = [g for g in ties if g.numa in near]
                if got.minor != min(g.minor for g in ties):
                    bad["tie_broken_wrong"] += 1
            held[got.minor] += n
            owner[holder] = (got.minor, n)
            live.append(holder)
            if held[got.minor] > shared[got.minor].shares or books.held() != held:
                bad["granted_twice"] += 1
        seconds.sort()
        out[name] = {
            "shared_gpus": len(shared),
            "shares": SHARES_PER_GPU * len(shared),
            **counts,
            **bad,
            "largest_fit": round(sum(largest) / len(largest), 3) if largest else None,
            "whole_free": round(sum(whole) / len(whole), 3) if whole else None,
            "full_fit": round(sum(1 for x in largest if x >= SHARES_PER_GPU) / len(largest), 4) if largest else None,
            "p50_us": round(seconds[len(seconds) // 2] * 1e6, 2) if seconds else None,
            "p99_us": round(seconds[min(len(seconds) - 1, int(len(seconds) * 0.99))] * 1e6, 2) if seconds else None,
        }
    return out


SHARE_PLACEMENTS = ("spread", "pack")


def shares_placements(topologies: dict[str, Topology], arrivals: int = 1000, seed: int = 20240611) -> dict:
    """``shares_stream`` once per --share-placement, with the same seed: policy -> host -> row."""
    return {p: shares_stream(topologies, arrivals, seed, placement=p) for p in SHARE_PLACEMENTS}


def placements_table(result: dict) -> str:
    """Per host and policy: refusals, the oracle's violations and the fragmentation figures."""
    lines = ["host          policy  placed no.room | violations | largest.fit whole.free full.fit"]
    hosts = sorted({h for rows in result.values() for h in rows})
    for host in hosts:
        for policy, rows in result.items():
            r = rows[host]
            wrong = sum(r[k] for k in ("granted_twice", "refused_with_room", "not_fewest", "tie_broken_wrong"))
            lines.append(
                f"{host:13s} {policy:6s} {r['placed']:7d} {r['refused_no_room']:7d} | {wrong:10d} |"
                f" {r['largest_fit']:11.2f} {r['whole_free']:10.2f} {r['full_fit']:8.1%}"
            )
    return "\n".join(lines)


def _shipped() -> frozenset[str]:
    from isolator.simhost.host import shipped_hosts

    return frozenset(shipped_hosts())


SHARES_HEADERS = (
    "host          shared arrivals placed no.room | twice refused.room not.fewest tie.wrong | p50 us  p99 us"
)


def shares_table(result: dict) -> str:
    lines = [SHARES_HEADERS]
    for host, r in result.items():
        lines.append(
            f"{host:13s} {r['shared_gpus']:3d}x{SHARES_PER_GPU} {r['arrivals']:8d} {r['placed']:6d}"
            f" {r['refused_no_room']:7d} |"
            f" {r['granted_twice']:5d} {r['refused_with_room']:12d} {r['not_fewest']:10d} {r['tie_broken_wrong']:9d} |"
            f" {r['p50_us']:6.1f} {r['p99_us']:7.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seed", type=int, default=20240611)
    parser.add_argument("--requests", type=int, default=400, help="arrivals per host")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--arrivals", type=int, default=1000, help="arrivals per host and mix (stream scenario)")
    args = parser.parse_args(argv)
    topologies, views = shipped_topologies()
    result = run(topologies, args.seed, args.requests, views)
    streams = stream(topologies, views, args.seed, args.arrivals)
    singles = fragmented(topologies, views)
    timing = decision_times()
    recovery = state_recovery_seconds()
    if args.json:
        print(
            json.dumps(
                {
                    "hosts": result,
                    "stream": streams,
                    "fragmented": singles,
                    "decision_times": timing,
                    "state_recovery_10k_s": round(recovery, 4),
                },
                indent=2,
            )
        )
        return 0
    print(
        "Relative columns compare what was handed out with the best set available at that moment\n"
        "(rel.sum: sum of pair scores; rel.slow: slowest pair; best.share: both best). sum and slowest\n"
        "are absolute means. 1-GPU.left: pair score left among free GPUs after a 1-GPU request,\n"
        "relative to the best single pick. refused: requests refused while enough GPUs were free."
    )
    print(table(result))
    print("\nStream scenario: best.free = the best set for the arriving size was still free; quad@4 = an")
    print("all-NVLink quad was free at a size-4 arrival; worse = topology's set worse now than the partition")
    print("baseline's on the same free GPUs (exact score / tier)")
    print(stream_table(streams))
    print("\nSingle decisions on fragmented patterns (topology vs partition):")
    for host, r in singles.items():
        print(f"  {host}: {r}")
    print("\nDecision time (ms) by size on 16 and 32 GPUs:")
    for host, r in timing.items():
        worst = max(v["p99_ms"] for v in r["sizes"].values())
        print(
            f"  {host} ({r['gpus']} GPUs): worst p99 {worst} ms; "
            + "; ".join(f"{k}: {v['p99_ms']}/{v['max_work']}w/{v['cut']}cut" for k, v in r["sizes"].items())
        )
    print(f"\nstate store: opened and loaded 10,000 recorded containers in {recovery * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
