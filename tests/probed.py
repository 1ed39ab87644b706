"""What a probe task printed (tests/mesos/probe.py, and the shell loop of the image scenarios): one
``dev <name> <ok|EPERM|ENXIO>`` line per device node it tried to open."""

from __future__ import annotations

import re


def seen(stdout: str) -> dict[str, str]:
    """What the probe opened: device name -> ok/EPERM/ENXIO."""
    return dict(re.findall(r"^dev (\S+) (\S+)$", stdout, re.M))


def opened_gpus(stdout: str) -> set[int]:
    """GPU minors the task could open (the open passed the device cgroup: ENXIO without a driver)."""
    return {int(name[6:]) for name, r in seen(stdout).items() if name[6:].isdigit() and r != "EPERM"}
