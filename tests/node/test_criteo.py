"""The other route under the shipped unit's sandbox (issue 43, items 2 and 3): criteo's command module
running our bridge executables (installed from the wheel with ``python -m isolator.bridge install``,
docs/mesos-agent.md) against the unit's bridge socket. One switch of the agent to that module (with
the image isolators and a local registry) and of the sidecar to a shared GPU 7 (two time-slice
shares), then a ``gpus:1`` command task, a ``gpus:1`` image task and a ``gpu-share-2:1`` task, each
asserting what it could open and what the kernel grants it; the agent's log holds no isolator error."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def criteo(walked: Walked) -> Iterator[tuple[Node, str]]:
    assert walked.returncode == 0, walked.said()
    node = walked.node
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
        f"MESOS_MODULES=file://{SHARE_IN_NODE}/criteo-modules.json\n" + IMAGE_FLAGS.format(backend="copy")
    )
    try:
        when = reconfigure(node, 'simulate = "dgx-1"\nshared_gpus = "7:2:time-slice"', agent)
        yield node, when
    finally:
        restore(node)


def test_a_command_task_through_criteo_s_module_and_the_bridge(criteo):
    node, when = criteo
    task = launch(node, "criteo-task", "cpus:0.1;mem:32;gpus:1")
    try:
        out = task.wait_probed()
        said = f"{task.log()[-3000:]}\n{out}"
        assert len(opened_gpus(out)) == 1, said
        assert granted(node, out) == opened_gpus(out), said
        assert {seen(out)[name] for name in ("nvidiactl", "nvidia-uvm")} == {"ENXIO"}, said
    finally:
        task.stop()
    assert isolator_errors(node, when) == []


def test_an_image_task_through_criteo_s_module(criteo):
    node, when = criteo
    image_task(node, "criteo-image", when)


def test_a_share_task_through_criteo_s_module(criteo):
    node, when = criteo
    task = launch(node, "criteo-share", "cpus:0.1;mem:32;gpu-share-2:1")
    try:
        out = task.wait_probed()
        said = f"{task.log()[-3000:]}\n{out}"
        assert opened_gpus(out) == {7}, said
        assert granted(node, out) == {7}, said
    finally:
        task.stop()
    assert isolator_errors(node, when) == []
