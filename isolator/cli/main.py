"""``gpu-isolator``: the daemon (``serve``) and the admin commands. The only module that prints.

Exit codes: 0 ok, 1 error, 2 usage, 3 the sidecar cannot be reached (the message names the socket);
``serve`` exits 4 when the node's GPUs are unavailable (no usable NVML, fewer GPUs than configured);
78 (EX_CONFIG) for a configuration error: a flag, a config file or a combination that cannot work;
75 (EX_TEMPFAIL) when another live sidecar holds the work directory, the cgroups root or a socket.
Errors are one line on stderr, never a traceback.
``audit`` follows diff(1): 0 no drift, 1 drift found and repaired, 2 and above trouble.
The admin commands' socket is ``--socket``, else ``$GPU_ISOLATOR_SOCKET``, else the default (as
kubectl's ``--kubeconfig`` over ``$KUBECONFIG``).
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from isolator import __version__
from isolator.daemon import config as configmod
from isolator.errors import ConfigError, GpusUnavailable, IsolatorError, OwnershipHeld

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NO_GPUS = 0, 1, 2, 3, 4
# audit only, as diff(1): 1 says "drift was found (and repaired)", so an error answered is 2 there.
EXIT_DRIFT = 1
SOCKET_ENV = "GPU_ISOLATOR_SOCKET"
# sysexits.h's EX_CONFIG: a configuration error does not heal by itself, so it has its own code,
# which the systemd unit lists in RestartPreventExitStatus (1 stays "a runtime failure: retry").
EXIT_CONFIG = 78
# sysexits.h's EX_TEMPFAIL: another live sidecar holds the work directory, the cgroups root or a socket;
# the conflict ends when it stops, so systemd may retry (within the unit's start limit).
EXIT_WORK_DIR_HELD = 75


def exit_code_of(exc: IsolatorError) -> int:
    """The exit code an error that stops a command (``serve`` above all) stands for."""
    if isinstance(exc, GpusUnavailable):
        return EXIT_NO_GPUS
    if isinstance(exc, ConfigError):
        return EXIT_CONFIG
    if isinstance(exc, OwnershipHeld):
        return EXIT_WORK_DIR_HELD
    return EXIT_ERROR


class UsageError(Exception):
    def __init__(self, message: str, help_text: str = "") -> None:
        super().__init__(message)
        self.help_text = help_text


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2; a command missing what it needs (``describe``
    without a container, ``cdi`` without an action) also shows that command's usage and choices."""

    def error(self, message: str) -> NoReturn:
        missing = message.startswith("the following arguments are required")
        raise UsageError(f"{self.prog}: {message}", self.format_help() if missing else "")


def _seconds(value: str) -> float:
    """A positive, finite number of seconds; anything else is a usage error naming the value."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 86400 * 365:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds above 0")
    return seconds


def _add_output(p: argparse.ArgumentParser) -> None:
    """``-o`` beside a command's ``--json`` (kubectl's formats): every command that prints JSON takes it."""
    p.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default=None,
        help="json (as --json), yaml (the same shape) or wide (the table with more columns)",
    )


def build_parser() -> Parser:
    parser = Parser(
        prog="gpu-isolator",
        description="GPU isolator sidecar for Apache Mesos agents",
        epilog=docs_epilog(),  # the docs/<page>.md that help texts cite are there
        formatter_class=_PathFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpu-isolator {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    serve = sub.add_parser(
        "serve", help="run the sidecar on its Unix socket", epilog=docs_epilog(), formatter_class=_PathFormatter
    )
    configmod.add_serve_arguments(serve)

    unit = sub.add_parser(
        "install-unit",
        help="install the systemd unit (Type=notify, watchdog, hardening) for this executable",
        description="Write gpu-isolator.service into DIR with ExecStart pointing at this installation, and a"
        " config file if there is none. Then: systemctl daemon-reload && systemctl enable --now gpu-isolator",
    )
    unit.add_argument("--dir", default="/etc/systemd/system", help="where units go (default /etc/systemd/system)")
    unit.add_argument(
        "--config",
        dest="unit_config",
        default="/etc/gpu-isolator/config.toml",
        help='the config file ExecStart names; written with mode = "mesos" if missing'
        " (default /etc/gpu-isolator/config.toml)",
    )

    def admin(name: str, help_text: str) -> Parser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "--socket",
            default=None,
            help=f"the sidecar's socket (default: ${SOCKET_ENV}, else {configmod.DEFAULT_SOCKET})",
        )
        p.add_argument("--json", action="store_true", help="print JSON (a stable shape) instead of a table")
        _add_output(p)
        p.add_argument("--timeout", type=_seconds, default=10.0, help="seconds to wait for an answer (default 10)")
        return p

    cdi = sub.add_parser("cdi", help="Container Device Interface spec of the managed GPUs")
    cdi_sub = cdi.add_subparsers(dest="cdi_command", metavar="ACTION", parser_class=Parser)
    cdi_sub.required = True
    generate = cdi_sub.add_parser(
        "generate", help="write the CDI spec (offline: reads NVML and builds the driver volume; no sidecar needed)"
    )
    configmod.add_serve_arguments(generate, configmod.CDI_FLAGS)
    generate.add_argument("--output", default="-", help="file to write (default: stdout); mode 0644")
    generate.add_argument(
        "--format",
        choices=CDI_FORMATS,
        default=None,
        help="yaml (default, as nvidia-ctk) or json; a --output FILE ending in .json or .yaml says it too",
    )
    generate.add_argument(
        "--device-name-strategy",
        dest="device_name_strategy",
        action="append",
        choices=(*CDI_NAME_STRATEGIES, "both"),
        default=None,
        help="how devices are named, as nvidia-ctk: index (0, 0:1), uuid (GPU-...), type-index (gpu0, mig0:1);"
        " repeat for several; both = index and uuid (the default)",
    )
    listing = cdi_sub.add_parser(
        "list",
        help="the CDI devices a runtime finds in the spec directories, as nvidia-ctk cdi list (offline)",
    )
    listing.add_argument(
        "--spec-dir",
        dest="spec_dirs",
        action="append",
        default=None,
        metavar="DIR",
        help="a spec directory, lowest priority first; repeat for several (default /etc/cdi then /var/run/cdi)",
    )
    listing.add_argument("--json", action="store_true", help="print JSON: each device and the spec defining it")
    _add_output(listing)

    resources = sub.add_parser(
        "resources", help="the agent's --resources entries for the GPUs and MIG devices (offline: reads NVML)"
    )
    configmod.add_serve_arguments(resources, configmod.INVENTORY_FLAGS)
    resources.add_argument(
        "--json", action="store_true", help="print JSON: the string and each entry's count, and the attributes"
    )
    _add_output(resources)
    attributes = sub.add_parser(
        "attributes",
        help="the agent's --attributes for its GPUs: model, memory, driver, CUDA, MIG (offline: reads NVML)",
    )
    configmod.add_serve_arguments(attributes, configmod.INVENTORY_FLAGS)
    attributes.add_argument("--json", action="store_true", help="print JSON: the string and each value, typed")
    _add_output(attributes)

    admin("gpus", help_text="every GPU, its health and its holder")
    admin("topology", help_text="the interconnect matrix, as nvidia-smi topo -m")
    admin("containers", help_text="every known container and its GPUs")
    describe = admin("describe", help_text="everything about one container")
    describe.add_argument("container", help="container ID, nested as parent.child")
    admin("volume", help_text="the driver volume")
    admin("health", help_text="the sidecar's own health")
    release = admin("release", help_text="release a stuck allocation")
    release.add_argument("container", help="container ID, nested as parent.child")
    release.add_argument("--force", action="store_true", help="release even while processes remain")
    admin(
        "audit",
        help_text="compare every container's kernel rules with its record now, re-apply drift"
        " (exit 0: none, 1: drift repaired, 2 or more: trouble)",
    )
    drain = admin(
        "drain",
        help_text="take a GPU out of service for maintenance: no new grants of it; running containers keep it",
    )
    drain.add_argument("gpu", help="the GPU's NVML index, its UUID, or minor:<N>")
    drain.add_argument("--reason", required=True, help="why (one line; shown in gpus, describe and health)")
    undrain = admin(
        "undrain",
        help_text="end a GPU's maintenance drain; with --handover, return a GPU the handover check keeps out"
        " to the pool now, whatever still runs on it",
    )
    undrain.add_argument("gpu", help="the GPU's NVML index, its UUID, or minor:<N>")
    undrain.add_argument(
        "--handover",
        action="store_true",
        help="override the handover check (docs/handover.md) instead of ending a maintenance drain",
    )

    completion = sub.add_parser(
        "completion",
        help="print the shell completion script",
        description="Print a completion script generated from this command's own parser."
        " Install: gpu-isolator completion bash > /etc/bash_completion.d/gpu-isolator",
    )
    completion.add_argument("shell", choices=("bash",), help="the shell (bash)")

    config = sub.add_parser("config", help="check a config file, or print the default one (docs/operations.md)")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", parser_class=Parser)
    config_sub.required = True
    check = config_sub.add_parser(
        "check",
        help="validate FILE as serve would read it (exit 0: valid, 78: not) and print what it changes",
    )
    check.add_argument("file", metavar="FILE", help="the TOML config file; - reads standard input")
    config_sub.add_parser("default", help="print the full default config file, every key commented")
    return parser


# As isolator.exporters.cdi.FORMATS and NAME_STRATEGIES (a test keeps them equal); not imported from
# there so that building the parser (every command) imports no exporter.
CDI_FORMATS = ("yaml", "json")
CDI_NAME_STRATEGIES = ("index", "uuid", "type-index")
CDI_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")

# ``-o``: kubectl's output formats; ``--json`` is ``-o json``.
OUTPUT_FORMATS = ("json", "yaml", "wide")


def _emit(text: str) -> None:
    sys.stdout.write(text)
    if not text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()


ADMIN_CALLS: dict[str, tuple[str, str]] = {
    # command -> (Admin RPC, request message)
    "gpus": ("ListGpus", "ListGpusRequest"),
    "topology": ("Topology", "TopologyRequest"),
    "containers": ("ListContainers", "ListContainersRequest"),
    "describe": ("DescribeContainer", "DescribeContainerRequest"),
    "volume": ("Volume", "VolumeRequest"),
    "health": ("Health", "HealthRequest"),
    "release": ("Release", "ReleaseRequest"),
    "audit": ("Audit", "AuditRequest"),
    "drain": ("MaintenanceDrain", "MaintenanceDrainRequest"),
    "undrain": ("MaintenanceUndrain", "MaintenanceUndrainRequest"),
    "undrain --handover": ("Undrain", "UndrainRequest"),
}


def _run_admin(args: argparse.Namespace) -> int:
    import grpc

    from isolator.rpc import isolator_pb2 as pb
    from isolator.transport.client import BadContainerId, Client, Unreachable, container_id, to_dict

    if args.socket is None:
        from_env = os.environ.get(SOCKET_ENV, "")
        args.socket = from_env or configmod.DEFAULT_SOCKET
        args.socket_from = f" (from ${SOCKET_ENV})" if from_env else ""
    else:
        args.socket_from = ""
    output = _output_format(args)
    call = "undrain --handover" if args.command == "undrain" and args.handover else args.command
    method, request_name = ADMIN_CALLS[call]
    request = getattr(pb, request_name)()
    if hasattr(args, "container"):
        try:
            request.container_id.CopyFrom(container_id(args.container))
        except BadContainerId as exc:
            raise UsageError(f"gpu-isolator {args.command}: {exc}") from None
    if args.command == "release":
        request.force = args.force
    if args.command in ("drain", "undrain"):
        request.gpu = args.gpu
    if args.command == "drain":
        request.reason = args.reason
    with Client(args.socket, timeout=args.timeout) as client:
        try:
            client.check_reachable()
            reply = client.call(client.admin, method, request)
        except Unreachable as exc:
            _fail(str(exc) + args.socket_from)
            return EXIT_UNREACHABLE
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                _fail(f"cannot reach the sidecar at '{args.socket}'{args.socket_from}: {exc.details()}")
                return EXIT_UNREACHABLE
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                _fail(f"the sidecar at '{args.socket}' did not answer within {args.timeout:g} s (see --timeout)")
                return EXIT_UNREACHABLE
            _fail(f"{args.command}: {exc.details()} ({code.name})")
            return EXIT_USAGE if args.command == "audit" else EXIT_ERROR
    data = to_dict(reply)
    status = EXIT_OK
    if args.command == "audit" and data.get("repaired"):
        status = EXIT_DRIFT
    if args.command == "volume":
        data = json.loads(data.get("manifest_json") or "{}")
    elif args.command == "health":
        data = _with_socket_check(data, args.socket)
        status = EXIT_OK if data["healthy"] else EXIT_ERROR
    _emit(formatted(args.command, data, output, now=time.time()))
    return status


def _output_format(args: argparse.Namespace) -> str:
    """``-o json|yaml|wide``, ``--json`` (= ``-o json``), or "" for the table; a contradiction is a usage error."""
    output = getattr(args, "output", None) or ""
    if getattr(args, "json", False):
        if output not in ("", "json"):
            raise UsageError(f"gpu-isolator {args.command}: --json and -o {output} contradict")
        output = "json"
    return output


def formatted(command: str, data: dict[str, Any], output: str, now: float) -> str:
    """The answer as ``-o`` asks: JSON and YAML carry the same stable shape (docs/cli.md), keys sorted."""
    if output in ("json", "yaml"):
        return _structured(data, output)
    return render(command, data, now=now, wide=output == "wide")


def _structured(data: dict[str, Any], output: str) -> str:
    if output == "json":
        return json.dumps(data, indent=2, sort_keys=True)
    import yaml  # only here and in CDI: the other commands do not pay for the import

    return str(yaml.safe_dump(data, sort_keys=True, default_flow_style=False, allow_unicode=True))


def _fail(message: str) -> None:
    print(f"gpu-isolator: {message}", file=sys.stderr)


def _with_socket_check(data: dict[str, Any], path: str) -> dict[str, Any]:
    """The socket is checked from this side: it answered, and this is who may use it."""
    checks = list(data.get("checks", []))
    try:
        st = os.stat(path)
        owner = _name(pwd.getpwuid, st.st_uid)
        group = _name(grp.getgrgid, st.st_gid)
        detail = f"'{path}' answers; {stat.filemode(st.st_mode)} {owner}:{group}"
        checks.append({"name": "socket", "ok": True, "detail": detail})
    except OSError as exc:
        checks.append({"name": "socket", "ok": False, "detail": f"'{path}': {exc.strerror}"})
    about: dict[str, Any] = {k: data[k] for k in ("version", "mode", "hostname") if k in data}
    return {"healthy": all(c.get("ok") for c in checks), "checks": checks, **about}


def _name(lookup: Callable[[int], Any], ident: int) -> str:
    try:
        return str(lookup(ident)[0])
    except KeyError:
        return str(ident)


# ---- rendering: tables for people -----------------------------------------------------------------
# The JSON form is the stable contract (docs/cli.md); these tables are for reading and may change.


def render(command: str, data: dict[str, Any], now: float, wide: bool = False) -> str:
    """The table for people; ``wide`` (``-o wide``) adds columns where a command has more to show
    (``gpus``: CPU affinity; ``containers``: the GPUs' minors and UUIDs)."""
    renderers: dict[str, Callable[[dict[str, Any], float], str]] = {
        "gpus": lambda d, _now: _gpus_table(d, wide),
        "topology": lambda d, _now: _topology_matrix(d),
        "containers": lambda d, now: _containers_table(d, now, wide),
        "describe": _describe_text,
        "volume": lambda d, _now: _volume_text(d),
        "health": lambda d, _now: _health_table(d),
        "release": lambda d, _now: str(d.get("detail", "")),
        "audit": lambda d, _now: _audit_text(d),
        "drain": lambda d, _now: str(d.get("detail", "")),
        "undrain": lambda d, _now: "\n".join([str(d.get("detail", "")), *(f"  reset {r}" for r in d.get("reset", []))]),
    }
    return renderers[command](data, now)


def _audit_text(data: dict[str, Any]) -> str:
    repaired = data.get("repaired", [])
    checked = int(data.get("checked", 0))
    head = f"checked {checked} container{'' if checked == 1 else 's'}: "
    head += f"re-applied {len(repaired)}" if repaired else "kernel rules agree with the records"
    lines = [head, *(f"  {line}" for line in repaired)]
    lines.append(f"repairs since the sidecar started: {data.get('repairs_total', 0)}")
    return "\n".join(lines)


def _table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str]], indent: str = "") -> str:
    header = [title for _, title in columns]
    body = [["" if r.get(key) is None else str(r.get(key)) for key, _ in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)).rstrip() for b in body]
    return "\n".join(indent + line for line in lines)


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _age(created: float, now: float) -> str:
    """kubectl's habit: one or two units, coarser as it grows."""
    s = max(0, int(now - created))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m" if s >= 600 else f"{s // 60}m{s % 60}s"
    if s < 86400:
        return f"{s // 3600}h" if s >= 36000 else f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 86400}d" if s >= 864000 else f"{s // 86400}d{s % 86400 // 3600}h"


def _list(values: Sequence[Any]) -> str:
    return ",".join(str(v) for v in values) if values else "-"


def _depth(cid: dict[str, Any]) -> int:
    depth = 0
    while "parent" in cid:
        cid = cid["parent"]
        depth += 1
    return depth


def _tree_branch() -> str:
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
    return "└─ " if encoding == "utf8" else "`- "


def _container_rows(containers: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    branch = _tree_branch()
    rows = []
    for c in containers:
        depth = _depth(c.get("container_id", {}))
        name = c.get("id", "") if not depth else "   " * (depth - 1) + branch + c["container_id"]["value"]
        indices = c.get("gpu_indices", [])
        # How many, then which (NVML indices): "1 [0]" is one GPU, GPU 0; a bare index read as a count.
        gpus = f"{len(indices)} [{_list(indices)}]" if indices else "0 (none asked)"
        if c.get("shares"):
            # gpu_shares (docs/sharing.md): "1/4 of [4]" is one of GPU 4's four shares.
            gpus = f"{c['shares']}/{c.get('shares_total', 0)} of [{c.get('share_gpu_index', 0)}]"
            indices = [c.get("share_gpu_index", 0)]
        rows.append(
            dict(
                c,
                name=name,
                # A nested container uses its parent's GPUs; the parentheses say they are not its own.
                gpus=f"({gpus})" if c.get("nested") and indices else ("-" if c.get("nested") else gpus),
                volume=c.get("volume_version") or "-",
                age=_age(float(c.get("created", now)), now),
            )
        )
    return rows


def _containers_table(data: dict[str, Any], now: float, wide: bool = False) -> str:
    containers = data.get("containers", [])
    if not containers:
        return "No containers."
    rows = _container_rows(containers, now)
    for row in rows:
        row["minors"] = _list(row.get("gpu_minors") or [])
        row["uuids"] = _list(row.get("gpu_uuids") or [])
    more = [("minors", "MINORS"), ("uuids", "UUIDS")] if wide else []
    return _table(
        rows,
        [
            ("name", "CONTAINER"),
            ("gpus", "GPUS"),
            ("state", "STATE"),
            ("mode", "MODE"),
            ("volume", "VOLUME"),
            ("age", "AGE"),
            ("cgroup", "CGROUP"),
            *more,
        ],
    )


def _health_text(g: dict[str, Any]) -> str:
    if g.get("healthy"):
        return "healthy"
    xid = int(g.get("last_xid") or 0)
    if xid:
        return f"UNHEALTHY: XID {xid} at {_when(float(g.get('last_xid_time') or 0))}"
    return f"UNHEALTHY: {g.get('health_reason') or 'unknown'}"


def _gpu_rows(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for g in gpus:
        numa = int(g.get("numa_node", -1))
        rows.append(
            dict(
                g,
                minor=g.get("minor", 0) if g.get("uuid") else "?",
                memory=f"{int(g.get('memory_total_bytes', 0)) // 2**20} MiB",
                numa="N/A" if numa < 0 else numa,
                health=_health_text(g),
                mig="on" if g.get("mig_enabled") else "-",
                holder=g.get("holder") or _sharers_text(g) or "-",
                handover=_handover_text(g),
                maintenance="DRAINED" if g.get("maintenance") else "-",
                shares=_shares_text(g),
            )
        )
    return rows


def _shares_text(g: dict[str, Any]) -> str:
    """``2/4 mps (running)``: shares held of the GPU's total, its mode and MPS daemon (docs/sharing.md)."""
    total = int(g.get("shares_total") or 0)
    if not total:
        return "-"
    text = f"{int(g.get('shares_held') or 0)}/{total} {g.get('share_mode', '')}"
    return text + (f" ({g['mps_state']})" if g.get("mps_state") else "")


def _sharers_text(g: dict[str, Any]) -> str:
    return ",".join(f"{h.get('holder', '')}:{int(h.get('shares') or 0)}" for h in g.get("share_holders") or ())


def _handover_text(g: dict[str, Any]) -> str:
    state = g.get("drain_state") or ""
    if not state:
        return "-"
    pids = g.get("drain_pids") or []
    return state.upper() + (f" (pids {_list(pids)})" if pids else "")


def _handover_lines(gpus: list[dict[str, Any]]) -> list[str]:
    """Why each draining GPU is kept out and since when, and what the last handovers reset."""
    lines = []
    drained = [g for g in gpus if g.get("maintenance")]
    if drained:
        lines += [
            "",
            "Drained for maintenance (no new grants; their holders keep them; `gpu-isolator undrain GPU` ends it)",
        ]
        for g in drained:
            since = _when(float(g.get("maintenance_since") or 0))
            who = g.get("maintenance_by") or "unknown caller"
            lines.append(f"  GPU {g.get('index', 0)}: since {since} by {who}: {g.get('maintenance_reason', '')}")
    draining = [g for g in gpus if g.get("drain_state")]
    if draining:
        lines += [
            "",
            "Kept out by the handover check (handed out again once nothing runs on them;"
            " `gpu-isolator undrain --handover GPU` forces it)",
        ]
        for g in draining:
            since = _when(float(g.get("drain_since") or 0))
            lines.append(f"  GPU {g.get('index', 0)}: {g['drain_state']} since {since}: {g.get('drain_reason', '')}")
    reset = [g for g in gpus if g.get("last_reset")]
    if reset:
        lines += ["", "Reset at the last handover"]
        lines += [f"  GPU {g.get('index', 0)}: {line}" for g in reset for line in g["last_reset"]]
    return lines


def _gpus_table(data: dict[str, Any], wide: bool = False) -> str:
    header = f"Driver {data.get('driver_version') or 'N/A'}, CUDA {data.get('cuda_driver_version') or 'N/A'}"
    if data.get("sidecar_version"):
        header += f"; gpu-isolator {data['sidecar_version']}"
    if not data.get("gpus"):
        return header + "\nNo GPUs managed."
    table = _table(
        _gpu_rows(data.get("gpus", [])),
        [
            ("index", "INDEX"),
            ("minor", "MINOR"),
            ("uuid", "UUID"),
            ("name", "NAME"),
            ("memory", "MEMORY"),
            ("numa", "NUMA"),
            ("pci_bus_id", "BUS-ID"),
            ("mig", "MIG"),
            ("health", "HEALTH"),
            ("maintenance", "MAINTENANCE"),
            ("handover", "HANDOVER"),
            ("shares", "SHARES"),
            ("holder", "HOLDER"),
            *([("cpu_affinity", "CPU AFFINITY")] if wide else []),
        ],
    )
    table += "\n".join(["", *_handover_lines(data.get("gpus", []))]) if _handover_lines(data.get("gpus", [])) else ""
    migs = _mig_rows(data.get("gpus", []))
    if migs:
        table += "\n\nMIG devices\n" + _table(
            migs,
            [
                ("gpu", "GPU"),
                ("slot", "SLOT"),
                ("gpu_instance_id", "GI"),
                ("compute_instance_id", "CI"),
                ("profile", "PROFILE"),
                ("resource", "RESOURCE"),
                ("memory", "MEMORY"),
                ("uuid", "UUID"),
                ("caps", "CAPS"),
                ("holder", "HOLDER"),
            ],
        )
    return header + "\n" + table


def _mig_rows(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for g in gpus:
        for m in g.get("mig_devices") or ():
            rows.append(
                dict(
                    m,
                    gpu=g.get("index", 0),
                    slot=m.get("slot", 0),
                    gpu_instance_id=m.get("gpu_instance_id", 0),
                    compute_instance_id=m.get("compute_instance_id", 0),
                    resource=m.get("resource") or "(not offered)",
                    memory=f"{int(m.get('memory_total_bytes', 0)) // 2**20} MiB",
                    caps=",".join(str(c) for c in m.get("caps_minors") or ()) or "MISSING",
                    holder=m.get("holder") or "-",
                )
            )
    return rows


def _describe_text(data: dict[str, Any], now: float) -> str:
    c = data.get("container", {})
    created = float(c.get("created", now))
    fields = [
        ("Container", c.get("id", "")),
        ("Nested", "yes: it uses its top-level container's GPUs" if c.get("nested") else "no"),
        ("State", c.get("state", "")),
        ("Mode", c.get("mode", "")),
        ("Created", f"{_when(created)} ({_age(created, now)} ago)"),
        ("Cgroup", c.get("cgroup", "")),
        ("Volume", c.get("volume_version") or "-"),
        ("Shares", _container_shares_text(c)),  # gpu_shares (docs/sharing.md)
        ("Processes", _list(data.get("pids", []))),
        ("Affinity", _affinity_text(data)),  # --cpu-affinity (docs/affinity.md)
    ]
    width = max(len(k) for k, _ in fields) + 2
    lines = [f"{k + ':':<{width}}{v}" for k, v in fields]
    lines.append("")
    if data.get("gpus"):
        lines.append("GPUs:")
        lines.append(
            _table(
                _gpu_rows(data["gpus"]),
                [
                    ("index", "INDEX"),
                    ("minor", "MINOR"),
                    ("uuid", "UUID"),
                    ("name", "NAME"),
                    ("health", "HEALTH"),
                    ("maintenance", "MAINTENANCE"),
                ],
                indent="  ",
            )
        )
        lines += _handover_lines(data["gpus"])
    else:
        lines.append("GPUs: none")
    lines.append("")
    lines += _rules_text(data)
    nested = data.get("nested", [])
    if nested:
        lines.append("")
        lines.append("Nested containers:")
        lines.append(
            _table(
                _container_rows(nested, now),
                [("id", "CONTAINER"), ("volume", "VOLUME"), ("cgroup", "CGROUP")],
                indent="  ",
            )
        )
    return "\n".join(lines)


def _container_shares_text(c: dict[str, Any]) -> str:
    if not c.get("shares"):
        return "-"
    return (
        f"{c['shares']} of the {c.get('shares_total', 0)} shares of GPU {c.get('share_gpu_index', 0)}"
        f" ({c.get('share_gpu_uuid', '')}, {c.get('share_mode', '')})"
    )


def _affinity_text(data: dict[str, Any]) -> str:
    """``hint: CPUs 0-19,40-59, NUMA nodes 0``, then the cpuset recorded and in force (docs/affinity.md)."""
    mode = data.get("cpu_affinity") or "off"
    local = data.get("local_cpus", "")
    text = f"{mode}: " + (f"CPUs {local}, NUMA nodes {data.get('local_numa_nodes', '')}" if local else "none local")
    recorded = data.get("cpuset_recorded_cpus", "")
    kernel = data.get("cpuset_cpus", "")
    if recorded or kernel:
        rec = f"CPUs {recorded}, nodes {data.get('cpuset_recorded_mems', '')}" if recorded else "none"
        now = f"CPUs {kernel}, nodes {data.get('cpuset_mems', '')}" if kernel else "no cpuset"
        agree = (
            "agree" if (recorded, data.get("cpuset_recorded_mems")) == (kernel, data.get("cpuset_mems")) else "DIFFER"
        )
        text += f"; cpuset recorded {rec}, in force {now} ({agree}) in '{data.get('cpuset_cgroup', '')}'"
    return text


def _rules_text(data: dict[str, Any]) -> list[str]:
    """Recorded next to kernel, one rule a row, so a difference stands out as a 'no'."""
    recorded, kernel = data.get("recorded_rules", []), data.get("kernel_rules", [])
    only_recorded, only_kernel = set(data.get("only_recorded", [])), set(data.get("only_kernel", []))
    agree = data.get("rules_agree", False)
    verdict = "they agree" if agree else "THEY DIFFER"
    lines = [
        f"Device rules: recorded in our state vs held by the kernel ({verdict})",
        f"  kernel source: {data.get('kernel_source', '')}",
        f"  GPU minors the kernel grants: {_list(data.get('kernel_gpu_minors', []))}",
    ]
    rows = []
    for rule in dict.fromkeys([*recorded, *kernel]):
        # A rule covered by a broader one on the other side counts as present there.
        in_recorded = rule in recorded or rule not in only_kernel
        in_kernel = rule in kernel or rule not in only_recorded
        mark = "" if in_recorded and in_kernel else "<- differs"
        rows.append(
            {
                "rule": rule,
                "recorded": "yes" if in_recorded else "no",
                "kernel": "yes" if in_kernel else "no",
                "m": mark,
            }
        )
    lines.append(_table(rows, [("rule", "RULE"), ("recorded", "RECORDED"), ("kernel", "KERNEL"), ("m", "")], "  "))
    return lines


def _volume_text(data: dict[str, Any]) -> str:
    from volumes.manifest import describe

    current = data.get("driver_version", "")
    head = f"volume root:     {data.get('volume_root') or 'N/A'}\nrunning driver:  {current or 'N/A'}"
    volumes = data.get("volumes", [])
    if not volumes:
        return head + "\n\nNo driver volume has been built yet: the first container whose image asks for it builds it."
    parts = [head]
    for manifest in volumes:
        mark = " (running driver)" if manifest.get("driver_version") == current else " (older driver)"
        parts.append(f"{manifest.get('name', '')}{mark}\n" + describe(manifest).rstrip("\n"))
    return "\n\n".join(parts)


def _health_table(data: dict[str, Any]) -> str:
    rows = [dict(c, state="ok" if c.get("ok") else "FAIL") for c in data.get("checks", [])]
    verdict = "healthy" if data.get("healthy") else "UNHEALTHY"
    about = f"gpu-isolator {data['version']}" if data.get("version") else ""
    if about and data.get("hostname"):
        about += f" on {data['hostname']}"
    if about and data.get("mode"):
        about += f", {data['mode']} mode"
    return (
        f"Sidecar {verdict}"
        + (f" ({about})" if about else "")
        + "\n"
        + _table(rows, [("name", "CHECK"), ("state", "STATE"), ("detail", "DETAIL")])
    )


def _topology_matrix(data: dict[str, Any]) -> str:
    """As ``nvidia-smi topo -m``: X on the diagonal, NV# or the PCIe level elsewhere."""
    indices = [int(i) for i in data.get("indices", [])]
    kinds: dict[tuple[int, int], str] = {}
    for link in data.get("links", []):
        a, b = int(link.get("a", 0)), int(link.get("b", 0))
        kinds[(a, b)] = kinds[(b, a)] = str(link.get("kind", ""))
    numa = [int(n) for n in data.get("numa_nodes", [])]
    cpus = list(data.get("cpu_affinity", []))
    rows = []
    for pos, a in enumerate(indices):
        row: dict[str, Any] = {"gpu": f"GPU{a}"}
        for b in indices:
            row[f"g{b}"] = "X" if a == b else kinds.get((a, b), "SYS")
        row["cpus"] = cpus[pos] if pos < len(cpus) and cpus[pos] else "N/A"
        row["numa"] = numa[pos] if pos < len(numa) and numa[pos] >= 0 else "N/A"
        rows.append(row)
    columns = [
        ("gpu", ""),
        *((f"g{b}", f"GPU{b}") for b in indices),
        ("cpus", "CPU Affinity"),
        ("numa", "NUMA Affinity"),
    ]
    legend = (
        "\n\nLegend:\n"
        "  X    = Self\n"
        "  SYS  = Traverses PCIe and the SMP interconnect between NUMA nodes\n"
        "  NODE = Traverses PCIe and the interconnect between host bridges within a NUMA node\n"
        "  PHB  = Traverses PCIe and a PCIe host bridge\n"
        "  PXB  = Traverses multiple PCIe bridges, without a host bridge\n"
        "  PIX  = Traverses at most a single PCIe bridge\n"
        "  NV#  = Traverses a bonded set of # NVLinks"
    )
    return _table(rows, columns) + legend


def _run_serve(args: argparse.Namespace) -> int:
    if args.config_file == configmod.STDIN:
        raise UsageError(
            "gpu-isolator serve: --config - is not a file; SIGHUP reads the config file again, give its path"
        )
    config = configmod.resolve(args)  # a configuration error stops the start before the daemon is loaded
    from isolator.daemon import main as daemon

    try:
        # SIGHUP reads the same flags and file again (flags still win over the file).
        return daemon.serve(config, reread=lambda: configmod.resolve(args))
    except IsolatorError as exc:
        if config.log_format != "json":
            raise
        # The daemon logs JSON: so is the line saying why it stops (one object, level critical).
        import logging

        from isolator.daemon.logfmt import JsonFormatter

        record = logging.LogRecord("isolator", logging.CRITICAL, __file__, 0, "%s", (exc.message,), None)
        print(JsonFormatter().format(record), file=sys.stderr)
        return exit_code_of(exc)


def _run_resources(args: argparse.Namespace) -> int:
    """``resources`` prints the agent's --resources; ``attributes`` its --attributes (docs/operations.md)."""
    from isolator.daemon import main as daemon
    from isolator.policy import attributes

    output = _output_format(args)
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "json", "output")}
    line, pairs = daemon.agent_flags(configmod.resolve(flags))
    if args.command == "attributes":
        text = attributes.render(pairs)
        data: dict[str, Any] = {"attributes": text, "values": attributes.typed(pairs)}
    else:
        text = line
        entries = {name: int(count) for name, _, count in (e.rpartition(":") for e in line.split(";"))}
        data = {"resources": line, "entries": entries, "attributes": attributes.render(pairs)}
    _emit(_structured(data, output) if output in ("json", "yaml") else text)
    return EXIT_OK


def _run_cdi(args: argparse.Namespace) -> int:
    from isolator.exporters import cdi

    if args.cdi_command == "list":
        return _run_cdi_list(args)
    from isolator.daemon import main as daemon

    output = args.output
    fmt = args.format or (cdi.format_of(output) if output.endswith((".json", ".yaml", ".yml")) else "yaml")
    if output != "-" and output.endswith((".json", ".yaml", ".yml")) and fmt != cdi.format_of(output):
        raise UsageError(f"gpu-isolator cdi generate: --format {fmt} contradicts --output '{output}'")
    if output != "-" and not output.endswith((".json", ".yaml")):
        # Runtimes read only *.json and *.yaml (pkg/cdi/spec-dirs.go): another name is never loaded.
        print(f"gpu-isolator: note: CDI runtimes read only *.json and *.yaml, not '{output}'", file=sys.stderr)
    strategies = args.device_name_strategy or ["both"]
    names = list(dict.fromkeys(n for s in strategies for n in (("index", "uuid") if s == "both" else (s,))))
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "cdi_command", "output")}
    config = configmod.resolve(flags)
    spec = daemon.generate_cdi(config, names)
    if output == "-":
        _emit(cdi.render(spec, fmt).rstrip("\n"))
    else:
        path, _ = cdi.write_spec(spec, os.path.dirname(os.path.abspath(output)), os.path.basename(output), fmt)
        print(f"wrote CDI spec '{path}': {len(spec['devices'])} devices, kind {spec['kind']}", file=sys.stderr)
    return EXIT_OK


def _run_cdi_list(args: argparse.Namespace) -> int:
    """As ``nvidia-ctk cdi list``: every device a CDI runtime would resolve, one qualified name a line;
    each problem that cost devices (an unreadable spec, a conflict) on stderr, and then exit 1."""
    from isolator.exporters import cdi

    output = _output_format(args)
    listing = cdi.read_spec_dirs(args.spec_dirs or CDI_SPEC_DIRS)
    for problem in listing.problems:
        _fail(f"cdi list: {problem}")
    if output in ("json", "yaml"):
        devices = [{"name": n, "spec": p} for n, p in listing.devices.items()]
        _emit(_structured({"devices": devices, "problems": list(listing.problems)}, output))
    elif listing.devices:
        _emit("\n".join(listing.devices))
    else:
        print(f"gpu-isolator: no CDI devices in {', '.join(args.spec_dirs or CDI_SPEC_DIRS)}", file=sys.stderr)
    return EXIT_ERROR if listing.problems else EXIT_OK


DEFAULT_CONFIG_TEXT = """\
# gpu-isolator serve settings; keys are the flags without their dashes (docs/configuration.md).
mode = "mesos"
socket = "/run/gpu-isolator/isolator.sock"
work_dir = "/var/lib/gpu-isolator"
"""


# What the unit's sandbox hides from the service: PrivateTmp=yes gives it empty /tmp and /var/tmp,
# ProtectHome=yes empty /home, /root and /run/user. An installation or config file there is bound
# read-only into the sandbox (BindReadOnlyPaths=; with ProtectHome=tmpfs, as systemd.exec(5)
# recommends for exposing parts of a home), or the service could not even start.
PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp")
HOME_DIRS = ("/home", "/root", "/run/user")


def _under(path: str, roots: Sequence[str]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)


def hidden_by_sandbox(paths: Sequence[str]) -> list[str]:
    """The outermost of ``paths`` that the unit's sandbox would hide (see PRIVATE_TMP_DIRS)."""
    hidden = sorted({os.path.normpath(os.path.abspath(p)) for p in paths if p})
    hidden = [p for p in hidden if _under(p, PRIVATE_TMP_DIRS + HOME_DIRS)]
    return [p for p in hidden if not any(p != q and _under(p, (q,)) for q in hidden)]


def _unit_word(word: str, command: bool = False) -> str:
    """``word`` as one word of a unit file line: ``%`` specifiers and (in a command) ``$`` variables
    escaped, quoted when it holds whitespace, quotes or backslashes."""
    word = word.replace("%", "%%")
    if command:
        word = word.replace("$", "$$")
    if not word or any(c.isspace() or c in "\"'\\;" for c in word):
        word = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


DOCS_SUBDIR = "share/doc/gpu-isolator"  # setup.cfg [options.data_files]


def docs_dir() -> str:
    """Where this installation's README.md and docs/ are, laid out as in the checkout, so that the
    ``docs/<page>.md`` the help texts cite is relative to it: the checkout beside the package (a
    clone, an editable install), else what the wheel installed under ``<prefix>/share/doc/gpu-isolator``
    (found in the installed files' record, whatever the install scheme). The project has no public URL."""
    from importlib import metadata

    import isolator

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(isolator.__file__)))
    if os.path.isfile(os.path.join(checkout, "README.md")):
        return checkout
    try:
        files = metadata.distribution("gpu-isolator").files or ()
        for f in files:
            if f.name == "README.md" and str(f).replace(os.sep, "/").endswith(f"{DOCS_SUBDIR}/README.md"):
                return os.path.dirname(os.path.abspath(str(f.locate())))
    except metadata.PackageNotFoundError:
        pass
    import sysconfig

    return os.path.join(sysconfig.get_paths()["data"], DOCS_SUBDIR)


def docs_epilog() -> str:
    return f"documentation: {docs_dir()}"


class _PathFormatter(argparse.HelpFormatter):
    """argparse's, but a path (the epilog's documentation directory) is never cut at a hyphen or
    inside a long word, so that it can be copied from the terminal."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        text = " ".join(text.split())
        return textwrap.fill(
            text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False
        )


def docs_url() -> str:
    """This installation's README as a ``file:`` URL, for the unit's Documentation= (``docs_dir``)."""
    from urllib.parse import quote

    return "file://" + quote(os.path.join(docs_dir(), "README.md"))


def unit_text(executable: str, config_path: str, read_only: Sequence[str] = (), docs: str | None = None) -> str:
    """The shipped unit with its placeholders filled in; ``read_only``: directories the service
    must read that its sandbox hides (``hidden_by_sandbox``); ``docs``: the Documentation= URL
    (default ``docs_url()``). Only the settings are filled in: comments stay as shipped."""
    from importlib.resources import files

    template = files("isolator").joinpath("data/gpu-isolator.service").read_text()
    exec_words = executable.split(" ") if executable.startswith(sys.executable + " ") else [executable]
    fills = {
        "@EXEC@": " ".join(_unit_word(w, command=True) for w in exec_words),
        "@CONFIG@": _unit_word(config_path, command=True),
        "@DOCS@": _unit_word(docs if docs is not None else docs_url()),
    }
    lines = template.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.startswith(("#", ";")):
            for placeholder, value in fills.items():
                line = line.replace(placeholder, value)
            lines[i] = line
    text = "".join(lines)
    if read_only:
        lines = text.splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if line.startswith("ProtectHome="))
        if any(_under(p, HOME_DIRS) for p in read_only):
            lines[at] = "ProtectHome=tmpfs\n"
        lines.insert(at + 1, "BindReadOnlyPaths=" + " ".join(_unit_word(p) for p in read_only) + "\n")
        text = "".join(lines)
    return text


def _run_install_unit(args: argparse.Namespace) -> int:
    import shutil

    executable = shutil.which("gpu-isolator") or ""
    here = os.path.join(os.path.dirname(sys.executable), "gpu-isolator")
    if os.access(here, os.X_OK):
        executable = here  # the one of this installation (a venv), not the first on PATH
    if not executable:
        executable = f"{sys.executable} -m isolator"
    unit_path = os.path.join(args.dir, "gpu-isolator.service")
    try:
        os.makedirs(args.dir, exist_ok=True)
        if not os.path.exists(args.unit_config):
            os.makedirs(os.path.dirname(os.path.abspath(args.unit_config)), exist_ok=True)
            with open(args.unit_config, "w") as fh:
                fh.write(DEFAULT_CONFIG_TEXT)
            print(f"wrote {args.unit_config}")
        config_path = os.path.abspath(args.unit_config)
        import isolator

        package_root = os.path.dirname(os.path.dirname(os.path.abspath(isolator.__file__)))
        exe_dir = os.path.dirname(executable.split(" ")[0])
        read_only = hidden_by_sandbox([sys.prefix, package_root, exe_dir, os.path.dirname(config_path)])
        tmp = unit_path + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(unit_text(executable, config_path, read_only))
        os.chmod(tmp, 0o644)
        os.replace(tmp, unit_path)
    except OSError as exc:
        _fail(f"install-unit: failed to write '{exc.filename}': {exc.strerror}")
        return EXIT_ERROR
    print(f"wrote {unit_path}")
    if read_only:
        print(f"bound read-only into the unit's sandbox, which would hide them: {' '.join(read_only)}")
    print("now: systemctl daemon-reload && systemctl enable --now gpu-isolator")
    return EXIT_OK


def _run_completion(args: argparse.Namespace) -> int:
    from isolator.cli import completion

    _emit(completion.bash(build_parser()))
    return EXIT_OK


def _run_config(args: argparse.Namespace) -> int:
    if args.config_command == "default":
        _emit(configmod.default_file_text())
        return EXIT_OK
    config = configmod.resolve({"config_file": args.file})
    configmod.check_at_start(config)
    changed = configmod.non_defaults(config)
    count = f"{len(changed)} setting{'' if len(changed) == 1 else 's'} differ" + ("s" if len(changed) == 1 else "")
    summary = f"{count} from the defaults" if changed else "every setting is the default"
    lines = [f"config file '{args.file}' is valid: {summary}"]
    lines += [f"  {name} = {value}" for name, value in changed]
    _emit("\n".join(lines))
    return EXIT_OK


def _usage_error(exc: UsageError) -> int:
    print(str(exc), file=sys.stderr)
    if exc.help_text:
        print(exc.help_text.rstrip("\n"), file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except BrokenPipeError:
        # The reader went away before all the output was written (`gpu-isolator gpus | head -1`): as
        # for other CLIs under a pager or head, that is the reader's choice, not an error. Point stdout
        # at /dev/null so that Python's flush at exit does not complain a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _main(argv: list[str]) -> int:
    parser = build_parser()
    if not argv:
        # `gpu-isolator` alone asks what there is: the usage and the command list, as kubectl and docker.
        _emit(parser.format_help())
        return EXIT_OK
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return _usage_error(exc)
    try:
        if args.command == "completion":
            return _run_completion(args)
        if args.command == "config":
            return _run_config(args)
        if args.command == "serve":
            return _run_serve(args)
        if args.command == "cdi":
            return _run_cdi(args)
        if args.command in ("resources", "attributes"):
            return _run_resources(args)
        if args.command == "install-unit":
            return _run_install_unit(args)
        try:
            return _run_admin(args)
        except (UsageError, BrokenPipeError, KeyboardInterrupt):
            raise
        except Exception as exc:  # a bug here must still be one line for the operator, not a traceback
            _fail(f"{args.command}: unexpected {type(exc).__name__}: {exc}")
            return EXIT_ERROR
    except IsolatorError as exc:
        print(f"gpu-isolator: {exc.message}", file=sys.stderr)
        return exit_code_of(exc)
    except KeyboardInterrupt:
        return 130
    except UsageError as exc:
        return _usage_error(exc)


if __name__ == "__main__":
    sys.exit(main())
