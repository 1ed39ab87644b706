"""ContainerConfig JSON exactly as a Mesos 1.6+ agent hands it to criteo/mesos-command-modules.

The module writes ``JSON::protobuf(containerConfig)`` (stout, 3rdparty/stout/include/stout/protobuf.hpp)
of Mesos's own messages (include/mesos/mesos.proto, mesos/slave/containerizer.proto,
mesos/docker/v1.proto). stout's rules, which every builder here follows:

* keys are the .proto field names (``Env``, ``Labels``, ``task_info``), enums are written by name;
* a field is written when it is set, or when it is a singular field with a declared
  ``[default = ...]`` that is not deprecated: ``CommandInfo.shell`` (true), ``Environment.Variable.type``
  (VALUE), ``Image.cached`` (true), ``CommandInfo.URI.extract`` (true), ``LinuxInfo.share_cgroups``
  (true, 1.10+) appear even when nobody set them; ``Resource.role`` (deprecated) does not;
* repeated fields are written only when non-empty; a map is a JSON object (``JSON::protobuf`` has
  done so since 1.4; before 1.6 the Docker labels were not a map);
* ``double`` values are numbers (``2.0``), 64-bit integers are numbers.

What the agent puts in ContainerConfig per kind of container (src/slave/slave.cpp
``Slave::launchExecutor``, src/slave/http.cpp ``launchContainer``, the provisioner's
``rootfs``/``docker.manifest`` in src/slave/containerizer/mesos/containerizer.cpp):

* command task: ``executor_info`` (the generated command executor), ``task_info``, ``command_info`` (a
  copy of the executor's), ``container_info`` (the task's), ``resources`` (executor + task, 1.9+);
* default executor (task groups): ``executor_info`` of type DEFAULT, no ``task_info``;
* custom executor: ``executor_info`` of type CUSTOM, no ``task_info``;
* nested container (a task of a task group, launched by the default executor): no ``executor_info``,
  ``command_info`` and ``container_info`` of the task, its ``resources`` and ``limits``;
* DEBUG container (``mesos task exec``): nested, ``container_class: "DEBUG"``, a command, nothing else.

No ``container_class`` is set for containers the agent launches itself (the field has no default,
so it is absent); the default executor sets none for its tasks either.
"""

from __future__ import annotations

from typing import Any

FRAMEWORK_ID = {"value": "8d5b7a1e-4f0c-4f7e-9a55-0c6f3e2d1b7a-0000"}
AGENT_ID = {"value": "8d5b7a1e-4f0c-4f7e-9a55-0c6f3e2d1b7a-S3"}
ROLE = "ml"
IMAGE = "nvidia/cuda:12.4.1-base-ubuntu22.04"

KINDS = ("command", "default-executor", "custom", "task", "debug")


def scalar(name: str, value: float | str) -> dict[str, Any]:
    """A scalar Resource as the agent holds it since reservation refinement (1.5): allocated to a
    role through ``allocation_info``; the deprecated ``role`` is unset and, deprecated, not written."""
    return {"name": name, "type": "SCALAR", "scalar": {"value": value}, "allocation_info": {"role": ROLE}}


def gpus(n: float) -> dict[str, Any]:
    # Proto JSON spells a NaN double as the string "NaN" (stout writes NaN for it, which no JSON
    # parser reads; a NaN never leaves an agent since the master refuses it).
    return scalar("gpus", "NaN" if n != n else n)


def environment(variables: dict[str, str]) -> dict[str, Any]:
    return {"variables": [{"name": k, "type": "VALUE", "value": v} for k, v in variables.items()]}


def command(
    value: str | None, *, shell: bool = True, arguments: list[str] | None = None, **extra: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {"shell": shell}  # [default = true]: written even when unset
    if value is not None:
        out["value"] = value
    if arguments:
        out["arguments"] = arguments
    out.update(extra)
    return out


def mesos_container(
    image: str | None = IMAGE, share_cgroups: bool | None = None, version: str = "1.11"
) -> dict[str, Any]:
    """ContainerInfo of type MESOS, with a Docker image when ``image`` is given.

    ``share_cgroups``: None leaves ``linux_info`` out. When it is present, a 1.10+ agent always writes
    ``share_cgroups`` (declared default true); 1.6-1.9 have no such field.
    """
    info: dict[str, Any] = {"type": "MESOS"}
    if image is not None:
        info["mesos"] = {"image": {"type": "DOCKER", "docker": {"name": image}, "cached": True}}
    if share_cgroups is not None:
        info["linux_info"] = {"share_cgroups": share_cgroups} if version_at_least(version, "1.10") else {}
    return info


def version_at_least(version: str, minimum: str) -> bool:
    if version == "master":
        return True
    return tuple(int(p) for p in version.split(".")) >= tuple(int(p) for p in minimum.split("."))


def docker_manifest(env: list[str], labels: dict[str, str]) -> dict[str, Any]:
    """docker.spec.v1.ImageManifest as the provisioner builds it from the image's config JSON."""
    config: dict[str, Any] = {
        "Hostname": "",
        "Env": env,
        "Cmd": ["/bin/bash"],
        "WorkingDir": "",
        "Image": "sha256:5f1ca5c4b3a9d1e2f0a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5",
    }
    if labels:
        config["Labels"] = dict(labels)  # map<string, string> Labels = 9 since 1.6: an object
    return {
        "id": "3c9e1f2a4b5d6c7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e",
        "parent": "0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b0c1d2e3f4a5b6c7d8e9f0a1b",
        "created": "2024-04-11T21:18:39.404937461Z",
        "container_config": {**config, "Cmd": ["/bin/sh", "-c", "#(nop) ", 'CMD ["/bin/bash"]']},
        "docker_version": "24.0.5",
        "config": config,
        "architecture": "amd64",
        "os": "linux",
    }


def executor_info(
    kind: str, executor_id: str, resources: list[dict[str, Any]], container: dict[str, Any] | None, task_name: str = ""
) -> dict[str, Any]:
    if kind == "command":
        # Slave::getExecutorInfo: the agent's generated command executor (no `type`).
        out: dict[str, Any] = {
            "executor_id": {"value": executor_id},
            "framework_id": FRAMEWORK_ID,
            "command": command(
                "/usr/libexec/mesos/mesos-executor",
                shell=False,
                arguments=["mesos-executor", "--launcher_dir=/usr/libexec/mesos"],
            ),
            "resources": resources,
            "name": f"Command Executor (Task: {task_name}) (Command: sh -c 'python3 /tmp/check.py')",
            "source": executor_id,
        }
    elif kind == "default-executor":
        out = {
            "type": "DEFAULT",
            "executor_id": {"value": executor_id},
            "framework_id": FRAMEWORK_ID,
            "command": command(
                "/usr/libexec/mesos/mesos-default-executor",
                shell=False,
                arguments=["mesos-default-executor", "--launcher_dir=/usr/libexec/mesos"],
            ),
            "resources": resources,
        }
    else:
        out = {
            "type": "CUSTOM",
            "executor_id": {"value": executor_id},
            "framework_id": FRAMEWORK_ID,
            "command": command(
                "./my-executor", uris=[{"value": "http://artifacts/my-executor", "executable": True, "extract": True}]
            ),
            "resources": resources,
            "name": "my-executor",
        }
    if container is not None:
        out["container"] = container
    return out


def container_config(
    kind: str,
    *,
    directory: str,
    gpu_count: float | None,
    check_command: str,
    rootfs: str | None = None,
    env: list[str] | None = None,
    labels: dict[str, str] | None = None,
    share_cgroups: bool | None = None,
    user: str | None = "nobody",
    version: str = "1.11",
) -> dict[str, Any]:
    """One container's ContainerConfig. ``rootfs`` set means a Docker image was provisioned there."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    image = IMAGE if rootfs is not None else None
    own = [scalar("cpus", 1.0), scalar("mem", 256.0)]
    if gpu_count is not None:
        own.append(gpus(gpu_count))
    out: dict[str, Any] = {"directory": directory}
    if user is not None:
        out["user"] = user
    if kind in ("command", "default-executor", "custom"):
        executor_resources = [scalar("cpus", 0.1), scalar("mem", 32.0)]
        if kind == "command":
            container = mesos_container(image, share_cgroups, version)
            task: dict[str, Any] = {
                "name": "gpu-check",
                "task_id": {"value": "gpu-check.2f4c1f4e"},
                "slave_id": AGENT_ID,
                "resources": own,
                "command": command(check_command),
                "container": container,
            }
            executor = executor_info("command", task["task_id"]["value"], executor_resources, container, "gpu-check")
            out["task_info"] = task
            out["container_info"] = container
        elif kind == "default-executor":
            container = mesos_container(None, None, version)
            executor = executor_info("default-executor", "default-executor.9a1c", executor_resources, container)
            out["container_info"] = container
        else:
            container = mesos_container(image, share_cgroups, version)
            executor = executor_info("custom", "my-executor.77e0", own, container)
            out["container_info"] = container
        out["executor_info"] = executor
        out["command_info"] = executor["command"]
        # The agent adds the resources of the task the executor is launched for to the executor's
        # (slave.cpp, launchExecutor): a single task's always, a task group's since 1.9 (7232dc139).
        if kind == "custom":
            out["resources"] = own
        elif kind == "default-executor" and not version_at_least(version, "1.9"):
            out["resources"] = executor_resources
        else:
            out["resources"] = executor_resources + own
    elif kind == "task":
        out["command_info"] = command(check_command)
        out["container_info"] = mesos_container(image, share_cgroups, version)
        out["resources"] = own
        if version_at_least(version, "1.10"):
            out["limits"] = {"cpus": {"value": 2.0}}
    else:  # debug
        out["command_info"] = command("bash")
        out["container_class"] = "DEBUG"
    if rootfs is not None:
        out["rootfs"] = rootfs
        out["docker"] = {"manifest": docker_manifest(env if env is not None else [], labels or {})}
    return out


class AgentAbort(AssertionError):
    """What the agent would die of (a CHECK failure in the slave process), read from our output."""


def check_limitation(limitation: dict[str, Any]) -> dict[str, Any]:
    """Check a ContainerLimitation as the agent uses it, or raise AgentAbort with the agent's words.

    The agent puts the limitation's resources in the executor's terminal status update
    (``Slave::sendExecutorTerminatedStatusUpdate``), whose resources must be in the
    post-reservation-refinement format: ``CHECK(!resource.has_role())`` aborts the whole agent on a
    resource that carries the deprecated ``role`` (even ``"*"``). Mesos also requires each
    resource's ``name`` and ``type`` and, for SCALAR, ``scalar.value``.
    """
    for resource in limitation.get("resources", []):
        if "role" in resource:
            raise AgentAbort(f"Check failed: !resource.has_role() {resource.get('name')}: {resource}")
        if "name" not in resource or "type" not in resource:
            raise AgentAbort(f"a Resource without its required name/type: {resource}")
        if resource["type"] == "SCALAR" and "value" not in resource.get("scalar", {}):
            raise AgentAbort(f"a SCALAR Resource without scalar.value: {resource}")
    return limitation
