"""The daemon's configuration: flags, an optional TOML file, and defaults, resolved once at start,
and the checks of ``config check``; the options themselves are options.py's table.

Precedence is flag > file > default. Names mirror the Mesos agent's flags where they mean the same
thing (``--nvidia-gpu-devices``, ``--resources``, ``--cgroups-root``, ``--cgroups-hierarchy``).
Nothing here touches the machine beyond reading the config file (and, for ``config check``, counting
the GPUs NVML shows); checks that need the filesystem (the socket directory) happen in the server
when it binds.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from isolator.daemon import parsers as p
from isolator.daemon.options import (
    AUTO,
    DEFAULT_CGROUPS_HIERARCHY,
    DEFAULT_CGROUPS_ROOT,
    DEFAULT_SOCKET,
    DEFAULT_VOLUME_ROOT,
    DEFAULT_WORK_DIR,
    OPTIONS,
    PARSERS,
    Config,
    Option,
    flag_value,
)
from isolator.errors import ConfigError
from isolator.transport.settings import BRIDGE_SUFFIX

# The names other modules read here (the cli, the tests, the benchmarks).
__all__ = [
    "AUTO",
    "BRIDGE_SUFFIX",
    "DEFAULT_CGROUPS_HIERARCHY",
    "DEFAULT_CGROUPS_ROOT",
    "DEFAULT_SOCKET",
    "DEFAULT_VOLUME_ROOT",
    "DEFAULT_WORK_DIR",
    "OPTIONS",
    "PARSERS",
    "Config",
    "Option",
]

# Mirrors isolator.transport.peergate.PRIVATE_EXTRA (".d/grpc"); a test keeps them equal. Not imported from
# there so that reading the configuration does not import grpc.
PRIVATE_SUFFIX = ".d"
PRIVATE_EXTRA = 7
# A config file named "-" is read from standard input (``config check -``); ``serve`` refuses it, since
# SIGHUP reads its file again.
STDIN = "-"


# The flags the offline commands read (``resources``, ``cdi generate``): they find and read the GPUs
# (and, for CDI, the device nodes and the driver volume) but serve nothing.
INVENTORY_FLAGS = ("work_dir", "simulate", "nvml_library", "nvidia_gpu_devices", "resources", "shared_gpus")
CDI_FLAGS = (*INVENTORY_FLAGS, "dev_root", "driver_root", "volume_root", "cdi_kind")


def add_serve_arguments(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """Flags of ``gpu-isolator serve`` (or only ``names`` of them). Every default is None so the file
    can fill it in."""
    parser.add_argument("--config", dest="config_file", metavar="FILE", help="TOML config file")
    for name in OPTIONS if names is None else names:
        o = OPTIONS[name]
        parser.add_argument(o.flag, dest=name, default=None, help=o.help, metavar=name.upper())


def load_file(path: str) -> dict[str, Any]:
    """The file's settings by field name (``socket_mode``), each parsed by TOML but not yet checked."""
    return _read_file(path)[0]


def _read_file(path: str) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """(settings by field name, where each was given: the file and line, and the key as written there).

    A key is spelled as in the docs (``work_dir``) or as its flag without the leading dashes
    (``work-dir``): both are accepted, here and wherever a file is read (``serve``, SIGHUP,
    ``config check``, the offline commands). The same setting given in both spellings is refused
    rather than one of them silently winning.
    """
    import tomllib  # only where a config file is given: every start and admin command imports this module

    try:
        if path == STDIN:  # `gpu-isolator config default | gpu-isolator config check -`
            raw = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as fh:
                raw = fh.read()
        data = tomllib.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"failed to read config file '{path}': {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"failed to parse config file '{path}': not UTF-8 text ({exc.reason})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"failed to parse config file '{path}'{_parse_problem(raw, str(exc))}") from exc
    text = raw.decode("utf-8")
    out: dict[str, Any] = {}
    written: dict[str, str] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in PARSERS:
            raise ConfigError(f"config file '{path}'{_at(text, key)}: unknown key '{key}'")
        if name in written:
            raise ConfigError(
                f"config file '{path}': '{written[name]}' and '{key}' are the same setting; keep one of them"
            )
        if name == "socket_mode" and isinstance(value, int) and not isinstance(value, bool):
            value = _toml_mode(path, text, key, value)
        out[name] = value
        written[name] = key
    return out, {name: (f"config file '{path}'{_at(text, key)}", key) for name, key in written.items()}


def _parse_problem(raw: bytes, problem: str) -> str:
    """What TOML refused, said for a person: a key given twice is named with both its lines (tomllib
    says only "Cannot overwrite a value" and where the second one is)."""
    import re

    at = re.search(r"\(at line (\d+), column \d+\)", problem)
    if problem.startswith("Cannot overwrite a value") and at:
        lines = raw.decode("utf-8", errors="replace").splitlines()
        lineno = int(at.group(1))
        key = _assigned_key(lines[lineno - 1]) if 0 < lineno <= len(lines) else None
        first = next((n for n, line in enumerate(lines[: lineno - 1], 1) if _assigned_key(line) == key), None)
        if key is not None and first is not None:
            return f", line {lineno}: key '{key}' is given twice (first on line {first}); keep one of them"
    return f": {problem}"


def _assigned_key(line: str) -> str | None:
    """The key a ``key = value`` line sets (bare or quoted), or None."""
    import re

    m = re.match(r"""^[ \t]*(?:"([^"]*)"|'([^']*)'|([A-Za-z0-9_-]+))[ \t]*=""", line)
    return next((g for g in m.groups() if g is not None), None) if m else None


def _key_line(text: str, key: str) -> tuple[int, str] | None:
    """(line number, the value's literal) of a top-level ``key = value`` in ``text``, if found."""
    import re

    spelled = "|".join(re.escape(k) for k in (key, f'"{key}"', f"'{key}'"))
    pattern = re.compile(rf"^[ \t]*(?:{spelled})[ \t]*=[ \t]*([^\s#,]+)")
    for lineno, line in enumerate(text.splitlines(), start=1):
        m = pattern.match(line)
        if m:
            return lineno, m.group(1)
    return None


def _at(text: str, key: str) -> str:
    found = _key_line(text, key)
    return f", line {found[0]}" if found else ""


def _toml_mode(path: str, text: str, key: str, value: int) -> int:
    """``socket_mode = 0o660`` is the mode 0660; ``socket_mode = 660`` is TOML's decimal 660 (0o1224),
    never what was meant, and ``440`` would even pass as 0o670. So an integer mode must be an octal
    literal; anything else is refused with a spelling that works: the digits read as octal when that is
    a mode ``serve`` accepts, else that reading without its refused bits (666: 0o660), else the default."""
    found = _key_line(text, key)
    literal = found[1] if found else ""
    if literal.startswith("0o"):
        return value
    where = f", line {found[0]}" if found else ""
    digits = str(value)
    octal = int(digits, 8) if all(c in "01234567" for c in digits) else None
    why = ""
    if octal is None:
        meant = Config.socket_mode
        why = f"; {digits} has no octal reading"
    else:
        try:
            meant = p.octal_mode(octal)
        except ValueError as exc:
            meant = octal & 0o770 if octal <= 0o777 else Config.socket_mode
            why = f"; read as octal it would be refused too ({exc})"
    raise ConfigError(
        f"invalid config file '{path}'{where} value for {key}: {literal or value} is a decimal integer in TOML"
        f" ({value} = {oct(value)}), not an octal mode{why}; write {key} = 0o{meant:o} or"
        f' {key} = "{meant:04o}"'
    )


def resolve(args: argparse.Namespace | dict[str, Any]) -> Config:
    """Merge flags over the config file over defaults, and validate the result."""
    flags = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    config_file = flags.get("config_file") or ""
    values, sources = _read_file(config_file) if config_file else ({}, {})
    # Where each value came from, and the key as its source spells it (an error names it so).
    for name in PARSERS:
        if flags.get(name) is not None:
            values[name] = flags[name]
            sources[name] = ("--" + name.replace("_", "-"), name.replace("_", "-"))

    parsed: dict[str, Any] = {}
    for name, raw in values.items():
        try:
            parsed[name] = PARSERS[name](raw)
        except ValueError as exc:
            source, key = sources[name]
            raise ConfigError(f"invalid {source} value for {key}: {exc}") from exc

    known = {f.name for f in fields(Config)}
    if parsed.get("simulate") and "volume_root" not in parsed:
        # A simulated host's driver volume belongs with the simulated host, never in the real
        # /run/mesos/isolators/gpu that a real agent on this machine may use.
        parsed["volume_root"] = os.path.join(parsed.get("work_dir", DEFAULT_WORK_DIR), "volumes")
    config = Config(config_file=config_file, **{k: v for k, v in parsed.items() if k in known})
    # A setting from the file is named as the file spells it, with where; one from a flag as the flag.
    spelled = {
        name: source if source.startswith("--") else f"{key} ({source})" for name, (source, key) in sources.items()
    }
    _check_combinations(config, spelled)
    return _absolutise(config)


def _check_combinations(config: Config, spelled: dict[str, str] | None = None) -> None:
    def n(name: str) -> str:
        return (spelled or {}).get(name) or "--" + name.replace("_", "-")

    if config.simulate and config.nvml_library:
        raise ConfigError(f"{n('simulate')} and {n('nvml_library')} contradict: a simulated host brings its own NVML")
    if config.simulate and config.driver_root != "/":
        raise ConfigError(f"{n('simulate')} and {n('driver_root')} contradict: a simulated host brings its own driver")
    if config.simulate and config.dev_root != "/dev":
        raise ConfigError(f"{n('simulate')} and {n('dev_root')} contradict: a simulated host brings its own /dev")
    if not config.socket:
        raise ConfigError(f"{n('socket')} must not be empty")
    if len(os.fsencode(config.socket)) > 107:
        raise ConfigError(f"{n('socket')} '{config.socket}' is longer than a Unix socket path may be (107 bytes)")
    bridge = config.bridge_path
    if bridge and len(os.fsencode(bridge)) > 107:
        raise ConfigError(
            f"{n('bridge_socket')} '{bridge}' is longer than a Unix socket path may be (107 bytes);"
            f" choose a shorter {n('bridge_socket')} or {n('socket')}"
        )
    # gRPC itself listens in '<socket>.d/' (isolator/transport/peergate.py), whose names must fit too.
    limit = 107 - PRIVATE_EXTRA
    if len(os.fsencode(os.path.abspath(config.socket))) > limit:
        raise ConfigError(
            f"{n('socket')} '{config.socket}' is longer than {limit} bytes; the private gRPC sockets beside it"
            f" ('<socket>{PRIVATE_SUFFIX}/...') must fit in a Unix socket path (107 bytes)"
        )
    if bridge and os.path.abspath(bridge) == os.path.abspath(config.socket):
        raise ConfigError(f"{n('bridge_socket')} '{bridge}' must differ from {n('socket')}")
    # A unix: metrics path on one of the daemon's own sockets would be claimed twice by the daemon
    # itself (isolator/daemon/ownership.py) and refused as if another daemon held it. Compared with
    # the directories resolved, as the lock files beside the sockets are found.
    metrics = config.metrics_address.strip()
    if metrics.startswith("unix:"):
        path = os.path.realpath(metrics[len("unix:") :])
        for name, own in (("socket", config.socket), ("bridge_socket", bridge)):
            if own and path == os.path.realpath(own):
                raise ConfigError(f"{n('metrics_address')} '{metrics}' must differ from {n(name)}")
    if not os.path.isabs(config.cgroups_hierarchy):
        # The daemon compares it with where the devices hierarchy is mounted (isolator/daemon/compose.py):
        # a relative path stopped the start with a traceback.
        raise ConfigError(
            f"{n('cgroups_hierarchy')} '{config.cgroups_hierarchy}' must be an absolute path, as the agent's"
            " --cgroups_hierarchy (default /sys/fs/cgroup)"
        )
    if config.cgroups_root.startswith("/") or ".." in Path(config.cgroups_root).parts:
        raise ConfigError(
            f"{n('cgroups_root')} '{config.cgroups_root}' must be relative to the hierarchy, without '..'"
        )


def check_at_start(config: Config) -> list[str]:
    """For ``config check``, which refuses what ``serve`` would: the checks ``serve`` makes at start that
    need no GPU, and which ``resolve`` leaves to it: the metrics address (its error is logged as the
    daemon logs, JSON included), the socket's group (looked up when the socket is bound), and the
    checks of --nvidia-gpu-devices and --resources that need no NVML (isolator/policy/gpuflags.py,
    Mesos's messages; the inventory makes them at start, see ``parsers.nvidia_gpu_devices``).

    Returns the warnings: what it could not check here (``host_gpus``)."""
    from isolator.errors import GpusUnavailable
    from isolator.policy.gpuflags import decide

    if config.metrics_address:
        from isolator.exporters.metrics import parse_address

        parse_address(config.metrics_address)
    if config.socket_group:
        import grp

        try:
            grp.getgrnam(config.socket_group)  # as the server looks it up when it binds
        except KeyError:
            raise ConfigError(f"--socket-group '{config.socket_group}': no group of that name") from None
    try:
        decide(config.resources, config.nvidia_gpu_devices, available=None)
    except GpusUnavailable:
        pass  # "NVML not found": available=None stands for the machine, which is not looked at here
    return _check_shared_gpus(config)


def _check_shared_gpus(config: Config) -> list[str]:
    """``--shared-gpus`` names GPUs by NVML index: one beyond the host's GPUs stops ``serve``. Offline, the
    host's count is known from the simulated host's description (``simulate``) or from NVML when it
    loads here; otherwise the indices are not checked, and the warning says so."""
    if not config.shared_gpus:
        return []
    count, source = host_gpus(config)
    named = sorted({s.index for s in config.shared_gpus})
    if count is None:
        return [f"shared_gpus names GPU(s) {','.join(map(str, named))}, not checked against the host's GPUs: {source}"]
    beyond = [i for i in named if i >= count]
    if beyond:
        raise ConfigError(
            f"shared_gpus names GPU(s) {','.join(map(str, beyond))}, but {source} has {count} GPU(s)"
            f" (NVML indices 0 to {count - 1})"
        )
    return []


def host_gpus(config: Config) -> tuple[int | None, str]:
    """(how many GPUs NVML shows, what showed them), or (None, why it could not be known), offline."""
    from isolator.errors import IsolatorError

    if config.simulate:
        from isolator.simhost.host import load_host

        try:
            return len(load_host(config.simulate).gpus), f"the simulated host '{config.simulate}'"
        except IsolatorError as exc:
            return None, exc.message
    from isolator.gpu.nvml import Inventory

    inventory = Inventory(library=config.nvml_library)
    try:
        inventory.open()
        return inventory.device_count(), "this host's NVML"
    except IsolatorError as exc:
        return None, f"no usable NVML here ({exc.message})"
    finally:
        inventory.close()


def _absolutise(config: Config) -> Config:
    from dataclasses import replace

    return replace(
        config,
        socket=os.path.abspath(config.socket),
        bridge_socket=os.path.abspath(config.bridge_socket) if config.bridge_socket else config.bridge_socket,
        work_dir=os.path.abspath(config.work_dir),
        volume_root=os.path.abspath(config.volume_root),
    )


# ---- the default file (``gpu-isolator config default``) ----------------------------------------------


def toml_value(name: str, value: Any) -> str:
    """A setting's value as the config file spells it (``socket_mode = 0o600``, lists as arrays,
    ``shared_gpus`` as its flag's text)."""
    if name == "socket_mode":
        return f"0o{value:o}"
    if name in ("shared_gpus", "cgroup_version"):
        return toml_value("", flag_value(name, value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(name, v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    import json  # a TOML basic string escapes as JSON does for these values

    return json.dumps(str(value))


def default_file_text() -> str:
    """The full default config file: every key ``serve`` reads, its help as a comment, its default as the
    value (commented out, as its example, where the default is "unset"). ``config check`` accepts it,
    and it yields the same settings as no file at all (tests/system/test_config_file.py)."""
    lines = [
        "# gpu-isolator serve: every setting with its default (`gpu-isolator config default`).",
        "# Keys are the flags without their leading dashes, spelled with underscores (work_dir) or",
        "# dashes (work-dir), not both; a flag given to serve wins over the file. Check a file with",
        "# `gpu-isolator config check FILE`; SIGHUP re-reads it (docs/operations.md).",
    ]
    for name, o in OPTIONS.items():
        lines.append("")
        lines += [f"# {line}" for line in _wrap(o.help)]
        if o.example:
            lines.append(f"# {name} = {o.example}")
        else:
            lines.append(f"{name} = {toml_value(name, o.default)}")
    return "\n".join(lines) + "\n"


def _wrap(text: str, width: int = 98) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=width) or [""]


def non_defaults(config: Config) -> list[tuple[str, str]]:
    """(key, value as the file spells it) of each setting that differs from the defaults."""
    base = resolve({})
    return [
        (name, toml_value(name, getattr(config, name)))
        for name in OPTIONS
        if getattr(config, name) != getattr(base, name)
    ]
