"""Which cgroup hierarchy enforces device access: parsing of /proc/self/mounts text, pure.

``read_mounts`` is the only function that reads a file, and it takes the path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from isolator.errors import CgroupVersionAbsent, HierarchyError
from isolator.model import CgroupVersion

AUTO = "auto"  # the version of the hierarchy the devices controller is bound to
VERSIONS = (AUTO, *CgroupVersion)


@dataclass(frozen=True)
class CgroupMounts:
    """Where the v1 ``devices`` controller and the cgroup2 hierarchy are mounted, if at all."""

    v1_devices: str | None = None
    v2: str | None = None

    @property
    def layout(self) -> str:
        """``v1``, ``v2``, ``hybrid`` (both, as on systemd's hybrid hosts) or ``none``."""
        if self.v1_devices and self.v2:
            return "hybrid"
        return "v1" if self.v1_devices else "v2" if self.v2 else "none"


@dataclass(frozen=True)
class Hierarchy:
    """The hierarchy the sidecar will use: its ``version`` and its mount point."""

    version: CgroupVersion
    mount: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "version", CgroupVersion(self.version))  # also when spelled "v1"


def _unescape(field: str) -> str:
    # The kernel escapes space, tab, newline and backslash in mount fields as \ooo (fs/proc_namespace.c).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str) -> CgroupMounts:
    """Find the first v1 mount carrying ``devices`` and the first cgroup2 mount."""
    v1: str | None = None
    v2: str | None = None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        target, fstype, options = _unescape(parts[1]), parts[2], parts[3].split(",")
        if fstype == "cgroup" and "devices" in options and v1 is None:
            v1 = target
        elif fstype == "cgroup2" and v2 is None:
            v2 = target
    return CgroupMounts(v1_devices=v1, v2=v2)


def select(
    mounts: CgroupMounts, override: CgroupVersion | str | None = None, source: str = "/proc/self/mounts"
) -> Hierarchy:
    """Pick the hierarchy; None (``auto``) follows the devices controller.

    On a hybrid host the ``devices`` controller is bound to v1, so that is where the kernel (and
    Mesos, whose ``cgroups2::mounted()`` only looks at /sys/fs/cgroup) enforces the whitelist;
    ``auto`` picks v1 there. An explicit ``v2`` on a hybrid host still works: eBPF device programs
    on the unified hierarchy are checked in addition to the v1 whitelist.
    """
    if override not in (None, *VERSIONS):
        raise HierarchyError(path=source, cause=f"cgroup version {override!r} is not one of {', '.join(VERSIONS)}")
    wanted = None if override in (None, AUTO) else CgroupVersion(override)
    if wanted is CgroupVersion.V1 or (wanted is None and mounts.v1_devices):
        if not mounts.v1_devices:
            cause = "v1 was requested but no cgroup v1 'devices' hierarchy is mounted"
            raise CgroupVersionAbsent(path=source, cause=f"{cause}{_what_it_has(mounts)}")
        return Hierarchy(CgroupVersion.V1, mounts.v1_devices)
    if not mounts.v2:
        if wanted is None:
            raise HierarchyError(path=source, cause="did not find a cgroup2 mount, nor a cgroup v1 'devices' hierarchy")
        cause = "v2 was requested but no cgroup2 hierarchy is mounted"
        raise CgroupVersionAbsent(path=source, cause=f"{cause}{_what_it_has(mounts)}")
    return Hierarchy(CgroupVersion.V2, mounts.v2)


def _what_it_has(mounts: CgroupMounts) -> str:
    """What the host mounts instead, and the setting that works on it (for a refused override)."""
    if mounts.v2:
        return f' (this host has cgroup2 alone at \'{mounts.v2}\': set cgroup_version = "v2" or "auto")'
    if mounts.v1_devices:
        return ' (this host has cgroup v1 alone: set cgroup_version = "v1" or "auto")'
    return ""


def read_mounts(path: str = "/proc/self/mounts") -> CgroupMounts:
    try:
        with open(path) as fh:
            return parse_mounts(fh.read())
    except OSError as exc:
        raise HierarchyError(path=path, cause=exc.strerror or str(exc)) from exc


def detect(mounts_path: str = "/proc/self/mounts", override: CgroupVersion | None = None) -> Hierarchy:
    return select(read_mounts(mounts_path), override, mounts_path)
