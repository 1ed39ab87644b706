"""The other route under the shipped unit's sandbox (issue 43, items 2 and 3): criteo's command module
running our bridge executables (installed from the wheel with ``python -m isolator.bridge install``,
docs/mesos-agent.md) against the unit's bridge socket. One switch of the agent to that module (with
the image isolators, a local registry and the ``copy`` provisioner backend) and of the sidecar to
the simulated ``dgx-a100`` with test_units.py's shares (GPU 5 four ways under MPS, 6 two ways by
time slices, MIG on GPUs 0-4, 7 whole), then a ``gpus:1`` command task, an image task on each
provisioner backend (``overlay``: the agent restarted with it), a time-slice share, an MPS share, a
MIG unit and a task group (a ``gpus:1`` task and a MIG unit), each asserting what it could open and
what the kernel grants it; the agent's log holds no isolator error. The cgroup2 node runs the same
cells (test_v2.py) through these helpers."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import pytest
from conftest import Walked, granted, isolator_errors, launch, opened_gpus, seen
from test_groups import task_group_with_a_mig_unit
from test_images import IMAGE_FLAGS, agent_with, image_task, provide_image
from test_units import SHARED, UNITS, reconfigure, restore, unit_task

from isolator.testing.mesoshome import MODULE
from isolator.testing.node import MESOS_IN_NODE, SHARE_IN_NODE, Node

pytestmark = pytest.mark.node

BIN = "/usr/libexec/gpu-isolator"


@contextlib.contextmanager
def criteo_route(node: Node, settings: str, backend: str) -> Iterator[str]:
    """The agent switched to criteo's command module running our bridge executables (installed from
    the wheel) with the image isolators and the ``backend`` provisioner, the sidecar's simulated host
    and shares set by ``settings`` (test_units.reconfigure); yields when the agent started; restores
    both on exit. Shared with the node booted with cgroup2 alone (test_v2.py)."""
    node.run(f"/opt/gpu-isolator/bin/python -m isolator.bridge install {BIN}")
    params = [{"key": "module_name", "value": "gpu-isolator-node"}]
    for hook in ("prepare", "isolate", "cleanup", "watch"):
        params.append({"key": f"isolator_{hook}_command", "value": f"{BIN}/gpu-isolator-{hook}"})
        if hook != "watch":
            params.append({"key": f"isolator_{hook}_timeout", "value": "30"})
    params.append({"key": "isolator_watch_frequence", "value": "1"})
    lib = f"{MESOS_IN_NODE}/lib/libmesos_command_modules.so"
    with open(os.path.join(node.share, "criteo-modules.json"), "w") as fh:
        json.dump({"libraries": [{"file": lib, "modules": [{"name": MODULE, "parameters": params}]}]}, fh)
    provide_image(node)
    agent = (
        f"MESOS_ISOLATION=filesystem/linux,docker/runtime,cgroups/devices,{MODULE}\n"
        f"MESOS_MODULES=file://{SHARE_IN_NODE}/criteo-modules.json\n" + IMAGE_FLAGS.format(backend=backend)
    )
    try:
        yield reconfigure(node, settings, agent)
    finally:
        restore(node)


@pytest.fixture(scope="module")
def criteo(walked: Walked) -> Iterator[tuple[Node, str]]:
    assert walked.returncode == 0, walked.said()
    with criteo_route(walked.node, f'simulate = "dgx-a100"\nshared_gpus = "{SHARED}"', "copy") as when:
        yield walked.node, when


def command_task(node: Node, name: str, when: str) -> None:
    """A ``gpus:1`` command task: it could open one GPU and the control nodes, the kernel grants it
    that GPU, no isolator error since ``when``."""
    task = launch(node, name, "cpus:0.1;mem:32;gpus:1")
    try:
        out = task.wait_probed()
        said = f"{task.log()[-3000:]}\n{out}"
        assert len(opened_gpus(out)) == 1, said
        assert granted(node, out) == opened_gpus(out), said
        assert {seen(out)[name] for name in ("nvidiactl", "nvidia-uvm")} == {"ENXIO"}, said
    finally:
        task.stop()
    assert isolator_errors(node, when) == []


def test_a_command_task_through_criteo_s_module_and_the_bridge(criteo):
    node, when = criteo
    command_task(node, "criteo-task", when)


def criteo_image_task(node: Node, name: str, backend: str) -> None:
    """An image task through criteo's route on the ``backend`` provisioner (the agent restarted with
    it, then with the route's ``copy`` again)."""
    provide_image(node)
    with agent_with(node, f"MESOS_IMAGE_PROVISIONER_BACKEND={backend}\n") as when:
        image_task(node, name, when)


@pytest.mark.parametrize("backend", ["copy", "overlay"])
def test_an_image_task_through_criteo_s_module(criteo, backend: str):
    node, _ = criteo
    criteo_image_task(node, f"criteo-image-{backend}", backend)


@pytest.mark.parametrize("kind", list(UNITS))
def test_a_unit_task_through_criteo_s_module(criteo, kind: str):
    """A time-slice share, an MPS share (its client environment from the bridge's Prepare) and a MIG
    unit, one at a time, each checked as test_units.py checks it."""
    node, when = criteo
    unit_task(node, f"criteo-{kind}", kind, when)


def test_a_task_group_through_criteo_s_module(criteo):
    """The module forwards nested containers (docs/mesos-agent.md, section 8): the default
    executor's container gets the group's GPUs at Prepare, its nested tasks share its v1 cgroup."""
    node, _ = criteo
    task_group_with_a_mig_unit(node, "criteo-group")
