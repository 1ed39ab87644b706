#!/usr/bin/env python3
"""What the sidecar costs a task under a real Mesos agent (issue 25, `make bench` part ``agent``).

The same Mesos (``MESOS_HOME`` or ``../shared/mesos/setup.sh``) on this machine, one master and one
agent on loopback per configuration (isolator/testing/cluster.py), ``tasks`` command tasks with
``gpus:1`` submitted one after the other through mesos-execute:

* ``none``: no module (the agent's own ``cgroups/devices`` only): what a task pays without us;
* ``noop``: criteo's module running ``/bin/true`` for every hook, which answers each one correctly
  (empty OUT: nothing to add, no limitation): the floor of this route;
* ``python``: the module running our Python bridge (``python -m isolator.bridge install``);
* ``c``: the module running the compiled bridge (``install --compiled``, isolator/bridge/bridge.c);
* ``native``: our own module (mesos/, ``make module``) talking gRPC to the sidecar (issue 36);
* ``gpu-nvidia``: Mesos's own ``gpu/nvidia`` isolator on the same simulated host, no module, no
  sidecar (the fake NVML preloaded and the simulated /dev/nvidia* in the agent's mount namespace, as
  scripts/mesos_side_by_side.py does).

Issue 36's goals, beside them: the native module's submit -> TASK_RUNNING within 10 ms of "none"
and no slower than ``gpu-nvidia``; a burst of 8 ``gpus:1`` tasks submitted at once, the last RUNNING
within 1.05x of "none" (median of ``burst_rounds`` rounds; the compiled bridge's ratio beside); an XID
on a running task's GPU -> TASK_FAILED at the master, p99 <= 1 s (``xid_rounds`` rounds, native, the
GPU reset after each).

Every agent runs under isolator/testing/reaper.py, which reaps orphans at once as systemd does: this
machine's PID 1 takes about 2 s, and every container's destroy waits for its killed processes.

Every configuration's cluster runs at once and their tasks take turns, one task at a time, starting one
configuration further each round (so a drift of the shared machine falls on all alike; run one after
another, the first configuration measured came out ~50 ms faster than the same code later). Per
configuration: submit -> TASK_RUNNING and submit -> TASK_FINISHED (median, p90), from mesos-execute's
own output, read every few milliseconds; these include starting mesos-execute and the master's
allocation cycle (every 100 ms), noise of tens of milliseconds against a 10 ms goal. So also the
agent's own part, from its log: "Got assigned task" to "Forwarding the update TASK_RUNNING", which
holds every isolator hook on the way to TASK_RUNNING (prepare, isolate, the update at the executor's
registration, status on each update) and none of that noise. Per hook: the time the module spent on each
call, from its debug log (``debug: true``, in every module configuration alike): "Calling command"
to "Removing temp files" for the same container and method, glog's microsecond timestamps; the
module runs one hook at a time for the whole agent, so this is what every other container waits.
Our cost per hook is the median over the no-op floor's median, beside the goal of 5 ms.

Our own module logs each hook's wait as the agent sees it (``GLOG_vmodule=gpu_isolator=1``, set for the
native agent only: "Prepare of container X: done after N ms", from the agent's call to its end, the
container's earlier hooks and retries included) and when each Watch opened; the sidecar logs its
prepare handler step by step ("prepared ... in N ms (booking, choice, state commit, rules, launch
info)"). Both go beside the six configurations (issue 45), with a hook cycle as the module sees it
(prepare + isolate + cleanup medians) against the raw kernel floor of the hook part
(bench_hooks.raw_cycles, cgroup v1, measured in the same run).

The road under faults (issue 45 item 4), on a native agent of its own with ``prepare_timeout``
``FAULT_PREPARE_TIMEOUT``: the sidecar down for good (stopped), a gpus:1 launch from submit to
TASK_FAILED, and what the module waited for its Prepare and its Cleanup; then the sidecar stopped
and started again ``FAULT_RESTART_AFTER_S`` after the submit, the launch from submit to TASK_RUNNING
and from the sidecar serving again to the module's Prepare answered.
"""

from __future__ import annotations

import contextlib
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

from isolator.testing.cluster import Cluster  # noqa: E402
from isolator.testing.mesoshome import GLOG_TIME, find_mesos_home, glog_time, wait_for  # noqa: E402

CONFIGS = ("none", "noop", "python", "c", "native", "gpu-nvidia")
BURST_CONFIGS = ("none", "c", "native")
GOAL_PER_HOOK_MS = 5.0
GOAL_NATIVE_OVER_NONE_MS = 10.0
GOAL_NATIVE_OVER_NONE_45_MS = 5.0  # issue 45: in the agent
GOAL_BURST_RATIO = 1.05
GOAL_XID_P99_S = 1.0
HOOK_LINE = re.compile(r" +\d+ \S+\] \[TASK=([^,\]]*), METHOD=(\w+)\] (Calling command|Removing temp files)")
# What the agent logs of a task and a container, by name or ID (the first such line is the one).
ASSIGNED = re.compile(r"Got assigned task '([^']+)'")
RUNNING_OUT = re.compile(r"Forwarding the update TASK_RUNNING \(.*\) for task (\S+) of")
LIMITED = re.compile(r"gpu-isolator: container (\S+) met a limitation")
# Our module's own view of each hook (VLOG(1) in mesos/gpu_isolator.cpp's inOrder and armWatch).
NATIVE_HOOK = re.compile(
    r"\] gpu-isolator (Prepare|Isolate|Update|Cleanup) of container (\S+): (done|failed) after ([\d.]+) ms"
)
NATIVE_UNSENT = re.compile(r"\] gpu-isolator: Update of container (\S+) changes nothing the sidecar acts on; not sent")
NATIVE_UNAWAITED = re.compile(
    r"\] gpu-isolator Isolate of container (\S+): answered at once, sent without the launch waiting"
)
NATIVE_WATCH = re.compile(r"\] gpu-isolator Watch of container (\S+): opened after ([\d.]+) ms")
# The sidecar's prepare handler, step by step (isolator/core/prepare.py's "prepared" line).
SIDECAR_PREPARE = re.compile(r"prepared container (\S+) .* in ([\d.]+) ms \(([^)]*)\)$")
SIDECAR_STEP = re.compile(r"([a-z][a-z ]*?) ([\d.]+)(?:, |$)")
# The sidecar's isolate handler, step by step (isolator/core/isolate.py's "isolated" line).
SIDECAR_ISOLATE = re.compile(r"isolated pid \d+ in container (\S+) .* in ([\d.]+) ms \(([^)]*)\)$")
# The containerizer's own marks of a container's launch, in order (the first line of each): every
# isolator's prepare lies between PREPARING and ISOLATING (with the launcher's fork), every
# isolator's isolate between ISOLATING and FETCHING; the update at the executor's registration and
# each isolator's status between the registration and TASK_RUNNING leaving.
LAUNCHING = re.compile(r"Launching container (\S+) for executor '([^']+)'")
TRANSITION = re.compile(
    r"Transitioning the state of container (\S+) from \w+ to (PREPARING|ISOLATING|FETCHING|RUNNING) "
)
REGISTERED = re.compile(r"Got registration for executor '([^']+)'")
SEGMENTS = (
    ("prepare", "PREPARING", "ISOLATING"),
    ("isolate", "ISOLATING", "FETCHING"),
    ("executor start", "RUNNING", "registered"),
    ("to TASK_RUNNING", "registered", "running_out"),
)
FAILED_OUT = re.compile(r"Forwarding the update TASK_FAILED \(.*\) for task (\S+) of")
# The module's hook logging, for the native agent only (glog's per-file verbosity: our file alone).
NATIVE_VMODULE = "gpu_isolator=1"
VMODULE_ENV = "GLOG_vmodule"  # glog's name for its --vmodule flag, in this case
FAULT_PREPARE_TIMEOUT = "5secs"
FAULT_RESTART_AFTER_S = 1.0


def first_times(log: str, pattern: re.Pattern[str]) -> dict[str, float]:
    """For each value of ``pattern``'s group, the time of the first line of ``log`` it matches: one
    pass over the log, however many tasks or containers are looked up in it."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = pattern.search(line)
        if m is not None and m.group(1) not in out:
            at = glog_time(line)
            if at is not None:
                out[m.group(1)] = at
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median_ms": statistics.median(values) * 1000, "p90_ms": _percentile(values, 0.9) * 1000}


def hook_times(log: str) -> dict[str, list[float]]:
    """Seconds per module call, by method, from the module's debug lines in an agent's log."""
    open_calls: dict[tuple[str, str], list[float]] = {}
    out: dict[str, list[float]] = {}
    for line in log.splitlines():
        prefix = GLOG_TIME.match(line)
        m = HOOK_LINE.match(line, prefix.end() - 1) if prefix else None
        at = glog_time(line) if m else None
        if m is None or at is None:
            continue
        task, method, what = m.groups()
        key = (task, method)
        if what == "Calling command":
            open_calls.setdefault(key, []).append(at)
        elif open_calls.get(key):
            out.setdefault(method, []).append(at - open_calls[key].pop(0))
    return out


def native_hook_times(log: str) -> dict[str, list[float]]:
    """Seconds per hook as our module saw it (its "done/failed after N ms" lines), by hook in lower
    case (as criteo's METHOD names); "update, unsent" for the Updates it answered itself (the one at
    the executor's registration), "isolate, unawaited" for the Isolates it answered at once (the
    call's own time, which no launch waited for), "watch" for the time until the Watch opened."""
    out: dict[str, list[float]] = {}
    unsent: set[str] = set()
    unawaited: set[str] = set()
    for line in log.splitlines():
        u = NATIVE_UNSENT.search(line)
        if u is not None:
            unsent.add(u.group(1))
            continue
        a = NATIVE_UNAWAITED.search(line)
        if a is not None:
            unawaited.add(a.group(1))
            continue
        m = NATIVE_HOOK.search(line)
        if m is not None:
            hook = m.group(1).lower()
            if hook == "update" and m.group(2) in unsent:
                unsent.discard(m.group(2))
                hook = "update, unsent"
            elif hook == "isolate" and m.group(2) in unawaited:
                unawaited.discard(m.group(2))
                hook = "isolate, unawaited"
            out.setdefault(hook, []).append(float(m.group(4)) / 1000)
            continue
        w = NATIVE_WATCH.search(line)
        if w is not None:
            out.setdefault("watch", []).append(float(w.group(2)) / 1000)
    return out


def native_cycles(log: str) -> list[float]:
    """Per container, seconds of its Prepare + Isolate + Cleanup as our module waited for them (a
    container without all three done is left out): the hook cycle of the hook part, in the agent."""
    spent: dict[str, dict[str, float]] = {}
    for m in NATIVE_HOOK.finditer(log):
        if m.group(1) != "Update" and m.group(3) == "done":
            spent.setdefault(m.group(2), {})[m.group(1)] = float(m.group(4)) / 1000
    return [sum(h.values()) for h in spent.values() if len(h) == 3]


def native_hook_of(log: str, hook: str, container: str) -> tuple[str, float] | None:
    """("done" or "failed", seconds) of ``hook`` of ``container`` as our module logged it, or None."""
    for m in NATIVE_HOOK.finditer(log):
        if m.group(1) == hook and m.group(2) == container:
            return m.group(3), float(m.group(4)) / 1000
    return None


def sidecar_prepare_steps(log: str) -> dict[str, list[float]]:
    """Milliseconds of the sidecar's prepare handler per step ("total" for the whole handler), from
    its "prepared ... in N ms (step ms, ...)" lines."""
    return _handler_steps(log, SIDECAR_PREPARE)


def sidecar_isolate_steps(log: str) -> dict[str, list[float]]:
    """The same of its isolate handler, from its "isolated ... in N ms (step ms, ...)" lines."""
    return _handler_steps(log, SIDECAR_ISOLATE)


def _handler_steps(log: str, line: re.Pattern[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for text in log.splitlines():
        m = line.search(text.rstrip())
        if m is None:
            continue
        out.setdefault("total", []).append(float(m.group(2)))
        steps = [(name, float(ms)) for name, ms in SIDECAR_STEP.findall(m.group(3))]
        for name, ms in steps:
            out.setdefault(name, []).append(ms)
        names = [name for name, _ in steps]
        if "answer" in names:  # a Prepare that answered early: its time to the answer
            out.setdefault("answered", []).append(sum(ms for _, ms in steps[: names.index("answer") + 1]))
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


def make_cluster(mesos_home: str, config: str, **kw: Any) -> Cluster:
    if config == "gpu-nvidia":
        from mesos_side_by_side import nvidia_cluster

        return nvidia_cluster(mesos_home, **kw)
    if config == "native":
        return Cluster(mesos_home, route="native", **kw)  # its hook lines: start_clusters sets GLOG_vmodule
    hooks: Any = {"none": None, "noop": "noop", "python": "bridge", "c": "bridge-c"}[config]
    if config == "python" and os.environ.get("GI_MESOS_BRIDGE") == "c":
        raise RuntimeError("GI_MESOS_BRIDGE=c would run the compiled bridge in the python configuration: unset it")
    cluster = Cluster(mesos_home, hooks=hooks, **kw)
    cluster.module_debug = hooks is not None
    return cluster


def start_clusters(
    stack: contextlib.ExitStack, mesos_home: str, configs: tuple[str, ...], out: dict[str, Any], log: Any
) -> dict[str, Cluster]:
    """One running cluster per configuration, all at once (so that their tasks can take turns);
    a configuration that cannot start is recorded in ``out["configs"]`` and left out. gpu-nvidia
    starts last: its agent needs the simulated NVML in its environment, which nothing after it may
    inherit."""
    from mesos_side_by_side import SimulatedNvidia

    clusters: dict[str, Cluster] = {}
    for config in sorted(configs, key=lambda c: c == "gpu-nvidia"):
        log(f"agent: starting configuration {config}")
        try:
            sim = stack.enter_context(SimulatedNvidia()) if config == "gpu-nvidia" else None
            try:
                with _native_logging(config == "native"):
                    clusters[config] = stack.enter_context(make_cluster(mesos_home, config))
            finally:
                if sim is not None:
                    sim.restore_env()
        except Exception as exc:  # a report: say what could not run, go on with the rest
            out["configs"][config] = {"error": f"{type(exc).__name__}: {str(exc)[-500:]}"}
    return clusters


@contextlib.contextmanager
def _native_logging(on: bool) -> Any:
    """GLOG_vmodule for an agent started in the block (our module's hook lines), and for nothing else."""
    saved = os.environ.get(VMODULE_ENV)
    if on:
        os.environ[VMODULE_ENV] = NATIVE_VMODULE
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(VMODULE_ENV, None)
        else:
            os.environ[VMODULE_ENV] = saved


def _turns(configs: list[str], i: int) -> list[str]:
    """Round ``i``'s order: each configuration in turn, starting one further each round, so that no
    configuration always follows the same one and a drift of the machine falls on all alike."""
    k = i % len(configs) if configs else 0
    return configs[k:] + configs[:k]


def one_task(cluster: Cluster, name: str) -> tuple[float, float]:
    """A ``true`` task with ``gpus:1``: seconds from submit to TASK_RUNNING and to TASK_FINISHED as
    mesos-execute shows them. Returns once the agent has destroyed its container (``_wait_cleaned``)."""
    agent_log = cluster.agents[0].log_path
    mark = os.path.getsize(agent_log)
    submitted = time.monotonic()
    task = cluster.submit("true", gpus=1, name=name)
    running = _wait_state(task.log_path, "TASK_RUNNING", name, 120) - submitted
    finished = _wait_state(task.log_path, "TASK_FINISHED", name, 120) - submitted
    task.proc.wait(60)
    _wait_cleaned(agent_log, mark, name, 60)
    return running, finished


def _wait_cleaned(path: str, offset: int, name: str, timeout: float) -> None:
    """Until the agent's log (read from ``offset`` on) shows task ``name``'s executor cleaned up, which
    it logs once its container is destroyed, every isolator's cleanup done. The command executor exits
    a second after its task ends and the agent destroys the container then: a next task submitted
    before that has its launch overlap this destroy, whose cost differs by configuration (criteo's
    Cleanup runs a bridge process, ours a gRPC call). The configurations take turns in a fixed cycle,
    so each would always follow the same other one and carry its destroy: a bias, not only noise."""
    needle = f"Cleaning up executor '{name}'".encode()
    seen = bytearray()
    with open(path, "rb") as fh:
        fh.seek(offset)

        def cleaned() -> bool:
            seen.extend(fh.read())  # only what the agent wrote since the last look
            return needle in seen

        wait_for(f"the agent to clean up task {name}'s executor", cleaned, timeout, 0.02)


def inside_the_agent(log: str, names: list[str]) -> list[float]:
    """Per task, the agent's own time from its arrival ("Got assigned task") to its TASK_RUNNING
    leaving for the master ("Forwarding the update TASK_RUNNING"), from the agent's log (a task with
    a line missing is left out): no framework start or allocation cycle adds noise to it. The
    executor's start is in it (two loads of libmesos, the launcher's and the executor's), and so is
    the framework's acknowledgement of TASK_STARTING: the agent forwards a task's updates one at a
    time, so TASK_RUNNING leaves only once the master has brought that acknowledgement back."""
    assigned, out = first_times(log, ASSIGNED), first_times(log, RUNNING_OUT)
    return [out[n] - assigned[n] for n in names if n in assigned and n in out]


def launch_segments(log: str, names: list[str]) -> dict[str, list[float]]:
    """Per segment of a launch (``SEGMENTS``), seconds per task (a task with a mark missing is left
    out of that segment): where the agent's time between arrival and TASK_RUNNING goes, so that the
    isolators' part is seen apart from the executor's start, which varies by tens of ms."""
    marks: dict[str, dict[str, float]] = {n: {} for n in names}
    container_of: dict[str, str] = {}
    for line in log.splitlines():
        at = glog_time(line)
        if at is None:
            continue
        m = LAUNCHING.search(line)
        if m is not None and m.group(2) in marks:
            container_of.setdefault(m.group(1), m.group(2))
            continue
        m = TRANSITION.search(line)
        if m is not None and m.group(1) in container_of:
            marks[container_of[m.group(1)]].setdefault(m.group(2), at)
            continue
        m = REGISTERED.search(line)
        if m is not None and m.group(1) in marks:
            marks[m.group(1)].setdefault("registered", at)
            continue
        m = RUNNING_OUT.search(line)
        if m is not None and m.group(1) in marks:
            marks[m.group(1)].setdefault("running_out", at)
    out: dict[str, list[float]] = {}
    for name, start, end in SEGMENTS:
        out[name] = [t[end] - t[start] for t in marks.values() if start in t and end in t]
    return out


def bootstrap_diff(a: list[float], b: list[float], rounds: int = 2000, seed: int = 45) -> tuple[float, float]:
    """A 95 % interval of median(a) - median(b), by resampling each (a fixed seed: the same samples
    give the same interval): how far apart two configurations' medians are beyond the noise."""
    import random

    rng = random.Random(seed)
    diffs = sorted(
        statistics.median(rng.choices(a, k=len(a))) - statistics.median(rng.choices(b, k=len(b))) for _ in range(rounds)
    )
    return diffs[int(0.025 * rounds)], diffs[int(0.975 * rounds) - 1]


def tasks_in_turn(clusters: dict[str, Cluster], tasks: int, out: dict[str, Any], log: Any) -> None:
    """``tasks`` tasks per configuration, the configurations taking turns (``_turns``)."""
    samples: dict[str, dict[str, list[float]]] = {c: {"running": [], "finished": []} for c in clusters}
    alive = list(clusters)
    for i in range(tasks):
        for config in _turns(alive, i):
            try:
                running, finished = one_task(clusters[config], f"bench-{config}-{i}")
            except Exception as exc:
                out["configs"][config] = {"error": f"{type(exc).__name__}: {str(exc)[-500:]}"}
                alive.remove(config)
                continue
            samples[config]["running"].append(running)
            samples[config]["finished"].append(finished)
            log(f"agent: {config} task {i + 1}/{tasks}: running {running * 1000:.0f} ms")
    time.sleep(1.5)  # the last cleanups' debug lines (a report, not a test)
    for config in alive:
        agent = clusters[config].agents[0]
        agent_log = agent.log()
        native = config == "native"
        per_hook = native_hook_times(agent_log) if native else hook_times(agent_log)
        names = [f"bench-{config}-{i}" for i in range(tasks)]
        inside = inside_the_agent(agent_log, names)
        out["configs"][config] = {
            "running": _summary(samples[config]["running"]),
            "finished": _summary(samples[config]["finished"]),
            "agent_running": _summary(inside),
            "agent_running_s": inside,
            "segments": {name: _summary(v) for name, v in launch_segments(agent_log, names).items()},
            "hooks": {method: _summary(times) for method, times in sorted(per_hook.items())},
        }
        if native:
            cycles = native_cycles(agent_log)
            out["configs"][config]["cycle"] = {
                "n": len(cycles),
                **(
                    {"p50_ms": _percentile(cycles, 0.5) * 1000, "p99_ms": _percentile(cycles, 0.99) * 1000}
                    if cycles
                    else {}
                ),
            }
        if native and agent.sidecar is not None:
            with open(agent.sidecar.log_path, errors="replace") as fh:
                sidecar_log = fh.read()
            for hook, read in (("prepare", sidecar_prepare_steps), ("isolate", sidecar_isolate_steps)):
                out["configs"][config][f"sidecar_{hook}_ms"] = {
                    name: {"n": len(v), "median_ms": statistics.median(v)} for name, v in read(sidecar_log).items()
                }


def raw_floor(clusters: dict[str, Cluster], cycles: int) -> dict[str, Any]:
    """The hook part's raw kernel floor on cgroup v1 (mkdir, deny + the 1-GPU rules, the pid in and
    out, rmdir: bench_hooks.raw_cycles), on the native agent's simulated /dev, in this run."""
    import bench_hooks

    native = clusters.get("native")
    if native is None or native.agents[0].sidecar is None:
        return {"error": "the native configuration did not run"}
    try:
        figures = bench_hooks.raw_cycles("v1", cycles, native.agents[0].sidecar.dev_root)
    except Exception as exc:  # a report: say why it is missing
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"cycles": cycles, "p50_ms": figures["p50_ms"], "p99_ms": figures["p99_ms"]}


def bursts_in_turn(clusters: dict[str, Cluster], rounds: int, log: Any, size: int = 8) -> dict[str, Any]:
    """Per configuration, seconds from submitting ``size`` gpus:1 tasks at once to the last one's
    TASK_RUNNING, per round; the configurations take turns round by round."""
    out: dict[str, Any] = {c: [] for c in clusters}
    for r in range(rounds):
        for config in _turns(list(clusters), r):
            if not isinstance(out[config], list):
                continue
            cluster = clusters[config]
            try:
                started = time.monotonic()
                tasks = [cluster.submit("sleep 600", gpus=1, name=f"burst-{config}-{r}-{i}") for i in range(size)]
                last = max(_wait_state(t.log_path, "TASK_RUNNING", t.name, 180) for t in tasks)
                out[config].append(last - started)
                log(f"agent: burst {config} round {r + 1}/{rounds}: last RUNNING after {out[config][-1]:.2f} s")
                for t in tasks:
                    t.teardown()
                for t in tasks:
                    t.wait_gone(120)
            except Exception as exc:
                out[config] = {"error": f"{type(exc).__name__}: {str(exc)[-500:]}"}
    return out


def xid_latency(mesos_home: str, rounds: int, log: Any = print) -> dict[str, list[float]]:
    """Per round, seconds from an XID written to a running gpus:1 task's GPU to the task's TASK_FAILED
    at the master ("failed"), and to the agent logging our module's limitation ("limitation": the
    sidecar's and the module's share; the rest is the agent destroying the container and sending the
    update). Native route. After each round the GPU is reset (unbound and bound again, as an operator
    would) and the next round starts once the sidecar holds it healthy, so rounds are not bounded by
    the host's 8 GPUs."""
    out: dict[str, list[float]] = {"failed": [], "limitation": []}
    injected_at: dict[str, float] = {}  # container ID -> when its GPU had the XID
    with make_cluster(mesos_home, "native") as cluster:
        agent = cluster.agents[0]
        sidecar = agent.sidecar
        assert sidecar is not None
        for r in range(rounds):
            task = cluster.submit("sleep 600", gpus=1, name=f"xid-{r}")
            _wait_state(task.log_path, "TASK_RUNNING", task.name, 120)
            cid = task.container_id()
            (index,) = [i for i, h in agent.holders().items() if h == cid]
            injected = injected_at[cid] = time.time()
            sidecar.sim.inject_xid(index, 79)
            task.wait("TASK_FAILED", timeout=60)
            out["failed"].append(task.status_times()["TASK_FAILED"] - injected)
            log(f"agent: xid round {r + 1}/{rounds}: TASK_FAILED after {out['failed'][-1] * 1000:.0f} ms")
            task.wait_gone(60)
            sidecar.sim.unbind(index)
            sidecar.sim.bind(index)
            _wait_healthy(agent, index)
        limited = first_times(agent.log(), LIMITED)
        out["limitation"] = [limited[cid] - at for cid, at in injected_at.items() if cid in limited]
    return out


def fault_road(mesos_home: str, rounds: int, log: Any = print) -> dict[str, Any]:
    """Issue 45 item 4 on a native agent of its own (prepare_timeout FAULT_PREPARE_TIMEOUT):
    ``down``: per round, the sidecar stopped for good, a gpus:1 launch's submit -> TASK_FAILED (s), and
    the module's Prepare and Cleanup waits (s, its own lines); ``restart``: per round, the sidecar
    stopped, the task submitted, the sidecar started again FAULT_RESTART_AFTER_S later: submit ->
    TASK_RUNNING and from the sidecar serving again to the module's Prepare answered (glog's clock)."""
    out: dict[str, Any] = {"prepare_timeout": FAULT_PREPARE_TIMEOUT, "restart_after_s": FAULT_RESTART_AFTER_S}
    down: list[dict[str, float]] = []
    restart: list[dict[str, float]] = []
    with contextlib.ExitStack() as stack:
        with _native_logging(True):  # the agent starts with our module's hook lines on
            cluster = stack.enter_context(
                Cluster(mesos_home, route="native", module_params={"prepare_timeout": FAULT_PREPARE_TIMEOUT})
            )
        agent = cluster.agents[0]
        sidecar = agent.sidecar
        assert sidecar is not None
        warm = cluster.submit("true", gpus=1, name="fault-warm")  # the module's channel is connected
        warm.wait("TASK_FINISHED", timeout=120)
        warm.wait_gone(60)
        for r in range(rounds):
            sidecar.terminate()
            mark = len(agent.log())
            try:
                submitted = time.monotonic()
                task = cluster.submit("true", gpus=1, name=f"fault-down-{r}")
                failed = _wait_state(task.log_path, "TASK_FAILED", task.name, 120) - submitted
                figures = {"failed_s": failed}
                # One launch at a time: the Prepare that failed after the mark is this task's.
                ended = _wait_hooks(agent, mark, 30)
            finally:
                agent.start_sidecar()
            figures.update(ended)
            down.append(figures)
            log(f"agent: fault round {r + 1}/{rounds}, sidecar down: TASK_FAILED after {failed:.2f} s")
        for r in range(rounds):
            sidecar.terminate()
            submitted = time.monotonic()
            task = cluster.submit("sleep 600", gpus=1, name=f"fault-restart-{r}")
            time.sleep(max(0.0, submitted + FAULT_RESTART_AFTER_S - time.monotonic()))
            agent.start_sidecar()
            serving = time.time()
            running = _wait_state(task.log_path, "TASK_RUNNING", task.name, 120) - submitted
            cid = task.container_id()
            answered = _hook_end(agent.log(), "Prepare", cid)
            figures = {"running_s": running}
            if answered is not None:
                figures["serving_to_prepared_s"] = answered - serving
            restart.append(figures)
            log(f"agent: fault round {r + 1}/{rounds}, sidecar restarted: TASK_RUNNING after {running:.2f} s")
            task.teardown()
            task.wait_gone(60)
    out["down"], out["restart"] = down, restart
    return out


def _wait_hooks(agent: Any, mark: int, timeout: float) -> dict[str, float]:
    """The module's Prepare (failed) and Cleanup waits, in seconds, of the one launch whose lines
    follow ``mark`` in the agent's log, once both are there (or what there is after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        text = agent.log()[mark:]
        failed = [m for m in NATIVE_HOOK.finditer(text) if m.group(1) == "Prepare" and m.group(3) == "failed"]
        out: dict[str, float] = {}
        if failed:
            container = failed[0].group(2)
            out["prepare_s"] = float(failed[0].group(4)) / 1000
            cleanup = native_hook_of(text, "Cleanup", container)
            if cleanup is not None:
                out["cleanup_s"] = cleanup[1]
                return out
        if time.monotonic() > deadline:
            return out
        time.sleep(0.05)


def _hook_end(log: str, hook: str, container: str) -> float | None:
    """time.time() of the module's line that ``hook`` of ``container`` ended (glog's clock)."""
    for line in log.splitlines():
        m = NATIVE_HOOK.search(line)
        if m is not None and m.group(1) == hook and m.group(2) == container:
            return glog_time(line)
    return None


def _wait_healthy(agent: Any, index: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        gpus = {int(g["index"]): g for g in agent.sidecar_json("gpus")["gpus"]}
        if gpus[index]["healthy"]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"GPU {index} not healthy again {timeout:g} s after its reset: {gpus[index]}")
        time.sleep(0.1)


def measure(
    tasks: int = 40,
    configs: tuple[str, ...] = CONFIGS,
    log: Any = print,
    burst_rounds: int = 3,
    xid_rounds: int = 40,
    fault_rounds: int = 3,
    raw_cycles: int = 200,
) -> dict[str, Any]:
    mesos_home = find_mesos_home()
    out: dict[str, Any] = {"tasks": tasks, "mesos_home": mesos_home, "configs": {}, "burst": {}, "xid": {}}
    with contextlib.ExitStack() as stack:
        clusters = start_clusters(stack, mesos_home, configs, out, log)
        tasks_in_turn(clusters, tasks, out, log)
        out["raw_floor"] = raw_floor(clusters, raw_cycles)
        if burst_rounds:
            bursting = {c: clusters[c] for c in BURST_CONFIGS if c in clusters and "error" not in out["configs"][c]}
            out["burst"] = bursts_in_turn(bursting, burst_rounds, log)
    if xid_rounds and "native" in configs:
        try:
            out["xid"] = xid_latency(mesos_home, xid_rounds, log)
        except Exception as exc:
            out["xid"] = {"error": f"{type(exc).__name__}: {str(exc)[-500:]}"}
    if fault_rounds and "native" in configs:
        try:
            out["faults"] = fault_road(mesos_home, fault_rounds, log)
        except Exception as exc:
            out["faults"] = {"error": f"{type(exc).__name__}: {str(exc)[-500:]}"}
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
        f"## Agent: {a['tasks']} gpus:1 command tasks per configuration through a real Mesos agent, one at a"
        " time, the configurations taking turns (median / p90)",
        f"   {'configuration':<16}{'submit->RUNNING':>22}{'submit->FINISHED':>22}{'in the agent':>22}",
    ]
    for config, f in a["configs"].items():
        if "error" in f:
            lines.append(f"   {config:<16}could not run: {f['error']}")
            continue
        r, d, g = f["running"], f["finished"], f.get("agent_running", {"n": 0})
        inside = f"{g['median_ms']:>12.1f} / {g['p90_ms']:>5.1f} ms" if g.get("n") else f"{'-':>22}"
        lines.append(
            f"   {config:<16}{r['median_ms']:>12.0f} / {r['p90_ms']:>5.0f} ms"
            f"{d['median_ms']:>12.0f} / {d['p90_ms']:>5.0f} ms{inside}"
        )
    lines.append(
        "   in the agent: from the agent's 'Got assigned task' to its 'Forwarding the update TASK_RUNNING',"
        " its log's timestamps (no framework start, no allocation cycle; the executor's start and the"
        " framework's acknowledgement of TASK_STARTING, which TASK_RUNNING waits for, are in it)"
    )
    methods = sorted({m for f in a["configs"].values() for m in f.get("hooks", {})})
    if methods:
        lines.append("   per hook, the module's wait (median ms; the module runs one hook at a time per agent):")
        lines.append(f"   {'hook':<16}" + "".join(f"{c:>10}" for c in a["configs"] if a["configs"][c].get("hooks")))
        for m in methods:
            cells = [
                f"{f['hooks'][m]['median_ms']:>10.1f}" if f["hooks"].get(m, {}).get("n") else f"{'-':>10}"
                for f in a["configs"].values()
                if f.get("hooks")
            ]
            lines.append(f"   {m:<16}" + "".join(cells))
        if a["configs"].get("native", {}).get("hooks"):
            lines.append(
                "   native: from the agent's call to the hook's end as our module logs it (its earlier hooks of"
                " the container and retries included; update: unsent ones too; isolate, unawaited: the call"
                " the launch did not wait for); watch: until the Watch opened (held until the container's"
                " Isolate ended)"
            )
    lines += render_segments(a)
    lines += render_native(a)
    for config in ("python", "c"):
        over = a["configs"].get(config, {}).get("over_floor_ms")
        if over:
            worst = max(over.values())
            costs = ", ".join(f"{m} {v:+.1f}" for m, v in sorted(over.items()))
            verdict = "met" if worst <= goal else "MISSED"
            lines.append(
                f"   {config} bridge over the no-op floor: {costs} ms; goal <= {goal:g} ms per hook: {verdict}"
            )
    lines += render_goals(a)
    return lines


def render_segments(a: dict[str, Any]) -> list[str]:
    """Where the agent's time from arrival to TASK_RUNNING goes, per configuration (median ms), and
    each configuration's launch (prepare + isolate segments) over none's."""
    shown = {c: f["segments"] for c, f in a["configs"].items() if f.get("segments")}
    if not shown:
        return []
    lines = [
        "   the agent's launch by segment (median ms, from its log): prepare = every isolator's prepare and the"
        " fork, isolate = every isolator's isolate, then the executor's start and its registration -> TASK_RUNNING out",
        f"   {'segment':<16}" + "".join(f"{c:>11}" for c in shown),
    ]
    for name, _, _ in SEGMENTS:
        cells = [
            f"{seg[name]['median_ms']:>11.1f}" if seg.get(name, {}).get("n") else f"{'-':>11}" for seg in shown.values()
        ]
        lines.append(f"   {name:<16}" + "".join(cells))
    base = shown.get("none")
    if base and all(base.get(k, {}).get("n") for k in ("prepare", "isolate")):
        floor = base["prepare"]["median_ms"] + base["isolate"]["median_ms"]
        over = [
            f"{c} {seg['prepare']['median_ms'] + seg['isolate']['median_ms'] - floor:+.1f}"
            for c, seg in shown.items()
            if c != "none" and all(seg.get(k, {}).get("n") for k in ("prepare", "isolate"))
        ]
        lines.append(f"   prepare + isolate over none's ({floor:.1f} ms): " + ", ".join(over) + " ms")
    return lines


def render_native(a: dict[str, Any]) -> list[str]:
    """Issue 45: the sidecar's prepare handler by step, the hook cycle against the raw kernel floor,
    and the road under faults."""
    lines: list[str] = []
    for hook in ("prepare", "isolate"):
        steps = a["configs"].get("native", {}).get(f"sidecar_{hook}_ms")
        if steps and "total" in steps:
            parts = ", ".join(
                f"{name} {v['median_ms']:.2f}" for name, v in steps.items() if name not in ("total", "answered")
            )
            early = steps.get("answered")
            answered = (
                f"; {early['n']} answered early, after {early['median_ms']:.2f} ms (the steps after 'answer' follow it)"
                if early
                else ""
            )
            lines.append(
                f"   native: the sidecar's {hook} handler (its log, median of {steps['total']['n']}):"
                f" {steps['total']['median_ms']:.2f} ms ({parts}){answered}"
            )
    cycle, floor = a["configs"].get("native", {}).get("cycle", {}), a.get("raw_floor", {})
    if cycle.get("n") and floor.get("p50_ms"):
        lines.append(
            f"   native hook cycle (each container's prepare + isolate + cleanup as the module waited, {cycle['n']}"
            f" containers): p50 {cycle['p50_ms']:.2f} ms = {cycle['p50_ms'] / floor['p50_ms']:.1f}x, p99"
            f" {cycle['p99_ms']:.2f} ms = {cycle['p99_ms'] / floor['p99_ms']:.1f}x the raw kernel floor on cgroup v1"
            f" (p50 {floor['p50_ms']:.3f}, p99 {floor['p99_ms']:.3f} ms over {floor['cycles']} cycles, this run)"
        )
    elif cycle or floor:
        lines.append(f"   native hook cycle against the raw floor: not measured (cycle {cycle}, floor {floor})")
    lines += render_faults(a.get("faults"))
    return lines


def render_faults(f: Any) -> list[str]:
    if not f:
        return []
    if "error" in f:
        return [f"   faults: could not run: {f['error']}"]
    lines = [f"   faults (native, prepare_timeout {f['prepare_timeout']}, median of {len(f.get('down', []))} rounds):"]

    def med(rows: list[dict[str, float]], key: str) -> str:
        values = [r[key] for r in rows if key in r]
        return f"{statistics.median(values):.2f} s" if values else "-"

    down, restart = f.get("down", []), f.get("restart", [])
    if down:
        lines.append(
            f"   sidecar down for good: submit -> TASK_FAILED {med(down, 'failed_s')}; the module waited"
            f" {med(down, 'prepare_s')} for Prepare, {med(down, 'cleanup_s')} for Cleanup"
        )
    if restart:
        lines.append(
            f"   sidecar restarted {f['restart_after_s']:g} s after the submit: submit -> TASK_RUNNING"
            f" {med(restart, 'running_s')}; sidecar serving -> the module's Prepare answered"
            f" {med(restart, 'serving_to_prepared_s')}"
        )
    return lines


def _median_of(a: dict[str, Any], config: str, key: str) -> float | None:
    f = a["configs"].get(config, {})
    return float(f[key]["median_ms"]) if f.get(key, {}).get("n") else None


def render_issue45_goal(a: dict[str, Any]) -> list[str]:
    """Issue 45: in the agent, native's median within 5 ms of none's and within the noise of
    gpu/nvidia's (the 95 % bootstrap interval of the difference of medians holds 0, or native is
    the faster), each difference with its interval."""
    samples = {c: a["configs"].get(c, {}).get("agent_running_s") or [] for c in ("native", "none", "gpu-nvidia")}
    if not samples["native"] or not samples["none"]:
        return ["   issue 45: in the agent: not measured (native or none did not run)"]
    native = statistics.median(samples["native"])

    def vs(other: str) -> tuple[float, tuple[float, float]]:
        lo, hi = bootstrap_diff(samples["native"], samples[other])
        return (native - statistics.median(samples[other])) * 1000, (lo * 1000, hi * 1000)

    over_none, (nlo, nhi) = vs("none")
    text = f"   issue 45: in the agent, native - none {over_none:+.1f} ms (95 % interval {nlo:+.1f} .. {nhi:+.1f})"
    met = over_none <= GOAL_NATIVE_OVER_NONE_45_MS
    if samples["gpu-nvidia"]:
        over_nvidia, (vlo, vhi) = vs("gpu-nvidia")
        text += f", native - gpu/nvidia {over_nvidia:+.1f} ms ({vlo:+.1f} .. {vhi:+.1f})"
        met = met and (vlo <= 0 or over_nvidia <= 0)
    else:
        text += ", gpu/nvidia did not run"
        met = False
    verdict = "met" if met else "MISSED"
    return [
        text + f"; goal within {GOAL_NATIVE_OVER_NONE_45_MS:g} ms of none and within the noise of gpu/nvidia: {verdict}"
    ]


def render_goals(a: dict[str, Any]) -> list[str]:
    """Issue 36's three goals, met or missed, with their figures (or why a figure is missing)."""
    lines = ["   issue 36 goals (native module):"]
    for label, key in (
        ("submit -> TASK_RUNNING", "running"),
        ("in the agent, arrival -> TASK_RUNNING out", "agent_running"),
    ):
        native, none, nvidia = (_median_of(a, c, key) for c in ("native", "none", "gpu-nvidia"))
        if native is None or none is None:
            lines.append(f"   1. {label}: not measured (native or none did not run)")
            continue
        over = native - none
        verdict = "met" if over <= GOAL_NATIVE_OVER_NONE_MS and (nvidia is None or native <= nvidia) else "MISSED"
        vs = (
            f", gpu/nvidia {nvidia:.1f} ms ({native - nvidia:+.1f})"
            if nvidia is not None
            else ", gpu/nvidia did not run"
        )
        lines.append(
            f"   1. {label} median: native {native:.1f} ms, none {none:.1f} ms ({over:+.1f} ms){vs};"
            f" goal within {GOAL_NATIVE_OVER_NONE_MS:g} ms of none and no slower than gpu/nvidia: {verdict}"
        )
    lines += render_issue45_goal(a)
    burst_figures = a.get("burst", {})
    medians = {c: statistics.median(v) for c, v in burst_figures.items() if isinstance(v, list) and v}
    if "native" in medians and "none" in medians:
        ratio = medians["native"] / medians["none"]
        beside = (
            f"; criteo + compiled bridge {medians['c']:.2f} s = {medians['c'] / medians['none']:.2f}x"
            if "c" in medians
            else ""
        )
        verdict = "met" if ratio <= GOAL_BURST_RATIO else "MISSED"
        lines.append(
            f"   2. 8 gpus:1 at once, last RUNNING (median of {len(burst_figures['native'])}):"
            f" none {medians['none']:.2f} s,"
            f" native {medians['native']:.2f} s = {ratio:.2f}x{beside}; goal <= {GOAL_BURST_RATIO:g}x: {verdict}"
        )
    else:
        lines.append(f"   2. burst of 8: not measured ({burst_figures})")
    xid = a.get("xid")
    xid = xid if isinstance(xid, dict) else {"error": xid}
    failed = xid.get("failed")
    if failed:
        p99 = _percentile(failed, 0.99)
        verdict = "met" if p99 <= GOAL_XID_P99_S else "MISSED"
        limited = xid.get("limitation") or []
        ours = (
            f"; of which XID -> the module's limitation in the agent's log: median"
            f" {statistics.median(limited) * 1000:.0f} ms, p99 {_percentile(limited, 0.99) * 1000:.0f} ms"
            if limited
            else ""
        )
        lines.append(
            f"   3. XID -> TASK_FAILED over {len(failed)} rounds: median {statistics.median(failed) * 1000:.0f} ms,"
            f" p99 {p99 * 1000:.0f} ms; goal p99 <= {GOAL_XID_P99_S * 1000:.0f} ms: {verdict}{ours}"
        )
    else:
        lines.append(f"   3. XID -> TASK_FAILED: not measured ({xid})")
    return lines


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    print("\n".join(render(measure(n))))
