"""A conformance harness that plays the Mesos containerizer against the sidecar.

It drives the hooks in the containerizer's order (reference/bridge-and-cgroup2.md §A.3): Recover
at start; per container Prepare, fork a blocked child, Isolate(pid), let the child apply the
launch info (mounts onto a small rootfs in a new mount namespace, environment) and exec, wait,
Cleanup — Cleanup also after a failed Prepare, as Mesos does. Requests are the JSON a Mesos agent
writes through criteo/mesos-command-modules (isolator/testing/mesos_json.py: Mesos's own field names and
shapes, stout's defaults), over gRPC or over the bridge executables, so the same checks run
against both routes.

With ``MesosCgroups`` it also plays the agent's cgroups isolator and launcher for the sidecar's
``--mode mesos``: the cgroups exist, whitelisted with Mesos's defaults (v1), before the sidecar
prepares, and the pid is in its cgroup before the sidecar isolates.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf import json_format

from isolator.model import CgroupVersion
from isolator.policy.devices import MESOS_DEFAULT_WHITELIST
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing import mesos_json
from isolator.testing.cgroupfs import remove_cgroup_tree
from isolator.transport.client import deadline_metadata
from isolator.transport.peergate import ALLOWED_NAME, PRIVATE_SUFFIX

HERE = Path(__file__).resolve().parent
DIRECT_SUFFIX = f"{PRIVATE_SUFFIX}/{ALLOWED_NAME}"  # the module's default route (mesos/settings.cpp)
INIT = HERE / "container" / "init.py"
CHECK = HERE / "container" / "check.py"
# The container runs the system interpreter: it is what the small rootfs carries.
CONTAINER_PYTHON = "/usr/bin/python3"


class HookFailed(Exception):
    """A hook answered with an error; ``code`` is the gRPC status name (or the bridge's)."""

    def __init__(self, hook: str, code: str, message: str) -> None:
        super().__init__(f"{hook} failed: {code}: {message}")
        self.hook = hook
        self.code = code
        self.message = message


def container_id(chain: str | list[str]) -> dict[str, Any]:
    """``"a"`` or ``["parent", "child"]`` as Mesos's ContainerID JSON."""
    parts = [chain] if isinstance(chain, str) else list(chain)
    node: dict[str, Any] = {"value": parts[0]}
    for part in parts[1:]:
        node = {"value": part, "parent": node}
    return node


def affinity_hint_only(info: dict[str, Any] | None) -> bool:
    """Whether a launch info carries nothing but the --cpu-affinity hint (docs/affinity.md): what a
    container without an image is given by default (``hint``)."""
    from isolator.policy.affinity import ENV_CPUS, ENV_NUMA_NODES

    if info is None:
        return True
    if set(info) - {"environment", "task_environment"}:
        return False
    names = {v["name"] for key in ("environment", "task_environment") for v in info.get(key, {}).get("variables", [])}
    return names <= {ENV_CPUS, ENV_NUMA_NODES}


def chain_of(cid: dict[str, Any]) -> list[str]:
    """A ContainerID's values from the top-level container down."""
    out = []
    node: dict[str, Any] | None = cid
    while node is not None:
        out.append(node["value"])
        node = node.get("parent")
    return out[::-1]


class Isolator(Protocol):
    def recover(self, states: list[dict[str, Any]], orphans: list[dict[str, Any]]) -> None: ...
    def prepare(self, cid: dict[str, Any], config: dict[str, Any]) -> dict[str, Any] | None: ...
    def isolate(self, cid: dict[str, Any], pid: int, config: dict[str, Any] | None = None) -> None: ...
    def update(self, cid: dict[str, Any], gpus: int) -> None: ...
    def cleanup(self, cid: dict[str, Any], config: dict[str, Any] | None = None) -> None: ...


class GrpcIsolator:
    """The hooks over gRPC; requests built from Mesos JSON with unknown keys ignored."""

    def __init__(self, socket_path: str, timeout: float = 30.0, direct: bool = False) -> None:
        """``direct``: call gRPC's own socket beside ``socket_path`` (``<socket>.d/grpc``), as the
        module does by default, instead of the public socket's gate."""
        self._channel = grpc.insecure_channel("unix:" + socket_path + (DIRECT_SUFFIX if direct else ""))
        self._stub = pb_grpc.IsolatorStub(self._channel)
        self._timeout = timeout

    def _call(self, hook: str, request_type: type, body: dict[str, Any]) -> Any:
        request = json_format.ParseDict(body, request_type(), ignore_unknown_fields=True)
        try:
            # As the module would: gRPC's deadline and the same one, absolute, that a stopped sidecar keeps.
            return getattr(self._stub, hook)(request, timeout=self._timeout, metadata=deadline_metadata(self._timeout))
        except grpc.RpcError as exc:
            raise HookFailed(hook, exc.code().name, exc.details() or "") from None

    def recover(self, states: list[dict[str, Any]], orphans: list[dict[str, Any]]) -> None:
        self._call("Recover", pb.RecoverRequest, {"states": states, "orphans": orphans})

    def prepare(self, cid: dict[str, Any], config: dict[str, Any]) -> dict[str, Any] | None:
        reply = self._call("Prepare", pb.PrepareRequest, {"container_id": cid, "container_config": config})
        if not reply.HasField("launch_info"):
            return None
        return json_format.MessageToDict(reply.launch_info, preserving_proto_field_name=True)

    def isolate(self, cid: dict[str, Any], pid: int, config: dict[str, Any] | None = None) -> None:
        self._call("Isolate", pb.IsolateRequest, {"container_id": cid, "pid": pid})

    def update(self, cid: dict[str, Any], gpus: int) -> None:
        self._call("Update", pb.UpdateRequest, {"container_id": cid, "resource_requests": [gpu_resource(gpus)]})

    def update_resources(self, cid: dict[str, Any], resources: list[dict[str, Any]]) -> None:
        """Update with the agent's whole resources (Mesos JSON), any kind: MIG units, gpu_shares."""
        self._call("Update", pb.UpdateRequest, {"container_id": cid, "resource_requests": resources})

    def cleanup(self, cid: dict[str, Any], config: dict[str, Any] | None = None) -> None:
        self._call("Cleanup", pb.CleanupRequest, {"container_id": cid})

    def close(self) -> None:
        self._channel.close()


class BridgeIsolator:
    """The hooks through the command-module bridge executables, exactly as the criteo module calls
    them: ``<command> IN OUT ERR`` with stdin set to IN, JSON in stout's form, ERR on failure.

    Recover and Update are not forwarded by that module (reference §A.1.3); ``recover`` and
    ``update`` here are therefore no-ops and refusals, as an agent would see them.
    """

    def __init__(self, bridge_dir: str, workdir: str) -> None:
        self.bridge_dir = bridge_dir
        self.workdir = workdir
        self.calls = 0

    def _call(self, method: str, body: dict[str, Any]) -> dict[str, Any] | None:
        self.calls += 1
        base = os.path.join(self.workdir, f"criteo-mesos-{self.calls}")
        paths = [base + ".in", base + ".out", base + ".err"]
        with open(paths[0], "w") as fh:
            json.dump(body, fh)
        for path in paths[1:]:
            open(path, "w").close()
        with open(paths[0]) as stdin:
            result = subprocess.run(
                [os.path.join(self.bridge_dir, f"gpu-isolator-{method}"), *paths],
                stdin=stdin,
                capture_output=True,
                timeout=60,
            )
        try:
            assert result.stdout == b"", f"the bridge wrote to stdout: {result.stdout!r}"
            with open(paths[1]) as fh:
                out = fh.read()
            with open(paths[2]) as fh:
                err = fh.read()
        finally:
            for path in paths:
                os.unlink(path)
        if result.returncode != 0:
            # ERR is one line: "gpu-isolator <method>: <CODE>: <message>".
            code, _, message = err.removeprefix(f"gpu-isolator {method}: ").partition(": ")
            raise HookFailed(method, code, message)
        return json.loads(out) if out else None

    def recover(self, states: list[dict[str, Any]], orphans: list[dict[str, Any]]) -> None:
        pass  # not forwarded by the module: the sidecar recovers on its own at start

    def prepare(self, cid: dict[str, Any], config: dict[str, Any]) -> dict[str, Any] | None:
        return self._call("prepare", {"container_id": cid, "container_config": config})

    # The module adds the ContainerConfig it saved at prepare to every later call's input
    # (criteo CommandIsolator: isolate, watch, usage, cleanup), as `container_config`.

    def isolate(self, cid: dict[str, Any], pid: int, config: dict[str, Any] | None = None) -> None:
        self._call("isolate", _with_config({"container_id": cid, "pid": pid}, config))

    def update(self, cid: dict[str, Any], gpus: int) -> None:
        raise HookFailed("update", "UNIMPLEMENTED", "the command module does not forward update")

    def cleanup(self, cid: dict[str, Any], config: dict[str, Any] | None = None) -> None:
        self._call("cleanup", _with_config({"container_id": cid}, config))

    def watch(self, cid: dict[str, Any], config: dict[str, Any] | None = None) -> dict[str, Any] | None:
        limitation = self._call("watch", _with_config({"container_id": cid}, config))
        # What the agent does with it next: abort on a resource it refuses (as the real one does).
        return None if limitation is None else mesos_json.check_limitation(limitation)

    def usage(self, cid: dict[str, Any], config: dict[str, Any] | None = None) -> dict[str, Any] | None:
        return self._call("usage", _with_config({"container_id": cid}, config))

    def close(self) -> None:
        pass


def _with_config(body: dict[str, Any], config: dict[str, Any] | None) -> dict[str, Any]:
    if config is not None:
        body["container_config"] = config
    return body


def gpu_resource(n: float) -> dict[str, Any]:
    return mesos_json.gpus(n)


def _variables(environment: dict[str, Any] | None) -> dict[str, str]:
    # Later duplicates win, as when Mesos turns an Environment into a process environment.
    return {v["name"]: v.get("value", "") for v in (environment or {}).get("variables", [])}


def process_environment(config: dict[str, Any], info: dict[str, Any] | None) -> dict[str, str]:
    """The environment Mesos gives the process (the task's, for a command task), from the isolators'
    launch infos: docker/runtime's (the image's ``Env``, built-in, so merged before ours) and ours.

    MesosContainerizer merges isolator launch infos in isolator order, module isolators last. A
    command task's command executor starts from its own environment (``environment``) and applies
    ``task_environment`` over it (src/launcher/executor.cpp); docker/runtime puts a command task's
    image ``Env`` in ``task_environment``, and everybody else's in ``environment``.
    """
    info = info or {}
    image_env: dict[str, str] = {}
    if config.get("container_info", {}).get("type") == "MESOS" and "docker" in config:
        for entry in config["docker"]["manifest"].get("config", {}).get("Env", []):
            name, sep, value = entry.partition("=")
            if sep:
                image_env[name] = value
    ours = _variables(info.get("environment"))
    ours_task = _variables(info.get("task_environment"))
    if "task_info" in config:
        return {**ours, **image_env, **ours_task}
    return {**image_env, **ours}


@dataclass
class Launched:
    container_id: dict[str, Any]
    launch_info: dict[str, Any] | None
    config: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    exit_code: int = 0
    stderr: str = ""
    cgroup: str = ""

    @property
    def env(self) -> dict[str, str]:
        return process_environment(self.config, self.launch_info)


class MesosCgroups:
    """The agent's cgroups isolator and launcher, for the sidecar's mesos mode (Mesos's layout).

    v1 (cgroups/devices, 1.6+): a top-level container gets ``<root>/<id>``; a nested one with
    ``LinuxInfo.share_cgroups`` false (1.10+) gets ``<root>/<parent>/mesos/<child>``; each is made
    deny-all then Mesos's default whitelist (DevicesSubsystemProcess::prepare); a nested one that
    shares runs in its nearest ancestor's. v2 (cgroups2, master): every container, nested ones
    included, gets ``<dir>`` and ``<dir>/leaf``, and its pid goes in its own leaf. Mesos's own v2
    device program (its default whitelist plus ``--allowed_devices``) is not attached: no program
    there means everything is allowed, the worst case for a sidecar that must restrict on its own.
    """

    def __init__(self, version: str, parent: str) -> None:
        self.version = CgroupVersion(version)
        self.parent = parent

    def path(self, chain: list[str]) -> str:
        return os.path.join(self.parent, "/mesos/".join(chain))

    def _own(self, chain: list[str], config: dict[str, Any]) -> bool:
        if len(chain) == 1 or self.version is CgroupVersion.V2:
            return True
        return config.get("container_info", {}).get("linux_info", {}).get("share_cgroups", True) is False

    def prepare(self, chain: list[str], config: dict[str, Any]) -> None:
        if not self._own(chain, config):
            return
        path = self.path(chain)
        os.makedirs(path)
        if self.version is CgroupVersion.V2:
            os.mkdir(os.path.join(path, "leaf"))
            return
        with open(os.path.join(path, "devices.deny"), "w") as fh:
            fh.write("a")
        for rule in MESOS_DEFAULT_WHITELIST:
            with open(os.path.join(path, "devices.allow"), "w") as fh:
                fh.write(str(rule))

    def place(self, chain: list[str], pid: int) -> str:
        """Put ``pid`` where the agent would, and return that cgroup."""
        target = self.path(chain)
        if self.version is CgroupVersion.V2:
            target = os.path.join(target, "leaf")
        else:
            while not os.path.isdir(target):  # shared: the nearest ancestor's cgroup
                chain = chain[:-1]
                target = self.path(chain)
        with open(os.path.join(target, "cgroup.procs"), "w") as fh:
            fh.write(str(pid))
        return target

    def destroy(self, chain: list[str]) -> None:
        remove_cgroup_tree(self.path(chain))
        if len(chain) > 1:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path(chain)))  # the parent's `mesos`, once empty


class Containerizer:
    """Plays MesosContainerizer for one agent run against ``isolator``."""

    def __init__(self, isolator: Isolator, workdir: str, cgroups: MesosCgroups | None = None) -> None:
        self.isolator = isolator
        self.workdir = workdir
        self.cgroups = cgroups
        self.configs: dict[str, dict[str, Any]] = {}

    def recover(self, states: list[dict[str, Any]] | None = None, orphans: list[dict[str, Any]] | None = None) -> None:
        self.isolator.recover(states or [], orphans or [])

    def config(
        self,
        gpus: float | None,
        image: bool = True,
        env: list[str] | None = None,
        labels: dict[str, str] | None = None,
        container_class: str | None = None,
        kind: str | None = None,
        share_cgroups: bool | None = None,
        version: str = "1.11",
    ) -> dict[str, Any]:
        """A ContainerConfig as the agent writes it (isolator/testing/mesos_json.py). ``kind``: command,
        default-executor, custom (the default), task (nested, of a task group) or debug."""
        if kind is None:
            kind = "debug" if container_class == "DEBUG" else "custom"
        sandbox = tempfile.mkdtemp(prefix="sandbox-", dir=self.workdir)
        rootfs = None
        if image and kind != "debug":  # a DEBUG container runs in its parent's mount namespace
            rootfs = tempfile.mkdtemp(prefix="rootfs-", dir=self.workdir)
            os.makedirs(os.path.join(rootfs, "tmp"))
            shutil.copy(CHECK, os.path.join(rootfs, "tmp", "check.py"))
            if env is None:
                env = ["NVIDIA_VISIBLE_DEVICES=all", "PATH=/usr/bin:/bin"]
        return mesos_json.container_config(
            kind,
            directory=sandbox,
            gpu_count=gpus,
            check_command="python3 /tmp/check.py",
            rootfs=rootfs,
            env=env,
            labels=labels,
            share_cgroups=share_cgroups,
            version=version,
        )

    def start(self, cid: dict[str, Any], config: dict[str, Any]) -> Launched:
        """The agent's cgroups (mesos mode), then Prepare; the cgroups go again if Prepare fails."""
        chain = chain_of(cid)
        self.configs[".".join(chain)] = config
        if self.cgroups is not None:
            self.cgroups.prepare(chain, config)
        return Launched(cid, self.isolator.prepare(cid, config), config)

    def destroy(self, cid: dict[str, Any]) -> None:
        """Cleanup (module isolators clean up before the built-ins), then the agent's cgroups."""
        chain = chain_of(cid)
        config = self.configs.pop(".".join(chain), None)
        try:
            self.isolator.cleanup(cid, config)
        finally:
            if self.cgroups is not None:
                self.cgroups.destroy(chain)

    def launch(
        self, cid: dict[str, Any], config: dict[str, Any], open_paths: list[str], env: dict[str, str] | None = None
    ) -> Launched:
        """Prepare, fork, Isolate, exec the check program, wait, Cleanup. Cleanup runs whatever fails."""
        try:
            launched = self.start(cid, config)
            self.run(launched, config, open_paths, env)
            return launched
        finally:
            self.destroy(cid)

    def run(
        self, launched: Launched, config: dict[str, Any], open_paths: list[str], env: dict[str, str] | None = None
    ) -> None:
        """Fork the blocked init, Isolate its pid, let it exec the check program, and wait."""
        info = launched.launch_info or {}
        launched.config = config
        rootfs = config.get("rootfs", "")
        spec = {
            "rootfs": rootfs,
            "mounts": info.get("mounts", []),
            "environment": {**launched.env, **(env or {})},
            "command": [CONTAINER_PYTHON, "-I", "-S", "/tmp/check.py" if rootfs else str(CHECK), *open_paths],
        }
        spec_path = os.path.join(config["directory"], "spec.json")
        with open(spec_path, "w") as fh:
            json.dump(spec, fh)
        child = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", CONTAINER_PYTHON, "-I", "-S", str(INIT), spec_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            if self.cgroups is not None:
                launched.cgroup = self.cgroups.place(chain_of(launched.container_id), child.pid)
            self.isolator.isolate(launched.container_id, child.pid, config)
        except BaseException:
            child.kill()
            child.communicate()
            raise
        out, err = child.communicate(b"g", timeout=60)
        launched.exit_code = child.returncode
        launched.stderr = err.decode(errors="replace")
        if child.returncode == 0:
            launched.report = json.loads(out)


def python_for_bridge() -> str:
    return sys.executable
