"""The interface both device controllers (v1 whitelist, v2 eBPF) offer, and Mesos's cgroup layout.

Paths are built only from a validated ``ContainerId``'s chain; nothing here touches the machine
except ``read_pids``/``write_pid``/``cgroup_exists``, which take the path they act on.
"""

from __future__ import annotations

import errno
import os
from typing import Protocol

from isolator.devices import DeviceRule
from isolator.errors import CgroupError, CgroupVanished
from isolator.model import ContainerId

MODES = ("mesos", "standalone")


class DeviceController(Protocol):
    """What the service calls; one instance per hierarchy.

    * ``prepare(c)``: mesos mode checks that Mesos's cgroup exists; standalone mode creates the
      cgroup and denies every device. Idempotent.
    * ``apply(c, rules)``: make the container's allow-list exactly ``rules`` (the full set,
      Mesos's default whitelist included); on failure the previous rules stay in force.
    * ``current(c)``: the rules in force (v1: read back from ``devices.list``; v2: the checkpoint).
    * ``recover(c)``: after a sidecar restart, bring the kernel in line with what was last applied
      and return it (v1: the list; v2: re-attach the checkpointed program).
    * ``add_pid(c, pid)`` / ``pids(c)``: place and list processes (``cgroup.procs``).
    * ``cleanup(c)``: remove exactly what we added; a missing cgroup is success. Idempotent.
    """

    version: str
    mode: str

    def cgroup_path(self, container: ContainerId) -> str: ...

    def prepare(self, container: ContainerId) -> None: ...

    def apply(self, container: ContainerId, rules: tuple[DeviceRule, ...]) -> None: ...

    def current(self, container: ContainerId) -> tuple[DeviceRule, ...]: ...

    def recover(self, container: ContainerId) -> tuple[DeviceRule, ...]: ...

    def add_pid(self, container: ContainerId, pid: int) -> None: ...

    def pids(self, container: ContainerId) -> tuple[int, ...]: ...

    def cleanup(self, container: ContainerId) -> None: ...


def mesos_relative_path(container: ContainerId) -> str:
    """Mesos's ``containerizer::paths::getCgroupPath`` below cgroups_root: ``a/mesos/b/mesos/c``."""
    return "/mesos/".join(container.chain())


def container_dir(hierarchy: str, cgroups_root: str, container: ContainerId) -> str:
    return os.path.join(hierarchy, cgroups_root.strip("/"), mesos_relative_path(container))


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    return mode


def read_pids(cgroup: str) -> tuple[int, ...]:
    path = os.path.join(cgroup, "cgroup.procs")
    try:
        with open(path) as fh:
            return tuple(int(line) for line in fh if line.strip())
    except FileNotFoundError as exc:
        raise CgroupVanished(op="read", path=path) from exc
    except OSError as exc:
        raise CgroupError(op="read", path=path, cause=exc.strerror or str(exc)) from exc


def write_pid(cgroup: str, pid: int) -> None:
    path = os.path.join(cgroup, "cgroup.procs")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise CgroupError(op="write", path=path, cause=f"{pid!r} is not a process id")
    try:
        with open(path, "w") as fh:
            fh.write(str(pid))
    except FileNotFoundError as exc:
        raise CgroupVanished(op="write", path=path) from exc
    except OSError as exc:
        cause = "no such process" if exc.errno == errno.ESRCH else exc.strerror or str(exc)
        raise CgroupError(op="write", path=path, cause=f"pid {pid}: {cause}") from exc


def rmdir_tree(cgroup: str) -> bool:
    """Remove a cgroup and its child cgroups bottom-up; False when it was already gone."""
    if not os.path.isdir(cgroup):
        return False
    for root, dirs, _files in os.walk(cgroup, topdown=False):
        for name in dirs:
            _rmdir(os.path.join(root, name))
    _rmdir(cgroup)
    return True


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise CgroupError(op="remove", path=path, cause=exc.strerror or str(exc)) from exc
