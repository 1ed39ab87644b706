"""A conformance harness that plays the Mesos containerizer against the sidecar.

It drives the hooks in the containerizer's order (reference/bridge-and-cgroup2.md §A.3): Recover
at start; per container Prepare, fork a blocked child, Isolate(pid), let the child apply the
launch info (mounts onto a small rootfs in a new mount namespace, environment) and exec, wait,
Cleanup — Cleanup also after a failed Prepare, as Mesos does. Requests and launch infos travel
as the JSON a Mesos agent writes (stout's form), over gRPC or over the bridge executables, so the
same checks run against both routes.
"""

from __future__ import annotations

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

from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc

HERE = Path(__file__).resolve().parent
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


class Isolator(Protocol):
    def recover(self, states: list[dict[str, Any]], orphans: list[dict[str, Any]]) -> None: ...
    def prepare(self, cid: dict[str, Any], config: dict[str, Any]) -> dict[str, Any] | None: ...
    def isolate(self, cid: dict[str, Any], pid: int) -> None: ...
    def update(self, cid: dict[str, Any], gpus: int) -> None: ...
    def cleanup(self, cid: dict[str, Any]) -> None: ...


class GrpcIsolator:
    """The hooks over gRPC; requests built from Mesos JSON with unknown keys ignored."""

    def __init__(self, socket_path: str, timeout: float = 30.0) -> None:
        self._channel = grpc.insecure_channel("unix:" + socket_path)
        self._stub = pb_grpc.IsolatorStub(self._channel)
        self._timeout = timeout

    def _call(self, hook: str, request_type: type, body: dict[str, Any]) -> Any:
        request = json_format.ParseDict(body, request_type(), ignore_unknown_fields=True)
        try:
            return getattr(self._stub, hook)(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            raise HookFailed(hook, exc.code().name, exc.details() or "") from None

    def recover(self, states: list[dict[str, Any]], orphans: list[dict[str, Any]]) -> None:
        self._call("Recover", pb.RecoverRequest, {"states": states, "orphans": orphans})

    def prepare(self, cid: dict[str, Any], config: dict[str, Any]) -> dict[str, Any] | None:
        reply = self._call("Prepare", pb.PrepareRequest, {"container_id": cid, "container_config": config})
        if not reply.HasField("launch_info"):
            return None
        return json_format.MessageToDict(reply.launch_info, preserving_proto_field_name=True)

    def isolate(self, cid: dict[str, Any], pid: int) -> None:
        self._call("Isolate", pb.IsolateRequest, {"container_id": cid, "pid": pid})

    def update(self, cid: dict[str, Any], gpus: int) -> None:
        self._call("Update", pb.UpdateRequest, {"container_id": cid, "resource_requests": [gpu_resource(gpus)]})

    def cleanup(self, cid: dict[str, Any]) -> None:
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

    def isolate(self, cid: dict[str, Any], pid: int) -> None:
        self._call("isolate", {"container_id": cid, "pid": pid})

    def update(self, cid: dict[str, Any], gpus: int) -> None:
        raise HookFailed("update", "UNIMPLEMENTED", "the command module does not forward update")

    def cleanup(self, cid: dict[str, Any]) -> None:
        self._call("cleanup", {"container_id": cid})

    def watch(self, cid: dict[str, Any]) -> dict[str, Any] | None:
        return self._call("watch", {"container_id": cid})

    def usage(self, cid: dict[str, Any]) -> dict[str, Any] | None:
        return self._call("usage", {"container_id": cid})

    def close(self) -> None:
        pass


def gpu_resource(n: float) -> dict[str, Any]:
    # Proto JSON spells a NaN double as the string "NaN".
    value: float | str = "NaN" if n != n else n
    return {"name": "gpus", "type": "SCALAR", "scalar": {"value": value}, "role": "*"}


@dataclass
class Launched:
    container_id: dict[str, Any]
    launch_info: dict[str, Any] | None
    report: dict[str, Any] = field(default_factory=dict)
    exit_code: int = 0
    stderr: str = ""

    @property
    def env(self) -> dict[str, str]:
        info = self.launch_info or {}
        return {v["name"]: v.get("value", "") for v in info.get("environment", {}).get("variables", [])}


class Containerizer:
    """Plays MesosContainerizer for one agent run against ``isolator``."""

    def __init__(self, isolator: Isolator, workdir: str) -> None:
        self.isolator = isolator
        self.workdir = workdir

    def recover(self, states: list[dict[str, Any]] | None = None, orphans: list[dict[str, Any]] | None = None) -> None:
        self.isolator.recover(states or [], orphans or [])

    def config(
        self,
        gpus: float | None,
        image: bool = True,
        env: list[str] | None = None,
        labels: dict[str, str] | None = None,
        container_class: str = "DEFAULT",
    ) -> dict[str, Any]:
        sandbox = tempfile.mkdtemp(prefix="sandbox-", dir=self.workdir)
        config: dict[str, Any] = {
            "command_info": {"shell": False, "value": CONTAINER_PYTHON},
            "directory": sandbox,
            "container_class": container_class,
            "resources": [{"name": "cpus", "type": "SCALAR", "scalar": {"value": 1}, "role": "*"}],
        }
        if gpus is not None:
            config["resources"].append(gpu_resource(gpus))
        if image:
            rootfs = tempfile.mkdtemp(prefix="rootfs-", dir=self.workdir)
            os.makedirs(os.path.join(rootfs, "tmp"))
            shutil.copy(CHECK, os.path.join(rootfs, "tmp", "check.py"))
            config["rootfs"] = rootfs
            config["docker"] = {
                "manifest": {
                    "config": {
                        "Env": env if env is not None else ["NVIDIA_VISIBLE_DEVICES=all", "PATH=/usr/bin:/bin"],
                        "labels": [{"key": k, "value": v} for k, v in (labels or {}).items()],
                    }
                }
            }
        return config

    def launch(
        self, cid: dict[str, Any], config: dict[str, Any], open_paths: list[str], env: dict[str, str] | None = None
    ) -> Launched:
        """Prepare, fork, Isolate, exec the check program, wait, Cleanup. Cleanup runs whatever fails."""
        try:
            info = self.isolator.prepare(cid, config)
            launched = Launched(cid, info)
            self.run(launched, config, open_paths, env)
            return launched
        finally:
            self.isolator.cleanup(cid)

    def run(
        self, launched: Launched, config: dict[str, Any], open_paths: list[str], env: dict[str, str] | None = None
    ) -> None:
        """Fork the blocked init, Isolate its pid, let it exec the check program, and wait."""
        info = launched.launch_info or {}
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
            ["unshare", "--mount", "--propagation", "private", CONTAINER_PYTHON, "-I", str(INIT), spec_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            self.isolator.isolate(launched.container_id, child.pid)
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
