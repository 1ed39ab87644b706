"""Units under the shipped unit's sandbox, through our module (issue 43, item 2): a time-slice share
(``gpu-share-2:1``), an MPS share (``gpu-share-4:1``, its control daemon started by the sidecar in
the unit) and a MIG unit (``mig-1g.5gb:1``), held at once. The sidecar runs the simulated
``dgx-a100`` (MIG on GPUs 0-4) with GPU 5 shared four ways under MPS and GPU 6 two ways by time
slices; the agent offers what ``gpu-isolator resources`` prints for that host, as docs/mig.md tells
an operator. Each task asserts what it could open, what the kernel grants its cgroup, and the
environment it was given; the agent's log holds no isolator error."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest
from conftest import Running, Walked, granted, isolator_errors, launch, opened_gpus, since, wait_registered

from isolator.testing.node import Node

pytestmark = pytest.mark.node

CONFIG = "/etc/gpu-isolator/config.toml"
CLI = "/opt/gpu-isolator/bin/gpu-isolator"
SHARED = "5:4:mps,6:2:time-slice"
UNITS = {"time-slice": "gpu-share-2:1", "mps": "gpu-share-4:1", "mig": "mig-1g.5gb:1"}


def restart_sidecar_under_mps(node: Node, index: int) -> tuple[float, str]:
    """``systemctl restart gpu-isolator``, timed, and GPU ``index``'s MPS daemon state as the
    sidecar reports it as soon as the restart returned (READY=1 comes after its start-up pass
    adopted the daemon)."""
    started = time.monotonic()
    node.run("systemctl restart gpu-isolator")
    took = time.monotonic() - started
    gpus = json.loads(node.run(f"{CLI} gpus --json").stdout)["gpus"]
    return took, next(g.get("mps_state", "") for g in gpus if int(g["index"]) == index)


def reconfigure(node: Node, settings: str, extra_env: str = "") -> str:
    """The sidecar's simulated host and shares replaced by ``settings`` (lines for its config file),
    the agent offering what ``gpu-isolator resources`` then prints (a new agent id: its resources
    changed), both restarted; returns the time the agent was started (for ``isolator_errors``)."""
    node.run(
        f"systemctl stop mesos-agent && cp {CONFIG} /root/config.plain && cp /etc/default/mesos-agent /root/agent.plain"
        f" && sed -i '/^simulate = /d' {CONFIG} && cat >> {CONFIG} <<'EOF'\n{settings}\nEOF\n"
        "systemctl restart gpu-isolator && rm -f /var/lib/mesos/meta/slaves/latest"
    )
    offered = json.loads(node.run(f"{CLI} resources --running --json").stdout)["resources"]
    units = ";".join(e for e in offered.split(";") if e.split(":")[0] not in ("cpus", "mem", "disk"))
    when = since(node)
    node.run(
        f"cat >> /etc/default/mesos-agent <<EOF\nMESOS_RESOURCES='cpus:4;mem:2048;disk:2048;{units}'\n{extra_env}EOF\n"
        "systemctl start mesos-agent"
    )
    wait_registered(node, when)
    return when


def restore(node: Node) -> None:
    node.run(
        f"systemctl stop mesos-agent; cp /root/config.plain {CONFIG}; cp /root/agent.plain /etc/default/mesos-agent;"
        " rm -f /var/lib/mesos/meta/slaves/latest; systemctl restart gpu-isolator; systemctl start mesos-agent",
        check=False,
    )


@pytest.fixture(scope="module")
def units(walked: Walked) -> Iterator[tuple[Node, str, dict[str, Running]]]:
    assert walked.returncode == 0, walked.said()
    node = walked.node
    when = reconfigure(node, f'simulate = "dgx-a100"\nshared_gpus = "{SHARED}"')
    tasks: dict[str, Running] = {}
    try:
        for kind, unit in UNITS.items():
            tasks[kind] = launch(node, f"unit-{kind}", f"cpus:0.1;mem:32;{unit}")
        yield node, when, tasks
    finally:
        for task in tasks.values():
            task.stop()
        restore(node)


def probed(tasks: dict[str, Running], kind: str, node: Node) -> tuple[str, str]:
    out = tasks[kind].wait_probed()
    said = (
        f"{tasks[kind].log()[-2000:]}\n{out}\n"
        + node.run("journalctl --no-pager -o cat -n 30 -u gpu-isolator", check=False).stdout
    )
    return out, said


def time_slice_share(node: Node, out: str, said: str) -> None:
    assert opened_gpus(out) == {6}, said
    assert granted(node, out) == {6}, said
    assert "CUDA_MPS_PIPE_DIRECTORY" not in out, said


def mps_share(node: Node, out: str, said: str) -> None:
    assert opened_gpus(out) == {5}, said
    assert granted(node, out) == {5}, said
    assert "env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in out, said
    pipe = re.search(r"^env CUDA_MPS_PIPE_DIRECTORY=(\S+)$", out, re.M)
    assert pipe, said
    # The control daemon the sidecar started for GPU 5 runs, in the sidecar's unit (KillMode=process).
    pid = node.run(f"cat {pipe.group(1)}/nvidia-cuda-mps-control.pid").stdout.strip()
    assert node.run(f"cat /proc/{pid}/cgroup").stdout.rstrip().endswith("/gpu-isolator.service"), said


def mig_unit(node: Node, out: str, said: str) -> None:
    (gpu,) = opened_gpus(out)
    assert gpu in (0, 1), said  # the GPUs with 1g.5gb instances (isolator/simhost/hosts/dgx-a100.toml)
    assert granted(node, out) == {gpu}, said
    assert re.search(r"^env NVIDIA_VISIBLE_DEVICES=MIG-", out, re.M), said


# What each unit's task must show (shared with test_v2.py and test_criteo.py).
CHECKS = {"time-slice": time_slice_share, "mps": mps_share, "mig": mig_unit}


def unit_task(node: Node, name: str, kind: str, when: str) -> None:
    """A task holding the unit ``kind`` of ``UNITS`` alone (the sidecar's host as ``units`` sets it:
    GPU 5 under MPS, 6 by time slices, MIG on the ``dgx-a100``): what ``CHECKS[kind]`` asserts, then
    no isolator error since ``when``. For the routes and nodes that run one unit at a time."""
    tasks = {kind: launch(node, name, f"cpus:0.1;mem:32;{UNITS[kind]}")}
    try:
        CHECKS[kind](node, *probed(tasks, kind, node))
    finally:
        tasks[kind].stop()
    assert isolator_errors(node, when) == []


def test_a_time_slice_share_task_opens_only_its_shared_gpu(units):
    node, _, tasks = units
    time_slice_share(node, *probed(tasks, "time-slice", node))


def test_an_mps_share_task_opens_its_gpu_with_the_sidecar_s_mps_daemon(units):
    node, _, tasks = units
    mps_share(node, *probed(tasks, "mps", node))


def test_a_mig_task_opens_only_its_mig_device_s_gpu(units):
    node, _, tasks = units
    mig_unit(node, *probed(tasks, "mig", node))


def test_the_units_end_and_leave_no_isolator_error(units):
    node, when, tasks = units
    for task in tasks.values():
        task.stop()
    held = json.loads(node.run(f"{CLI} containers --json").stdout).get("containers", [])
    assert held == [], held
    assert isolator_errors(node, when) == []
