"""The daemon's configuration: flags, an optional TOML file, and defaults, resolved once at start.

Precedence is flag > file > default. Names mirror the Mesos agent's flags where they mean the same
thing (``--nvidia-gpu-devices``, ``--resources``, ``--cgroups-root``, ``--cgroups-hierarchy``).
Nothing here touches the machine beyond reading the config file; checks that need the filesystem
(the socket directory) happen in the server when it binds.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from isolator.errors import ConfigError
from isolator.gpu.xids import DEFAULT_IGNORED_XIDS
from isolator.policy.shares import ShareSpec, parse_shared_gpus
from isolator.transport.settings import BRIDGE_SUFFIX, ServerSettings

# Mirrors isolator.transport.peergate.PRIVATE_EXTRA (".d/grpc"); a test keeps them equal. Not imported from
# there so that reading the configuration does not import grpc.
PRIVATE_SUFFIX = ".d"
PRIVATE_EXTRA = 7

DEFAULT_SOCKET = "/run/gpu-isolator/isolator.sock"
# A config file named "-" is read from standard input (``config check -``); ``serve`` refuses it, since
# SIGHUP reads its file again.
STDIN = "-"
# The command-module bridge listens next to the gRPC socket unless told otherwise: BRIDGE_SUFFIX,
# from isolator/transport/settings.py (the bridge executable's default in isolator/bridge/command.py
# must agree).
DEFAULT_WORK_DIR = "/var/lib/gpu-isolator"
# Mesos keeps its driver volumes here (src/slave/containerizer/mesos/isolators/gpu/volume.cpp).
DEFAULT_VOLUME_ROOT = "/var/run/mesos/isolators/gpu"
# Mesos agent defaults: --cgroups_hierarchy=/sys/fs/cgroup, --cgroups_root=mesos.
DEFAULT_CGROUPS_HIERARCHY = "/sys/fs/cgroup"
DEFAULT_CGROUPS_ROOT = "mesos"

MODES = ("mesos", "standalone")
CGROUP_VERSIONS = ("auto", "v1", "v2")
POLICIES = ("topology", "first-fit")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
CPU_AFFINITY = ("off", "hint", "enforce")
ON_OFF = ("on", "off")
# nvmlComputeMode_t names (isolator.model.COMPUTE_MODES); EXCLUSIVE_THREAD is gone since CUDA 8.
COMPUTE_MODE_NAMES = ("DEFAULT", "EXCLUSIVE_PROCESS", "PROHIBITED")


@dataclass(frozen=True)
class Config:
    socket: str = DEFAULT_SOCKET
    socket_mode: int = 0o600
    socket_group: str = ""
    # None: ``<socket>.bridge``; "": no bridge listener.
    bridge_socket: str | None = None
    work_dir: str = DEFAULT_WORK_DIR
    volume_root: str = DEFAULT_VOLUME_ROOT
    cgroups_hierarchy: str = DEFAULT_CGROUPS_HIERARCHY
    cgroups_root: str = DEFAULT_CGROUPS_ROOT
    cgroup_version: str = "auto"
    mode: str = "mesos"
    nvidia_gpu_devices: tuple[int, ...] | None = None
    resources: str = ""
    allocation_policy: str = "topology"
    simulate: str = ""
    nvml_library: str = ""
    dev_root: str = "/dev"
    driver_root: str = "/"
    ignored_xids: tuple[int, ...] = DEFAULT_IGNORED_XIDS
    max_workers: int = 16
    reap_interval: float = 60.0
    audit_interval: float = 300.0  # 0: no periodic audit (gpu-isolator audit still runs one)
    gpu_probe_interval: float = 30.0
    max_concurrent_rpcs: int = 256
    max_connections: int = 256
    # A Mesos ContainerConfig with a large Docker manifest is tens of KiB (docs/reliability.md).
    max_message_bytes: int = 256 * 1024
    log_level: str = "info"
    log_format: str = "text"
    metrics_address: str = ""
    job_mapping_dir: str = ""
    allowed_uids: tuple[int, ...] = (0,)
    allowed_gids: tuple[int, ...] = ()
    cdi_dir: str = ""
    cdi_kind: str = "nvidia.com/gpu"
    cpu_affinity: str = "hint"  # docs/affinity.md
    # The handover check of released GPUs (docs/handover.md).
    drain_check: str = "on"
    drain_memory_mib: int = 256
    drain_timeout: float = 600.0  # 0: a draining GPU is never reported unhealthy
    default_compute_mode: str = "DEFAULT"
    # GPUs cut into shares (docs/sharing.md): they leave the gpus pool for gpu_shares.
    shared_gpus: tuple[ShareSpec, ...] = ()
    config_file: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def state_dir(self) -> str:
        return os.path.join(self.work_dir, "state")

    @property
    def bridge_path(self) -> str:
        """Where the command-module bridge listens; empty when it is disabled."""
        return self.socket + BRIDGE_SUFFIX if self.bridge_socket is None else self.bridge_socket

    def server_settings(self) -> ServerSettings:
        """What the server of both routes is told (isolator/transport/settings.py)."""
        return ServerSettings(
            socket=self.socket,
            bridge_socket=self.bridge_socket,
            socket_mode=self.socket_mode,
            socket_group=self.socket_group,
            allowed_uids=self.allowed_uids,
            allowed_gids=self.allowed_gids,
            max_workers=self.max_workers,
            max_concurrent_rpcs=self.max_concurrent_rpcs,
            max_connections=self.max_connections,
            max_message_bytes=self.max_message_bytes,
            mode=self.mode,
        )


# Flag name -> (Config field, parser). The parser turns a flag or file value into the field's type
# and raises ValueError with a reason on bad input.
def _octal_mode(value: Any) -> int:
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


def _int_list(value: Any) -> tuple[int, ...]:
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


def _positive_int(value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not an integer") from None
    if n <= 0:
        raise ValueError(f"{n} must be positive")
    return n


def _positive_float(value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number") from None
    if not x > 0 or x != x or x == float("inf"):
        raise ValueError(f"{value!r} must be a positive number of seconds")
    return x


def _mib(value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a whole number of MiB") from None
    if n < 0:
        raise ValueError(f"{n} must not be negative")
    return n


def _seconds_or_off(value: Any) -> float:
    if str(value).strip() == "0":
        return 0.0
    return _positive_float(value)


def _choice(choices: tuple[str, ...]) -> Any:
    def parse(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return str(value)

    parse.choices = choices  # type: ignore[attr-defined]  # what shell completion offers (isolator/cli/completion.py)
    return parse


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def _nvidia_gpu_devices(value: Any) -> tuple[int, ...]:
    # Mesos parses this flag as a list of unsigned ints; the semantic checks (duplicates, indices
    # that do not exist, the need for --resources gpus:N) belong to the inventory, which knows
    # the machine.
    items = _int_list(value)
    for n in items:
        if n < 0:
            raise ValueError(f"{n} is not a valid NVML index")
    return items


def _ids(value: Any) -> tuple[int, ...]:
    # uids and gids are unsigned 32-bit; (uid_t)-1 means "no id" to the kernel's calls and is no
    # caller's id (a peer's SO_PEERCRED never reads it).
    items = _int_list(value)
    for n in items:
        if not 0 <= n < 2**32 - 1:
            raise ValueError(f"{n} is not a user or group id (0 to {2**32 - 2})")
    return items


def _shared_gpus(value: Any) -> tuple[ShareSpec, ...]:
    try:
        return parse_shared_gpus(value)
    except ConfigError as exc:
        raise ValueError(exc.message.removeprefix("--shared-gpus ")) from None


def _cdi_kind(value: Any) -> str:
    from isolator.errors import InvalidArgument
    from isolator.exporters.cdi import check_kind

    try:
        return check_kind(_text(value))
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None


PARSERS: dict[str, Any] = {
    "socket": _text,
    "socket_mode": _octal_mode,
    "socket_group": _text,
    "bridge_socket": _text,
    "work_dir": _text,
    "volume_root": _text,
    "cgroups_hierarchy": _text,
    "cgroups_root": _text,
    "cgroup_version": _choice(CGROUP_VERSIONS),
    "mode": _choice(MODES),
    "nvidia_gpu_devices": _nvidia_gpu_devices,
    "resources": _text,
    "allocation_policy": _choice(POLICIES),
    "simulate": _text,
    "nvml_library": _text,
    "dev_root": _text,
    "driver_root": _text,
    "ignored_xids": _int_list,
    "max_workers": _positive_int,
    "reap_interval": _positive_float,
    "audit_interval": _seconds_or_off,
    "gpu_probe_interval": _positive_float,
    "max_concurrent_rpcs": _positive_int,
    "max_connections": _positive_int,
    "max_message_bytes": _positive_int,
    "log_level": _choice(LOG_LEVELS),
    "log_format": _choice(LOG_FORMATS),
    "metrics_address": _text,
    "job_mapping_dir": _text,
    "allowed_uids": _ids,
    "allowed_gids": _ids,
    "cdi_dir": _text,
    "cdi_kind": _cdi_kind,
    "cpu_affinity": _choice(CPU_AFFINITY),
    "drain_check": _choice(ON_OFF),
    "drain_memory_mib": _mib,
    "drain_timeout": _seconds_or_off,
    "default_compute_mode": _choice(COMPUTE_MODE_NAMES),
    "shared_gpus": _shared_gpus,
}

HELP = {
    "socket": f"Unix socket to serve on (default {DEFAULT_SOCKET})",
    "socket_mode": "octal mode of the socket (default 0600; world bits are refused)",
    "socket_group": "group that owns the socket, for non-root callers in the allow-list",
    "bridge_socket": "socket of the command-module bridge (default <socket>.bridge; empty: no bridge)",
    "work_dir": f"work directory; state lives in <work-dir>/state (default {DEFAULT_WORK_DIR})",
    "volume_root": f"where nvidia_<version> driver volumes are built (default {DEFAULT_VOLUME_ROOT};"
    " with --simulate, <work-dir>/volumes)",
    "cgroups_hierarchy": f"cgroup mount root, as the agent's flag (default {DEFAULT_CGROUPS_HIERARCHY})",
    "cgroups_root": f"cgroup under which containers live, as the agent's flag (default {DEFAULT_CGROUPS_ROOT})",
    "cgroup_version": "devices cgroup to use: auto (detect), v1 or v2 (default auto)",
    "mode": "mesos: Mesos creates each container's cgroup; standalone: the sidecar does (default mesos)",
    "nvidia_gpu_devices": "comma-separated NVML indices to manage, as the agent's flag (needs --resources gpus:N)",
    "resources": "the agent's --resources string; its gpus:N entry is honoured",
    "allocation_policy": "topology (default) or first-fit (Mesos's lowest-minor-first)",
    "simulate": "run on a simulated GPU host: a host description file or a shipped host's name",
    "nvml_library": "path of libnvidia-ml.so.1 when it is not where the dynamic loader finds it",
    "dev_root": "directory holding the nvidia device nodes (default /dev)",
    "driver_root": "root of the driver installation the volume is built from (default /)",
    "ignored_xids": f"XIDs that do not mark a GPU unhealthy (default {','.join(map(str, DEFAULT_IGNORED_XIDS))})",
    "max_workers": "worker threads of both sockets' calls (default 16)",
    "reap_interval": "seconds between checks for containers whose Mesos cgroup vanished (default 60)",
    "audit_interval": "seconds between drift audits of every container's kernel rules (default 300; 0: off)",
    "gpu_probe_interval": "seconds between probes of the GPUs for loss or a MIG mode change (default 30)",
    "max_concurrent_rpcs": (
        "requests in flight on both sockets together (open Watch calls aside; Cleanup never refused)"
        " before load shedding: RESOURCE_EXHAUSTED, RETRY on the bridge (default 256)"
    ),
    "max_connections": "connections of allowed callers open at once per socket, one uid at most half (default 256)",
    "max_message_bytes": "largest request accepted, in bytes (default 256 KiB)",
    "log_level": "debug, info, warning or error (default info)",
    "log_format": "text (default) or json: one object per line with stable keys (docs/metrics.md)",
    "metrics_address": "serve Prometheus metrics on HOST:PORT, :PORT (every interface), PORT (localhost) or"
    " unix:/path (default: off; docs/metrics.md suggests port 9416)",
    "job_mapping_dir": "write dcgm-exporter's HPC job mapping here: one file per GPU index listing its containers",
    "allowed_uids": "uids allowed to call the socket (default 0)",
    "allowed_gids": "gids allowed to call the socket (default none)",
    "cdi_dir": "keep a CDI spec of the managed GPUs in this directory, e.g. /var/run/cdi (default: none)",
    "cdi_kind": "the CDI spec's kind (default nvidia.com/gpu)",
    "cpu_affinity": "off, hint (default: the GPUs' local CPUs and NUMA nodes in the container's environment) or"
    " enforce (also a cpuset holding the container to them); docs/affinity.md",
    "drain_check": "on (default): a released GPU is handed out again only when NVML shows no process on it"
    " and little memory in use, after its clocks and compute mode are reset; off: at once (docs/handover.md)",
    "drain_memory_mib": "memory in use, in MiB, from which a released GPU counts as busy (default 256)",
    "drain_timeout": "seconds after which a GPU still draining is reported unhealthy (default 600; 0: never)",
    "default_compute_mode": "compute mode a released GPU is set back to: DEFAULT (default), EXCLUSIVE_PROCESS"
    " or PROHIBITED",
    "shared_gpus": "GPUs cut into shares, offered as gpu_shares instead of gpus: INDEX[-LAST]:SHARES[:MODE],"
    " comma-separated, MODE time-slice (default) or mps, e.g. 4-7:4:mps (docs/sharing.md)",
}


# The flags the offline commands read (``resources``, ``cdi generate``): they find and read the GPUs
# (and, for CDI, the device nodes and the driver volume) but serve nothing.
INVENTORY_FLAGS = ("work_dir", "simulate", "nvml_library", "nvidia_gpu_devices", "resources", "shared_gpus")
CDI_FLAGS = (*INVENTORY_FLAGS, "dev_root", "driver_root", "volume_root", "cdi_kind")


def add_serve_arguments(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """Flags of ``gpu-isolator serve`` (or only ``names`` of them). Every default is None so the file
    can fill it in."""
    parser.add_argument("--config", dest="config_file", metavar="FILE", help="TOML config file")
    for name in PARSERS if names is None else names:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, dest=name, default=None, help=HELP[name], metavar=name.upper())


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
        raise ConfigError(f"failed to parse config file '{path}': {exc}") from exc
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
    literal; anything else is refused with the spelling that works."""
    found = _key_line(text, key)
    literal = found[1] if found else ""
    if literal.startswith("0o"):
        return value
    where = f", line {found[0]}" if found else ""
    digits = str(value)
    meant = f"0o{digits}" if all(c in "01234567" for c in digits) else f"0o{value:o}"
    raise ConfigError(
        f"invalid config file '{path}'{where} value for {key}: {literal or value} is a decimal integer in TOML"
        f' ({value} = {oct(value)}), not an octal mode; write {key} = {meant} or {key} = "{meant[2:].rjust(4, "0")}"'
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
        # The daemon compares it with where the devices hierarchy is mounted (isolator/daemon/main.py):
        # a relative path stopped the start with a traceback.
        raise ConfigError(
            f"{n('cgroups_hierarchy')} '{config.cgroups_hierarchy}' must be an absolute path, as the agent's"
            " --cgroups_hierarchy (default /sys/fs/cgroup)"
        )
    if config.cgroups_root.startswith("/") or ".." in Path(config.cgroups_root).parts:
        raise ConfigError(
            f"{n('cgroups_root')} '{config.cgroups_root}' must be relative to the hierarchy, without '..'"
        )


def check_at_start(config: Config) -> None:
    """For ``config check``, which refuses what ``serve`` would: the checks ``serve`` makes at start that
    need no GPU, and which ``resolve`` leaves to it: the metrics address (its error is logged as the
    daemon logs, JSON included), the socket's group (looked up when the socket is bound), and the
    checks of --nvidia-gpu-devices and --resources that need no NVML (isolator/policy/gpuflags.py,
    Mesos's messages; the inventory makes them at start, see ``_nvidia_gpu_devices``)."""
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

# Settings written commented out in the default file: their default is "unset" or follows another
# setting, which no value in the file can say (writing one would pin it).
_UNSET_IN_FILE = {
    "bridge_socket": '"/run/gpu-isolator/isolator.sock.bridge"',
    "nvidia_gpu_devices": "[0, 1]",
    "volume_root": f'"{DEFAULT_VOLUME_ROOT}"',
}


def toml_value(name: str, value: Any) -> str:
    """A setting's value as the config file spells it (``socket_mode = 0o600``, lists as arrays)."""
    if name == "socket_mode":
        return f"0o{value:o}"
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
    value (commented out where the default is "unset"). ``config check`` accepts it, and it yields
    the same settings as no file at all (tests/system/test_config_file.py)."""
    defaults = Config()
    lines = [
        "# gpu-isolator serve: every setting with its default (`gpu-isolator config default`).",
        "# Keys are the flags without their leading dashes, spelled with underscores (work_dir) or",
        "# dashes (work-dir), not both; a flag given to serve wins over the file. Check a file with",
        "# `gpu-isolator config check FILE`; SIGHUP re-reads it (docs/operations.md).",
    ]
    for name in PARSERS:
        lines.append("")
        lines += [f"# {line}" for line in _wrap(HELP[name])]
        if name in _UNSET_IN_FILE:
            lines.append(f"# {name} = {_UNSET_IN_FILE[name]}")
        else:
            lines.append(f"{name} = {toml_value(name, getattr(defaults, name))}")
    return "\n".join(lines) + "\n"


def _wrap(text: str, width: int = 98) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=width) or [""]


def non_defaults(config: Config) -> list[tuple[str, str]]:
    """(key, value as the file spells it) of each setting that differs from the defaults."""
    base = resolve({})
    return [
        (name, toml_value(name, getattr(config, name)))
        for name in PARSERS
        if getattr(config, name) != getattr(base, name)
    ]
