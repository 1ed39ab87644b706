"""The launch environment: what Prepare hands Mesos for a container's launch. Pure: the container's
kind (image or host filesystem, command task or not), its MIG devices, its GPUs' locality and what
the driver volume adds in; a ``LaunchInfo`` (or None: nothing to add) out. The mounts are computed by
the caller (targets resolved inside the image, which is I/O) and passed through in order.
"""

from __future__ import annotations

from collections.abc import Iterable

from isolator.model import LaunchInfo, MigDevice, Mount
from isolator.policy import mig as migunits
from isolator.policy.affinity import Affinity

Env = tuple[tuple[str, str], ...]

VISIBLE = "NVIDIA_VISIBLE_DEVICES"


def visible_env(units: Iterable[MigDevice]) -> Env:
    """MIG holders are told which devices are theirs (docs/mig.md), with or without an image."""
    units = tuple(units)
    return ((VISIBLE, migunits.visible_devices(units)),) if units else ()


def locality_env(aff: Affinity | None) -> Env:
    """--cpu-affinity hint/enforce: the GPUs' local CPUs and NUMA nodes (docs/affinity.md)."""
    return aff.environment() if aff is not None else ()


def on_host(command_task: bool, visible: Env, local: Env) -> LaunchInfo | None:
    """A container on the host's filesystem: the host's /dev and libraries, access gated by the
    cgroup (Mesos). A command task gets the locality through task_environment, like the volume's
    PATH (its executor's environment is not its own)."""
    if command_task and local:
        return LaunchInfo(environment=visible, task_environment=local)
    return LaunchInfo(environment=visible + local) if visible or local else None


def in_image(command_task: bool, mounts: Iterable[Mount], volume_env: Env, visible: Env, local: Env) -> LaunchInfo:
    """A container with an image: its mounts (the volume's, then the device nodes') and the volume's
    environment, whose NVIDIA_VISIBLE_DEVICES gives way to the MIG holder's own."""
    env = tuple((k, v) for k, v in volume_env if k != VISIBLE) + visible + local
    if command_task:
        # Mesos's isolator: a command task's environment goes in task_environment, which the
        # command executor applies over the image's own (docker/runtime puts the image's PATH
        # there); in `environment` the image's PATH and LD_LIBRARY_PATH would win over ours.
        return LaunchInfo(task_environment=env, mounts=tuple(mounts))
    return LaunchInfo(environment=env, mounts=tuple(mounts))
