#!/usr/bin/env python3
"""The same GPU tasks through Mesos's own ``gpu/nvidia`` isolator and through ours (issue 25, deliverable 5).

One master and one agent on loopback per route (isolator/testing/cluster.py), on the simulated DGX-1:

* ``mesos``: ``--isolation=cgroups/devices,filesystem/linux,gpu/nvidia``, no module, no sidecar. The
  agent finds "NVML" by ``dlopen("libnvidia-ml.so.1")``: the simulated host's fake NVML is preloaded
  (``LD_PRELOAD``; a loaded library with that soname satisfies the dlopen), and it stats
  ``/dev/nvidia*``: in the agent's own mount namespace ``/dev`` is a copy of the host's (a tmpfs, the
  host's nodes copied, its pts/shm/mqueue bound) plus the simulated host's nodes (major 195, no
  driver: an open that passes the device cgroup fails ENXIO). The host's /dev is untouched.
* ``ours``: criteo's module running the compiled bridge against a sidecar in mesos mode on the same
  simulated host (``cgroups/devices`` and the module).

Per route: ``tasks`` command tasks with ``gpus:1`` held at once, then ``tasks`` more with ``gpus:2``
one after another: which GPUs each task could open (the probe in tests/mesos/probe.py),
submit -> TASK_RUNNING (median), and the exact error where the route could not run at all.
Prints a Markdown table for docs/mesos-agent.md. Needs root, cgroup v1 and MESOS_HOME.

``--cgroups v2`` runs both agents on the pure cgroup2 layout (isolator/testing/cluster.py,
``cgroups="v2"``; Mesos master only): Mesos's ``gpu/nvidia`` then grants through its device manager's
program on ``<id>``; ours through the agent's program on ``<id>`` (its ``--allowed_devices`` listing
the NVIDIA nodes) and the sidecar's on ``<id>/leaf``. The kernel column then shows, per cgroup, the
programs bpf(2) finds (Mesos's have no name) and the GPUs that all programs on the way let through.

    python3 scripts/mesos_side_by_side.py [N] [ROUTES] [--cgroups v1|v2]
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from isolator.model import CgroupVersion  # noqa: E402
from isolator.simhost.sim import SimulatedHost  # noqa: E402
from isolator.testing.agent import Agent  # noqa: E402
from isolator.testing.cluster import Cluster  # noqa: E402
from isolator.testing.mesoshome import device_programs, find_mesos_home  # noqa: E402

PROBE = os.path.join(ROOT, "tests", "mesos", "probe.py")

# Run in the agent's mount namespace before exec: /dev becomes a tmpfs copy of the host's plus the
# simulated host's nvidia nodes ($1), so that the gpu/nvidia isolator can stat them.
# Without $GI_SIM_DEV the last copy would read "/." and copy the whole root filesystem into the
# tmpfs (seen once, from a script that made the agent without the simulated host): refused first.
DEV_SCRIPT = r"""
set -e
if [ -z "${GI_SIM_DEV:-}" ] || [ ! -d "$GI_SIM_DEV" ]; then
  echo "GI_SIM_DEV='${GI_SIM_DEV:-}' is not the simulated host's dev directory; /dev left as it is" >&2
  exit 2
fi
new=$(mktemp -d /tmp/gi-dev-XXXXXX)
mount -t tmpfs -o mode=0755 gi-dev "$new"
cp -a /dev/. "$new"/ 2>/dev/null || true
for m in pts shm mqueue hugepages; do
  if mountpoint -q "/dev/$m"; then mkdir -p "$new/$m"; mount --rbind "/dev/$m" "$new/$m"; fi
done
cp -a "$GI_SIM_DEV"/. "$new"/
mount --move "$new" /dev
"""


class NvidiaAgent(Agent):
    """The harness's agent, with the simulated host's /dev/nvidia* in its own mount namespace."""

    def argv(self) -> list[str]:
        sim_dev = os.environ.get("GI_SIM_DEV", "")
        if not os.path.isdir(sim_dev):
            raise RuntimeError(
                f"GI_SIM_DEV={sim_dev!r} is not a directory: the agent's /dev needs the simulated host's"
                " nvidia nodes (set up by the side-by-side run or the agent bench)"
            )
        # A mount namespace for /dev around whatever runs the agent (the v1 unshare, or the v2
        # wrapper, whose own namespace starts from this one's mounts).
        outer = ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c", DEV_SCRIPT + 'exec "$@"', "dev"]
        return [*outer, *super().argv()]


def _opened(stdout: str) -> list[int]:
    return sorted(
        int(name[6:])
        for name, result in re.findall(r"^dev (\S+) (\S+)$", stdout, re.M)
        if name[6:].isdigit() and result != "EPERM"
    )


def _kernel(task: Any) -> list[str]:
    """v1: the devices.list entries for major 195; v2: each cgroup from the container's down to its
    leaf with the programs on it, and the GPU minors every program on the way allows (rw)."""
    agent = task.agent()
    if agent.cgroups is CgroupVersion.V1:
        return [r for r in task.devices_list() if "195:" in r or r.startswith("a ")]
    out = []
    along: list[Any] = []
    root = os.path.join(agent.cgroups_mount(), agent.cgroups_root)
    along += device_programs(root)
    for where, path in (("<id>", task.cgroup()), ("<id>/leaf", task.leaf())):
        progs = device_programs(path)
        along += progs
        names = ", ".join(repr(p.name) for p in progs) or "none"
        gpus = [m for m in range(255) if all(p.allows("c", 195, m) for p in along)]
        out.append(f"{where}: {names} -> GPUs {gpus}")
    return out


def _wait_running(task: Any, timeout: float = 180) -> float:
    started = time.monotonic()
    task.wait("TASK_RUNNING", timeout=timeout)
    return time.monotonic() - started


class SimulatedNvidia:
    """Mesos's own gpu/nvidia on the simulated DGX-1: the fake NVML preloaded into the agent, the
    simulated /dev/nvidia* in its mount namespace (``NvidiaAgent``), through the environment the
    agent starts with. ``restore_env()`` once it has started, so that nothing started later inherits
    it (the agent bench); the simulated host stays until the exit, which restores the environment too."""

    def __enter__(self) -> SimulatedNvidia:
        self.root = tempfile.mkdtemp(prefix="gi-sim-", dir="/tmp")
        SimulatedHost("dgx-1", self.root).setup(make_devices=True)
        self.saved: dict[str, str | None] | None = {k: os.environ.get(k) for k in ("LD_PRELOAD", "GI_SIM_DEV")}
        os.environ["LD_PRELOAD"] = os.path.join(self.root, "nvml", "libnvidia-ml.so.1")
        os.environ["GI_SIM_DEV"] = os.path.join(self.root, "dev")
        return self

    def restore_env(self) -> None:
        if self.saved is None:
            return
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.saved = None

    def __exit__(self, *exc: object) -> None:
        self.restore_env()
        shutil.rmtree(self.root, ignore_errors=True)


def nvidia_cluster(mesos_home: str, **kw: Any) -> Cluster:
    """A cluster whose agent runs Mesos's own gpu/nvidia on the simulated DGX-1 (``NvidiaAgent``; start it
    inside ``SimulatedNvidia``), its eight GPUs given by index."""
    cluster = Cluster(
        mesos_home,
        hooks=None,
        isolation=("cgroups/devices", "filesystem/linux", "gpu/nvidia"),
        agent_flags=("--nvidia_gpu_devices=0,1,2,3,4,5,6,7",),
        **kw,
    )
    for agent in cluster.agents:
        agent.__class__ = NvidiaAgent
        agent.allowed_nvidia = ()  # on v2, gpu/nvidia grants through the device manager itself
    return cluster


def run_route(mesos_home: str, route: str, tasks: int, cgroups: str = "v1") -> dict[str, Any]:
    out: dict[str, Any] = {"route": f"{route} ({cgroups})", "concurrent": [], "pairs": [], "running_s": []}
    with SimulatedNvidia() if route == "mesos" else contextlib.nullcontext():
        return _run_route(mesos_home, route, tasks, cgroups, out)


def _run_route(mesos_home: str, route: str, tasks: int, cgroups: str, out: dict[str, Any]) -> dict[str, Any]:
    if route == "mesos":
        cluster = nvidia_cluster(mesos_home, cgroups=cgroups)
        devdir = "/dev"
    else:
        cluster = Cluster(mesos_home, hooks="bridge-c", cgroups=cgroups)
        devdir = ""
    try:
        cluster.start()
    except Exception as exc:
        out["error"] = str(exc)[-3000:]
        return out
    try:
        if not devdir:
            devdir = cluster.agents[0].sidecar.dev_root  # type: ignore[union-attr]
        held = []
        for i in range(tasks):
            task = cluster.submit(f"python3 {PROBE} {devdir} 600", gpus=1, name=f"{route}-one-{i}")
            out["running_s"].append(_wait_running(task))
            task.wait_stdout("probed")
            stdout = task.stdout()
            out["concurrent"].append(_opened(stdout))
            if i == 0:
                out["others"] = {
                    name: result
                    for name, result in re.findall(r"^dev (\S+) (\S+)$", stdout, re.M)
                    if not name[6:].isdigit()
                }
                out["env"] = re.findall(r"^env (\S+)$", stdout, re.M)
                out["devices_list"] = _kernel(task)
            held.append(task)
        for task in held:
            task.teardown()
        for task in held:
            task.wait_gone()
        for i in range(tasks):
            task = cluster.submit(f"python3 {PROBE} {devdir} 0", gpus=2, name=f"{route}-two-{i}")
            _wait_running(task)
            task.wait("TASK_FINISHED")
            out["pairs"].append(_opened(task.stdout()))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc)[-3000:]}"
        out["agent_log"] = cluster.agents[0].log()[-3000:]
    finally:
        cluster.stop()
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| route | gpus:1 tasks held at once: GPUs each opened | gpus:2 tasks one after another: GPUs opened"
        " | a gpus:1 task: other /dev/nvidia* nodes | its NVIDIA_* env"
        " | what the kernel holds (v1: devices.list, major 195; v2: programs per cgroup) |"
        " submit -> TASK_RUNNING (median) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r and not r["concurrent"]:
            lines.append(f"| {r['route']} | could not run: `{r['error'].strip().splitlines()[-1][:300]}` | | | | | |")
            continue
        running = f"{statistics.median(r['running_s']) * 1000:.0f} ms" if r["running_s"] else "-"
        others = ", ".join(f"{k} {v}" for k, v in sorted(r.get("others", {}).items()))
        lines.append(
            f"| {r['route']} | {' '.join(str(g) for g in r['concurrent'])} | {' '.join(str(p) for p in r['pairs'])}"
            f" | {others} | {' '.join(r.get('env', [])) or '-'} | {'; '.join(r.get('devices_list', []))} | {running} |"
        )
        if "error" in r:
            lines.append(f"| {r['route']} (then) | failed: `{r['error'].strip().splitlines()[-1][:300]}` | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    layout = "v1"
    if "--cgroups" in args:
        i = args.index("--cgroups")
        layout = args[i + 1]
        del args[i : i + 2]
    n = int(args[0]) if args else 4
    routes = args[1].split(",") if len(args) > 1 else ["mesos", "ours"]
    home = find_mesos_home()
    results = [run_route(home, route, n, layout) for route in routes]
    for r in results:
        if "error" in r:
            print(f"{r['route']}: {r['error']}\n{r.get('agent_log', '')}", file=sys.stderr)
    print(table(results))
