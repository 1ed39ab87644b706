"""The device rule, a word shared by the record, the kernel and the policy: one devices-cgroup entry
as data (``c 195:0 rwm``), validated when made. Pure: no I/O. Which rules a container gets is
``isolator.policy.devices``'s decision.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from isolator.errors import RuleParseError

# Linux dev_t limits (include/linux/kdev_t.h: MINORBITS 20; majors are 12 bits).
MAX_MAJOR = (1 << 12) - 1
MAX_MINOR = (1 << 20) - 1
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
