"""A task group under the shipped unit's sandbox (issue 43, item 2): two ``gpus:1`` tasks through
the default executor; the group's GPUs are folded into the executor's container at Prepare, and each
nested task could open exactly those two."""

from __future__ import annotations

import json
import os

import pytest
from conftest import SHARE_IN_NODE, STATE, Walked, opened_gpus, seen

from isolator.testing.node import MESOS_IN_NODE

pytestmark = pytest.mark.node

NAMES = ("first", "second")


def test_a_task_group_gets_its_gpus_in_every_nested_container(walked: Walked):
    assert walked.returncode == 0, walked.said()
    node = walked.node
    resources = [
        {"name": name, "type": "SCALAR", "scalar": {"value": value}}
        for name, value in (("cpus", 0.1), ("mem", 32), ("gpus", 1))
    ]
    group = {
        "tasks": [
            {
                "name": f"group-{n}",
                "task_id": {"value": f"group-{n}"},
                "agent_id": {"value": ""},
                "resources": resources,
                # Each holds 5 s after probing: when the first task ends, the agent shrinks the
                # executor by its GPU, so a sibling that probed after that would see one (seen in CI
                # under load: {0, 3} and {0}).
                "command": {"value": f"python3 {SHARE_IN_NODE}/probe.py {STATE}/simhost/dev 5"},
            }
            for n in NAMES
        ]
    }
    with open(os.path.join(node.share, "group.json"), "w") as fh:
        json.dump(group, fh)
    master = node.run("sed -n 's/^MESOS_MASTER=//p' /etc/default/mesos-agent").stdout.strip()
    run = node.run(
        f"LD_LIBRARY_PATH={MESOS_IN_NODE}/lib {MESOS_IN_NODE}/bin/mesos-execute --master={master}"
        f" --framework_capabilities=GPU_RESOURCES --task_group=file://{SHARE_IN_NODE}/group.json",
        check=False,
        timeout=180,
    )
    outs = {
        n: node.run(
            f"cat /var/lib/mesos/slaves/*/frameworks/*/executors/*/runs/latest/tasks/group-{n}/stdout", check=False
        ).stdout
        for n in NAMES
    }
    said = (
        f"{run.stdout[-3000:]}\n{outs}\n"
        + node.run("journalctl --no-pager -o cat -n 30 -u gpu-isolator", check=False).stdout
    )
    assert run.stdout.count("TASK_FINISHED") == 2, said
    opened = [opened_gpus(out) for out in outs.values()]
    assert len(opened[0]) == 2 and opened[0] == opened[1], said
    for out in outs.values():
        assert {seen(out)[name] for name in ("nvidiactl", "nvidia-uvm")} == {"ENXIO"}, said
