"""A top-level container's cpuset cgroup (v1 ``cpuset`` hierarchy or cgroup2 ``cpuset``): write, read back, remove.

Decides nothing: which CPUs and memory nodes come from isolator/policy/affinity.py; what the machine
has online is read by isolator/host/cpus.py. The mount and root are given to the constructor.
"""

from __future__ import annotations

import errno
import logging
import os

from isolator.cgroups.base import container_dir, read_pids, top_level_ids, write_pid
from isolator.cgroups.detect import read_mounts
from isolator.errors import CgroupBusy, CgroupError, CgroupVanished, HierarchyError, IsolatorError
from isolator.model import CgroupVersion, ContainerId
from isolator.policy.affinity import Affinity, format_list, parse_list

LOG = logging.getLogger(__name__)

# Mesos mode: our cpusets live under ``<cgroups_root>-gpu-isolator``, beside the agent's root, never
# in a cgroup Mesos made (it manages no cpuset; if it did, the names would not collide).
MESOS_CPUSET_SUFFIX = "-gpu-isolator"

# File names differ between the versions (Documentation/admin-guide/cgroup-v1/cpusets.rst, cgroup-v2.rst).
EFFECTIVE = {
    CgroupVersion.V1: ("cpuset.effective_cpus", "cpuset.effective_mems"),
    CgroupVersion.V2: ("cpuset.cpus.effective", "cpuset.mems.effective"),
}


def find_cpuset(mounts_path: str = "/proc/self/mounts") -> tuple[CgroupVersion, str] | None:
    """(version, mount) of the hierarchy the cpuset controller is bound to: a v1 ``cpuset`` mount,
    else the cgroup2 mount when its root offers ``cpuset``; None when neither."""
    try:
        with open(mounts_path) as fh:
            text = fh.read()
    except OSError as exc:
        raise HierarchyError(path=mounts_path, cause=exc.strerror or str(exc)) from exc
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup" and "cpuset" in parts[3].split(","):
            return CgroupVersion.V1, parts[1]
    v2 = read_mounts(mounts_path).v2
    if v2 is not None:
        try:
            with open(os.path.join(v2, "cgroup.controllers")) as fh:
                if "cpuset" in fh.read().split():
                    return CgroupVersion.V2, v2
        except OSError:
            return None
    return None


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except FileNotFoundError as exc:
        raise CgroupVanished(op="read", path=path) from exc
    except OSError as exc:
        raise CgroupError(op="read", path=path, cause=exc.strerror or str(exc)) from exc


def _write(path: str, value: str) -> None:
    try:
        with open(path, "w") as fh:
            fh.write(value)
    except FileNotFoundError as exc:
        raise CgroupVanished(op="write", path=path) from exc
    except OSError as exc:
        raise CgroupError(op="write", path=path, cause=f"{value!r}: {exc.strerror or exc}") from exc


class CpusetController:
    """cpuset cgroups at ``<mount>/<root>/<a>`` for top-level containers (nested ones share them).

    ``root`` is the cgroups root: in standalone mode the one the devices cgroups live under (the
    cgroup we own); in mesos mode one of our own beside Mesos's (Mesos manages no cpuset), e.g.
    ``mesos-gpu-isolator``. On v1 every directory we create is first given its parent's CPUs and
    memory nodes (a new v1 cpuset is empty and takes no process); on v2 ``+cpuset`` is written to
    the ``cgroup.subtree_control`` of each directory from the root down to the container's parent.
    """

    def __init__(
        self,
        mount: str,
        root: str,
        version: CgroupVersion | str = CgroupVersion.V1,
    ) -> None:
        if version not in EFFECTIVE:
            raise ValueError(f"cpuset version {version!r} is not v1 or v2")
        self.mount = mount
        self.root = root.strip("/")
        self.version = CgroupVersion(version)

    # ---- paths ------------------------------------------------------------------------------

    def root_path(self) -> str:
        return os.path.normpath(os.path.join(self.mount, self.root))

    def path(self, container: ContainerId) -> str:
        return container_dir(self.mount, self.root, container.root)

    def exists(self, container: ContainerId) -> bool:
        return os.path.isdir(self.path(container))

    def containers(self) -> tuple[ContainerId, ...]:
        return top_level_ids(self.root_path())

    # ---- reading ----------------------------------------------------------------------------

    def current(self, container: ContainerId) -> Affinity | None:
        """The CPUs and memory nodes the container's cpuset is set to; None without a cgroup."""
        path = self.path(container)
        if not os.path.isdir(path):
            return None
        try:
            cpus = parse_list(_read(os.path.join(path, "cpuset.cpus")))
            mems = parse_list(_read(os.path.join(path, "cpuset.mems")))
        except CgroupVanished:
            return None
        except IsolatorError as exc:
            raise CgroupError(op="read", path=path, cause=exc.message) from exc
        return Affinity(cpus=cpus, mems=mems)

    def allowed(self, container: ContainerId) -> frozenset[int]:
        """The CPUs a process in the container's cpuset could use without us: its nearest existing
        ancestor's effective CPUs (the container's own cgroup excluded); empty when none says."""
        path = os.path.dirname(self.path(container))
        below = self.mount.rstrip("/") + "/"
        while path.startswith(below):
            if os.path.isdir(path):
                text = _read(os.path.join(path, EFFECTIVE[self.version][0]))
                if text:
                    return parse_list(text)
            path = os.path.dirname(path)
        return frozenset()

    def pids(self, container: ContainerId) -> tuple[int, ...]:
        return read_pids(self.path(container))

    # ---- writing ----------------------------------------------------------------------------

    def apply(self, container: ContainerId, cpus: frozenset[int], mems: frozenset[int]) -> None:
        """Make the container's cpuset exactly ``cpus``/``mems`` (created if missing), read back."""
        if not cpus or not mems:
            raise CgroupError(op="apply", path=self.path(container), cause="an empty cpuset is never written")
        path = self.path(container)
        self._make(path)
        cpus_file, mems_file = os.path.join(path, "cpuset.cpus"), os.path.join(path, "cpuset.mems")
        # Memory nodes first: a v1 cpuset takes no process until both are set, and neither order
        # can leave an empty one behind.
        _write(mems_file, format_list(mems))
        _write(cpus_file, format_list(cpus))
        got = self.current(container)
        if got is None or got.cpus != cpus or got.mems != mems:
            held = "nothing" if got is None else f"CPUs {got.cpu_list}, memory nodes {got.mem_list}"
            raise CgroupError(
                op="verify",
                path=path,
                cause=f"the kernel holds {held}; asked for CPUs {format_list(cpus)}, memory nodes {format_list(mems)}",
            )

    def _make(self, path: str) -> None:
        """Create ``path`` and the directories above it under the mount, each usable as a cpuset."""
        missing: list[str] = []
        walk = path
        while not os.path.isdir(walk):
            if walk in (self.mount, "/", ""):
                raise CgroupError(op="create", path=path, cause=f"the cpuset hierarchy '{self.mount}' is not mounted")
            missing.append(walk)
            walk = os.path.dirname(walk)
        if self.version is CgroupVersion.V2:
            self._enable_v2(path)
        else:
            # Directories made by someone else (mkdir -p of the cgroups root) are empty cpusets too.
            above = [d for d in self._ancestors(path) if d not in missing and os.path.isdir(d)]
            for directory in above:
                self._inherit_v1(directory)
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                pass
            except OSError as exc:
                raise CgroupError(op="create", path=directory, cause=exc.strerror or str(exc)) from exc
            if self.version is CgroupVersion.V1 and directory != path:
                self._inherit_v1(directory)
            elif self.version is CgroupVersion.V2 and directory != path:
                self._subtree_cpuset(directory)

    def _ancestors(self, path: str) -> list[str]:
        """The directories strictly between the mount and ``path``, top first."""
        out = []
        directory = os.path.dirname(path)
        below = self.mount.rstrip("/") + "/"
        while directory.startswith(below):
            out.append(directory)
            directory = os.path.dirname(directory)
        return out[::-1]

    def _inherit_v1(self, directory: str) -> None:
        # What cgroup.clone_children=1 would do: the parent's CPUs and memory nodes.
        parent = os.path.dirname(directory)
        for name in ("cpuset.mems", "cpuset.cpus"):
            if not _read(os.path.join(directory, name)):
                _write(os.path.join(directory, name), _read(os.path.join(parent, name)))

    def _enable_v2(self, path: str) -> None:
        """``+cpuset`` in the subtree_control of each existing directory from our root's parent's
        child down to the container's parent; the root's parent must already offer it."""
        top = self.root_path()
        directory = os.path.dirname(path)
        chain = []
        while directory != os.path.dirname(top) and directory.startswith(self.mount):
            chain.append(directory)
            directory = os.path.dirname(directory)
        for d in reversed(chain):
            if os.path.isdir(d):
                self._subtree_cpuset(d)

    def _subtree_cpuset(self, directory: str) -> None:
        offered = _read(os.path.join(directory, "cgroup.controllers")).split()
        if "cpuset" not in offered:
            raise CgroupError(
                op="enable cpuset in",
                path=directory,
                cause="the cpuset controller is not offered here (enable it in the parent's cgroup.subtree_control)",
            )
        control = os.path.join(directory, "cgroup.subtree_control")
        if "cpuset" not in _read(control).split():
            _write(control, "+cpuset")

    def join(self, container: ContainerId, pid: int) -> None:
        write_pid(self.path(container), pid)

    def remove(self, container: ContainerId) -> None:
        """Remove the container's cpuset cgroup; a missing one is success; processes left: ``CgroupBusy``."""
        path = self.path(container)
        if not os.path.isdir(path):
            return
        try:
            pids = read_pids(path)
        except CgroupVanished:
            return
        if pids:
            raise CgroupBusy(op="remove", path=path, pids=sorted(pids))
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                raise CgroupBusy(op="remove", path=path, pids="(exiting)") from exc
            raise CgroupError(op="remove", path=path, cause=exc.strerror or str(exc)) from exc
        LOG.info("container %s: cpuset cgroup '%s' removed", container, path)
