"""Character device nodes of a simulated NVIDIA host, made with mknod under a dev root.

Numbers follow a real driver: GPUs are 195:<minor>, nvidiactl 195:255, nvidia-modeset 195:254.
nvidia-uvm and nvidia-caps get dynamic majors on real hosts, so the simulation picks unused majors
from the range Linux reserves for local use; code under test must read them with stat, never
assume them. Nodes have no driver behind them, so opening one that the cgroup allows gives ENXIO.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from isolator.policy.devices import NVIDIA_MAJOR

NVIDIACTL_MINOR = 255
NVIDIA_MODESET_MINOR = 254
# LANANA's "local/experimental use" character majors (Documentation/admin-guide/devices.txt).
LOCAL_MAJORS = range(240, 255)


@dataclass(frozen=True)
class DeviceNumbers:
    uvm_major: int
    caps_major: int


def used_char_majors(proc_devices: str = "/proc/devices") -> set[int]:
    used: set[int] = set()
    with open(proc_devices) as fh:
        for line in fh:
            if line.startswith("Block devices"):
                break
            parts = line.split()
            if parts and parts[0].isdigit():
                used.add(int(parts[0]))
    return used


def pick_dynamic_majors(proc_devices: str = "/proc/devices") -> DeviceNumbers:
    free = [m for m in LOCAL_MAJORS if m not in used_char_majors(proc_devices)]
    if len(free) < 2:
        raise RuntimeError(f"no two free character majors in {LOCAL_MAJORS.start}-{LOCAL_MAJORS.stop - 1}")
    return DeviceNumbers(uvm_major=free[0], caps_major=free[1])


def _mknod(path: str, major: int, minor: int) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        return
    if not stat.S_ISCHR(st.st_mode) or os.major(st.st_rdev) != major or os.minor(st.st_rdev) != minor:
        raise FileExistsError(f"failed to create device node '{path}': something else is there")


def make_device_nodes(
    dev_root: str,
    gpu_minors: list[int] | tuple[int, ...],
    numbers: DeviceNumbers | None = None,
    caps_minors: list[int] | tuple[int, ...] = (),
    uvm_tools: bool = True,
) -> DeviceNumbers:
    """Create the nodes (idempotent). Needs CAP_MKNOD, i.e. root."""
    numbers = numbers or pick_dynamic_majors()
    os.makedirs(dev_root, exist_ok=True)
    for minor in gpu_minors:
        _mknod(os.path.join(dev_root, f"nvidia{minor}"), NVIDIA_MAJOR, minor)
    _mknod(os.path.join(dev_root, "nvidiactl"), NVIDIA_MAJOR, NVIDIACTL_MINOR)
    _mknod(os.path.join(dev_root, "nvidia-modeset"), NVIDIA_MAJOR, NVIDIA_MODESET_MINOR)
    _mknod(os.path.join(dev_root, "nvidia-uvm"), numbers.uvm_major, 0)
    if uvm_tools:
        _mknod(os.path.join(dev_root, "nvidia-uvm-tools"), numbers.uvm_major, 1)
    if caps_minors:
        caps = os.path.join(dev_root, "nvidia-caps")
        os.makedirs(caps, exist_ok=True)
        for minor in caps_minors:
            _mknod(os.path.join(caps, f"nvidia-cap{minor}"), numbers.caps_major, minor)
    return numbers
