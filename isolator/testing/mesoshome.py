"""The installed Mesos and what the real-agent harness (cluster.py, agent.py, task.py) shares.

Finds a Mesos (``MESOS_HOME``, else ``../shared/mesos/setup.sh``) and our module built for it, names the
two routes and the harness's constants, and reads the host as the agent's cgroups use it (the v1
hierarchies, the device programs bpf(2) reports). Starts nothing and keeps no state.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from isolator.model import CgroupVersion

__all__ = [
    "CGROUPS",
    "HOOKS",
    "MODULE",
    "NATIVE_MODULE",
    "ROUTES",
    "MesosNotFound",
    "Program",
    "Route",
    "cgroups_v2_unsupported",
    "device_programs",
    "devices_hierarchy",
    "find_mesos_home",
    "free_port",
    "get_json",
    "mesos_version",
    "native_module",
    "read_lines",
    "terminate",
    "v1_hierarchies",
    "wait_for",
]


class Route(StrEnum):
    """How the agent reaches the sidecar: criteo's command module running our bridge executables,
    or our own module (mesos/) talking gRPC."""

    CRITEO = "criteo"
    NATIVE = "native"


HOOKS = ("prepare", "isolate", "watch", "usage", "cleanup")
MODULE = "com_criteo_mesos_CommandIsolator"
NATIVE_MODULE = "org_gpuisolator_GpuIsolator"  # mesos/module.cpp
ROUTES = tuple(Route)
MODULE_STATE = "/var/run/mesos/isolators/command"
DEFAULT_ISOLATION = ("cgroups/devices", MODULE)
TERMINAL = frozenset(
    {"TASK_FINISHED", "TASK_FAILED", "TASK_KILLED", "TASK_LOST", "TASK_ERROR", "TASK_DROPPED", "TASK_GONE"}
)
CGROUPS = tuple(CgroupVersion)  # the agent's cgroup layout (``Cluster(cgroups=...)``)
# The wrapper an operator runs the agent through on cgroup v2 (shipped as package data).
AGENT_CGROUP2_WRAPPER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "mesos-agent-cgroup2.sh")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class MesosNotFound(RuntimeError):
    pass


def find_mesos_home() -> str:
    """``$MESOS_HOME``, else what ``../shared/mesos/setup.sh`` prints (from the repository root)."""
    home = os.environ.get("MESOS_HOME")
    if not home:
        setup = os.path.join(os.path.dirname(REPO), "shared", "mesos", "setup.sh")
        if not os.path.exists(setup):
            raise MesosNotFound("no MESOS_HOME and no ../shared/mesos/setup.sh")
        home = subprocess.run([setup], check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    for rel in ("sbin/mesos-agent", "sbin/mesos-master", "bin/mesos-execute", "lib/libmesos_command_modules.so"):
        if not os.path.exists(os.path.join(home, rel)):
            raise MesosNotFound(f"MESOS_HOME={home} has no {rel}")
    return home


def mesos_version(home: str) -> tuple[int, ...]:
    """The agent's version, from ``mesos-agent --version`` ("mesos 1.12.0")."""
    out = subprocess.run(
        [f"{home}/sbin/mesos-agent", "--version"],
        capture_output=True,
        text=True,
        env=dict(os.environ, LD_LIBRARY_PATH=f"{home}/lib"),
        timeout=60,
    )
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    if m is None:
        raise MesosNotFound(f"{home}/sbin/mesos-agent --version said {out.stdout + out.stderr!r}")
    return tuple(int(g) for g in m.groups())


def cgroups_v2_unsupported(home: str) -> str | None:
    """Why this Mesos cannot run on a pure cgroup v2 host, or None. Mesos's cgroups2 isolators and
    device manager came to master in 2024 (1.12.0-dev); no release up to 1.11.0 has them."""
    version = mesos_version(home)
    if version < (1, 12, 0):
        shown = ".".join(map(str, version))
        return f"Mesos {shown} has no cgroups v2 support (master of 2024-08, 1.12.0-dev, is the first with it)"
    return None


def native_module(mesos_home: str) -> str:
    """Our module built for ``mesos_home``'s version (``make module MESOS_HOME=...``); an agent loads
    a module only of its own version."""
    path = os.path.join(
        REPO, "build", f"mesos-{'.'.join(map(str, mesos_version(mesos_home)))}", "libgpu_isolator_module.so"
    )
    if not os.path.exists(path):
        raise MesosNotFound(f"{path} is missing: run `make module MESOS_HOME={mesos_home}`")
    return path


def free_port() -> int:
    """A loopback TCP port free now (the kernel's pick); a start that loses the race is retried."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listen_port_outside_ephemeral() -> int:
    """A loopback TCP port free now, below the kernel's ephemeral range
    (``net.ipv4.ip_local_port_range``), for a process started by a script that cannot retry. A port
    from :func:`free_port` can be taken by any outgoing connection on the host before the process binds
    it (three suites run at once in CI); one outside that range only by another picker like this."""
    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        low = int(fh.read().split()[0])
    if low <= 10001:
        return free_port()
    for _ in range(200):
        port = random.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


def get_json(url: str, timeout: float = 10) -> Any:
    """One GET of a Mesos endpoint, parsed."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


# glog's line prefix: severity, [year]monthday, local time with microseconds (the year since glog 0.6).
GLOG_TIME = re.compile(r"^[IWE](\d{4})?(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) ")


def glog_time(line: str) -> float | None:
    """time.time() of a glog line (local time; this year where the line has none), or None."""
    m = GLOG_TIME.match(line)
    if m is None:
        return None
    year, month, day, hh, mm, ss, us = m.groups()
    when = datetime.datetime(
        int(year) if year else datetime.date.today().year, int(month), int(day), int(hh), int(mm), int(ss), int(us)
    )
    return when.timestamp()


def wait_for(what: str, predicate: Any, timeout: float, interval: float = 0.1) -> Any:
    """``predicate()``'s first truthy value, polled every ``interval``; TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def terminate(proc: subprocess.Popen[Any] | None, grace: float = 20) -> None:
    """SIGTERM ``proc`` (ours, by PID), SIGKILL after ``grace`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def v1_hierarchies() -> list[str]:
    """Mount points of every cgroup v1 hierarchy (the agent's launcher uses freezer and systemd too)."""
    out = []
    with open("/proc/self/mounts") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) > 2 and parts[2] == "cgroup":
                out.append(parts[1])
    return out


def devices_hierarchy() -> str:
    for mount in v1_hierarchies():
        if os.path.exists(os.path.join(mount, "devices.list")):
            return mount
    raise RuntimeError("no cgroup v1 devices hierarchy")


@dataclass(frozen=True)
class Program:
    """A BPF_CGROUP_DEVICE program attached to a cgroup, as bpf(2) reports it (``bpftool cgroup show``)."""

    id: int
    name: str  # ours: "gpu_isolator"; Mesos's device manager loads its programs without a name
    insns: bytes  # the kernel's translated instructions (empty when it withholds them)

    def allows(self, type_: str, major: int, minor: int, access: str = "rw") -> bool:
        """What this program answers to one request, run in the project's evaluator
        (isolator/cgroups/bpfprog.py, checked against the kernel by tests/system/test_bpf_differential.py)."""
        from isolator.cgroups import bpfprog

        return bpfprog.evaluate(self.insns, bpfprog.Request(type_, major, minor, access)) == 1


def device_programs(cgroup: str) -> list[Program]:
    """The device programs attached directly to ``cgroup`` (BPF_PROG_QUERY; inherited ones not
    included), in the kernel's order; [] when the cgroup does not exist."""
    from isolator.cgroups import bpf

    try:
        fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    out = []
    try:
        for prog_id in bpf.prog_query(fd, cgroup):
            prog_fd = bpf.prog_fd_by_id(prog_id)
            try:
                info = bpf.prog_info(prog_fd)
            finally:
                os.close(prog_fd)
            out.append(Program(prog_id, info.name, info.insns))
    finally:
        os.close(fd)
    return out


def read_lines(path: str) -> list[str]:
    with open(path) as fh:
        return [line.strip() for line in fh if line.strip()]


def unmount_below(path: str) -> None:
    with open("/proc/self/mounts") as fh:
        targets = [line.split()[1] for line in fh if line.split()[1].startswith(path + "/")]
    for target in sorted(targets, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)
