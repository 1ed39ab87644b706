"""The other route under the shipped unit's sandbox (issue 43, items 2 and 3): criteo's command module
running our bridge executables (installed from the wheel with ``python -m isolator.bridge install``,
docs/mesos-agent.md) against the unit's bridge socket. One switch of the agent to that module (with
the image isolators and a local registry) and of the sidecar to a shared GPU 7 (two time-slice
shares), then a ``gpus:1`` command task, a ``gpus:1`` image task and a ``gpu-share-2:1`` task, each
asserting what it could open and what the kernel grants it; the agent's log holds no isolator error."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import pytest
from conftest import Walked, granted, isolator_errors, launch, opened_gpus, seen
from test_images import IMAGE_FLAGS, image_task, provide_image
from test_units import reconfigure, restore

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
    with criteo_route(walked.node, 'simulate = "dgx-1"\nshared_gpus = "7:2:time-slice"', "copy") as when:
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


def share_task(node: Node, name: str, resources: str, gpu: int, when: str) -> str:
    """A task holding the share ``resources``: it could open GPU ``gpu`` alone, the kernel grants it
    that GPU, no isolator error since ``when``. Returns its output."""
    task = launch(node, name, f"cpus:0.1;mem:32;{resources}")
    try:
        out = task.wait_probed()
        said = f"{task.log()[-3000:]}\n{out}"
        assert opened_gpus(out) == {gpu}, said
        assert granted(node, out) == {gpu}, said
    finally:
        task.stop()
    assert isolator_errors(node, when) == []
    return out


def test_a_command_task_through_criteo_s_module_and_the_bridge(criteo):
    node, when = criteo
    command_task(node, "criteo-task", when)


def test_an_image_task_through_criteo_s_module(criteo):
    node, when = criteo
    image_task(node, "criteo-image", when)


def test_a_share_task_through_criteo_s_module(criteo):
    node, when = criteo
    share_task(node, "criteo-share", "gpu-share-2:1", 7, when)
