"""A real Mesos master and agents on loopback, with the sidecar behind criteo's command module or ours.

For ``make test-mesos`` (tests/mesos/) and the agent benchmark. Needs root, cgroup v1 and an installed
Mesos 1.12 with ``lib/libmesos_command_modules.so`` (``../shared/mesos/setup.sh`` prints one).

    from isolator.testing.cluster import Cluster
    from isolator.testing.mesoshome import find_mesos_home

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
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from typing import Any

from isolator.model import CgroupVersion
from isolator.testing.agent import Agent
from isolator.testing.cgroupfs import TEST_PARENT
from isolator.testing.mesoshome import (
    DEFAULT_ISOLATION,
    Route,
    find_mesos_home,
    free_port,
    get_json,
    native_module,
    terminate,
    wait_for,
)
from isolator.testing.task import Task

__all__ = ["Cluster"]


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
        cgroups: str = CgroupVersion.V1,
        route: str = Route.CRITEO,
        module_params: dict[str, str] | None = None,
        module_socket: str | None = None,
    ) -> None:
        """``gpus``: what each agent advertises (default: the simulated host's GPU count);
        ``resources``: the agents' other resources (default ``cpus:8;mem:4096;disk:4096``);
        ``cgroups``: the layout the agents see, a ``CgroupVersion`` (or its value, ``"v1"``/``"v2"``);
        ``route``: a ``Route`` (or ``"criteo"``/``"native"``; the module's docstring)."""
        try:
            layout = CgroupVersion(cgroups)
        except ValueError:
            raise ValueError(f"cgroups={cgroups!r} is not one of {[str(v) for v in CgroupVersion]}") from None
        try:
            route = Route(route)
        except ValueError:
            raise ValueError(f"route {route!r}: expected one of {[str(r) for r in Route]}") from None
        if route is Route.NATIVE and hooks not in ("bridge", None):
            raise ValueError(f"route 'native' runs no hook commands (hooks={hooks!r})")
        if route is Route.NATIVE and hooks is not None:
            native_module(mesos_home)  # fail before anything starts
        self.route = route
        self.module_params = dict(module_params or {})
        self.module_socket = module_socket
        self.mesos_home = mesos_home
        self.work = tempfile.mkdtemp(prefix="gi-mesos-", dir=tmp or "/tmp")
        # Searchable, as the directories above a real sidecar's work directory are (/var/lib): a task
        # run as another user reaches its GPU's MPS pipe directory under the sidecar's work directory.
        os.chmod(self.work, 0o711)
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
                cgroups=layout,
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
                    return bool(get_json(f"http://{self.master_address}/master/state", 2).get("leader"))
                return False

            with contextlib.suppress(TimeoutError):
                wait_for("the master", lambda: up() or self.master.poll() is not None, 60)
            if self.master.poll() is None:
                return
            self._master_log.close()
        with open(path, errors="replace") as fh:
            raise RuntimeError(f"mesos-master did not start:\n{fh.read()[-3000:]}")

    def stop(self) -> None:
        """Tear everything down, by PID, whatever state it is in."""
        for task in self.tasks:
            terminate(task.proc, 5)
        for agent in self.agents:
            with contextlib.suppress(Exception):
                agent.teardown()
        terminate(self.master)
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
                state = get_json(f"http://{agent.address}/slave(1)/state", 10)
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
    """``python -m isolator.testing.cluster``: start a cluster, run one gpus:1 task, print what it saw."""
    with Cluster(find_mesos_home()) as cluster:
        task = cluster.submit("cat /proc/self/cgroup; env | grep -i nvidia", gpus=1)
        task.wait("TASK_FINISHED")
        sys.stdout.write(task.stdout())
    return 0


if __name__ == "__main__":
    sys.exit(main())
