"""Image tasks under the shipped unit's sandbox (issue 43, item 2): the agent given a local Docker
registry and the ``copy`` or ``overlay`` provisioner backend, a ``gpus:1`` task in an image that asks
for the driver volume. The sidecar creates the volume's mount point inside the image's root
filesystem, which lives under the agent's work directory: read-only to a ``ProtectSystem=strict``
service unless the unit says otherwise.

The image is Debian's ``busybox-static`` in ``docker save`` layout (isolator/testing/images.py, as
tests/mesos/test_real_image.py builds it)."""

from __future__ import annotations

import os
import re
import shlex
import time

import pytest
from conftest import SHARE_IN_NODE, Walked

from isolator.testing.images import BUSYBOX, busybox_image
from isolator.testing.node import MESOS_IN_NODE

pytestmark = pytest.mark.node

APPLETS = ("sh", "ls", "cat", "grep", "echo", "touch", "test", "[", "sleep")
SCRIPT = (
    "for d in /dev/nvidia*; do"
    ' if (exec 3<"$d") 2>/tmp/err; then echo "dev ${d#/dev/} ok";'
    ' else echo "dev ${d#/dev/} $(cat /tmp/err)"; fi; done;'
    " grep ' /usr/local/nvidia ' /proc/self/mountinfo; echo probed"
)


def image_tarball(path: str, name: str) -> None:
    """The image, labelled for the NVIDIA driver volume, without its mount point: the sidecar makes it."""
    busybox_image(path, name, {"com.nvidia.volumes.needed": "nvidia_driver"}, applets=APPLETS)


@pytest.mark.parametrize("backend", ["copy", "overlay"])
def test_an_image_task_gets_the_driver_volume_and_only_its_gpu_under_the_sandbox(walked: Walked, backend: str):
    assert walked.returncode == 0, walked.said()
    node = walked.node
    if not os.path.exists(BUSYBOX):
        pytest.fail("image tasks need Debian's busybox-static (/bin/busybox): apt-get install busybox-static")
    registry = os.path.join(node.share, "registry")
    os.makedirs(registry, exist_ok=True)
    image_tarball(os.path.join(registry, "gpu-busybox.tar"), "gpu-busybox")
    node.run(
        "cp /etc/default/mesos-agent /root/mesos-agent.plain && cat >> /etc/default/mesos-agent <<EOF\n"
        "MESOS_ISOLATION=filesystem/linux,docker/runtime,cgroups/devices,org_gpuisolator_GpuIsolator\n"
        f"MESOS_IMAGE_PROVIDERS=docker\nMESOS_DOCKER_REGISTRY={SHARE_IN_NODE}/registry\n"
        f"MESOS_IMAGE_PROVISIONER_BACKEND={backend}\nEOF\n"
        "systemctl restart mesos-agent"
    )
    try:
        deadline = time.monotonic() + 60
        while "egistered with master" not in node.run("journalctl --no-pager -o cat -u mesos-agent -n 100").stdout:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        master = node.run("sed -n 's/^MESOS_MASTER=//p' /etc/default/mesos-agent").stdout.strip()
        run = node.run(
            f"LD_LIBRARY_PATH={MESOS_IN_NODE}/lib {MESOS_IN_NODE}/bin/mesos-execute --master={master}"
            f" --name=image-{backend} --framework_capabilities=GPU_RESOURCES --docker_image=gpu-busybox"
            f" --resources='cpus:0.1;mem:32;gpus:1' --command={shlex.quote(SCRIPT)}",
            check=False,
            timeout=180,
        )
        out = node.run(
            f"cat /var/lib/mesos/slaves/*/frameworks/*/executors/image-{backend}/runs/latest/stdout", check=False
        ).stdout
        said = (
            f"{run.stdout[-3000:]}\n{out}\n"
            + node.run("journalctl --no-pager -o cat -n 30 -u gpu-isolator", check=False).stdout
            + node.run("journalctl --no-pager -o cat -u mesos-agent | grep -E '^[EW]2' | tail -20", check=False).stdout
        )
        assert "TASK_FINISHED" in run.stdout, said
        seen = dict(re.findall(r"^dev (\S+) (.*)$", out, re.M))
        opened = {name for name, result in seen.items() if "not permitted" not in result}
        assert len({name for name in opened if name[6:].isdigit()}) == 1, said
        assert {"nvidiactl", "nvidia-uvm"} <= opened, said
        mount = next(line for line in out.splitlines() if " /usr/local/nvidia " in line)
        assert re.search(r"\bro\b", mount.split(" - ")[0]), mount
    finally:
        node.run("cp /root/mesos-agent.plain /etc/default/mesos-agent && systemctl restart mesos-agent", check=False)
