"""The rule set a container gets, and what a rule set permits: pure, no I/O. A rule itself is
``isolator.devicerule.DeviceRule`` (vocabulary: the record, the kernel and this module share it).

The device numbers come from ``isolator.host.devices.HostDevices`` (the edge that stats a dev root).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The rule itself is vocabulary (isolator/devicerule.py: records hold rules too); ``devices.DeviceRule`` names it.
from isolator.devicerule import MAX_MINOR, DeviceRule
from isolator.errors import InvalidArgument
from isolator.model import MigDevice

NVIDIA_MAJOR = 195


def parse_rules(lines: Iterable[str]) -> tuple[DeviceRule, ...]:
    """Parse ``devices.list``-style text lines; blank lines are skipped."""
    return tuple(DeviceRule.parse(line) for line in lines if line.strip())


def permits(rules: Iterable[DeviceRule], request: DeviceRule) -> bool:
    """Whether an allow-list grants ``request`` (one rule must encompass it, as in the kernel)."""
    return any(rule.encompasses(request) for rule in rules)


def normalize(rules: Iterable[DeviceRule]) -> tuple[DeviceRule, ...]:
    """Drop duplicates and rules another rule encompasses; keep first-seen order otherwise."""
    unique = list(dict.fromkeys(rules))
    return tuple(r for r in unique if not any(o != r and o.encompasses(r) for o in unique))


# Mesos's default whitelist, written by the cgroups/devices subsystem (v1) and controller (v2)
# after denying 'a *:* rwm' (src/slave/containerizer/mesos/isolators/cgroups/subsystems/devices.cpp,
# cgroups2/controllers/devices.cpp): mknod of any node, then the terminals, pts, tun and the
# memory devices.
MESOS_DEFAULT_WHITELIST: tuple[DeviceRule, ...] = parse_rules(
    [
        "c *:* m",
        "b *:* m",
        "c 5:1 rwm",  # /dev/console
        "c 4:0 rwm",  # /dev/tty0
        "c 4:1 rwm",  # /dev/tty1
        "c 136:* rwm",  # /dev/pts/*
        "c 5:2 rwm",  # /dev/ptmx
        "c 10:200 rwm",  # /dev/net/tun
        "c 1:3 rwm",  # /dev/null
        "c 1:5 rwm",  # /dev/zero
        "c 1:7 rwm",  # /dev/full
        "c 5:0 rwm",  # /dev/tty
        "c 1:9 rwm",  # /dev/urandom
        "c 1:8 rwm",  # /dev/random
    ]
)


@dataclass(frozen=True)
class DeviceNumber:
    """A character device's number as stat(2) reports it, with the path it was read from."""

    major: int
    minor: int
    path: str = ""

    def rule(self, access: str = "rwm") -> DeviceRule:
        return DeviceRule.char(self.major, self.minor, access)


@dataclass(frozen=True)
class ControlDevices:
    """The NVIDIA control nodes a GPU container needs, as numbers read from a dev root.

    Mesos grants nvidiactl and nvidia-uvm (mandatory) and nvidia-uvm-tools (when present) even to
    containers with 0 GPUs so that nvidia-smi works (isolator.cpp ``prepare``). nvidia-modeset is
    not granted by Mesos; we add it only when configured.
    """

    nvidiactl: DeviceNumber
    uvm: DeviceNumber
    uvm_tools: DeviceNumber | None = None
    modeset: DeviceNumber | None = None

    def numbers(self) -> tuple[DeviceNumber, ...]:
        return tuple(d for d in (self.nvidiactl, self.uvm, self.uvm_tools, self.modeset) if d is not None)


def container_rules(
    control: ControlDevices,
    gpu_minors: Iterable[int],
    mig_devices: Iterable[MigDevice] = (),
    caps_major: int | None = None,
    base: Sequence[DeviceRule] = MESOS_DEFAULT_WHITELIST,
) -> tuple[DeviceRule, ...]:
    """The full allow-list of a container: ``base``, control devices, GPUs, then MIG caps nodes.

    ``gpu_minors`` are the ``/dev/nvidia<minor>`` minors of the allocated GPUs (for a MIG device,
    its parent GPU's minor). Each MIG device adds ``c <caps_major>:<cap minor> rwm`` for its
    ``caps_minors``. ``rwm`` everywhere matches Mesos on v1; ``m`` is already granted by ``c *:* m``.
    """
    rules: list[DeviceRule] = list(base)
    rules.extend(d.rule() for d in control.numbers())
    for minor in sorted(set(gpu_minors)):
        if not isinstance(minor, int) or isinstance(minor, bool) or not 0 <= minor <= MAX_MINOR:
            raise InvalidArgument(f"invalid GPU minor {minor!r}")
        rules.append(DeviceRule.char(NVIDIA_MAJOR, minor))
    caps_minors = sorted({m for mig in mig_devices for m in mig.caps_minors})
    if caps_minors and caps_major is None:
        raise InvalidArgument("MIG devices need the nvidia-caps major, and none was given")
    for minor in caps_minors:
        assert caps_major is not None
        rules.append(DeviceRule.char(caps_major, minor))
    return tuple(dict.fromkeys(rules))


def owned_majors(
    rules: Iterable[DeviceRule], base: Iterable[DeviceRule], known: Iterable[int] = (NVIDIA_MAJOR,)
) -> frozenset[int]:
    """The character majors the sidecar decides for in mesos mode: NVIDIA's (195, and the dynamic
    nvidia-uvm and nvidia-caps majors in ``known``) and every major of a rule of ours in ``rules``.
    Every other device is the agent's (its default whitelist and --allowed_devices)."""
    base_set = set(base)
    ours = {r.major for r in rules if r.type == "c" and r.major is not None and r not in base_set}
    return frozenset({NVIDIA_MAJOR, *known, *ours})


def is_owned(rule: DeviceRule, majors: frozenset[int]) -> bool:
    """A rule of ours in mesos mode: a character device of one of ``majors`` (wildcard majors and
    block devices are never ours; the agent's ``c *:* m`` stays the agent's)."""
    return rule.type == "c" and rule.major is not None and rule.major in majors


@dataclass(frozen=True)
class KernelRules:
    """The rules a cgroup backend says are in force on a cgroup, and where it read them.

    ``present`` is False when nothing of ours is in force there (no cgroup, or no device program of
    ours attached); ``source`` then says which.
    """

    rules: tuple[DeviceRule, ...]
    source: str
    present: bool = True
