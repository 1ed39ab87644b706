"""The options of ``gpu-isolator serve``, each written once: a field of ``Config`` declared with
``option(...)`` (its type, default, parser, help, whether SIGHUP takes it over). Its flag, its config
file key, ``serve``'s help, the default file, the reload policy (reload.py) and docs/configuration.md's
table (tests/system/test_doc_drift.py) all read ``OPTIONS``. Reading and checking them: config.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from isolator.daemon import parsers as p
from isolator.gpu.xids import DEFAULT_IGNORED_XIDS
from isolator.model import CgroupVersion, Mode
from isolator.policy.shares import ShareSpec, format_shared_gpus
from isolator.transport.settings import BRIDGE_SUFFIX, ServerSettings

DEFAULT_SOCKET = "/run/gpu-isolator/isolator.sock"
# The command-module bridge listens next to the gRPC socket unless told otherwise: BRIDGE_SUFFIX,
# from isolator/transport/settings.py (the bridge executable's default in isolator/bridge/command.py
# must agree).
DEFAULT_WORK_DIR = "/var/lib/gpu-isolator"
# Mesos keeps its driver volumes here (src/slave/containerizer/mesos/isolators/gpu/volume.cpp).
DEFAULT_VOLUME_ROOT = "/var/run/mesos/isolators/gpu"
# Mesos agent defaults: --cgroups_hierarchy=/sys/fs/cgroup, --cgroups_root=mesos.
DEFAULT_CGROUPS_HIERARCHY = "/sys/fs/cgroup"
DEFAULT_CGROUPS_ROOT = "mesos"

MODES = tuple(Mode)
AUTO = "auto"  # --cgroup-version auto: the devices controller where it is bound (None in Config)
CGROUP_VERSIONS = (AUTO, *CgroupVersion)
POLICIES = ("topology", "first-fit")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
CPU_AFFINITY = ("off", "hint", "enforce")
ON_OFF = ("on", "off")
# nvmlComputeMode_t names (isolator.model.COMPUTE_MODES); EXCLUSIVE_THREAD is gone since CUDA 8.
COMPUTE_MODE_NAMES = ("DEFAULT", "EXCLUSIVE_PROCESS", "PROHIBITED")


@dataclass(frozen=True)
class Option:
    """One setting of ``serve``, as ``option()`` declares it on ``Config``."""

    name: str  # the Config field and the config file's key (also spelled with dashes)
    parse: Callable[[Any], Any]  # flag text or TOML value -> the field's type; ValueError with a reason
    default: Any
    help: str  # serve --help, the default file's comment
    reloadable: bool  # SIGHUP takes it over while serving (isolator/daemon/reload.py)
    # When the default is "unset" or follows another setting: what the docs say it is, and the example
    # value the default file writes commented out (writing the value would pin it); "" otherwise.
    unset: str
    example: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def documented_default(self) -> str:
        """The default as docs/configuration.md's table shows it: the value as its flag takes it, in
        backticks, or the ``unset`` text."""
        return self.unset or f"`{flag_value(self.name, self.default)}`"


def option(
    default: Any,
    parse: Callable[[Any], Any],
    help: str,
    *,
    reloadable: bool = False,
    unset: str = "",
    example: str = "",
) -> Any:
    """A ``Config`` field that is an option; ``{default}`` in ``help`` is the default as its flag takes it."""
    return field(
        default=default,
        metadata={"option": (parse, help, reloadable, unset, example)},
    )


@dataclass(frozen=True)
class Config:
    socket: str = option(DEFAULT_SOCKET, p.text, "Unix socket to serve on (default {default})")
    socket_mode: int = option(
        0o600, p.octal_mode, "octal mode of the socket (default {default}; world bits are refused)"
    )
    socket_group: str = option(
        "", p.text, "group that owns the socket, for non-root callers in the allow-list", unset="root's"
    )
    # None: ``<socket>.bridge``; "": no bridge listener.
    bridge_socket: str | None = option(
        None,
        p.text,
        "socket of the command-module bridge (default <socket>.bridge; empty: no bridge)",
        unset="`<socket>.bridge`",
        example='"/run/gpu-isolator/isolator.sock.bridge"',
    )
    work_dir: str = option(
        DEFAULT_WORK_DIR, p.text, "work directory; state lives in <work-dir>/state (default {default})"
    )
    volume_root: str = option(
        DEFAULT_VOLUME_ROOT,
        p.text,
        "where nvidia_<version> driver volumes are built (default {default}; with --simulate, <work-dir>/volumes)",
        unset=f"`{DEFAULT_VOLUME_ROOT}`; `<work-dir>/volumes` with `--simulate`",
        example=f'"{DEFAULT_VOLUME_ROOT}"',
    )
    cgroups_hierarchy: str = option(
        DEFAULT_CGROUPS_HIERARCHY, p.text, "cgroup mount root, as the agent's flag (default {default})"
    )
    cgroups_root: str = option(
        DEFAULT_CGROUPS_ROOT, p.text, "cgroup under which containers live, as the agent's flag (default {default})"
    )
    # (RUF009: option() declares a field; these defaults are immutable enum members and None)
    cgroup_version: CgroupVersion | None = option(  # noqa: RUF009
        None,
        p.enum_choice(CgroupVersion, AUTO),
        "devices cgroup to use: auto (detect), v1 or v2 (default {default})",
    )
    mode: Mode = option(  # noqa: RUF009
        Mode.MESOS,
        p.enum_choice(Mode),
        "mesos: Mesos creates each container's cgroup; standalone: the sidecar does (default {default})",
    )
    nvidia_gpu_devices: tuple[int, ...] | None = option(
        None,
        p.nvidia_gpu_devices,
        "comma-separated NVML indices to manage, as the agent's flag (needs --resources gpus:N)",
        unset="all",
        example="[0, 1]",
    )
    resources: str = option("", p.text, "the agent's --resources string; its gpus:N entry is honoured", unset="auto")
    allocation_policy: str = option(
        "topology", p.choice(POLICIES), "topology (default) or first-fit (Mesos's lowest-minor-first)"
    )
    simulate: str = option(
        "", p.text, "run on a simulated GPU host: a host description file or a shipped host's name", unset="off"
    )
    nvml_library: str = option(
        "", p.text, "path of libnvidia-ml.so.1 when it is not where the dynamic loader finds it", unset="loader"
    )
    dev_root: str = option("/dev", p.text, "directory holding the nvidia device nodes (default {default})")
    driver_root: str = option(
        "/", p.text, "root of the driver installation the volume is built from (default {default})"
    )
    ignored_xids: tuple[int, ...] = option(
        DEFAULT_IGNORED_XIDS,
        p.int_list,
        "XIDs that do not mark a GPU unhealthy (default {default})",
        reloadable=True,
    )
    max_workers: int = option(16, p.positive_int, "worker threads of both sockets' calls (default {default})")
    reap_interval: float = option(
        60.0,
        p.positive_float,
        "seconds between checks for containers whose Mesos cgroup vanished (default {default})",
    )
    # 0: no periodic audit (gpu-isolator audit still runs one)
    audit_interval: float = option(
        300.0,
        p.seconds_or_off,
        "seconds between drift audits of every container's kernel rules (default {default}; 0: off)",
        reloadable=True,
    )
    gpu_probe_interval: float = option(
        30.0,
        p.positive_float,
        "seconds between probes of the GPUs for loss or a MIG mode change (default {default})",
        reloadable=True,
    )
    max_concurrent_rpcs: int = option(
        256,
        p.positive_int,
        "requests in flight on both sockets together (open Watch calls aside; Cleanup never refused)"
        " before load shedding: RESOURCE_EXHAUSTED, RETRY on the bridge (default {default})",
    )
    max_connections: int = option(
        256,
        p.positive_int,
        "connections of allowed callers open at once per socket, one uid at most half (default {default})",
    )
    # A Mesos ContainerConfig with a large Docker manifest is tens of KiB (docs/reliability.md).
    max_message_bytes: int = option(256 * 1024, p.positive_int, "largest request accepted, in bytes (default 256 KiB)")
    log_level: str = option(
        "info", p.choice(LOG_LEVELS), "debug, info, warning or error (default {default})", reloadable=True
    )
    log_format: str = option(
        "text",
        p.choice(LOG_FORMATS),
        "text (default) or json: one object per line with stable keys (docs/metrics.md)",
    )
    metrics_address: str = option(
        "",
        p.text,
        "serve Prometheus metrics on HOST:PORT, :PORT (every interface), PORT (localhost) or"
        " unix:/path (default: off; docs/metrics.md suggests port 9416)",
        unset="off",
    )
    job_mapping_dir: str = option(
        "",
        p.text,
        "write dcgm-exporter's HPC job mapping here: one file per GPU index listing its containers",
        unset="off",
    )
    allowed_uids: tuple[int, ...] = option(
        (0,), p.ids, "uids allowed to call the socket (default {default})", reloadable=True
    )
    allowed_gids: tuple[int, ...] = option(
        (), p.ids, "gids allowed to call the socket (default none)", reloadable=True, unset="none"
    )
    cdi_dir: str = option(
        "",
        p.text,
        "keep a CDI spec of the managed GPUs in this directory, e.g. /var/run/cdi (default: none)",
        unset="off",
    )
    cdi_kind: str = option("nvidia.com/gpu", p.cdi_kind, "the CDI spec's kind (default {default})")
    cpu_affinity: str = option(  # docs/affinity.md
        "hint",
        p.choice(CPU_AFFINITY),
        "off, hint (default: the GPUs' local CPUs and NUMA nodes in the container's environment) or"
        " enforce (also a cpuset holding the container to them); docs/affinity.md",
    )
    # The handover check of released GPUs (docs/handover.md).
    drain_check: str = option(
        "on",
        p.choice(ON_OFF),
        "on (default): a released GPU is handed out again only when NVML shows no process on it"
        " and little memory in use, after its clocks and compute mode are reset; off: at once (docs/handover.md)",
    )
    drain_memory_mib: int = option(
        256, p.mib, "memory in use, in MiB, from which a released GPU counts as busy (default {default})"
    )
    # 0: a draining GPU is never reported unhealthy
    drain_timeout: float = option(
        600.0,
        p.seconds_or_off,
        "seconds after which a GPU still draining is reported unhealthy (default {default}; 0: never)",
    )
    default_compute_mode: str = option(
        "DEFAULT",
        p.choice(COMPUTE_MODE_NAMES),
        "compute mode a released GPU is set back to: DEFAULT (default), EXCLUSIVE_PROCESS or PROHIBITED",
    )
    # GPUs cut into shares (docs/sharing.md): they leave the gpus pool for gpu-share-<N> units.
    shared_gpus: tuple[ShareSpec, ...] = option(
        (),
        p.shared_gpus,
        "GPUs cut into shares, offered as gpu-share-<N> units instead of gpus:"
        " INDEX[-LAST]:SHARES[:MODE[:multiuser]], comma-separated, MODE time-slice (default) or mps, e.g."
        " 4-7:4:mps; :multiuser runs that GPU's MPS daemon for every user (no isolation between users)"
        " (docs/sharing.md)",
        reloadable=True,
        unset="none",
    )
    # Where a new sharer goes (docs/sharing.md): not reloadable, the booking is built at start.
    share_placement: str = option(
        "spread",
        p.choice(("spread", "pack")),
        "spread (default: sharers on the GPU holding the fewest shares) or pack (fill a GPU before opening"
        " the next, keeping whole GPUs' worth of shares free) (docs/sharing.md)",
    )
    config_file: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The closed sets as their enums, also when a caller (a test, a benchmark) spelled them as words.
        if not isinstance(self.mode, Mode):
            object.__setattr__(self, "mode", Mode(self.mode))
        if self.cgroup_version is not None and not isinstance(self.cgroup_version, CgroupVersion):
            version = None if self.cgroup_version == AUTO else CgroupVersion(self.cgroup_version)
            object.__setattr__(self, "cgroup_version", version)

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


def flag_value(name: str, value: Any) -> str:
    """A setting's value as its flag takes it (``0600``, ``13,31``, ``4:4:mps``, ``auto``)."""
    if name == "socket_mode":
        return f"{value:04o}"
    if name == "cgroup_version" and value is None:
        return AUTO
    if isinstance(value, tuple):
        if value and all(isinstance(v, ShareSpec) for v in value):
            return format_shared_gpus(value)
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return "" if value is None else str(value)


def _options() -> dict[str, Option]:
    out = {}
    for f in fields(Config):
        if "option" in f.metadata:
            parse, help, reloadable, unset, example = f.metadata["option"]
            shown = flag_value(f.name, f.default)
            out[f.name] = Option(f.name, parse, f.default, help.replace("{default}", shown), reloadable, unset, example)
    return out


# The options, in the order of ``Config``: what every list of them reads.
OPTIONS: dict[str, Option] = _options()
# Option name -> its parser (the flag's completion offers a choice parser's ``choices``).
PARSERS: dict[str, Callable[[Any], Any]] = {name: o.parse for name, o in OPTIONS.items()}
