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


def test_the_agent_part_reads_our_modules_own_hook_lines_and_the_sidecars_prepare_steps():
    import bench_agent

    agent_log = "\n".join(
        [
            "I1128 20:01:00.000100 4242 gpu_isolator.cpp:480] gpu-isolator Prepare of container c1: done after 3.25 ms",
            "I1128 20:01:00.000200 4242 gpu_isolator.cpp:620] gpu-isolator Watch of container c1: opened after 4.5 ms",
            "I1128 20:01:00.000300 4242 gpu_isolator.cpp:480] gpu-isolator Isolate of container c1: done after 2 ms",
            "I1128 20:01:00.000350 4242 gpu_isolator.cpp:256] gpu-isolator: Update of container c1 changes nothing the"
            " sidecar acts on; not sent",
            "I1128 20:01:00.000400 4242 gpu_isolator.cpp:480] gpu-isolator Update of container c1: done after 0.01 ms",
            "I1128 20:01:00.000450 4242 gpu_isolator.cpp:480] gpu-isolator Update of container c1: done after 2.5 ms",
            "I1128 20:01:00.000460 4242 gpu_isolator.cpp:480] gpu-isolator Cleanup of container c1: done after 1.5 ms",
            "I1128 20:01:00.000500 4242 gpu_isolator.cpp:480] gpu-isolator Cleanup of container c2: failed after 5 ms",
            "I1128 20:01:00.000600 4242 slave.cpp:1] gpu-isolator Prepare of container c9 unrelated",
        ]
    )
    times = bench_agent.native_hook_times(agent_log)
    assert {m: [round(t * 1e6) for t in v] for m, v in times.items()} == {
        "prepare": [3250],
        "watch": [4500],
        "isolate": [2000],
        "update, unsent": [10],
        "update": [2500],
        "cleanup": [1500, 5000],
    }
    # c1's cycle: prepare + isolate + cleanup; c2's Cleanup failed and it has no Prepare: left out.
    assert [round(c * 1e6) for c in bench_agent.native_cycles(agent_log)] == [6750]
    assert bench_agent.native_hook_of(agent_log, "Cleanup", "c2") == ("failed", 0.005)
    assert bench_agent.native_hook_of(agent_log, "Isolate", "c2") is None
    sidecar_log = (
        "2026-11-28 20:01:00,000 INFO isolator.core.prepare: prepared container c1 (cgroup 'x/c1', GPUs [0]) "
        "(topology) in 2.61 ms (booking 0.30, choice 0.21, state commit 0.90, rules 0.70, launch info 0.50)\n"
        "2026-11-28 20:01:01,000 INFO isolator.core.prepare: prepared nested container c1.n (GPUs [0])\n"
    )
    steps = bench_agent.sidecar_prepare_steps(sidecar_log)
    assert steps == {
        "total": [2.61],
        "booking": [0.30],
        "choice": [0.21],
        "state commit": [0.90],
        "rules": [0.70],
        "launch info": [0.50],
    }


def test_the_agent_part_prints_the_native_breakdown_the_hook_cycle_against_the_floor_and_the_faults():
    import bench_agent

    def s(ms: float) -> dict:
        return {"n": 3, "median_ms": ms, "p90_ms": ms}

    result = {
        "tasks": 3,
        "configs": {
            "none": {"running": s(900), "finished": s(1000), "agent_running": s(340), "hooks": {}},
            "native": {
                "running": s(910),
                "finished": s(1010),
                "agent_running": s(345),
                "hooks": {"prepare": s(4.0), "isolate": s(3.0), "cleanup": s(3.0), "update, unsent": s(0.01)},
                "cycle": {"n": 3, "p50_ms": 10.0, "p99_ms": 20.0},
                "sidecar_prepare_ms": {"total": {"n": 3, "median_ms": 2.5}, "booking": {"n": 3, "median_ms": 0.3}},
            },
        },
        "raw_floor": {"cycles": 20, "p50_ms": 0.2, "p99_ms": 0.5},
        "faults": {
            "prepare_timeout": "5secs",
            "restart_after_s": 1.0,
            "down": [{"failed_s": 6.0, "prepare_s": 5.0, "cleanup_s": 0.0}],
            "restart": [{"running_s": 2.5, "serving_to_prepared_s": 0.3}],
        },
        "burst": {},
        "xid": {},
    }
    text = "\n".join(bench_agent.render(result))
    assert "prepare handler (its log, median of 3): 2.50 ms (booking 0.30)" in text
    assert "3 containers): p50 10.00 ms = 50.0x, p99 20.00 ms = 40.0x the raw kernel floor on cgroup v1" in text
    assert "   update, unsent" in text
    assert "sidecar down for good: submit -> TASK_FAILED 6.00 s; the module waited 5.00 s for Prepare, 0.00 s" in text
    assert "submit -> TASK_RUNNING 2.50 s; sidecar serving -> the module's Prepare answered 0.30 s" in text
    # A run without the native configuration says what is missing, and does not fail.
    del result["configs"]["native"]
    assert "native hook cycle against the raw floor: not measured" in "\n".join(bench_agent.render(result))
