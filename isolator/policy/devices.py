"""Device rules as data and the rule set a container gets: pure, no I/O.

The device numbers come from ``isolator.host.devices.HostDevices`` (the edge that stats a dev root).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from isolator.errors import InvalidArgument, RuleParseError
from isolator.model import MigDevice

# Linux dev_t limits (include/linux/kdev_t.h: MINORBITS 20; majors are 12 bits).
MAX_MAJOR = (1 << 12) - 1
MAX_MINOR = (1 << 20) - 1
NVIDIA_MAJOR = 195
ACCESS_ORDER = "rwm"

_RULE_RE = re.compile(r"([abc]) (\*|[0-9]{1,7}):(\*|[0-9]{1,7}) ([rwm]{1,3})")


@dataclass(frozen=True)
class DeviceRule:
    """One devices-cgroup entry as the kernel prints it: ``c 195:0 rwm``, ``a *:* rwm``.

    ``major``/``minor`` of None mean the wildcard ``*``. ``access`` is kept in canonical ``rwm``
    order so that equal rules compare equal whatever order they were written in.
    """

    type: str
    major: int | None
    minor: int | None
    access: str = "rwm"

    def __post_init__(self) -> None:
        problem = _rule_problem(self.type, self.major, self.minor, self.access)
        if problem:
            raise RuleParseError(value=self._raw(), reason=problem)
        object.__setattr__(self, "access", "".join(c for c in ACCESS_ORDER if c in self.access))

    @classmethod
    def parse(cls, text: str) -> DeviceRule:
        """Parse the kernel's form; ``a`` alone is the kernel's shorthand for ``a *:* rwm``."""
        if not isinstance(text, str):
            raise RuleParseError(value=repr(text), reason="must be a string")
        stripped = text.strip()
        if stripped == "a":
            return cls("a", None, None, "rwm")
        m = _RULE_RE.fullmatch(stripped)
        if m is None:
            raise RuleParseError(value=text[:80], reason="expected '<a|b|c> <major|*>:<minor|*> <access of rwm>'")
        kind, major, minor, access = m.groups()
        if len(set(access)) != len(access):
            raise RuleParseError(value=text[:80], reason=f"access {access!r} repeats a letter")
        return cls(
            kind,
            None if major == "*" else int(major),
            None if minor == "*" else int(minor),
            access,
        )

    @classmethod
    def char(cls, major: int, minor: int, access: str = "rwm") -> DeviceRule:
        return cls("c", major, minor, access)

    def __str__(self) -> str:
        major = "*" if self.major is None else str(self.major)
        minor = "*" if self.minor is None else str(self.minor)
        return f"{self.type} {major}:{minor} {self.access}"

    @property
    def is_wildcard(self) -> bool:
        return self.type == "a" or self.major is None or self.minor is None

    @property
    def selector(self) -> tuple[str, int | None, int | None]:
        return (self.type, self.major, self.minor)

    def encompasses(self, other: DeviceRule) -> bool:
        """True when every access ``other`` grants is also granted by this rule."""
        if self.type != "a" and self.type != other.type:
            return False
        if self.major is not None and self.major != other.major:
            return False
        if self.minor is not None and self.minor != other.minor:
            return False
        return set(other.access) <= set(self.access)

    def sort_key(self) -> tuple[str, int, int, str]:
        return (
            self.type,
            -1 if self.major is None else self.major,
            -1 if self.minor is None else self.minor,
            self.access,
        )

    def _raw(self) -> str:
        return f"{self.type} {self.major}:{self.minor} {self.access}"


def _rule_problem(kind: object, major: object, minor: object, access: object) -> str | None:
    if kind not in ("a", "b", "c"):
        return f"type {kind!r} is not one of a, b, c"
    for name, value, limit in (("major", major, MAX_MAJOR), ("minor", minor, MAX_MINOR)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            return f"{name} {value!r} is not an integer in 0..{limit}"
    if kind == "a" and (major is not None or minor is not None):
        return "type 'a' covers every device and takes '*:*'"
    if not isinstance(access, str) or not access or any(c not in ACCESS_ORDER for c in access):
        return f"access {access!r} must be a non-empty subset of 'rwm'"
    if len(set(access)) != len(access):
        return f"access {access!r} repeats a letter"
    return None


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
