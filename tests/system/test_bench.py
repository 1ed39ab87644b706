"""`make bench` runs: every part at a tiny size reports its figures, the table and the JSON file.

These prove the benchmark code works; they assert no timings (the benchmark reports, it never fails).
The quick run of every part (marker ``bench``, a minute) is run by ``make bench`` before its report,
not by ``make test``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import paths
import pytest

from isolator.simhost.host import load_host, shipped_hosts

SCRIPTS = os.path.join(paths.ROOT, "scripts")


def _load(name: str):
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load("bench")
bench_hooks = _load("bench_hooks")
bench_allocator = _load("bench_allocator")


def test_percentiles_are_nearest_rank_and_summaries_count_cycles_per_second():
    samples = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert bench_hooks.percentile(samples, 50) == 0.050
    assert bench_hooks.percentile(samples, 99) == 0.099
    assert bench_hooks.percentile([0.005], 99) == 0.005
    summary = bench_hooks.summarize(samples, wall=2.0)
    assert summary["cycles"] == 100 and summary["per_s"] == 50.0
    assert bench_hooks.median_of([{"a": 1.0}, {"a": 5.0}, {"a": 2.0}]) == {"a": 2.0}


def test_the_bench_host_has_a_gpu_for_each_of_64_concurrent_clients(short_tmp):
    spec = load_host(bench_hooks.write_host(os.path.join(short_tmp, "h.toml")))
    assert len(spec.gpus) == 64
    assert sorted(g.minor for g in spec.gpus) == list(range(64))


def test_the_allocator_part_reads_every_shipped_host_through_the_inventory(short_tmp):
    topologies, views = bench_allocator.shipped_topologies(short_tmp)
    assert sorted(topologies) == sorted(shipped_hosts())
    for name, topology in topologies.items():
        spec = load_host(name)
        assert sorted(g.minor for g in topology.gpus) == sorted(g.minor for g in spec.gpus)
        assert set(views[name].links) == set(topology.links)
        if spec.switches:  # NVSwitch hosts: the sidecar sees the fabric, the baseline sees no lanes (D1)
            assert all(link.nvlink_lanes > 0 for link in topology.links.values())
            assert all(link.nvlink_lanes == 0 for link in views[name].links.values())
    # DGX-1's lanes are direct GPU-to-GPU links: the baseline sees them as they are.
    assert views["dgx-1"].links == topologies["dgx-1"].links


def test_an_unknown_part_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--parts", "hooks,warp"])
    assert "unknown part(s) warp" in capsys.readouterr().err


@pytest.mark.bench  # a minute of benchmark: `make bench` runs it first, `make test` leaves it out
@pytest.mark.root
@pytest.mark.cgroup_v1
@pytest.mark.cgroup_v2
def test_a_quick_run_of_every_part_reports_every_figure_in_the_table_and_the_json(short_tmp, capsys):
    out = os.path.join(short_tmp, "bench.json")
    # Every part but "agent", which needs a real Mesos (make test-mesos's machinery; make bench runs it).
    local = [p for p in bench.PARTS if p != "agent"]
    assert bench.main(["--quick", "--parts", ",".join(local), "--json", out]) == 0
    with open(out) as fh:
        result = json.load(fh)
    assert set(result["machine"]) >= {"cpu_model", "cores", "kernel", "python"}
    parts = result["parts"]
    assert list(parts) == local
    errors = {name: p["error"] for name, p in parts.items() if "error" in p}
    assert errors == {}
    hooks = parts["hooks"]
    for version in ("v1", "v2"):
        assert set(hooks[version]) >= {"raw", "in_process", "grpc_1", "grpc_8", "grpc_64"}
        assert hooks[version]["grpc_64"]["cycles"] == 64
        assert hooks[version]["grpc_1"]["p99_over_raw_p99"] > 0
    assert parts["bridge"]["bridge_over_bare"] > 0
    assert set(parts["allocator"]["hosts"]) == set(shipped_hosts())
    assert parts["volume"]["files"] > 0
    assert set(parts["recovery"]["counts"]) == {"10", "100"}
    assert parts["footprint"]["cycles"] == 80 and len(parts["footprint"]["rss_series_mib"]) == 11
    load = parts["load"]["median"]
    assert load["health_p99_ms_with"] > 0 and load["peak_mib"] > 0 and load["per_s"]["64"] > 0
    assert load["hogs_ok"]
    table = capsys.readouterr().out
    for heading in ("Hook latency", "Bridge", "Allocator", "Driver volume", "Recovery", "Footprint", "Load"):
        assert f"## {heading}" in table
    assert "could not run" not in table


def test_the_agent_part_pairs_each_module_call_from_the_modules_debug_lines():
    import bench_agent

    log = "\n".join(
        [
            "I20261125 15:38:44.263222 29617 RunningContext.cpp:46] [TASK=c1, METHOD=prepare] Calling command: x",
            "I20261125 15:38:44.300000 29617 RunningContext.cpp:46] [TASK=c2, METHOD=prepare] Calling command: x",
            "I20261125 15:38:44.386245 29617 RunningContext.cpp:55] [TASK=c1, METHOD=prepare] Removing temp files a",
            "I1125 15:38:45.000000 29617 RunningContext.cpp:46] [TASK=c1, METHOD=cleanup] Calling command: x",
            "I1125 15:38:45.010500 29617 RunningContext.cpp:55] [TASK=c1, METHOD=cleanup] Removing temp files a",
            "I20261125 15:38:46.000000 29617 slave.cpp:1] unrelated",
        ]
    )
    times = bench_agent.hook_times(log)
    assert {m: [round(t * 1e6) for t in v] for m, v in times.items()} == {"prepare": [123023], "cleanup": [10500]}
