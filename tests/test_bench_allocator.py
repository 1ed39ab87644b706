"""The allocator benchmark's own pieces: the partition baseline behaves as described, and run() reports."""

from __future__ import annotations

import importlib.util
import os

from topologies import dgx1_volta, padded_trap, workstation

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_allocator.py")
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
        assert result[host]["topology"]["rel_score"] >= 0.9  # exact unless the 4 ms deadline cut in
    assert "rel.sum" in bench.table(result)
