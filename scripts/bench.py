#!/usr/bin/env python3
"""`make bench`: the figures that say how fast and how good the sidecar is, next to their floors.

Runs the parts asked for (hooks, bridge, allocator, volume, recovery, footprint, load, agent), prints one table
with each figure beside its baseline and goal, and writes every figure and the machine it ran on to
a JSON file. A report, not a test: a part that cannot run is reported and the exit status stays 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (ROOT, HERE, os.path.join(ROOT, "tests")) if p not in sys.path]

PARTS = ("hooks", "bridge", "allocator", "volume", "recovery", "footprint", "load", "agent")
DEFAULT_JSON = os.path.join(ROOT, "bench-results.json")

# The goals the figures are read against (issue 10, and issue 6 for the allocator).
GOAL_HOOK_P99_OVER_RAW = 10.0
GOAL_BRIDGE_OVER_BARE = 3.0
GOAL_DECISION_P99_MS_16 = 5.0
# Issue 19: decision p99 at every request size, on 16 and on 32 GPUs.
GOAL_DECISION_P99_MS_BY_GPUS = {16: 2.0, 32: 10.0}
GOAL_RECOVERY_10K_S = 1.0
GOAL_IDLE_RSS_MIB = 60.0
# "No growth across cycles", stated as a bound: under 2 MiB over the second half of the cycles
# (the first half lets the allocator, SQLite's page cache and gRPC's pools reach their size).
GOAL_RSS_GROWTH_MIB = 2.0
# Serving under load (issue 17).
GOAL_LOAD_HEALTH_P99_MS = 10.0
GOAL_LOAD_CYCLE_RATIO = 1.5
GOAL_LOAD_BACK_S = 1.0
GOAL_LOAD_SCALING = 3.0
GOAL_LOAD_PEAK_MIB = 300.0
GOAL_LOAD_AFTER_MIB = 100.0
GOAL_LOAD_AFTER_S = 5.0
GOAL_HOOK_P99_OVER_RAW_LOAD = 8.0


# ---- sizes --------------------------------------------------------------------------------------


def sizes(quick: bool, repeats: int | None) -> dict[str, Any]:
    """Per part, the size of a full run (``make bench``: a few minutes on 2 cores) or a quick one."""
    if quick:
        return {
            "repeats": repeats or 1,
            "raw_cycles": 20,
            "in_process_cycles": 10,
            "grpc_cycles": {1: 5, 8: 1, 64: 1},
            "bridge_calls": 3,
            "agent_tasks": 3,
            "allocator_requests": 40,
            "allocator_arrivals": 40,
            "allocator_patterns": 3,
            "volume_repeats": 1,
            "recovery_counts": (10, 100),
            "footprint_cycles": 80,
            "load": {
                "watches": 50,
                "health_calls": 20,
                "cycles": 5,
                "memory_requests": 10,
                "throughput": {1: 5, 8: 1, 64: 1},
                "idle": 20,
                "trickling": 10,
            },
        }
    return {
        "repeats": repeats or 5,
        "raw_cycles": 500,
        "in_process_cycles": 300,
        "grpc_cycles": {1: 300, 8: 50, 64: 8},
        "bridge_calls": 50,
        "agent_tasks": 40,
        "allocator_requests": 400,
        "allocator_arrivals": 1000,
        "allocator_patterns": 40,
        "volume_repeats": 5,
        "recovery_counts": (100, 1_000, 10_000),
        "footprint_cycles": 10_000,
        "load": {
            "watches": 1000,
            "health_calls": 300,
            "cycles": 200,
            "memory_requests": 100,
            "throughput": {1: 200, 8: 40, 64: 6},
            "idle": 1000,
            "trickling": 300,
        },
    }


# ---- the machine --------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu_model": model or platform.processor(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "hostname": platform.node(),
    }


# ---- the parts -----------------------------------------------------------------------------------


def part_hooks(s: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    import bench_hooks

    versions = bench_hooks.available_versions()
    size = bench_hooks.Sizes(
        repeats=s["repeats"],
        raw_cycles=s["raw_cycles"],
        in_process_cycles=s["in_process_cycles"],
        grpc_cycles=s["grpc_cycles"],
    )
    return bench_hooks.hooks(versions, size, log=log)


def part_bridge(s: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    import bench_bridge

    runs = []
    for r in range(s["repeats"]):
        log(f"bridge: run {r + 1}/{s['repeats']}")
        runs.append(bench_bridge.measure(s["bridge_calls"]))
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    out = {k: _median([run[k] for run in runs]) for k in keys}
    out["calls"] = s["bridge_calls"]
    out["repeats"] = s["repeats"]
    return out


def part_allocator(s: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    import bench_allocator

    log("allocator: reading the shipped hosts through the inventory")
    topologies, views = bench_allocator.shipped_topologies()
    log("allocator: running the request streams")
    hosts = bench_allocator.run(topologies, requests=s["allocator_requests"], baseline_views=views)
    log("allocator: stream scenario (mixes of sizes, side by side)")
    stream = bench_allocator.stream(topologies, views, arrivals=s["allocator_arrivals"])
    log("allocator: single decisions on fragmented patterns")
    fragmented = bench_allocator.fragmented(topologies, views, samples=max(10, s["allocator_patterns"] * 5))
    log("allocator: decision times on 16 and 32 GPUs")
    times = bench_allocator.decision_times(patterns=s["allocator_patterns"])
    log("allocator: shares stream (arrivals and departures of 1-4 gpu_shares)")
    shares = bench_allocator.shares_stream(topologies, arrivals=s["allocator_arrivals"])
    log("allocator: shares stream per --share-placement (spread, pack): fragmentation")
    placements = bench_allocator.shares_placements(topologies, arrivals=s["allocator_arrivals"])
    from isolator.simhost.host import load_host

    nvswitch = [name for name in hosts if load_host(name).switches]
    return {
        "requests_per_host": s["allocator_requests"],
        "hosts": hosts,
        "nvswitch_hosts": nvswitch,
        "stream_arrivals": s["allocator_arrivals"],
        "stream": stream,
        "fragmented": fragmented,
        "decision_times": times,
        "shares": shares,
        "share_placements": placements,
    }


def part_volume(s: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    import bench_volume

    log("volume: cold link and copy builds, warm check")
    return bench_volume.bench(s["volume_repeats"])


def part_recovery(s: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    import bench_recovery

    return bench_recovery.measure(tuple(s["recovery_counts"]), s["repeats"], log=log)


def part_footprint(s: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    import bench_hooks

    version = "v1" if "v1" in bench_hooks.available_versions() else "v2"
    return bench_hooks.footprint(version, s["footprint_cycles"], log=log)


def part_load(s: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    import bench_hooks
    import bench_load

    version = "v1" if "v1" in bench_hooks.available_versions() else "v2"
    runs = [bench_load.load(version, s["load"], log=log) for _ in range(s["repeats"])]
    return {"version": version, "repeats": len(runs), "runs": runs, "median": load_medians(runs)}


def _throughput(clients: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: r["throughput"][clients]["per_s"]


def load_medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the goals read, each the median over the runs (ratios taken within each run)."""

    def med(pick: Callable[[dict[str, Any]], Any]) -> float | None:
        values = [v for v in (pick(r) for r in runs) if v is not None]
        return _median(values) if values else None

    w = "watches"
    return {
        "health_p50_ms_without": med(lambda r: r[w]["without"]["health"]["p50_ms"]),
        "health_p99_ms_without": med(lambda r: r[w]["without"]["health"]["p99_ms"]),
        "health_p50_ms_with": med(lambda r: r[w]["with"]["health"]["p50_ms"]),
        "health_p99_ms_with": med(lambda r: r[w]["with"]["health"]["p99_ms"]),
        "cycle_p99_ms_without": med(lambda r: r[w]["without"]["cycle"]["p99_ms"]),
        "cycle_p99_ms_with": med(lambda r: r[w]["with"]["cycle"]["p99_ms"]),
        "cycle_p99_ratio": med(lambda r: r[w]["cycle_p99_ratio"]),
        "threads_without": med(lambda r: r[w]["without"]["threads"]),
        "threads_with": med(lambda r: r[w]["with"]["threads"]),
        "rss_mib_without": med(lambda r: r[w]["without"]["rss_kib"] / 1024),
        "rss_mib_with": med(lambda r: r[w]["with"]["rss_kib"] / 1024),
        "rss_mib_after": med(lambda r: r[w]["after"]["rss_kib"] / 1024),
        "threads_after": med(lambda r: r[w]["after"]["threads"]),
        "back_to_baseline_s": med(lambda r: r[w]["back_to_baseline_s"]),
        "back_runs": sum(r[w]["back_to_baseline_s"] is not None for r in runs),
        "rest_mib": med(lambda r: r["memory"]["rest_mib"]),
        "peak_mib": med(lambda r: r["memory"]["peak_mib"]),
        "after_mib": med(lambda r: r["memory"]["after_mib"]),
        "under_100_mib_after_s": med(lambda r: r["memory"]["under_100_mib_after_s"]),
        "per_s": {c: med(_throughput(c)) for c in runs[0]["throughput"] if c.isdigit()},
        "scaling": med(lambda r: r["throughput"]["ratio_64_over_1"]),
        "hogs_ok": all(
            r["hogs"][who]["grpc_ok"] and r["hogs"][who]["bridge_exit"] == 0
            for r in runs
            for who in ("allowed", "denied")
        ),
    }


def part_agent(s: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """Issue 25: a real Mesos agent with no module, no-op hooks, and our Python and compiled bridges
    (scripts/bench_agent.py; needs root, cgroup v1 and Mesos from MESOS_HOME or ../shared/mesos)."""
    import bench_agent

    quick = s["agent_tasks"] < 10  # --quick: a few tasks, one burst round, two XIDs, one fault round each
    return bench_agent.measure(
        s["agent_tasks"],
        log=log,
        burst_rounds=1 if quick else 3,
        xid_rounds=2 if quick else 40,
        fault_rounds=1 if quick else 3,
        raw_cycles=20 if quick else 200,
    )


RUNNERS: dict[str, Callable[[dict[str, Any], Callable[[str], None]], dict[str, Any]]] = {
    "hooks": part_hooks,
    "bridge": part_bridge,
    "allocator": part_allocator,
    "volume": part_volume,
    "recovery": part_recovery,
    "footprint": part_footprint,
    "load": part_load,
    "agent": part_agent,
}


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def run(parts: list[str], quick: bool = False, repeats: int | None = None, log: Callable[[str], None] = print) -> dict:
    """Every asked-for part's figures (or its error), the sizes used and the machine."""
    s = sizes(quick, repeats)
    result: dict[str, Any] = {
        "measured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "quick": quick,
        "sizes": {
            k: ({str(c): n for c, n in v.items()} if isinstance(v, dict) else v) for k, v in s.items() if k != "load"
        },
        "parts": {},
    }
    for part in parts:
        started = time.perf_counter()
        try:
            figures = RUNNERS[part](s, log)
        except Exception as exc:  # a report, not a test: say what failed and go on
            log(f"{part}: failed: {exc}")
            figures = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        figures["seconds"] = round(time.perf_counter() - started, 1)
        result["parts"][part] = figures
    return result


# ---- the table ------------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"Measured {result['measured']} on {m['cpu_model']} ({m['cores']} cores), "
        f"kernel {m['kernel']}, Python {m['python']}{' (quick sizes)' if result['quick'] else ''}",
    ]
    parts = result["parts"]
    for name in PARTS:
        if name not in parts:
            continue
        figures = parts[name]
        lines.append("")
        if "error" in figures:
            lines.append(f"## {name}: could not run: {figures['error']}")
            continue
        lines.extend(RENDER[name](figures))
    return "\n".join(lines)


def render_hooks(h: dict[str, Any]) -> list[str]:
    out = [
        f"## Hook latency: prepare -> isolate -> cleanup, 1 GPU, standalone, {h['host_gpus']}-GPU simulated host"
        f" (median of {h['repeats']} runs)",
        "   path        clients  p50 ms  p99 ms  cycles/s  p50/raw p99/raw  p50/in-proc p99/in-proc  CPU daemon client",
    ]
    for version in ("v1", "v2"):
        if version not in h:
            continue
        v = h[version]
        raw, inproc = v["raw"], v["in_process"]
        out.append(f" cgroup {version}")
        out.append(f"   raw syscalls      1 {raw['p50_ms']:7.3f} {raw['p99_ms']:7.3f} {raw['per_s']:9.0f}")
        out.append(
            f"   in-process        1 {inproc['p50_ms']:7.3f} {inproc['p99_ms']:7.3f} {inproc['per_s']:9.0f}"
            f" {inproc['p50_over_raw_p50']:8.1f} {inproc['p99_over_raw_p99']:7.1f}"
        )
        for key in sorted((k for k in v if k.startswith("grpc_")), key=lambda k: int(k[5:])):
            g = v[key]
            out.append(
                f"   gRPC       {int(key[5:]):6d} {g['p50_ms']:7.3f} {g['p99_ms']:7.3f} {g['per_s']:9.0f}"
                f" {g['p50_over_raw_p50']:8.1f} {g['p99_over_raw_p99']:7.1f}"
                f" {g['p50_over_in_process_p50']:12.2f} {g['p99_over_in_process_p99']:11.2f}"
                f" {g.get('daemon_cores', 0):10.2f} {g.get('client_cores', 0):6.2f}"
            )
        out.append(
            f"   in-process p50 by hook: prepare {inproc['prepare_p50_ms']:.3f} ms (of which the 1-GPU decision"
            f" {inproc['allocator_1gpu_ms']:.3f}), isolate {inproc['isolate_p50_ms']:.3f}, cleanup"
            f" {inproc['cleanup_p50_ms']:.3f}; one durable state commit {v['state_commit_ms']:.3f} ms (3 a cycle)"
        )
        g1 = v.get("grpc_1")
        if g1:
            ratio = g1["p99_over_raw_p99"]
            out.append(
                f"   goal: gRPC p99 at 1 client within {GOAL_HOOK_P99_OVER_RAW:g}x of the raw floor (issue 10),"
                f" {GOAL_HOOK_P99_OVER_RAW_LOAD:g}x (issue 17): {ratio:.1f}x,"
                f" {_verdict(ratio <= GOAL_HOOK_P99_OVER_RAW)}, {_verdict(ratio <= GOAL_HOOK_P99_OVER_RAW_LOAD)}"
            )
        counts = sorted(int(k[5:]) for k in v if k.startswith("grpc_"))
        if len(counts) > 1:
            rates = [v[f"grpc_{c}"]["per_s"] for c in counts]
            last = v[f"grpc_{counts[-1]}"]
            busy = last.get("daemon_cores", 0) + last.get("client_cores", 0)
            cores = h.get("cores") or os.cpu_count() or 1
            # What the cores allow: the 1-client rate times the cores left idle at 1 client. Met when
            # the most clients reach 80% of that, or keep the cores 90% busy.
            first = v[f"grpc_{counts[0]}"]
            used_1 = first.get("daemon_cores", 0) + first.get("client_cores", 0)
            allowed = rates[0] * cores / used_1 if used_1 > 0 else rates[0]
            ok = rates[-1] >= 0.8 * allowed or busy >= 0.9 * cores
            out.append(
                f"   goal: throughput scales with clients until the cores are busy: {_verdict(ok)}"
                f" ({' -> '.join(f'{r:.0f}' for r in rates)} cycles/s at {counts} clients, where the idle"
                f" cores allow {allowed:.0f}; at {counts[-1]} clients daemon + client use {busy:.2f} of"
                f" {cores} cores; one in-process caller alone makes {inproc['per_s']:.0f}/s)"
            )
    return out


def render_bridge(b: dict[str, Any]) -> list[str]:
    ratio = b["bridge_over_bare"]
    return [
        f"## Bridge: wall time per call (median of {b['calls']} calls, median of {b['repeats']} runs)",
        f"   python3 -I -S -c pass    {b['bare_interpreter_s'] * 1000:8.2f} ms",
        f"   bridge prepare           {b['bridge_prepare_s'] * 1000:8.2f} ms   {ratio:.2f}x bare",
        f"   console-script prepare   {b['console_script_prepare_s'] * 1000:8.2f} ms"
        f"   {b['console_script_prepare_s'] / b['bare_interpreter_s']:.2f}x bare (for comparison)",
        f"   goal: within {GOAL_BRIDGE_OVER_BARE:g}x of the bare interpreter:"
        f" {_verdict(ratio <= GOAL_BRIDGE_OVER_BARE)}",
    ] + (
        [f"   compiled bridge prepare  {b['compiled_prepare_s'] * 1000:8.2f} ms   (isolator/bridge/bridge.c)"]
        if "compiled_prepare_s" in b
        else []
    )


def render_allocator(a: dict[str, Any]) -> list[str]:
    from bench_allocator import PARTITION, POLICY_NAMES, TOPOLOGY

    out = [
        f"## Allocator: fixed-seed stream of {a['requests_per_host']} requests per shipped host"
        " (sizes 1, 2, 4, 8; arrivals and departures)",
        "   rel.sum/rel.slow: mean set score / slowest link relative to the best set free at the time;",
        "   best: share of multi-GPU requests given the best set; 1-GPU.left: pair score left after a",
        "   1-GPU request relative to the best pick; refused: refused while enough GPUs were free",
        "   host          GPUs policy     rel.sum rel.slow   best 1-GPU.left refused  p50 ms  p99 ms",
    ]
    verdicts = []
    for host, per in a["hosts"].items():
        for policy in POLICY_NAMES:
            r = per[policy]
            out.append(
                f"   {host:13s} {per['gpus']:4d} {policy:10s} {_f(r['rel_score'], 4):>7s}"
                f" {_f(r['rel_slowest_link'], 4):>8s}"
                f" {_f(r['share_best'], 3):>6s} {_f(r['single_rel_leftover'], 4):>10s} {r['refused_while_free']:7d}"
                f" {_f(r['p50_ms'], 3):>7s} {_f(r['p99_ms'], 3):>7s}"
            )
        t, p = per[TOPOLOGY], per[PARTITION]
        if t["rel_score"] is not None and p["rel_score"] is not None:
            as_good = (
                t["rel_score"] >= p["rel_score"]
                and t["rel_slowest_link"] >= p["rel_slowest_link"]
                and t["refused_while_free"] <= p["refused_while_free"]
            )
            verdicts.append((host, as_good))
    bad = [h for h, ok in verdicts if not ok]
    out.append(
        "   goal: topology at least as good as partition on every host: "
        + (_verdict(not bad) + (f" (not on {', '.join(bad)})" if bad else ""))
    )
    out.extend(_clearly_better(a))
    sixteen = [per[TOPOLOGY]["p99_ms"] for per in a["hosts"].values() if per["gpus"] == 16]
    eight = [per[TOPOLOGY]["p99_ms"] for per in a["hosts"].values() if per["gpus"] == 8]
    if eight:
        out.append(f"   topology decision p99 at 8 GPUs: {max(eight):.3f} ms (worst 8-GPU host)")
    if sixteen:
        worst = max(sixteen)
        out.append(
            f"   goal: topology decision p99 at 16 GPUs under {GOAL_DECISION_P99_MS_16:g} ms: {worst:.3f} ms,"
            f" {_verdict(worst < GOAL_DECISION_P99_MS_16)}"
        )
    if "stream" in a:
        out.extend(render_stream(a))
    if "shares" in a:
        out.extend(render_shares(a))
    if "share_placements" in a:
        out.extend(render_share_placements(a))
    return out


def render_share_placements(a: dict[str, Any]) -> list[str]:
    """Issue 42 item 2: the shares stream under each --share-placement, with its oracle and fragmentation."""
    from bench_allocator import placements_table

    out = [
        f"## Allocator shares stream per --share-placement: {a['stream_arrivals']} arrivals of 1-4 shares per host",
        "   violations: the oracle's four goals for that policy (spread: fewest held; pack: fewest left free);",
        "   largest.fit: the largest request that still fit one GPU, whole.free: shared GPUs holding nothing,",
        "   full.fit: arrivals at which a whole GPU's worth (4 shares) still fit; means over the arrivals",
    ]
    out.extend("   " + line for line in placements_table(a["share_placements"]).splitlines())
    rows = [r for rows in a["share_placements"].values() for r in rows.values()]
    worst = sum(r[k] for r in rows for k in ("granted_twice", "refused_with_room", "not_fewest", "tie_broken_wrong"))
    out.append(f"   goal: each placement as its policy says: {worst} violations, {_verdict(worst == 0)}")
    return out


def render_shares(a: dict[str, Any]) -> list[str]:
    """Issue 32: the shares stream, with its three goals (each a count that must be 0)."""
    from bench_allocator import SHARE_SIZES, shares_table

    out = [
        f"## Allocator shares stream: {a['stream_arrivals']} arrivals of {SHARE_SIZES[0]}-{SHARE_SIZES[-1]} gpu_shares"
        " per host (the upper half of its GPUs not in MIG mode shared four ways; seeded arrivals and departures)",
        "   twice: a GPU over its shares or the books disagreeing with the oracle; refused.room: refused while",
        "   a shared GPU had room; not.fewest: placed on a GPU holding more shares than another with room;",
        "   tie.wrong: among the fewest, not the NUMA-near one or not the lowest minor",
    ]
    out.extend("   " + line for line in shares_table(a["shares"]).splitlines())
    for key, goal in (
        ("granted_twice", "no share granted twice"),
        ("refused_with_room", "no request refused while a shared GPU had room"),
        ("not_fewest", "every placement on a GPU holding the fewest shares among those with room"),
    ):
        worst = sum(r[key] for r in a["shares"].values())
        out.append(f"   goal: {goal}: {worst} violations, {_verdict(worst == 0)}")
    return out


def render_stream(a: dict[str, Any]) -> list[str]:
    """Issue 19: the stream scenario, fragmented single decisions and decision times, with goals."""
    from bench_allocator import PARTITION, TOPOLOGY, stream_table

    out = [
        f"## Allocator stream scenario: {a['stream_arrivals']} arrivals per host and mix (seeded allocate/release)",
        "   best.free: the best set for the arriving size was still free; quad@4: an all-NVLink quad was",
        "   free at a size-4 arrival; worse: topology's set worse now than partition's on the same free GPUs",
        "   (exact score / tier) out of the arrivals compared",
    ]
    out.extend("   " + line for line in stream_table(a["stream"]).splitlines() if line)
    behind, worse = [], []
    for host, per in a["stream"].items():
        for mix, rows in per.items():
            if not isinstance(rows, dict):
                continue
            t, p = rows[TOPOLOGY], rows[PARTITION]
            if t["quad_free_at_4"] is not None and t["quad_free_at_4"] < p["quad_free_at_4"]:
                behind.append(f"{host} {mix}")
            if t.get("worse_tier"):
                worse.append(f"{host} {mix}")
    out.append(
        "   goal: quad@4 at least partition's on every host and mix: "
        + _verdict(not behind)
        + (f" (behind on {', '.join(behind)})" if behind else "")
    )
    out.append(
        "   goal: never a set worse now than partition's (up to the tolerance, by tier): "
        + _verdict(not worse)
        + (f" (worse on {', '.join(worse)})" if worse else "")
    )
    frag = a["fragmented"]
    out.append(
        "   fragmented single decisions (every pattern on 8 GPUs or fewer, sampled on 16): "
        + "; ".join(
            f"{h} {r['decisions']} decisions, worse {r['worse_raw']} raw / {r['worse_tier']} tier,"
            f" cut {r['budget_cut']}"
            for h, r in frag.items()
        )
    )
    out.append(
        "   goal: never worse than partition (by tier) and exact (no budget cut) up to 16 GPUs: "
        + _verdict(all(r["worse_tier"] == 0 and r["budget_cut"] == 0 for r in frag.values()))
    )
    for host, r in a["decision_times"].items():
        worst_size, worst = max(((k, v["p99_ms"]) for k, v in r["sizes"].items()), key=lambda kv: kv[1])
        cpu_size, cpu = max(((k, v["p99_cpu_ms"]) for k, v in r["sizes"].items()), key=lambda kv: kv[1])
        cut = sum(v["cut"] for v in r["sizes"].values())
        goal = GOAL_DECISION_P99_MS_BY_GPUS.get(r["gpus"])
        out.append(
            f"   decision p99 on {host} ({r['gpus']} GPUs), worst size: wall {worst:.3f} ms (size {worst_size}),"
            f" CPU {cpu:.3f} ms (size {cpu_size}); budget cut {cut} of"
            f" {sum(v['decisions'] for v in r['sizes'].values())}"
            + (
                f"; goal under {goal:g} ms at every size: wall {_verdict(worst < goal)}, CPU {_verdict(cpu < goal)}"
                if goal
                else ""
            )
        )
    return out


CLEARLY = 0.01  # "clearly better": ahead by at least one percentage point of the best possible


def _clearly_better(a: dict[str, Any]) -> list[str]:
    """Topology minus partition, per host, on the relative measures; and the two "clearly better" goals."""
    from bench_allocator import PARTITION, TOPOLOGY

    def gain(host: str, key: str) -> float | None:
        t, p = a["hosts"][host][TOPOLOGY][key], a["hosts"][host][PARTITION][key]
        return None if t is None or p is None else t - p

    out = []
    multi = [h for h, per in a["hosts"].items() if per["gpus"] > 1]
    nvswitch = [h for h in a.get("nvswitch_hosts", []) if h in multi]
    if nvswitch:
        rows = []
        clear = []
        for h in nvswitch:
            gains = {k: gain(h, k) for k in ("rel_score", "rel_slowest_link", "share_best", "single_rel_leftover")}
            known = [g for g in gains.values() if g is not None]
            clear.append(bool(known) and max(known) >= CLEARLY and min(known) >= 0)
            rows.append(f"{h} " + "/".join(f"{g:+.4f}" for g in known))
        out.append("   topology - partition on NVSwitch hosts (rel.sum/rel.slow/best/1-GPU.left): " + "; ".join(rows))
        out.append(
            f"   goal: clearly better (>= {CLEARLY:g} ahead on some measure, behind on none) on NVSwitch hosts:"
            f" {_verdict(all(clear))}"
        )
    singles = {h: gain(h, "single_rel_leftover") for h in multi}
    if singles:
        ahead = [h for h, g in singles.items() if g is not None and g >= CLEARLY]
        behind = [h for h, g in singles.items() if g is not None and g < 0]
        out.append(
            "   topology - partition on 1-GPU requests (1-GPU.left): "
            + "; ".join(f"{h} {g:+.4f}" for h, g in singles.items() if g is not None)
        )
        out.append(
            f"   goal: clearly better on single-GPU requests (>= {CLEARLY:g} ahead on every multi-GPU host):"
            f" {_verdict(not behind and len(ahead) == len(singles))}"
            + (f" (clearly ahead on {', '.join(ahead)} only)" if ahead and len(ahead) < len(singles) else "")
        )
    return out


def render_volume(v: dict[str, Any]) -> list[str]:
    copy = v.get("cold_copy_ms")
    return [
        f"## Driver volume (simulated driver {v['driver_version']}): {v['files']} files, {v['links']} links,"
        f" {v['bytes'] / 2**20:.1f} MiB",
        f"   discover + plan          {v['discover_and_plan_ms']:8.2f} ms",
        f"   cold build, link path    {v['cold_link_ms']:8.2f} ms",
        f"   cold build, copy path    {_f(copy):>8s} ms" + (f"   ({v.get('copy_mode')})" if copy is not None else ""),
        f"   warm check at prepare    {v['warm_check_ms']:8.3f} ms",
    ]


def render_recovery(r: dict[str, Any]) -> list[str]:
    out = [
        f"## Recovery: process start to SERVING ({r['host']}, {r['mode']} mode, median of {r['repeats']} runs)",
        f"   recorded containers {0:9,d}: {r['start_to_serving_0_s'] * 1000:8.1f} ms (the fixed start cost)",
    ]
    for count, e in r["counts"].items():
        call = e.get("recover_call_s")
        out.append(
            f"   recorded containers {int(count):9,d}: {e['start_to_serving_s'] * 1000:8.1f} ms"
            f" ({e['over_empty_s'] * 1000:+.1f} ms over 0, x{e['ratio_to_empty']:.2f})"
            + (f"; then Recover with all of them: {call * 1000:.1f} ms" if call is not None else "")
        )
    big = r["counts"].get("10000")
    if big:
        ok = big["start_to_serving_s"] < GOAL_RECOVERY_10K_S
        out.append(
            f"   goal: 10,000 recorded containers serving in under {GOAL_RECOVERY_10K_S:g} s:"
            f" {big['start_to_serving_s']:.2f} s, {_verdict(ok)}"
        )
    return out


def render_footprint(f: dict[str, Any]) -> list[str]:
    idle_ok = f["rss_idle_mib"] < GOAL_IDLE_RSS_MIB
    growth_ok = f["growth_second_half_mib"] < GOAL_RSS_GROWTH_MIB
    return [
        f"## Footprint: the daemon's resident memory (cgroup {f['cgroup_version']})",
        f"   at start {f['rss_at_start_mib']:.1f} MiB; idle after one cycle per client {f['rss_idle_mib']:.1f} MiB;"
        f" after {f['cycles']:,} cycles {f['rss_after_cycles_mib']:.1f} MiB",
        "   RSS every tenth of the way (MiB): " + " ".join(f"{x:.1f}" for x in f["rss_series_mib"]),
        f"   goal: idle under {GOAL_IDLE_RSS_MIB:g} MiB: {_verdict(idle_ok)}; growth over the second half"
        f" under {GOAL_RSS_GROWTH_MIB:g} MiB: {f['growth_second_half_mib']:+.2f} MiB, {_verdict(growth_ok)}",
    ]


def render_load(result: dict[str, Any]) -> list[str]:
    m = result["median"]
    run0 = result["runs"][0]
    sizes = run0["watches"]["watches"], run0["memory"]["requests"], run0["hogs"]["idle"], run0["hogs"]["trickling"]
    health_ok = m["health_p99_ms_with"] < GOAL_LOAD_HEALTH_P99_MS
    ratio_ok = m["cycle_p99_ratio"] <= GOAL_LOAD_CYCLE_RATIO
    back = m["back_to_baseline_s"]
    back_ok = back is not None and back <= GOAL_LOAD_BACK_S and m["back_runs"] == result["repeats"]
    scaling = m["scaling"]
    peak_ok = m["peak_mib"] < GOAL_LOAD_PEAK_MIB
    after = m["under_100_mib_after_s"]
    after_ok = after is not None and after <= GOAL_LOAD_AFTER_S
    per_s = "  ".join(f"{c} client(s) {v:.0f}/s" for c, v in m["per_s"].items() if v is not None)
    return [
        f"## Load: one daemon (cgroup {result['version']}), median of {result['repeats']} runs",
        f"   Health p50/p99 ms: {_f(m['health_p50_ms_without'])}/{_f(m['health_p99_ms_without'])} with no Watch open,"
        f" {_f(m['health_p50_ms_with'])}/{_f(m['health_p99_ms_with'])} with {sizes[0]} open",
        f"   hook cycle p99 ms: {_f(m['cycle_p99_ms_without'])} without, {_f(m['cycle_p99_ms_with'])} with them"
        f" ({_f(m['cycle_p99_ratio'])}x)",
        f"   threads {m['threads_without']:.0f} -> {m['threads_with']:.0f} with them -> {m['threads_after']:.0f} after"
        f" cancelling; RSS {m['rss_mib_without']:.1f} -> {m['rss_mib_with']:.1f} -> {m['rss_mib_after']:.1f} MiB;"
        f" back to baseline (threads, RSS +2 MiB) in {_f(back)} s ({m['back_runs']}/{result['repeats']} runs)",
        f"   {sizes[1]} concurrent Prepare of {run0['memory']['request_bytes']:,} bytes: RSS at rest"
        f" {m['rest_mib']:.1f} MiB, peak {m['peak_mib']:.1f} MiB, after {m['after_mib']:.1f} MiB;"
        f" under 100 MiB {_f(after)} s after",
        f"   cycles/s: {per_s}; 64 over 1: {_f(scaling)}x",
        f"   another user holding {sizes[2]} idle connections and {sizes[3]} trickling bridge clients (allowed,"
        f" then denied): agent's Prepare+Cleanup over gRPC and cleanup over the bridge "
        + ("all succeeded" if m["hogs_ok"] else "FAILED")
        + " ("
        + ", ".join(
            f"{who} gRPC {run0['hogs'][who]['grpc_ms']:.0f} ms, bridge {run0['hogs'][who]['bridge_ms']:.0f} ms"
            for who in ("allowed", "denied")
        )
        + ")",
        f"   goals: Health p99 with watches < {GOAL_LOAD_HEALTH_P99_MS:g} ms: {_verdict(health_ok)};"
        f" cycle p99 within {GOAL_LOAD_CYCLE_RATIO:g}x: {_verdict(ratio_ok)};"
        f" back within {GOAL_LOAD_BACK_S:g} s: {_verdict(back_ok)};"
        f" 64 clients >= {GOAL_LOAD_SCALING:g}x 1: {_verdict(scaling is not None and scaling >= GOAL_LOAD_SCALING)};"
        f" peak < {GOAL_LOAD_PEAK_MIB:g} MiB: {_verdict(peak_ok)};"
        f" < {GOAL_LOAD_AFTER_MIB:g} MiB within {GOAL_LOAD_AFTER_S:g} s: {_verdict(after_ok)};"
        f" agent served under hogs: {_verdict(m['hogs_ok'])}",
        f"   (hook cycle p99 at 1 client <= {GOAL_HOOK_P99_OVER_RAW_LOAD:g}x the raw floor: see the hook latency part)",
    ]


def render_agent(a: dict[str, Any]) -> list[str]:
    import bench_agent

    return bench_agent.render(a)


RENDER: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "hooks": render_hooks,
    "bridge": render_bridge,
    "allocator": render_allocator,
    "volume": render_volume,
    "recovery": render_recovery,
    "footprint": render_footprint,
    "load": render_load,
    "agent": render_agent,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated parts to run (default all: {','.join(PARTS)})"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: proves the benchmark runs, measures little")
    parser.add_argument("--repeats", type=int, default=None, help="runs per figure (default 5, quick 1)")
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"where to write every figure (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")

    def log(line: str) -> None:
        print(f"... {line}", file=sys.stderr, flush=True)

    result = run(parts, quick=args.quick, repeats=args.repeats, log=log)
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2, default=str)
    print(table(result))
    print(f"\n(every figure: {args.json})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
