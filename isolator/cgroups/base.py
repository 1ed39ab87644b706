"""What both device controllers (v1 whitelist, v2 eBPF) share: Mesos's cgroup layout and cgroup files.

The interface they implement is ``isolator.core.ports.CgroupBackend``.

Paths are built only from a validated ``ContainerId``'s chain; nothing here touches the machine
except ``read_pids``/``write_pid``/``child_names``/``rmdir_tree``, which take the path they act on.
"""

from __future__ import annotations

import errno
import os

from isolator.errors import CgroupError, CgroupVanished
from isolator.model import ContainerId

MODES = ("mesos", "standalone")


def mesos_relative_path(container: ContainerId) -> str:
    """Mesos's ``containerizer::paths::getCgroupPath`` below cgroups_root: ``a/mesos/b/mesos/c``."""
    return "/mesos/".join(container.chain())


def container_dir(hierarchy: str, cgroups_root: str, container: ContainerId) -> str:
    return os.path.join(hierarchy, cgroups_root.strip("/"), mesos_relative_path(container))


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    return mode


def child_names(top: str) -> tuple[str, ...]:
    """Names of the cgroups Mesos made for nested containers directly below ``top`` (``top/mesos/<name>``)."""
    below = os.path.join(top, "mesos")
    try:
        names = os.listdir(below)
    except OSError:
        return ()
    return tuple(sorted(n for n in names if os.path.isdir(os.path.join(below, n))))


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
