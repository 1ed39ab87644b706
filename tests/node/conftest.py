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
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import paths
import pytest
from docpage import sh_blocks
from docpage import with_values as with_values
from probed import opened_gpus as opened_gpus
from probed import seen as seen

from isolator.testing.mesoshome import MesosNotFound, device_programs, find_mesos_home, native_module
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
DEV = f"{STATE}/simhost/dev"  # the simulated host's device nodes
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
    script: str  # the walkthrough as run, with this test's values: run it again to see a second run

    def again(self) -> subprocess.CompletedProcess[str]:
        """The walkthrough run once more on the same node, as an operator runs a page twice."""
        return self.node.run(f"cd /root && bash -eu -c {shlex.quote(self.script)}", check=False, timeout=600)

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


@contextlib.contextmanager
def walk(
    cgroups: str = "v1",
    cgroups_root: str = "mesos",
    settings: str = 'simulate = "dgx-1"',
    resources: str = "cpus:4;mem:2048;disk:2048;gpus:8",
) -> Iterator[Walked]:
    """A node booted with ``cgroups`` (``"v1"``: the host's hybrid layout; ``"v2"``: cgroup2 alone),
    the walkthrough run on it as written with the sidecar's ``settings`` and the agent's
    ``resources``; stopped on exit."""
    home, module, wheel = _need()
    rootfs = ensure_rootfs()
    wheelhouse = ensure_wheelhouse(wheel, sys.executable)
    node = Node(rootfs, ro_binds=[(home, MESOS_IN_NODE), (wheelhouse, "/wheels")], cgroups=cgroups)
    with node:
        shutil.copy(wheel, node.share)
        shutil.copy(module, node.share)
        shutil.copy(PROBE, node.share)
        if cgroups == "v1":
            # systemd-nspawn mounts the v1 controllers read-only (its node's cgroups are the host's,
            # under the tests' parent here); a real host's are writable by root: as on a real host.
            # (On v2 nspawn mounts the node's cgroup2 read-write, as a host's.)
            remount = 'mount -o remount,bind,rw "$c"'
            node.run(f'for c in /sys/fs/cgroup/*/; do [ "$c" = /sys/fs/cgroup/unified/ ] || {remount}; done')
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
            "AGENT_RESOURCES": resources,
            "CGROUPS_ROOT": cgroups_root,
            "CGROUP_VERSION": cgroups,
            "NVIDIA_DEV": DEV,
            "SIDECAR_SETTINGS": settings,
            # The simulated host's nodes (no driver): the probe prints `dev nvidia<n> ENXIO` for an
            # open the devices cgroup let through, EPERM for one it refused.
            "GPU_CHECK": f"python3 {SHARE_IN_NODE}/probe.py {DEV} 0",
        }
        script = with_values(blocks[0], values) + "\n".join(blocks[1:])
        run = node.run(f"cd /root && bash -eu -c {shlex.quote(script)}", check=False, timeout=600)
        yield Walked(node, master, run.returncode, run.stdout, run.stderr, script)
        with contextlib.suppress(Exception):
            node.run("systemctl stop mesos-agent gpu-isolator mesos-master", check=False, timeout=60)


@pytest.fixture(scope="session")
def walked() -> Iterator[Walked]:
    """The node on the host's hybrid layout (cgroup v1), shared by every v1 scenario."""
    with walk("v1") as w:
        yield w


# ---- tasks launched into the node, and what the kernel holds for them --------------------------


def agent_env(node: Node) -> dict[str, str]:
    """The agent's flags as its unit reads them (/etc/default/mesos-agent)."""
    text = node.run("cat /etc/default/mesos-agent").stdout
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def since(node: Node) -> str:
    """Now, as ``journalctl --since`` takes it."""
    return node.run("date '+%Y-%m-%d %H:%M:%S'").stdout.strip()


def wait_registered(node: Node, when: str, timeout: float = 90) -> None:
    journal = f"journalctl --no-pager -o cat -u mesos-agent --since '{when}'"
    deadline = time.monotonic() + timeout
    while "egistered with master" not in node.run(journal).stdout:
        assert time.monotonic() < deadline, node.run(f"{journal} | tail -30").stdout
        time.sleep(0.5)


@dataclass
class Running:
    """A task launched by ``mesos-execute`` in the background of the node (its framework's log in
    ``/root/<name>.log``), that runs until ``stop()``; ``task``: one task of a task group launched so
    (its framework is ``name``, its sandbox under the default executor's)."""

    node: Node
    name: str
    task: str = ""

    def log(self) -> str:
        return self.node.run(f"cat /root/{self.name}.log", check=False).stdout

    def stdout(self) -> str:
        runs = "/var/lib/mesos/slaves/*/frameworks/*/executors"
        where = f"{runs}/*/runs/latest/tasks/{self.task}" if self.task else f"{runs}/{self.name}/runs/latest"
        return self.node.run(f"cat {where}/stdout", check=False).stdout

    def wait_probed(self, timeout: float = 120) -> str:
        """The probe's output once it printed ``probed`` (fails with the framework's log if the task ended)."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.stdout()
            if "\nprobed\n" in f"\n{out}":
                return out
            log = self.log()
            assert not re.search(r"TASK_(FAILED|LOST|ERROR|KILLED|DROPPED|FINISHED)", log), f"{log}\n{out}"
            gone = self.node.run(f"kill -0 $(cat /root/{self.name}.pid)", check=False).returncode != 0
            assert not gone, f"{self.name}: its framework exited\n{log[-3000:]}\n{out}"
            assert time.monotonic() < deadline, f"{self.name} never probed\n{log}\n{out}"
            time.sleep(0.5)

    def stop(self) -> None:
        """Ends the framework (the master tears it down: its task is killed) and waits until the
        agent's cleanup removed the task's cgroup."""
        out = self.stdout()
        self.node.run(f"kill $(cat /root/{self.name}.pid) 2>/dev/null", check=False)
        found = re.findall(r"^cgroup2 (\S+)$" if self.node.cgroups == "v2" else r"^cgroup (\S+)$", out, re.M)
        if not found:
            return
        where = self.node.host_cgroup(found[0], "" if self.node.cgroups == "v2" else "devices")
        deadline = time.monotonic() + 60
        while os.path.isdir(where):
            assert time.monotonic() < deadline, f"{self.name}: {where} still there 60 s after its framework ended"
            time.sleep(0.3)


def launch(node: Node, name: str, resources: str, *flags: str, command: str = "") -> Running:
    """``mesos-execute`` of a task holding ``resources`` that probes the simulated nodes and then
    sleeps (or runs ``command``)."""
    command = command or f"python3 {SHARE_IN_NODE}/probe.py {DEV} 600"
    quoted = f"--resources={shlex.quote(resources)} --command={shlex.quote(command)}"
    execute(node, name, f"--name={name} {quoted} {' '.join(flags)}")
    return Running(node, name)


def execute(node: Node, name: str, flags: str) -> None:
    """``mesos-execute flags`` against the agent's master, in the background of the node (its log in
    ``/root/<name>.log``, its pid in ``/root/<name>.pid``)."""
    master = agent_env(node)["MESOS_MASTER"]
    node.run(
        f"setsid nohup env LD_LIBRARY_PATH={MESOS_IN_NODE}/lib {MESOS_IN_NODE}/bin/mesos-execute"
        f" --master={master} --framework_capabilities=GPU_RESOURCES {flags}"
        f" > /root/{name}.log 2>&1 < /dev/null & echo $! > /root/{name}.pid"
    )


def granted(node: Node, stdout: str) -> set[int]:
    """GPU minors the kernel lets the probe's container open read-write, read from the kernel on the
    host: on v1 the ``c 195:N rwm`` lines of its devices cgroup's devices.list, on v2 the device
    programs on its cgroup2 cgroup and on each ancestor (every one must allow: the kernel ANDs them)."""
    if node.cgroups == "v1":
        (path,) = re.findall(r"^cgroup (\S+)$", stdout, re.M)
        with open(os.path.join(node.host_cgroup(path, "devices"), "devices.list")) as fh:
            rules = fh.read()
        return {int(m) for m in re.findall(r"^c 195:(\d+) rwm$", rules, re.M) if int(m) < 255}
    (path,) = re.findall(r"^cgroup2 (\S+)$", stdout, re.M)
    where, programs = node.host_cgroup(path), []
    while where.startswith("/sys/fs/cgroup/unified/"):
        programs += device_programs(where)
        where = os.path.dirname(where)
    assert any(p.name == "gpu_isolator" for p in programs), f"no program of ours above {path}: {programs}"
    return {m for m in range(255) if all(p.allows("c", 195, m, "rw") for p in programs)}


def isolator_errors(node: Node, when: str) -> list[str]:
    """The agent's error lines about an isolator (glog: they start with E) and the sidecar's ERROR
    lines in the journal since ``when``."""
    agent = node.run(f"journalctl --no-pager -o cat -u mesos-agent --since '{when}'").stdout
    sidecar = node.run(f"journalctl --no-pager -o cat -u gpu-isolator --since '{when}'").stdout
    return [ln for ln in agent.splitlines() if ln.startswith("E") and "isolator" in ln.lower()] + [
        ln for ln in sidecar.splitlines() if re.search(r"\b(ERROR|CRITICAL)\b", ln)
    ]
