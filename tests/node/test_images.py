"""Image tasks under the shipped unit's sandbox (issue 43, item 2): the agent given a local Docker
registry and the ``copy`` or ``overlay`` provisioner backend, a ``gpus:1`` task in an image that asks
for the driver volume. The sidecar creates the volume's mount point inside the image's root
filesystem, which lives under the agent's work directory: read-only to a ``ProtectSystem=strict``
service unless the unit says otherwise.

The image is Debian's ``busybox-static`` in ``docker save`` layout (isolator/testing/images.py, as
tests/mesos/test_real_image.py builds it). ``image_task`` is shared with the other routes and layouts
(test_criteo.py, test_v2.py)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

import pytest
from conftest import SHARE_IN_NODE, Walked, granted, isolator_errors, launch, since, wait_registered

from isolator.testing.images import BUSYBOX, busybox_image
from isolator.testing.node import Node

pytestmark = pytest.mark.node

APPLETS = ("sh", "ls", "cat", "grep", "echo", "touch", "test", "[", "sleep")
# What the task could open (``dev <name> <result>``, as the probe prints), its cgroups (``cgroup``:
# v1 devices, ``cgroup2``), the driver volume's mount, then it sleeps until its framework ends.
SCRIPT = (
    "for d in /dev/nvidia*; do"
    ' if (exec 3<"$d") 2>/tmp/err; then echo "dev ${d#/dev/} ok";'
    ' else echo "dev ${d#/dev/} $(cat /tmp/err)"; fi; done;'
    ' while IFS= read -r l; do case "$l" in 0::*) echo "cgroup2 ${l#0::}";;'
    ' *:devices:*) echo "cgroup ${l#*:devices:}";; esac; done < /proc/self/cgroup;'
    " grep ' /usr/local/nvidia ' /proc/self/mountinfo; echo probed; sleep 600"
)
OURS = "MESOS_ISOLATION=filesystem/linux,docker/runtime,cgroups/devices,org_gpuisolator_GpuIsolator\n"
IMAGE_FLAGS = (
    "MESOS_IMAGE_PROVIDERS=docker\n"
    f"MESOS_DOCKER_REGISTRY={SHARE_IN_NODE}/registry\n"
    "MESOS_IMAGE_PROVISIONER_BACKEND={backend}\n"
)


def image_tarball(path: str, name: str) -> None:
    """The image, labelled for the NVIDIA driver volume, without its mount point: the sidecar makes it."""
    busybox_image(path, name, {"com.nvidia.volumes.needed": "nvidia_driver"}, applets=APPLETS)


def provide_image(node: Node) -> None:
    """The image in a local registry the agent reads (``/node/registry``)."""
    if not os.path.exists(BUSYBOX):
        pytest.fail("image tasks need Debian's busybox-static (/bin/busybox): apt-get install busybox-static")
    registry = os.path.join(node.share, "registry")
    os.makedirs(registry, exist_ok=True)
    if not os.path.exists(os.path.join(registry, "gpu-busybox.tar")):
        image_tarball(os.path.join(registry, "gpu-busybox.tar"), "gpu-busybox")


def image_task(node: Node, name: str, when: str) -> str:
    """A ``gpus:1`` task in the image on the agent as configured now; asserts what it could open, that
    the kernel grants it exactly that GPU, the driver volume read-only, no isolator error since
    ``when``. Returns its output."""
    task = launch(node, name, "cpus:0.1;mem:32;gpus:1", "--docker_image=gpu-busybox", command=SCRIPT)
    try:
        out = task.wait_probed()
        said = (
            f"{task.log()[-3000:]}\n{out}\n"
            + node.run("journalctl --no-pager -o cat -n 30 -u gpu-isolator", check=False).stdout
        )
        seen = dict(re.findall(r"^dev (\S+) (.*)$", out, re.M))
        opened = {name for name, result in seen.items() if "not permitted" not in result}
        gpus = {int(name[6:]) for name in opened if name[6:].isdigit()}
        assert len(gpus) == 1, said
        assert {"nvidiactl", "nvidia-uvm"} <= opened, said
        assert granted(node, out) == gpus, said
        mount = next(line for line in out.splitlines() if " /usr/local/nvidia " in line)
        assert re.search(r"\bro\b", mount.split(" - ")[0]), mount
    finally:
        task.stop()
    assert isolator_errors(node, when) == []
    return out


@contextlib.contextmanager
def agent_with(node: Node, lines: str) -> Iterator[str]:
    """The agent restarted with ``lines`` appended to its environment file (a later assignment wins
    over an earlier one); yields the time it was restarted, once it registered; on exit the file as it
    was and the agent restarted on it, registered again. Shared by both nodes and both routes."""
    when = since(node)
    node.run(
        f"cp /etc/default/mesos-agent /root/mesos-agent.before && cat >> /etc/default/mesos-agent <<'EOF'\n{lines}EOF\n"
        "systemctl restart mesos-agent"
    )
    try:
        wait_registered(node, when)
        yield when
    finally:
        again = since(node)
        node.run("cp /root/mesos-agent.before /etc/default/mesos-agent && systemctl restart mesos-agent", check=False)
        wait_registered(node, again)


@pytest.mark.parametrize("backend", ["copy", "overlay"])
def test_an_image_task_gets_the_driver_volume_and_only_its_gpu_under_the_sandbox(walked: Walked, backend: str):
    assert walked.returncode == 0, walked.said()
    node = walked.node
    provide_image(node)
    with agent_with(node, OURS + IMAGE_FLAGS.format(backend=backend)) as when:
        image_task(node, f"image-{backend}", when)
