"""One booted Debian 12 node for tests/node/ (``make test-node``; marker ``node``).

The node (isolator/testing/node.py) boots once per session with systemd as PID 1, and the walkthrough
of docs/operations.md ("A node under systemd") installs the sidecar from the wheel as its unit and the
agent as a unit after it; every scenario then runs on that node. Needs root, systemd-nspawn and
mmdebstrap (``make test-node`` names the packages), a Mesos (``MESOS_HOME`` or ``../shared/mesos``),
our module built for it (``make module``) and the wheel (``make dist``); without one, every test
here fails, saying which.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import paths
import pytest
from docpage import sh_blocks
from docpage import with_values as with_values
from probed import opened_gpus as opened_gpus
from probed import seen as seen

from isolator.testing.mesoshome import MesosNotFound, find_mesos_home, native_module
from isolator.testing.node import (
    MESOS_IN_NODE,
    SHARE_IN_NODE,
    Node,
    ensure_rootfs,
    ensure_wheelhouse,
    free_ports,
    missing_host_packages,
)

PAGE = os.path.join(paths.ROOT, "docs", "operations.md")
SECTION = "## A node under systemd"
PROBE = os.path.join(paths.TESTS, "mesos", "probe.py")
CONTROL = {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"}
MODULE_IN_NODE = "/usr/local/lib/mesos/modules/libgpu_isolator_module.so"
STATE = "/var/lib/gpu-isolator"
# The drop-in the simulated host needs, and nothing else (docs/operations.md says so).
SIM_DROPIN = """\
# The simulated host (--simulate) makes its GPUs' device nodes under the state directory with
# mknod(2); on a real host the driver makes them, and the shipped unit rightly has no CAP_MKNOD.
[Service]
CapabilityBoundingSet=CAP_MKNOD
"""


def walkthrough_blocks() -> list[str]:
    """The ``sh`` blocks of the walkthrough section, in order."""
    with open(PAGE) as fh:
        text = fh.read()
    section = text[text.index(SECTION) :]
    nxt = re.search(r"^## ", section[len(SECTION) :], re.M)
    if nxt:
        section = section[: len(SECTION) + nxt.start()]
    return sh_blocks(section)


@dataclass
class Walked:
    """The booted node and what the walkthrough printed."""

    node: Node
    master: str
    returncode: int
    stdout: str
    stderr: str

    def said(self) -> str:
        journal = self.node.run("journalctl --no-pager -n 60 -u gpu-isolator -u mesos-agent", check=False).stdout
        return f"stdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-3000:]}\njournal:\n{journal}"


def _need() -> tuple[str, str, str]:
    """Mesos home, our module for it, the wheel; fails naming what is missing."""
    if os.geteuid() != 0:
        pytest.fail("tests/node/ boots a node with systemd-nspawn: run as root")
    missing = missing_host_packages()
    if missing:
        pytest.fail(f"tests/node/ needs the Debian package(s) {' '.join(missing)} (make test-node names them)")
    try:
        home = find_mesos_home()
        module = native_module(home)
    except MesosNotFound as exc:
        pytest.fail(f"tests/node/ needs a Mesos and our module for it: {exc}")
    wheels = sorted(glob.glob(os.path.join(paths.ROOT, "dist", "gpu_isolator-*.whl")), key=os.path.getmtime)
    if not wheels:
        pytest.fail("no wheel in dist/: run `make dist`")
    return home, module, wheels[-1]


@pytest.fixture(scope="session")
def walked() -> Iterator[Walked]:
    home, module, wheel = _need()
    rootfs = ensure_rootfs()
    wheelhouse = ensure_wheelhouse(wheel, sys.executable)
    node = Node(rootfs, ro_binds=[(home, MESOS_IN_NODE), (wheelhouse, "/wheels")])
    with node:
        shutil.copy(wheel, node.share)
        shutil.copy(module, node.share)
        shutil.copy(PROBE, node.share)
        # systemd-nspawn mounts the v1 controllers read-only (its node's cgroups are the host's,
        # under the tests' parent here); a real host's are writable by root: as on a real host.
        node.run(
            'for c in /sys/fs/cgroup/*/; do [ "$c" = /sys/fs/cgroup/unified/ ] || mount -o remount,bind,rw "$c"; done'
        )
        # The Debian installer puts the host's name in /etc/hosts (mesos-execute resolves it); mmdebstrap does not.
        node.run('echo "127.0.1.1 $(hostname)" >> /etc/hosts')
        node.run(f"install -D -m 0755 {SHARE_IN_NODE}/{os.path.basename(module)} {MODULE_IN_NODE}")
        node.run(
            "mkdir -p /etc/systemd/system/gpu-isolator.service.d && cat > "
            f"/etc/systemd/system/gpu-isolator.service.d/simulated-host.conf <<'EOF'\n{SIM_DROPIN}EOF"
        )
        master_port, agent_port = free_ports(2)
        master = f"127.0.0.1:{master_port}"
        node.run(
            f"systemd-run --unit=mesos-master -E LD_LIBRARY_PATH={MESOS_IN_NODE}/lib {MESOS_IN_NODE}/sbin/mesos-master"
            f" --ip=127.0.0.1 --port={master_port} --work_dir=/var/lib/mesos-master --registry=in_memory"
        )
        blocks = walkthrough_blocks()
        values = {
            "WHEEL": f"{SHARE_IN_NODE}/{os.path.basename(wheel)}",
            "WHEELS": "/wheels",
            "MESOS_HOME": MESOS_IN_NODE,
            "MODULE": MODULE_IN_NODE,
            "MASTER": master,
            "AGENT_IP": "127.0.0.1",
            "AGENT_PORT": str(agent_port),
            "AGENT_RESOURCES": "cpus:4;mem:2048;disk:2048;gpus:8",
            "CGROUPS_ROOT": "mesos",
            "SIDECAR_SETTINGS": 'simulate = "dgx-1"',
            # The simulated host's nodes (no driver): the probe prints `dev nvidia<n> ENXIO` for an
            # open the devices cgroup let through, EPERM for one it refused.
            "GPU_CHECK": f"python3 {SHARE_IN_NODE}/probe.py {STATE}/simhost/dev 0",
        }
        script = with_values(blocks[0], values) + "\n".join(blocks[1:])
        run = node.run(f"cd /root && bash -eu -c {shlex.quote(script)}", check=False, timeout=600)
        yield Walked(node, master, run.returncode, run.stdout, run.stderr)
        with contextlib.suppress(Exception):
            node.run("systemctl stop mesos-agent gpu-isolator mesos-master", check=False, timeout=60)
