"""One mesos-agent of the harness (cluster.py): its flags, modules.json, mount namespace and sidecar.

Builds the agent's command line for either route (``Route``) and either layout (``CgroupVersion``),
starts and stops the agent and its sidecar by PID, and removes what they made (its cgroups, the
module's state dir, mounts below its work dir). Submits no task (the cluster does).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from isolator.model import CgroupVersion, Mode
from isolator.testing.cgroupfs import cgroup_mount, remove_cgroup_tree
from isolator.testing.mesoshome import (
    AGENT_CGROUP2_WRAPPER,
    MODULE,
    MODULE_STATE,
    NATIVE_MODULE,
    PATH,
    Route,
    devices_hierarchy,
    free_port,
    get_json,
    native_module,
    terminate,
    unmount_below,
    v1_hierarchies,
    wait_for,
)
from isolator.testing.sidecar import Sidecar

__all__ = ["Agent", "AgentCluster"]


class AgentCluster(Protocol):
    """What an agent reads of its cluster (``Cluster`` is the one; this module does not import it)."""

    mesos_home: str
    module_params: dict[str, str]
    module_socket: str | None
    watch_frequence: int
    module_debug: bool
    sidecar_flags: tuple[str, ...]

    @property
    def master_address(self) -> str: ...


@dataclass
class Agent:
    """One mesos-agent (and its sidecar, unless hooks is "noop" or None)."""

    cluster: AgentCluster
    index: int
    work: str
    cgroups_root: str
    module_name: str
    resources: str
    isolation: tuple[str, ...]
    hooks: Any
    host: str
    extra_flags: tuple[str, ...] = ()
    cgroups: CgroupVersion = CgroupVersion.V1  # the layout the agent sees; the sidecar follows it
    # v2: the NVIDIA nodes (names under the host's dev dir) in --allowed_devices; None: all of them,
    # (): no --allowed_devices at all. Ignored when extra_flags carry their own.
    allowed_nvidia: tuple[str, ...] | None = None
    route: Route = Route.CRITEO
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
        return devices_hierarchy() if self.cgroups == CgroupVersion.V1 else cgroup_mount(CgroupVersion.V2)

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
        return NATIVE_MODULE if self.route == Route.NATIVE else MODULE

    def modules_json(self) -> dict[str, Any]:
        if self.route == Route.NATIVE:
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
                cgroup_version=self.cgroups,
                cgroups_root=self.cgroups_root,
                extra=self.cluster.sidecar_flags,
                mode=Mode.MESOS,
            )
            if self.hooks in ("bridge", "bridge-c") and self.route == Route.CRITEO:
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
            self.cgroups == CgroupVersion.V2
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
            found = sorted(
                n for n in os.listdir(dev) if n.startswith("nvidia") and not os.path.isdir(os.path.join(dev, n))
            )
            # MIG: a MIG unit's holder opens its GPU instance's and compute instance's capability nodes
            # (docs/mig.md), which the agent's program must let through as well (docs/mesos-agent.md).
            caps = os.path.join(dev, "nvidia-caps")
            if os.path.isdir(caps):
                found += [f"nvidia-caps/{n}" for n in sorted(os.listdir(caps)) if n.startswith("nvidia-cap")]
            names = found
        access = {"read": True, "write": True, "mknod": True}
        return {"allowed_devices": [{"device": {"path": os.path.join(dev, n)}, "access": access} for n in names]}

    def namespace_argv(self) -> list[str]:
        """What runs the agent (its path and flags follow): on v1 ``unshare`` into a mount namespace
        of its own (propagation slave: nothing done there reaches the host) without the cgroup2
        mount; on v2 the wrapper we ship for operators (isolator/data/mesos-agent-cgroup2.sh): it
        creates ``--cgroups_root`` (the agent aborts at the first launch otherwise) and, on a hybrid
        host, runs the agent in such a namespace with ``/sys/fs/cgroup`` unmounted recursively and
        cgroup2 mounted there."""
        if self.cgroups == CgroupVersion.V2:
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
                self.agent_id = wait_for(f"agent {self.index} to register", self._registered, timeout, 0.2)
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
            for slave in get_json(f"http://{self.cluster.master_address}/master/slaves", 5)["slaves"]:
                if slave["pid"].endswith(f"@{self.address}") and slave.get("active"):
                    return str(slave["id"])
        return None

    def stop(self) -> None:
        """SIGTERM the agent (its containers keep running, as after a crash of the agent)."""
        self.stopped = True
        terminate(self.proc)
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
        for mount in v1_hierarchies() + ([cgroup_mount(CgroupVersion.V2)] if self.cgroups == CgroupVersion.V2 else []):
            with contextlib.suppress(Exception):
                remove_cgroup_tree(os.path.join(mount, self.cgroups_root))
        shutil.rmtree(os.path.join(MODULE_STATE, self.module_name), ignore_errors=True)
        # Mesos mounts the sandboxes' persistent volumes and container rootfses under the work dir.
        unmount_below(self.work)


class _PortTaken(Exception):
    pass
