"""A real Mesos master and agents on loopback, with the sidecar behind criteo's command module or ours.

For ``make test-mesos`` (tests/mesos/) and the agent benchmark. Needs root, cgroup v1 and an installed
Mesos 1.12 with ``lib/libmesos_command_modules.so`` (``../shared/mesos/setup.sh`` prints one).

    from isolator.testing.agent import Cluster, find_mesos_home

    with Cluster(find_mesos_home(), agents=1) as cluster:          # master + agent + sidecar
        task = cluster.submit("cat /proc/self/cgroup", gpus=1)      # mesos-execute, GPU_RESOURCES
        task.wait("TASK_FINISHED")                                   # every status update seen
        task.stdout(), task.devices_list(), cluster.agents[0].sidecar.containers()

Everything a run makes is its own, so that runs may overlap (another engineer's, or a second
pytest): ports picked free at start, work/runtime/store dirs in one temp dir, a ``--cgroups_root`` of
``gpu-isolator-test/mesos-<pid>-<hex>-<agent>``, a ``module_name`` per agent. ``stop()`` (also on
``__exit__`` and when ``start()`` fails) SIGTERMs the mesos-execute processes, the agents, the
sidecars and the master, by PID, then removes the agents' cgroups from every v1 hierarchy (killing
what is left in them), the module's state dir ``/var/run/mesos/isolators/command/<module_name>`` and
the temp dir.

Hooks (``hooks=``): ``"bridge"`` (default) runs our bridge executables (``python -m isolator.bridge
install``) against a sidecar per agent, the compiled one (``install --compiled``, isolator/bridge/bridge.c)
with ``"bridge-c"`` or when ``GI_MESOS_BRIDGE=c`` is set (``GI_MESOS_BRIDGE=c make test-mesos`` runs
every scenario through it); ``"noop"`` runs ``/bin/true`` for every hook (the floor of
the route: the module, a fork and an exec; no sidecar); ``None`` loads no module at all (no sidecar);
a dict ``{hook: command}`` gives a command per hook (prepare, isolate, cleanup, watch, usage), a
sidecar is still started.

Routes (``route=``): ``"criteo"`` (default) is criteo's command module running the hooks above;
``"native"`` is our own module (mesos/, ``make module``: ``build/mesos-<version>/libgpu_isolator_module.so``
for the Mesos version of ``mesos_home``) talking gRPC to the agent's sidecar; ``module_params`` adds or
overrides its parameters, ``module_socket`` points it at another socket than the sidecar's (a proxy).
With ``"native"``, ``hooks`` is only "bridge" (a sidecar per agent) or None (no module).

The agent runs in a mount namespace of its own. ``cgroups="v1"`` (default): without
``/sys/fs/cgroup/unified``, as this Mesos refuses the hybrid layout, so it manages cgroup v1 only.
``cgroups="v2"``: through the wrapper shipped for operators (isolator/data/mesos-agent-cgroup2.sh),
``/sys/fs/cgroup`` unmounted recursively and ``cgroup2`` mounted there, a pure v2 host for the agent
(Mesos master's cgroups2 isolators; 1.11.0 has none: ``cgroups_v2_unsupported``); the wrapper
creates its ``--cgroups_root`` first (the agent aborts at the first launch otherwise), the agent
gets ``--allowed_devices`` with the NVIDIA nodes (``nvidia_allowed_devices``), and the sidecar
runs with ``--cgroup-version v2`` on the host's view of the same cgroup2 hierarchy
(``/sys/fs/cgroup/unified`` on a hybrid host). Either way the host's mounts are untouched
(docs/mesos-agent.md). Task states come from mesos-execute's own output (one process per task, or
per task group); sandboxes, container IDs and cgroups from the agent's ``/state``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from isolator.model import CgroupVersion, Mode
from isolator.testing.cgroupfs import TEST_PARENT, cgroup_mount, remove_cgroup_tree
from isolator.testing.sidecar import Sidecar

__all__ = [
    "HOOKS",
    "NATIVE_MODULE",
    "ROUTES",
    "Agent",
    "Cluster",
    "MesosNotFound",
    "Program",
    "Task",
    "cgroups_v2_unsupported",
    "device_programs",
    "devices_hierarchy",
    "find_mesos_home",
    "free_port",
    "mesos_version",
    "read_lines",
]

HOOKS = ("prepare", "isolate", "watch", "usage", "cleanup")
MODULE = "com_criteo_mesos_CommandIsolator"
NATIVE_MODULE = "org_gpuisolator_GpuIsolator"  # mesos/module.cpp
ROUTES = ("criteo", "native")
MODULE_STATE = "/var/run/mesos/isolators/command"
DEFAULT_ISOLATION = ("cgroups/devices", MODULE)
TERMINAL = frozenset(
    {"TASK_FINISHED", "TASK_FAILED", "TASK_KILLED", "TASK_LOST", "TASK_ERROR", "TASK_DROPPED", "TASK_GONE"}
)
CGROUPS = ("v1", "v2")  # the agent's cgroup layout (``Cluster(cgroups=...)``)
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


def _get_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def _wait(what: str, predicate: Any, timeout: float, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def _terminate(proc: subprocess.Popen[Any] | None, grace: float = 20) -> None:
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


@dataclass
class Update:
    """One status update as mesos-execute printed it."""

    state: str
    message: str = ""
    reason: str = ""
    source: str = ""


@dataclass
class Task:
    """A task (or a task group: ``name`` is the group's first task) submitted through mesos-execute."""

    cluster: Cluster
    name: str
    proc: subprocess.Popen[str]
    log_path: str
    names: tuple[str, ...] = ()
    submitted_at: float = 0.0  # time.time() when mesos-execute was started

    def status_times(self) -> dict[str, float]:
        """State -> the agent's timestamp (time.time() seconds) of this task's first update in that
        state, from the master's /master/tasks: finer than polling mesos-execute's output."""
        data = _get_json(f"http://{self.cluster.master_address}/master/tasks?limit=100000", 10)
        out: dict[str, float] = {}
        for task in data.get("tasks", []):
            if task.get("id") == self.name:
                for status in task.get("statuses", []):
                    out.setdefault(str(status["state"]), float(status["timestamp"]))
        return out

    def updates(self) -> list[Update]:
        """Every status update so far, in order, for this task (its first one for a group)."""
        with open(self.log_path, errors="replace") as fh:
            text = fh.read()
        out: list[Update] = []
        for line in text.splitlines():
            m = re.match(r"Received status update (TASK_\w+) for task '([^']*)'", line.strip())
            if m:
                if m.group(2) == self.name:
                    out.append(Update(m.group(1)))
                continue
            if not out:
                continue
            m = re.match(r"(message|reason|source): '?(.*?)'?$", line.strip())
            if m and not getattr(out[-1], m.group(1)):
                setattr(out[-1], m.group(1), m.group(2))
        return out

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()

    @property
    def state(self) -> str | None:
        updates = self.updates()
        return updates[-1].state if updates else None

    def wait(self, *states: str, timeout: float = 90) -> Update:
        """The first update in ``states``; AssertionError when a different terminal state comes first."""

        def seen() -> Update | None:
            self.cluster.check_agents()
            for update in self.updates():
                if update.state in states:
                    return update
                if update.state in TERMINAL:
                    raise AssertionError(f"task {self.name} ended {update} waiting for {states}; log:\n{self.log()}")
            return None

        try:
            return _wait(f"{self.name} to reach {states}", seen, timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; mesos-execute said:\n{self.log()[-3000:]}") from None

    def teardown(self) -> None:
        """Tear down the task's framework (one per mesos-execute) at the master: the agent kills its
        executor; mesos-execute exits without a last update (use ``kill_after`` for TASK_KILLED)."""
        framework = self.executor()["framework_id"]
        req = urllib.request.Request(
            f"http://{self.cluster.master_address}/master/teardown",
            data=f"frameworkId={framework}".encode(),
            method="POST",
        )
        urllib.request.urlopen(req, timeout=10).close()

    def wait_gone(self, timeout: float = 60) -> dict[str, Any]:
        """Wait until the agent lists the task's executor as completed (its container destroyed)."""

        def gone() -> dict[str, Any] | None:
            ex = self.cluster.find_executor(self.name)
            return ex if ex is not None and ex.get("completed") else None

        return _wait(f"the executor of {self.name} to complete", gone, timeout)

    def executor(self) -> dict[str, Any]:
        """The agent's record of this task's executor: ``container`` (ID), ``directory``, ``framework_id``."""
        return _wait(f"the executor of {self.name}", lambda: self.cluster.find_executor(self.name), 60)

    def agent(self) -> Agent:
        return self.cluster.agent_of(self.executor()["agent_id"])

    def container_id(self) -> str:
        return str(self.executor()["container"])

    def sandbox(self, task: str | None = None) -> str:
        """The executor's sandbox; a nested task's (``task`` of a group) below it under tasks/."""
        directory = str(self.executor()["directory"])
        return os.path.join(directory, "tasks", task) if task else directory

    def stdout(self, task: str | None = None) -> str:
        path = os.path.join(self.sandbox(task), "stdout")
        with open(path, errors="replace") as fh:
            return fh.read()

    def wait_stdout(self, pattern: str, task: str | None = None, timeout: float = 60) -> str:
        def found() -> str | None:
            with contextlib.suppress(OSError):
                text = self.stdout(task)
                if re.search(pattern, text):
                    return text
            return None

        return _wait(f"{pattern!r} in the stdout of {task or self.name}", found, timeout)

    def cgroup(self, *nested: str) -> str:
        """The task's container cgroup in the devices hierarchy (``nested``: child container IDs);
        on v2 the container's non-leaf cgroup ``<root>/<id>``, the device manager's."""
        parts = [self.container_id()]
        for child in nested:
            parts += ["mesos", child]
        return os.path.join(self.agent().cgroups_mount(), self.agent().cgroups_root, *parts)

    def leaf(self, *nested: str) -> str:
        """v2: ``<root>/<id>/leaf`` (``.../mesos/<child>/leaf``), where the processes are (and ours)."""
        return os.path.join(self.cgroup(*nested), "leaf")

    def debug(self, command: str, timeout: float = 120) -> tuple[str, str]:
        """Run ``command`` in a DEBUG container below the task's executor (the agent's
        LAUNCH_NESTED_CONTAINER_SESSION, what ``mesos task exec`` does) and return its
        ``(container ID, stdout)``: the session streams its output as RecordIO and ends with it."""
        import base64

        child = str(uuid.uuid4())
        call = {
            "type": "LAUNCH_NESTED_CONTAINER_SESSION",
            "launch_nested_container_session": {
                "container_id": {"parent": {"value": self.container_id()}, "value": child},
                "command": {"shell": True, "value": command},
            },
        }
        req = urllib.request.Request(
            f"http://{self.agent().address}/api/v1",
            data=json.dumps(call).encode(),
            headers={
                "Content-Type": "application/json",
                "Accept": "application/recordio",
                "Message-Accept": "application/json",
            },
            method="POST",
        )
        out = []
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            stream = resp.read()
        while stream:
            size, _, rest = stream.partition(b"\n")
            record, stream = rest[: int(size)], rest[int(size) :]
            message = json.loads(record)
            data = message.get("data", {})
            if message.get("type") == "DATA" and data.get("type") == "STDOUT":
                out.append(base64.b64decode(data.get("data", "")).decode(errors="replace"))
        return child, "".join(out)

    def devices_list(self, *nested: str) -> list[str]:
        """The kernel's devices.list of the task's cgroup, one rule per entry."""
        return read_lines(os.path.join(self.cgroup(*nested), "devices.list"))


def read_lines(path: str) -> list[str]:
    with open(path) as fh:
        return [line.strip() for line in fh if line.strip()]


@dataclass
class Agent:
    """One mesos-agent (and its sidecar, unless hooks is "noop" or None)."""

    cluster: Cluster
    index: int
    work: str
    cgroups_root: str
    module_name: str
    resources: str
    isolation: tuple[str, ...]
    hooks: Any
    host: str
    extra_flags: tuple[str, ...] = ()
    cgroups: str = "v1"  # the layout the agent sees (CGROUPS); the sidecar follows it
    # v2: the NVIDIA nodes (names under the host's dev dir) in --allowed_devices; None: all of them,
    # (): no --allowed_devices at all. Ignored when extra_flags carry their own.
    allowed_nvidia: tuple[str, ...] | None = None
    route: str = "criteo"
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    sidecar: Sidecar | None = None
    agent_id: str = ""
    stopped: bool = False  # stopped on purpose (stop/restart/teardown), not died
    log_mark: int = 0  # len(log()) when the sidecar last started (start_sidecar)
    _log: Any = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.work, "agent.log")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()

    @property
    def bin_dir(self) -> str:
        return os.path.join(self.work, "bin")

    def cgroups_mount(self) -> str:
        """Where this agent's cgroups are, as seen from the host's mount namespace (the tests' and
        the sidecar's): the v1 devices hierarchy, or the cgroup2 mount (``/sys/fs/cgroup/unified``
        on a hybrid host, which the agent sees at ``/sys/fs/cgroup``)."""
        return devices_hierarchy() if self.cgroups == "v1" else cgroup_mount("v2")

    def hook_commands(self) -> dict[str, str]:
        if self.hooks is None:
            return {}
        if self.hooks == "noop":
            true = shutil.which("true") or "/bin/true"
            return {hook: true for hook in ("prepare", "isolate", "cleanup", "watch")}
        if self.hooks in ("bridge", "bridge-c"):
            return {
                hook: os.path.join(self.bin_dir, f"gpu-isolator-{hook}")
                for hook in ("prepare", "isolate", "cleanup", "watch")
            }
        return dict(self.hooks)

    @property
    def module(self) -> str:
        """The name of the isolator module this agent loads (in ``--isolation``)."""
        return NATIVE_MODULE if self.route == "native" else MODULE

    def modules_json(self) -> dict[str, Any]:
        if self.route == "native":
            assert self.sidecar is not None
            socket_path = self.cluster.module_socket or self.sidecar.socket
            values = {"socket": socket_path, **self.cluster.module_params}
            params_native = [{"key": k, "value": v} for k, v in values.items()]
            lib_native = native_module(self.cluster.mesos_home)
            return {
                "libraries": [{"file": lib_native, "modules": [{"name": NATIVE_MODULE, "parameters": params_native}]}]
            }
        params = [{"key": "module_name", "value": self.module_name}]
        for hook, command in self.hook_commands().items():
            params.append({"key": f"isolator_{hook}_command", "value": command})
            if hook != "watch":
                params.append({"key": f"isolator_{hook}_timeout", "value": "30"})
        params += [
            {"key": "isolator_watch_frequence", "value": str(self.cluster.watch_frequence)},
            {"key": "debug", "value": "true" if self.cluster.module_debug else "false"},
        ]
        lib = os.path.join(self.cluster.mesos_home, "lib", "libmesos_command_modules.so")
        return {"libraries": [{"file": lib, "modules": [{"name": MODULE, "parameters": params}]}]}

    def sidecar_json(self, *args: str) -> Any:
        """``gpu-isolator <args> --json`` against this agent's sidecar, parsed."""
        assert self.sidecar is not None
        out = subprocess.run(
            [sys.executable, "-m", "isolator", *args, "--json", "--socket", self.sidecar.socket],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"gpu-isolator {' '.join(args)} exited {out.returncode}: {out.stderr}")
        return json.loads(out.stdout)

    def holders(self, by: str = "index") -> dict[int, str]:
        """GPU index (or ``by="minor"``) -> the container the sidecar says holds it ("" when free)."""
        return {int(g[by]): str(g.get("holder") or "") for g in self.sidecar_json("gpus")["gpus"]}

    def start_sidecar(self) -> None:
        if self.hooks in (None, "noop"):
            return
        if self.sidecar is None:
            side_work = os.path.join(self.work, "sidecar")
            os.makedirs(side_work, exist_ok=True)
            self.sidecar = Sidecar(
                work=side_work,
                host=self.host,
                cgroup_version=CgroupVersion(self.cgroups),
                cgroups_root=self.cgroups_root,
                extra=self.cluster.sidecar_flags,
                mode=Mode.MESOS,
            )
            if self.hooks in ("bridge", "bridge-c") and self.route == "criteo":
                from isolator.bridge.command import compiled_bridge, install

                compiled = None
                if self.hooks == "bridge-c" or os.environ.get("GI_MESOS_BRIDGE") == "c":
                    compiled = compiled_bridge()
                    if compiled is None:
                        raise RuntimeError("build/gpu-isolator-bridge is missing: run `make build` (it needs gcc)")
                install(self.bin_dir, self.sidecar.bridge_socket, timeout=25, compiled=compiled)
        # Where the agent's log stood when this sidecar started: its memory of the containers Mesos
        # cleaned up lately is in memory (core/changes.py), so a poll for one of them that reaches a
        # restarted sidecar reads NOT_FOUND once; tests of steady-state noise read from here.
        self.log_mark = len(self.log()) if os.path.exists(self.log_path) else 0
        self.sidecar.start()

    def argv(self) -> list[str]:
        home = self.cluster.mesos_home
        modules = (MODULE, NATIVE_MODULE)
        isolation = ",".join(
            (self.module if i in modules else i) for i in self.isolation if self.hooks is not None or i not in modules
        )
        flags = [
            f"--master={self.cluster.master_address}",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--hostname=127.0.0.1",
            f"--work_dir={self.work}/agent",
            f"--runtime_dir={self.work}/runtime",
            f"--fetcher_cache_dir={self.work}/fetch",
            f"--docker_store_dir={self.work}/store/docker",
            f"--appc_store_dir={self.work}/store/appc",
            f"--cgroups_root={self.cgroups_root}",
            "--containerizers=mesos",
            "--systemd_enable_support=false",
            f"--resources={self.resources}",
            f"--isolation={isolation}",
            f"--launcher_dir={home}/libexec/mesos",
            "--executor_environment_variables=" + json.dumps({"LD_LIBRARY_PATH": f"{home}/lib", "PATH": PATH}),
            "--executor_registration_timeout=2mins",
            "--executor_shutdown_grace_period=1secs",
            *self.extra_flags,
        ]
        if (
            self.cgroups == "v2"
            and self.allowed_nvidia != ()
            and not any(f.startswith("--allowed_devices=") for f in flags)
        ):
            # In a file, as an operator would keep it (file:// works for any of the agent's flags).
            allowed = os.path.join(self.work, "allowed-devices.json")
            with open(allowed, "w") as fh:
                json.dump(self.nvidia_allowed_devices(self.allowed_nvidia), fh, indent=1)
            flags.append(f"--allowed_devices=file://{allowed}")
        if self.hooks is not None:
            path = os.path.join(self.work, "modules.json")
            with open(path, "w") as fh:
                json.dump(self.modules_json(), fh, indent=1)
            flags.append(f"--modules=file://{path}")
        return [*self.namespace_argv(), f"{home}/sbin/mesos-agent", *flags]

    def nvidia_allowed_devices(self, names: Iterable[str] | None = None) -> dict[str, Any]:
        """The agent's ``--allowed_devices`` for cgroup v2: every NVIDIA node of the host (or only
        ``names``), read, write and mknod. On v2 the agent's device manager attaches one program to
        ``<root>/<id>`` from its default whitelist plus this flag, and every program on a cgroup and
        its ancestors must allow an open: without the GPUs here, ours on ``<id>/leaf`` could only
        narrow nothing down (the sidecar refuses, naming this flag). The agent stats each path at
        start (by path only; no wildcards), so the nodes must exist by then (nvidia-uvm included)."""
        dev = self.sidecar.dev_root if self.sidecar is not None else "/dev"
        if names is None:
            names = sorted(
                n for n in os.listdir(dev) if n.startswith("nvidia") and not os.path.isdir(os.path.join(dev, n))
            )
        access = {"read": True, "write": True, "mknod": True}
        return {"allowed_devices": [{"device": {"path": os.path.join(dev, n)}, "access": access} for n in names]}

    def namespace_argv(self) -> list[str]:
        """What runs the agent (its path and flags follow): on v1 ``unshare`` into a mount namespace
        of its own (propagation slave: nothing done there reaches the host) without the cgroup2
        mount; on v2 the wrapper we ship for operators (isolator/data/mesos-agent-cgroup2.sh): it
        creates ``--cgroups_root`` (the agent aborts at the first launch otherwise) and, on a hybrid
        host, runs the agent in such a namespace with ``/sys/fs/cgroup`` unmounted recursively and
        cgroup2 mounted there."""
        if self.cgroups == "v2":
            return ["sh", AGENT_CGROUP2_WRAPPER]
        # Without the cgroup2 mount: this Mesos refuses the hybrid layout.
        unified = os.path.ismount("/sys/fs/cgroup/unified")
        prelude = "umount /sys/fs/cgroup/unified 2>/dev/null; " if unified else ""
        return ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c", prelude + 'exec "$@"', "mesos-agent"]

    def start(self, timeout: float = 90) -> None:
        """Start the agent (a fresh port unless restarting) and wait until the master lists it active."""
        env = dict(os.environ, LD_LIBRARY_PATH=f"{self.cluster.mesos_home}/lib")
        for attempt in range(3):
            if not self.port or attempt:
                self.port = free_port()
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            self.stopped = False
            # Under a reaper of the orphans below it, as an init that reaps at once (isolator/testing/
            # reaper.py: this machine's PID 1 reaps them every ~2 s, and each container's destroy
            # waits for its killed processes to be gone).
            argv = [sys.executable, "-m", "isolator.testing.reaper", "--", *self.argv()]
            self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
            try:
                self.agent_id = _wait(f"agent {self.index} to register", self._registered, timeout, 0.2)
                return
            except _PortTaken:
                self._log.close()
                continue
        raise RuntimeError(f"agent {self.index} could not bind a port:\n{self.log()[-3000:]}")

    def _registered(self) -> str | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            log = self.log()
            if "Address already in use" in log[-2000:]:
                raise _PortTaken()
            raise RuntimeError(f"agent {self.index} exited {self.proc.returncode}:\n{log[-4000:]}")
        with contextlib.suppress(OSError, ValueError):
            for slave in _get_json(f"http://{self.cluster.master_address}/master/slaves", 5)["slaves"]:
                if slave["pid"].endswith(f"@{self.address}") and slave.get("active"):
                    return str(slave["id"])
        return None

    def stop(self) -> None:
        """SIGTERM the agent (its containers keep running, as after a crash of the agent)."""
        self.stopped = True
        _terminate(self.proc)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def teardown(self) -> None:
        self.stop()
        if self.sidecar is not None:
            self.sidecar.terminate()
            if self.sidecar._log is not None:
                self.sidecar._log.close()  # type: ignore[attr-defined]
        for mount in v1_hierarchies() + ([cgroup_mount("v2")] if self.cgroups == "v2" else []):
            with contextlib.suppress(Exception):
                remove_cgroup_tree(os.path.join(mount, self.cgroups_root))
        shutil.rmtree(os.path.join(MODULE_STATE, self.module_name), ignore_errors=True)
        # Mesos mounts the sandboxes' persistent volumes and container rootfses under the work dir.
        _unmount_below(self.work)


class _PortTaken(Exception):
    pass


def _unmount_below(path: str) -> None:
    with open("/proc/self/mounts") as fh:
        targets = [line.split()[1] for line in fh if line.split()[1].startswith(path + "/")]
    for target in sorted(targets, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)


class Cluster:
    """One master and ``agents`` agents. ``start()``/``stop()``, or use it as a context manager."""

    # The module's `debug` parameter: it then logs each hook call's start and end (the agent bench).
    module_debug = False

    def __init__(
        self,
        mesos_home: str,
        agents: int = 1,
        *,
        hooks: Any = "bridge",
        host: str = "dgx-1",
        gpus: int | None = None,
        isolation: Iterable[str] = DEFAULT_ISOLATION,
        agent_flags: Iterable[str] = (),
        sidecar_flags: Iterable[str] = (),
        watch_frequence: int = 1,
        resources: str | None = None,
        tmp: str | None = None,
        cgroups: str = "v1",
        route: str = "criteo",
        module_params: dict[str, str] | None = None,
        module_socket: str | None = None,
    ) -> None:
        """``gpus``: what each agent advertises (default: the simulated host's GPU count);
        ``resources``: the agents' other resources (default ``cpus:8;mem:4096;disk:4096``);
        ``cgroups``: the layout the agents see, ``"v1"`` or ``"v2"``; ``route``: ``"criteo"`` or
        ``"native"`` (the module's docstring)."""
        if cgroups not in CGROUPS:
            raise ValueError(f"cgroups={cgroups!r} is not one of {CGROUPS}")
        if route not in ROUTES:
            raise ValueError(f"route {route!r}: expected one of {ROUTES}")
        if route == "native" and hooks not in ("bridge", None):
            raise ValueError(f"route 'native' runs no hook commands (hooks={hooks!r})")
        if route == "native" and hooks is not None:
            native_module(mesos_home)  # fail before anything starts
        self.route = route
        self.module_params = dict(module_params or {})
        self.module_socket = module_socket
        self.mesos_home = mesos_home
        self.work = tempfile.mkdtemp(prefix="gi-mesos-", dir=tmp or "/tmp")
        self.run_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.watch_frequence = watch_frequence
        self.sidecar_flags = tuple(sidecar_flags)
        self.master_port = 0
        self.master: subprocess.Popen[bytes] | None = None
        self.tasks: list[Task] = []
        self._master_log: Any = None
        if gpus is None:
            from isolator.simhost.host import load_host

            gpus = len(load_host(host).gpus)
        self.agents = [
            Agent(
                cluster=self,
                index=i,
                work=os.path.join(self.work, f"agent{i}"),
                cgroups_root=f"{TEST_PARENT}/mesos-{self.run_id}-{i}",
                module_name=f"gpu-isolator-test-{self.run_id}-{i}",
                resources=f"{resources or 'cpus:8;mem:4096;disk:4096'};gpus:{gpus}",
                isolation=tuple(isolation),
                hooks=hooks,
                host=host,
                extra_flags=tuple(agent_flags),
                cgroups=cgroups,
                route=route,
            )
            for i in range(agents)
        ]

    # ---- life cycle ----

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    def start(self) -> Cluster:
        try:
            self._start_master()
            for agent in self.agents:
                os.makedirs(agent.work, exist_ok=True)
                agent.start_sidecar()
                agent.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_master(self) -> None:
        env = dict(os.environ, LD_LIBRARY_PATH=f"{self.mesos_home}/lib")
        path = os.path.join(self.work, "master.log")
        for _ in range(3):
            self.master_port = free_port()
            self._master_log = open(path, "ab")  # noqa: SIM115 - closed in stop()
            self.master = subprocess.Popen(
                [
                    f"{self.mesos_home}/sbin/mesos-master",
                    "--ip=127.0.0.1",
                    f"--port={self.master_port}",
                    f"--work_dir={self.work}/master",
                    "--registry=in_memory",
                    "--allocation_interval=100ms",
                ],
                stdout=self._master_log,
                stderr=subprocess.STDOUT,
                env=env,
            )

            def up() -> bool:
                assert self.master is not None
                if self.master.poll() is not None:
                    return False
                with contextlib.suppress(OSError, ValueError):
                    return bool(_get_json(f"http://{self.master_address}/master/state", 2).get("leader"))
                return False

            with contextlib.suppress(TimeoutError):
                _wait("the master", lambda: up() or self.master.poll() is not None, 60)
            if self.master.poll() is None:
                return
            self._master_log.close()
        with open(path, errors="replace") as fh:
            raise RuntimeError(f"mesos-master did not start:\n{fh.read()[-3000:]}")

    def stop(self) -> None:
        """Tear everything down, by PID, whatever state it is in."""
        for task in self.tasks:
            _terminate(task.proc, 5)
        for agent in self.agents:
            with contextlib.suppress(Exception):
                agent.teardown()
        _terminate(self.master)
        if self._master_log is not None:
            self._master_log.close()
        if not os.environ.get("GI_MESOS_KEEP"):
            shutil.rmtree(self.work, ignore_errors=True)

    # ---- tasks ----

    def submit(
        self,
        command: str,
        gpus: int = 0,
        *,
        name: str | None = None,
        cpus: float = 0.1,
        mem: int = 32,
        env: dict[str, str] | None = None,
        kill_after: str | None = None,
        extra: Iterable[str] = (),
        shares: int = 0,
    ) -> Task:
        """Launch a command task through mesos-execute (a framework of its own with GPU_RESOURCES,
        checkpointing, so that it survives an agent restart). ``shares``: ``gpu_shares`` (docs/sharing.md)."""
        name = name or f"t-{uuid.uuid4().hex[:8]}"
        resources = f"cpus:{cpus};mem:{mem}" + (f";gpus:{gpus}" if gpus else "")
        resources += f";gpu_shares:{shares}" if shares else ""
        args = [f"--name={name}", f"--command={command}", f"--resources={resources}", *extra]
        if env:
            args.append("--env=" + json.dumps(env))
        if kill_after:
            args.append(f"--kill_after={kill_after}")
        return self._execute(name, args, (name,))

    def submit_group(self, tasks: list[dict[str, Any]]) -> Task:
        """Launch a task group through the default executor. Each task: ``name``, ``command``,
        ``resources`` (``"cpus:0.1;mem:32;gpus:1"``), optional ``container`` (ContainerInfo JSON)."""
        group = {"tasks": [_task_info(t) for t in tasks]}
        path = os.path.join(self.work, f"group-{uuid.uuid4().hex[:8]}.json")
        with open(path, "w") as fh:
            json.dump(group, fh)
        names = tuple(t["name"] for t in tasks)
        return self._execute(names[0], [f"--task_group=file://{path}"], names)

    def _execute(self, name: str, args: list[str], names: tuple[str, ...]) -> Task:
        log_path = os.path.join(self.work, f"execute-{name}.log")
        env = dict(os.environ, LD_LIBRARY_PATH=f"{self.mesos_home}/lib")
        started = time.time()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    f"{self.mesos_home}/bin/mesos-execute",
                    f"--master={self.master_address}",
                    "--framework_capabilities=GPU_RESOURCES",
                    "--checkpoint",
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                text=True,
            )
        task = Task(self, name, proc, log_path, names, submitted_at=started)
        self.tasks.append(task)
        return task

    # ---- the agents' view ----

    def check_agents(self) -> None:
        """AssertionError, with the agent's last words, when an agent died that nobody stopped
        (a CHECK failure aborts the whole agent: every task on it is lost)."""
        for agent in self.agents:
            if agent.proc is not None and agent.proc.poll() is not None and not agent.stopped:
                log = agent.log()
                fatal = [line for line in log.splitlines() if line.startswith(("F2", "E2")) or "Check failed" in line]
                raise AssertionError(f"agent {agent.index} died ({agent.proc.returncode}): " + "\n".join(fatal[-5:]))

    def agent_of(self, agent_id: str) -> Agent:
        for agent in self.agents:
            if agent.agent_id == agent_id:
                return agent
        raise KeyError(agent_id)

    def find_executor(self, task: str) -> dict[str, Any] | None:
        """The executor running (or that ran) ``task`` on any agent, from the agent's /state."""
        for agent in self.agents:
            if agent.proc is None or agent.proc.poll() is not None:
                continue
            try:
                state = _get_json(f"http://{agent.address}/slave(1)/state", 10)
            except (OSError, ValueError):
                continue
            for fw in state.get("frameworks", []) + state.get("completed_frameworks", []):
                running = [(ex, False) for ex in fw.get("executors", [])]
                for ex, completed in running + [(ex, True) for ex in fw.get("completed_executors", [])]:
                    ids = [t["id"] for key in ("tasks", "queued_tasks", "completed_tasks") for t in ex.get(key, [])]
                    if task in ids or ex.get("id") == task:
                        return dict(ex, framework_id=fw["id"], agent_id=agent.agent_id, completed=completed)
        return None


def _scalars(text: str) -> list[dict[str, Any]]:
    out = []
    for part in text.split(";"):
        key, _, value = part.partition(":")
        out.append({"name": key, "type": "SCALAR", "scalar": {"value": float(value)}})
    return out


def _task_info(spec: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {
        "name": spec["name"],
        "task_id": {"value": spec["name"]},
        "agent_id": {"value": ""},
        "resources": _scalars(spec.get("resources", "cpus:0.1;mem:32")),
        "command": {"value": spec["command"]},
    }
    if "container" in spec:
        info["container"] = spec["container"]
    return info


def main(argv: list[str] | None = None) -> int:
    """``python -m isolator.testing.agent``: start a cluster, run one gpus:1 task, print what it saw."""
    with Cluster(find_mesos_home()) as cluster:
        task = cluster.submit("cat /proc/self/cgroup; env | grep -i nvidia", gpus=1)
        task.wait("TASK_FINISHED")
        sys.stdout.write(task.stdout())
    return 0


if __name__ == "__main__":
    sys.exit(main())
