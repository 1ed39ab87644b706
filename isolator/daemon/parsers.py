"""The value parsers of the daemon's options (isolator/daemon/config.py): each turns a flag's text or
a config file's TOML value into the setting's type, and raises ValueError with a reason on bad input.
Pure: nothing here reads the machine.
"""

from __future__ import annotations

from typing import Any

from isolator.errors import ConfigError
from isolator.policy.shares import ShareSpec, parse_shared_gpus


def octal_mode(value: Any) -> int:
    if isinstance(value, int):
        mode = value
    else:
        text = str(value).strip()
        if not text or any(c not in "01234567" for c in text.removeprefix("0o")):
            raise ValueError(f"{value!r} is not an octal file mode (e.g. 0600)")
        mode = int(text.removeprefix("0o"), 8)
    if mode & ~0o777:
        raise ValueError(f"{oct(mode)} has bits outside 0777")
    if mode & 0o007:
        raise ValueError(f"{oct(mode)} would let every local user steer the sidecar")
    return mode


def int_list(value: Any) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [v for v in str(value).replace(" ", "").split(",") if v != ""]
    out = []
    for item in items:
        try:
            out.append(int(item))
        except (TypeError, ValueError):
            raise ValueError(f"{item!r} is not an integer") from None
    return tuple(out)


def positive_int(value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not an integer") from None
    if n <= 0:
        raise ValueError(f"{n} must be positive")
    return n


def positive_float(value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number") from None
    if not x > 0 or x != x or x == float("inf"):
        raise ValueError(f"{value!r} must be a positive number of seconds")
    return x


def mib(value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a whole number of MiB") from None
    if n < 0:
        raise ValueError(f"{n} must not be negative")
    return n


def seconds_or_off(value: Any) -> float:
    if str(value).strip() == "0":
        return 0.0
    return positive_float(value)


def choice(choices: tuple[str, ...]) -> Any:
    def parse(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return str(value)

    parse.choices = choices  # type: ignore[attr-defined]  # what shell completion offers (isolator/cli/completion.py)
    return parse


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def nvidia_gpu_devices(value: Any) -> tuple[int, ...]:
    # Mesos parses this flag as a list of unsigned ints; the semantic checks (duplicates, indices
    # that do not exist, the need for --resources gpus:N) belong to the inventory, which knows
    # the machine.
    items = int_list(value)
    for n in items:
        if n < 0:
            raise ValueError(f"{n} is not a valid NVML index")
    return items


def ids(value: Any) -> tuple[int, ...]:
    # uids and gids are unsigned 32-bit; (uid_t)-1 means "no id" to the kernel's calls and is no
    # caller's id (a peer's SO_PEERCRED never reads it).
    items = int_list(value)
    for n in items:
        if not 0 <= n < 2**32 - 1:
            raise ValueError(f"{n} is not a user or group id (0 to {2**32 - 2})")
    return items


def shared_gpus(value: Any) -> tuple[ShareSpec, ...]:
    try:
        return parse_shared_gpus(value)
    except ConfigError as exc:
        raise ValueError(exc.message.removeprefix("--shared-gpus ")) from None


def cdi_kind(value: Any) -> str:
    from isolator.errors import InvalidArgument
    from isolator.exporters.cdi import check_kind

    try:
        return check_kind(text(value))
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None


def enum_choice(enum: Any, auto: str = "") -> Any:
    """One of ``enum``'s values, parsed into its member; ``auto`` (when given) is also accepted, as None:
    the choice left to the machine (``cgroup_version = "auto"``)."""
    words = ((auto,) if auto else ()) + tuple(member.value for member in enum)
    pick = choice(words)

    def parse(value: Any) -> Any:
        word = pick(value)
        return None if word == auto else enum(word)

    parse.choices = words  # type: ignore[attr-defined]
    return parse
