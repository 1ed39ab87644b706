"""A task group under the shipped unit's sandbox (issue 43, item 2): two ``gpus:1`` tasks through
the default executor; the group's GPUs are folded into the executor's container at Prepare, and each
nested task could open exactly those two, which the kernel grants its cgroup. ``task_group`` is
shared with the node booted with cgroup2 alone (test_v2.py)."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from conftest import (
    CONTROL,
    DEV,
    SHARE_IN_NODE,
    Running,
    Walked,
    execute,
    granted,
    isolator_errors,
    opened_gpus,
    seen,
    since,
)

from isolator.testing.node import Node

pytestmark = pytest.mark.node

NAMES = ("first", "second")


def task_group(node: Node, name: str, units: tuple[str, str] = ("gpus:1", "gpus:1")) -> set[int]:
    """A group of two tasks holding ``units`` (one each: ``gpus:1``, ``mig-1g.5gb:1``) launched as
    framework ``name``, their GPUs folded into the default executor's container: each probes, then
    holds until both have been checked (a file in ``/node`` appears), so that neither probes after its sibling
    ended and the agent shrank the executor by its GPU (seen in CI under load when each held 5 s:
    {0, 3} and {0}). Both could open the same two GPUs, exactly what the kernel grants their
    cgroups; both finish, their executor's cgroup goes, and no isolator error is logged. Returns
    the GPUs they opened."""
    when = since(node)
    gate = f"{SHARE_IN_NODE}/{name}.go"

    def resources(unit: str) -> list[dict[str, object]]:
        held = (("cpus", 0.1), ("mem", 32), (unit.split(":")[0], float(unit.split(":")[1])))
        return [{"name": n, "type": "SCALAR", "scalar": {"value": value}} for n, value in held]

    hold = f"python3 {SHARE_IN_NODE}/probe.py {DEV} 0 && while [ ! -e {gate} ]; do sleep 0.2; done"
    group = {
        "tasks": [
            {
                "name": f"{name}-{n}",
                "task_id": {"value": f"{name}-{n}"},
                "agent_id": {"value": ""},
                "resources": resources(unit),
                "command": {"value": hold},
            }
            for n, unit in zip(NAMES, units, strict=True)
        ]
    }
    with open(os.path.join(node.share, f"{name}.json"), "w") as fh:
        json.dump(group, fh)
    execute(node, name, f"--task_group=file://{SHARE_IN_NODE}/{name}.json")
    tasks = [Running(node, name, task=f"{name}-{n}") for n in NAMES]
    try:
        outs = [task.wait_probed() for task in tasks]
        said = (
            f"{tasks[0].log()[-3000:]}\n{outs}\n"
            + node.run("journalctl --no-pager -o cat -n 30 -u gpu-isolator", check=False).stdout
        )
        opened = [opened_gpus(out) for out in outs]
        assert len(opened[0]) == 2 and opened[0] == opened[1], said
        for out in outs:
            assert {seen(out)[c] for c in CONTROL} == {"ENXIO"}, said
            assert granted(node, out) == opened[0], said
    finally:
        open(os.path.join(node.share, f"{name}.go"), "w").close()
    deadline = time.monotonic() + 90
    while node.run(f"kill -0 $(cat /root/{name}.pid) 2>/dev/null", check=False).returncode == 0:
        assert time.monotonic() < deadline, f"{name}: its framework still runs 90 s after the gate opened\n{said}"
        time.sleep(0.5)
    assert tasks[0].log().count("TASK_FINISHED") == 2, tasks[0].log()[-3000:]
    # The executor's cgroup: v1, the devices cgroup its nested tasks share; v2, above <id>/mesos/<task>/leaf.
    if node.cgroups == "v2":
        (path,) = re.findall(r"^cgroup2 (\S+)$", outs[0], re.M)
        executor = node.host_cgroup(path.rsplit("/mesos/", 1)[0])
    else:
        (path,) = re.findall(r"^cgroup (\S+)$", outs[0], re.M)
        executor = node.host_cgroup(path, "devices")
    while os.path.isdir(executor):
        assert time.monotonic() < deadline, f"{name}: {executor} still there after its tasks finished"
        time.sleep(0.3)
    assert isolator_errors(node, when) == []
    return opened[0]


def task_group_with_a_mig_unit(node: Node, name: str) -> None:
    """A group of a ``gpus:1`` task and a ``mig-1g.5gb:1`` task on a sidecar simulating the
    ``dgx-a100`` with GPU 7 its one whole GPU (GPUs 5 and 6 shared): both open GPU 7 and the MIG
    device's GPU (0 or 1, isolator/simhost/hosts/dgx-a100.toml)."""
    opened = task_group(node, name, ("gpus:1", "mig-1g.5gb:1"))
    assert 7 in opened and opened - {7} <= {0, 1}, opened


def test_a_task_group_gets_its_gpus_in_every_nested_container(walked: Walked):
    assert walked.returncode == 0, walked.said()
    task_group(walked.node, "group")
