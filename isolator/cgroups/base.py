"""What both device controllers (v1 whitelist, v2 eBPF) share: Mesos's cgroup layout and cgroup files.

The interface they implement is ``isolator.core.ports.CgroupBackend``.

Paths are built only from a validated ``ContainerId``'s chain; nothing here touches the machine
except ``read_pids``/``write_pid``/``child_names``/``rmdir_tree``, which take the path they act on.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterable

from isolator.errors import CgroupError, CgroupVanished, InvalidArgument, IsolatorError
from isolator.model import ContainerId, Mode
from isolator.policy.devices import NVIDIA_MAJOR

LOG = logging.getLogger(__name__)

MODES = tuple(Mode)


# Names the cgroup filesystem gives its own files (cgroup v1 core and devices controller, cgroup v2
# core): a container ID spelled like one cannot be a cgroup's directory (mkdir finds the file).
CONTROL_FILES = frozenset({"tasks", "notify_on_release", "release_agent"})
# cgroup v2 puts every enabled controller's files in each cgroup ('memory.max', 'pids.max', ...).
CONTROL_PREFIXES = tuple(
    f"{c}."
    for c in (
        "cgroup", "devices", "memory", "cpu", "cpuacct", "cpuset", "io", "blkio", "pids", "freezer",
        "hugetlb", "misc", "rdma", "net_cls", "net_prio", "perf_event",
    )
)  # fmt: skip


def mesos_relative_path(container: ContainerId) -> str:
    """Mesos's ``containerizer::paths::getCgroupPath`` below cgroups_root: ``a/mesos/b/mesos/c``.

    ``InvalidArgument`` for an ID that names a control file of the cgroup filesystem."""
    for value in container.chain():
        if value in CONTROL_FILES or value.startswith(CONTROL_PREFIXES):
            raise InvalidArgument(
                f"container ID '{value}' cannot name a cgroup: the cgroup filesystem uses that name for its own files"
            )
    return "/mesos/".join(container.chain())


def container_dir(hierarchy: str, cgroups_root: str, container: ContainerId) -> str:
    return os.path.join(hierarchy, cgroups_root.strip("/"), mesos_relative_path(container))


def check_mode(mode: Mode | str) -> Mode:
    """``mode`` as its enum (a word is taken too); ValueError for anything else."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    return Mode(mode)


def child_names(top: str) -> tuple[str, ...]:
    """Names of the cgroups Mesos made for nested containers directly below ``top`` (``top/mesos/<name>``)."""
    below = os.path.join(top, "mesos")
    try:
        names = os.listdir(below)
    except OSError:
        return ()
    return tuple(sorted(n for n in names if os.path.isdir(os.path.join(below, n))))


def top_level_ids(root: str) -> tuple[ContainerId, ...]:
    """The top-level containers whose cgroups are directly under ``root``; names that are not valid
    container IDs (another tool's cgroups) are skipped."""
    from isolator.errors import IsolatorError

    try:
        names = sorted(os.listdir(root))
    except OSError:
        return ()
    out = []
    for name in names:
        if not os.path.isdir(os.path.join(root, name)):
            continue
        try:
            out.append(ContainerId.parse(name))
        except IsolatorError:
            continue
    return tuple(out)


def read_text(path: str) -> str:
    """A small kernel file (``/proc``, cgroupfs) in full through os.open, os.read and os.close: Python's
    ``open()`` adds an fstat, an ioctl and three objects (30 us a read against 8 us here). Raises
    what they raise (FileNotFoundError for a file or process that is gone)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def cgroup_of(pid: int, mount: str, controller: str | None, proc_root: str = "/proc") -> str | None:
    """The cgroup of ``pid`` under ``mount``: the v1 hierarchy with ``controller``, or with None the
    cgroup2 one (``0::``) of ``/proc/<pid>/cgroup``. None when the process is gone."""
    try:
        lines = read_text(os.path.join(proc_root, str(pid), "cgroup")).splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:
        raise CgroupError(
            op="read", path=os.path.join(proc_root, str(pid), "cgroup"), cause=exc.strerror or str(exc)
        ) from exc
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        if (controller is None and _id == "0" and controllers == "") or (
            controller is not None and controller in controllers.split(",")
        ):
            return os.path.normpath(os.path.join(mount, path.lstrip("/")))
    return None


def read_pids(cgroup: str) -> tuple[int, ...]:
    path = os.path.join(cgroup, "cgroup.procs")
    try:
        return tuple(int(line) for line in read_text(path).splitlines() if line.strip())
    except FileNotFoundError as exc:
        raise CgroupVanished(op="read", path=path) from exc
    except OSError as exc:
        raise CgroupError(op="read", path=path, cause=exc.strerror or str(exc)) from exc


def write_pid(cgroup: str, pid: int) -> None:
    path = os.path.join(cgroup, "cgroup.procs")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise CgroupError(op="write", path=path, cause=f"{pid!r} is not a process id")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)  # the kernel moves the process at write(2)
        try:
            os.write(fd, str(pid).encode())
        finally:
            os.close(fd)
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


def known_majors(nvidia_majors: Callable[[], Iterable[int]] | None) -> tuple[int, ...]:
    """The NVIDIA majors the host reports; 195 alone when it cannot say (a node is gone): then only
    rules of ours with other majors are recognised, by the rules applied."""
    if nvidia_majors is None:
        return (NVIDIA_MAJOR,)
    try:
        return tuple(nvidia_majors())
    except (IsolatorError, OSError) as exc:
        LOG.warning("failed to read the NVIDIA device majors, deciding for %d only: %s", NVIDIA_MAJOR, exc)
        return (NVIDIA_MAJOR,)
