"""Image tasks under a real agent: the driver volume and the CUDA-version check.

The test builds its own local Docker registry: image tarballs in ``docker save`` layout (a
``repositories`` file, one layer directory with ``json`` and ``layer.tar``) holding Debian's
``busybox-static``, named ``<name>.tar`` in a directory given to the agent as ``--docker_registry``.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator

import pytest
from conftest import granted

from isolator.model import CgroupVersion
from isolator.testing.cluster import Cluster
from isolator.testing.images import BUSYBOX, DIRS, busybox_image
from isolator.testing.mesoshome import MODULE, Route

APPLETS = ("sh", "ls", "cat", "grep", "echo", "touch", "env", "test", "[")
# What the task prints: each /dev/nvidia* it can open (busybox sh's words for the errno), the
# volume, its mount options, and the environment the sidecar set.
SCRIPT = (
    "for d in /dev/nvidia*; do"
    ' if (exec 3<"$d") 2>/tmp/err; then echo "dev ${d#/dev/} ok";'
    ' else echo "dev ${d#/dev/} $(cat /tmp/err)"; fi; done;'
    " ls /usr/local/nvidia/bin /usr/local/nvidia/lib64 2>&1 | head -50;"
    " grep ' /usr/local/nvidia ' /proc/self/mountinfo;"
    " touch /usr/local/nvidia/x 2>&1 || true;"
    ' echo "PATH=$PATH"; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; echo probed'
)


def image_tarball(path: str, name: str, labels: dict[str, str]) -> None:
    """The image, with the volume's mount point already in it (/usr/local/nvidia)."""
    busybox_image(path, name, labels, dirs=(*DIRS, "usr/local/nvidia"), applets=APPLETS)


@pytest.fixture(scope="module")
def imaged(mesos_home: str, cgroups: CgroupVersion, route: Route) -> Iterator[Cluster]:
    if not os.path.exists(BUSYBOX):
        pytest.fail("image tasks need Debian's busybox-static (/bin/busybox): apt-get install busybox-static")
    with tempfile.TemporaryDirectory(prefix="gi-registry-") as registry:
        image_tarball(
            os.path.join(registry, "gpu-busybox.tar"), "gpu-busybox", {"com.nvidia.volumes.needed": "nvidia_driver"}
        )
        image_tarball(
            os.path.join(registry, "gpu-newer-cuda.tar"),
            "gpu-newer-cuda",
            {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "99.0"},
        )
        flags = [
            "--image_providers=docker",
            f"--docker_registry={registry}",
            "--image_provisioner_backend=copy",
        ]
        isolation = ("filesystem/linux", "docker/runtime", "cgroups/devices", MODULE)
        with Cluster(mesos_home, isolation=isolation, agent_flags=flags, cgroups=cgroups, route=route) as c:
            yield c


def test_an_image_task_gets_the_driver_volume_read_only_and_only_its_gpu(imaged: Cluster) -> None:
    agent = imaged.agents[0]
    task = imaged.submit(SCRIPT + "; sleep 60", gpus=1, extra=["--docker_image=gpu-busybox"])
    task.wait("TASK_RUNNING", timeout=120)
    out = task.wait_stdout("probed")
    seen = dict(re.findall(r"^dev (\S+) (.*)$", out, re.M))
    opened = {name for name, result in seen.items() if "not permitted" not in result}
    gpus = {name for name in opened if name[6:].isdigit()}
    assert len(gpus) == 1, seen
    assert {"nvidiactl", "nvidia-uvm"} <= opened, seen
    mount = next(line for line in out.splitlines() if " /usr/local/nvidia " in line)
    assert re.search(r"\bro\b", mount.split(" - ")[0]), mount
    assert "Read-only file system" in out, out
    assert "PATH=" in out and "/usr/local/nvidia/bin" in out, out
    assert re.search(r"^LD_LIBRARY_PATH=.*/usr/local/nvidia/lib64", out, re.M), out
    # The kernel and the sidecar agree with what the task saw.
    (minor,) = (int(name[6:]) for name in gpus)
    assert granted(task) == {minor}
    assert task.container_id() in agent.holders(by="minor")[minor]
    task.teardown()
    task.wait_gone()
    assert all(h == "" for h in agent.holders().values())


def test_an_image_needing_a_newer_cuda_than_the_driver_is_refused(imaged: Cluster) -> None:
    task = imaged.submit("echo should-not-run", gpus=1, extra=["--docker_image=gpu-newer-cuda"])
    update = task.wait("TASK_FAILED", timeout=120)
    assert update.reason == "REASON_CONTAINER_LAUNCH_FAILED", update
    assert "CUDA" in update.message or "cuda" in update.message, update
    assert all(h == "" for h in imaged.agents[0].holders().values())
