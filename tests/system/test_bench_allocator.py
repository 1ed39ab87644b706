"""The allocator benchmark's own pieces: the partition baseline behaves as described, and run() reports."""

from __future__ import annotations

import importlib.util
import os

import paths
import pytest
from topologies import dgx1_volta, padded_trap, workstation

_PATH = os.path.join(paths.ROOT, "scripts", "bench_allocator.py")
_spec = importlib.util.spec_from_file_location("bench_allocator", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_partition_baseline_reproduces_the_padded_group_defect():
    # k8s-topology.md §1.6 D2: from five GPUs, size 3 comes back as the NVLink pair plus padding.
    assert bench.PartitionBaseline(padded_trap())(frozenset(range(5)), 3) == (0, 1)


def test_the_partition_baseline_prefers_the_split_over_the_best_pair():
    # §1.4: DGX-1V with {0, 2, 4, 5} free and size 2 returns {4, 5}, not the better {0, 4}.
    assert set(bench.PartitionBaseline(dgx1_volta())(frozenset({0, 2, 4, 5}), 2)) == {4, 5}


def test_run_reports_every_policy_per_host_and_counts_short_answers_as_refusals():
    result = bench.run({"dgx-1": dgx1_volta(), "ws": workstation()}, seed=7, requests=60)
    for host in ("dgx-1", "ws"):
        for policy in bench.POLICY_NAMES:
            row = result[host][policy]
            assert row["requests"] == 60
            assert row["p99_ms"] is not None
        assert result[host]["topology"]["refused_while_free"] == 0
        assert result[host]["topology"]["rel_score"] >= 0.9
    assert "rel.sum" in bench.table(result)


@pytest.mark.bench  # 5 s of CPU (the partition baseline's search on the 16-GPU host): `make bench` runs it
def test_the_stream_scenario_reports_every_mix_and_topology_keeps_dgx1_quads_at_least_as_often():
    result = bench.stream({"dgx-1": dgx1_volta(), "ws": workstation()}, arrivals=150, seed=3)
    assert set(result) == {"dgx-1", "ws", "dgx-1x2"}
    assert set(result["dgx-1"]) >= {"1/2/4", "2/4"}
    assert result["dgx-1"]["nvlink_quads"] == 2 and result["dgx-1x2"]["nvlink_quads"] == 4
    for mix in ("1/2/4", "2/4"):
        rows = result["dgx-1"][mix]
        for policy in bench.POLICY_NAMES:
            assert rows[policy]["arrivals"] == 150 and rows[policy]["refused_while_free"] == 0
        assert rows["topology"]["quad_free_at_4"] >= rows["partition"]["quad_free_at_4"]
        assert rows["topology"]["worse_tier"] == 0  # never worse now, up to the tolerance
    assert "quad@4" in bench.stream_table(result)


def test_the_stream_generator_never_overfills_the_host():
    events = bench.make_mix_stream(8, (2, 4), seed=1, arrivals=300)
    live: dict[int, int] = {}
    for kind, job, size in events:
        if kind == "arrive":
            live[job] = size
            assert sum(live.values()) <= 8
        else:
            del live[job]
    assert sum(1 for e in events if e[0] == "arrive") == 300


def test_nvlink_quads_are_the_all_nvlink_four_sets():
    assert bench.nvlink_quads(dgx1_volta()) == [0b1111, 0b11110000]
    assert bench.nvlink_quads(workstation()) == []


def test_fragmented_patterns_compare_every_size_with_the_partition_baseline():
    result = bench.fragmented({"ws": workstation(), "dgx-1": dgx1_volta()})
    assert result["ws"]["decisions"] == 4 * 1 + 1 * 2  # 3 free: size 2; 4 free: sizes 2 and 3
    assert result["dgx-1"]["worse_tier"] == 0 and result["dgx-1"]["budget_cut"] == 0
