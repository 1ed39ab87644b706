#!/usr/bin/env python3
"""What the sidecar costs a task under a real Mesos agent (issue 25, `make bench` part ``agent``).

The same Mesos (``MESOS_HOME`` or ``../shared/mesos/setup.sh``) on this machine, one master and one
agent on loopback per configuration (isolator/testing/agent.py), ``tasks`` command tasks with
``gpus:1`` submitted one after the other through mesos-execute:

* ``none``: no module (the agent's own ``cgroups/devices`` only): what a task pays without us;
* ``noop``: criteo's module running ``/bin/true`` for every hook, which answers each one correctly
  (empty OUT: nothing to add, no limitation): the floor of this route;
* ``python``: the module running our Python bridge (``python -m isolator.bridge install``);
* ``c``: the module running the compiled bridge (``install --compiled``, isolator/bridge/bridge.c).

Per configuration: submit -> TASK_RUNNING and submit -> TASK_FINISHED (median, p90), from
mesos-execute's own output, read every few milliseconds. Per hook: the time the module spent on each
call, from its debug log (``debug: true``, in every module configuration alike): "Calling command"
to "Removing temp files" for the same container and method, glog's microsecond timestamps; the
module runs one hook at a time for the whole agent, so this is what every other container waits.
Our cost per hook is the median over the no-op floor's median, beside the goal of 5 ms.
"""

from __future__ import annotations

import datetime
import os
import re
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from isolator.testing.agent import Cluster, find_mesos_home  # noqa: E402

CONFIGS = ("none", "noop", "python", "c")
GOAL_PER_HOOK_MS = 5.0
HOOK_LINE = re.compile(
    r"^[IWE](?:\d{4})?(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ \S+\] \[TASK=([^,\]]*), METHOD=(\w+)\] "
    r"(Calling command|Removing temp files)"
)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median_ms": statistics.median(values) * 1000, "p90_ms": _percentile(values, 0.9) * 1000}


def hook_times(log: str) -> dict[str, list[float]]:
    """Seconds per module call, by method, from the module's debug lines in an agent's log."""
    year = datetime.date.today().year
    open_calls: dict[tuple[str, str], list[float]] = {}
    out: dict[str, list[float]] = {}
    for line in log.splitlines():
        m = HOOK_LINE.match(line)
        if not m:
            continue
        month, day, hh, mm, ss, us, task, method, what = m.groups()
        at = datetime.datetime(year, int(month), int(day), int(hh), int(mm), int(ss), int(us)).timestamp()
        key = (task, method)
        if what == "Calling command":
            open_calls.setdefault(key, []).append(at)
        elif open_calls.get(key):
            out.setdefault(method, []).append(at - open_calls[key].pop(0))
    return out


def _wait_state(path: str, state: str, name: str, timeout: float) -> float:
    """monotonic() when mesos-execute's log first shows ``state`` for task ``name`` (read every 2 ms)."""
    needle = f"Received status update {state} for task '{name}'"
    terminal = re.compile(rf"Received status update (TASK_\w+) for task '{re.escape(name)}'")
    deadline = time.monotonic() + timeout
    while True:
        with open(path, errors="replace") as fh:
            text = fh.read()
        if needle in text:
            return time.monotonic()
        for seen in terminal.findall(text):
            if seen in ("TASK_FAILED", "TASK_KILLED", "TASK_LOST", "TASK_ERROR", "TASK_DROPPED", "TASK_GONE"):
                raise RuntimeError(f"task {name} ended {seen} waiting for {state}:\n{text[-2000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"task {name} did not reach {state} in {timeout:g} s:\n{text[-2000:]}")
        time.sleep(0.002)


def run_config(mesos_home: str, config: str, tasks: int, log: Any = print) -> dict[str, Any]:
    hooks: Any = {"none": None, "noop": "noop", "python": "bridge", "c": "bridge-c"}[config]
    if config == "python" and os.environ.get("GI_MESOS_BRIDGE") == "c":
        raise RuntimeError("GI_MESOS_BRIDGE=c would run the compiled bridge in the python configuration: unset it")
    cluster = Cluster(mesos_home, hooks=hooks)
    cluster.module_debug = hooks is not None
    running: list[float] = []
    finished: list[float] = []
    with cluster:
        for i in range(tasks):
            name = f"bench-{config}-{i}"
            submitted = time.monotonic()
            task = cluster.submit("true", gpus=1, name=name)
            running.append(_wait_state(task.log_path, "TASK_RUNNING", name, 120) - submitted)
            finished.append(_wait_state(task.log_path, "TASK_FINISHED", name, 120) - submitted)
            task.proc.wait(60)
            log(f"agent: {config} task {i + 1}/{tasks}: running {running[-1] * 1000:.0f} ms")
        time.sleep(1.5)  # the last cleanup's debug lines (a report, not a test)
        per_hook = hook_times(cluster.agents[0].log())
    return {
        "running": _summary(running),
        "finished": _summary(finished),
        "hooks": {method: _summary(times) for method, times in sorted(per_hook.items())},
    }


def measure(tasks: int = 20, configs: tuple[str, ...] = CONFIGS, log: Any = print) -> dict[str, Any]:
    mesos_home = find_mesos_home()
    out: dict[str, Any] = {"tasks": tasks, "mesos_home": mesos_home, "configs": {}}
    for config in configs:
        log(f"agent: configuration {config}")
        out["configs"][config] = run_config(mesos_home, config, tasks, log)
    floor = out["configs"].get("noop", {}).get("hooks", {})
    for config in ("python", "c"):
        figures = out["configs"].get(config)
        if not figures:
            continue
        figures["over_floor_ms"] = {
            method: s["median_ms"] - floor[method]["median_ms"]
            for method, s in figures["hooks"].items()
            if s.get("n") and floor.get(method, {}).get("n")
        }
    return out


def render(a: dict[str, Any], goal: float = GOAL_PER_HOOK_MS) -> list[str]:
    lines = [
        f"## Agent: {a['tasks']} gpus:1 command tasks one after another through a real Mesos agent"
        " (submit -> state, median / p90)",
        f"   {'configuration':<16}{'TASK_RUNNING':>22}{'TASK_FINISHED':>22}",
    ]
    for config, f in a["configs"].items():
        r, d = f["running"], f["finished"]
        lines.append(
            f"   {config:<16}{r['median_ms']:>12.0f} / {r['p90_ms']:>5.0f} ms"
            f"{d['median_ms']:>12.0f} / {d['p90_ms']:>5.0f} ms"
        )
    methods = sorted({m for f in a["configs"].values() for m in f.get("hooks", {})})
    if methods:
        lines.append("   per hook, the module's wait (median ms; the module runs one hook at a time per agent):")
        lines.append(f"   {'hook':<10}" + "".join(f"{c:>10}" for c in a["configs"] if a["configs"][c]["hooks"]))
        for m in methods:
            cells = [
                f"{f['hooks'][m]['median_ms']:>10.1f}" if f["hooks"].get(m, {}).get("n") else f"{'-':>10}"
                for f in a["configs"].values()
                if f["hooks"]
            ]
            lines.append(f"   {m:<10}" + "".join(cells))
    for config in ("python", "c"):
        over = a["configs"].get(config, {}).get("over_floor_ms")
        if over:
            worst = max(over.values())
            costs = ", ".join(f"{m} {v:+.1f}" for m, v in sorted(over.items()))
            verdict = "met" if worst <= goal else "MISSED"
            lines.append(
                f"   {config} bridge over the no-op floor: {costs} ms; goal <= {goal:g} ms per hook: {verdict}"
            )
    return lines


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    print("\n".join(render(measure(n))))
