"""Device isolation in the kernel: hierarchy detection, the v1 whitelist and the v2 eBPF program.

    detect.py    which hierarchy enforces device access (a pure parse of /proc/self/mounts)
    base.py      what both device controllers share: Mesos's cgroup layout and files
    v1.py        the v1 devices whitelist: diff, write, read back, roll back
    v2.py        the v2 eBPF device program: checkpoint, ancestors, attach or replace
    bpfprog.py   device rules -> BPF_PROG_TYPE_CGROUP_DEVICE instructions, and an evaluator (pure)
    bpf.py       the only bpf(2) caller
    cpuset.py    a top-level container's cpuset cgroup

``controller_for`` is the one place that picks a concrete controller for a hierarchy; both implement
``isolator.core.ports.CgroupBackend``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from isolator.cgroups.detect import Hierarchy
from isolator.model import CgroupVersion, Mode
from isolator.policy.devices import MESOS_DEFAULT_WHITELIST, DeviceRule

if TYPE_CHECKING:
    from isolator.cgroups.v1 import V1DeviceController
    from isolator.cgroups.v2 import V2DeviceController


def controller_for(
    hierarchy: Hierarchy,
    state_dir: str,
    cgroups_root: str = "mesos",
    mode: Mode = Mode.MESOS,
    base: Iterable[DeviceRule] = MESOS_DEFAULT_WHITELIST,
    nvidia_majors: Callable[[], Iterable[int]] | None = None,
    device_path: Callable[[str, int, int], str | None] | None = None,
) -> V1DeviceController | V2DeviceController:
    # Each version's module only where it is used: v2 brings the eBPF program builder and bpf(2).
    if hierarchy.version is CgroupVersion.V1:
        from isolator.cgroups.v1 import V1DeviceController

        return V1DeviceController(hierarchy.mount, cgroups_root, mode, base, nvidia_majors)
    from isolator.cgroups.v2 import V2DeviceController

    return V2DeviceController(
        hierarchy.mount, state_dir, cgroups_root, mode, base, nvidia_majors=nvidia_majors, device_path=device_path
    )


__all__ = ["Hierarchy", "controller_for"]
