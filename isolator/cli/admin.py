"""The admin commands, one row each: its arguments, the Admin RPC it calls and how the request is
built from the arguments, the exit rule and the renderer (``isolator.cli.render``). ``run`` is the
one path every row takes: socket, call, errors, output format. A new admin command is a row here
and its renderer there; the parser, ``-o``, completion and docs/cli.md's drift test follow.

The socket is ``--socket``, else ``$GPU_ISOLATOR_SOCKET``, else the default (as kubectl's
``--kubeconfig`` over ``$KUBECONFIG``).
"""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from isolator.cli import render
from isolator.cli.exits import EXIT_DRIFT, EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, UsageError
from isolator.daemon import config as configmod

SOCKET_ENV = "GPU_ISOLATOR_SOCKET"
# ``-o``: kubectl's output formats; ``--json`` is ``-o json``.
OUTPUT_FORMATS = ("json", "yaml", "wide")

Data = dict[str, Any]


@dataclass(frozen=True)
class AdminCommand:
    """One admin command. ``request`` names the Admin RPC and fills its request from the arguments
    (the request message arrives empty); ``shape`` turns the answer into what is printed (its JSON);
    ``exit_status`` reads that; ``error_exit`` is the code when the sidecar answers with an error."""

    name: str
    help: str
    method: str
    request: Callable[[argparse.Namespace, Any], None] = lambda args, request: None
    renderer: Callable[[Data, float, bool], str] = render.detail
    arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    shape: Callable[[Data, argparse.Namespace], Data] = lambda data, args: data
    exit_status: Callable[[Data], int] = lambda data: EXIT_OK
    error_exit: int = EXIT_ERROR
    # Another RPC for the same command when the arguments say so (``undrain --handover``).
    variant: Callable[[argparse.Namespace], str | None] = field(default=lambda args: None)


def _container_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("container", help="container ID, nested as parent.child")


def _container(args: argparse.Namespace, request: Any) -> None:
    from isolator.transport.client import BadContainerId, container_id

    try:
        request.container_id.CopyFrom(container_id(args.container))
    except BadContainerId as exc:
        raise UsageError(f"gpu-isolator {args.command}: {exc}") from None


def _release_arguments(parser: argparse.ArgumentParser) -> None:
    _container_argument(parser)
    parser.add_argument("--force", action="store_true", help="release even while processes remain")


def _release(args: argparse.Namespace, request: Any) -> None:
    _container(args, request)
    request.force = args.force


def _gpu_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gpu", help="the GPU's NVML index, its UUID, or minor:<N>")


def _drain_arguments(parser: argparse.ArgumentParser) -> None:
    _gpu_argument(parser)
    parser.add_argument("--reason", required=True, help="why (one line; shown in gpus, describe and health)")


def _drain(args: argparse.Namespace, request: Any) -> None:
    request.gpu = args.gpu
    request.reason = args.reason


def _undrain_arguments(parser: argparse.ArgumentParser) -> None:
    _gpu_argument(parser)
    parser.add_argument(
        "--handover",
        action="store_true",
        help="override the handover check (docs/handover.md) instead of ending a maintenance drain",
    )
    parser.add_argument(
        "--reason",
        default="",
        help="why the drain ends (one line; kept with the drain in drain-history)",
    )


def _undrain(args: argparse.Namespace, request: Any) -> None:
    if args.handover and args.reason:
        raise UsageError("gpu-isolator undrain: --reason is kept with a maintenance drain; --handover ends none")
    request.gpu = args.gpu
    if not args.handover:
        request.reason = args.reason


def _volume_manifest(data: Data, args: argparse.Namespace) -> Data:
    import json

    return dict(json.loads(data.get("manifest_json") or "{}"))


def _health_shape(data: Data, args: argparse.Namespace) -> Data:
    return with_socket_check(data, args.socket)


COMMANDS: tuple[AdminCommand, ...] = (
    AdminCommand("gpus", "every GPU, its health and its holder", "ListGpus", renderer=render.gpus),
    AdminCommand("topology", "the interconnect matrix, as nvidia-smi topo -m", "Topology", renderer=render.topology),
    AdminCommand("containers", "every known container and its GPUs", "ListContainers", renderer=render.containers),
    AdminCommand(
        "describe",
        "everything about one container",
        "DescribeContainer",
        request=_container,
        renderer=render.describe,
        arguments=_container_argument,
    ),
    AdminCommand("volume", "the driver volume", "Volume", renderer=render.volume, shape=_volume_manifest),
    AdminCommand(
        "health",
        "the sidecar's own health",
        "Health",
        renderer=render.health,
        shape=_health_shape,
        exit_status=lambda data: EXIT_OK if data["healthy"] else EXIT_ERROR,
    ),
    AdminCommand("release", "release a stuck allocation", "Release", request=_release, arguments=_release_arguments),
    AdminCommand(
        "audit",
        "compare every container's kernel rules with its record now, re-apply drift"
        " (exit 0: none, 1: drift repaired, 2 or more: trouble)",
        "Audit",
        renderer=render.audit,
        exit_status=lambda data: EXIT_DRIFT if data.get("repaired") else EXIT_OK,
        error_exit=EXIT_USAGE,  # diff(1)'s: 1 says "drift repaired", so trouble is 2
    ),
    AdminCommand(
        "drain",
        "take a GPU out of service for maintenance: no new grants of it; running containers keep it",
        "MaintenanceDrain",
        request=_drain,
        arguments=_drain_arguments,
    ),
    AdminCommand(
        "undrain",
        "end a GPU's maintenance drain; with --handover, return a GPU the handover check keeps out"
        " to the pool now, whatever still runs on it",
        "MaintenanceUndrain",
        request=_undrain,
        renderer=render.undrain,
        arguments=_undrain_arguments,
        variant=lambda args: "Undrain" if args.handover else None,
    ),
    AdminCommand(
        "drain-history",
        "the maintenance drains that ended: who took each GPU out, why, and who returned it, and why",
        "MaintenanceHistory",
        renderer=render.drain_history,
    ),
)
BY_NAME: dict[str, AdminCommand] = {c.name: c for c in COMMANDS}


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """What every admin command takes: the socket, the output format, the timeout."""
    parser.add_argument(
        "--socket",
        default=None,
        help=f"the sidecar's socket (default: ${SOCKET_ENV}, else {configmod.DEFAULT_SOCKET})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (a stable shape) instead of a table")
    add_output(parser)
    parser.add_argument("--timeout", type=seconds, default=10.0, help="seconds to wait for an answer (default 10)")


def add_output(parser: argparse.ArgumentParser) -> None:
    """``-o`` beside a command's ``--json`` (kubectl's formats): every command that prints JSON takes it."""
    parser.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default=None,
        help="json (as --json), yaml (the same shape) or wide (the table with more columns)",
    )


def seconds(value: str) -> float:
    """A positive, finite number of seconds; anything else is a usage error naming the value."""
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0 < number < 86400 * 365:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds above 0")
    return number


def output_format(args: argparse.Namespace) -> str:
    """``-o json|yaml|wide``, ``--json`` (= ``-o json``), or "" for the table; a contradiction is a usage error."""
    output = getattr(args, "output", None) or ""
    if getattr(args, "json", False):
        if output not in ("", "json"):
            raise UsageError(f"gpu-isolator {args.command}: --json and -o {output} contradict")
        output = "json"
    return output


def formatted(command: str, data: Data, output: str, now: float) -> str:
    """The answer as ``-o`` asks: JSON and YAML carry the same stable shape (docs/cli.md), keys sorted,
    times as ISO 8601 UTC as in the tables."""
    if output in ("json", "yaml"):
        return render.structured(render.with_iso_times(data), output)
    return render_table(command, data, now=now, wide=output == "wide")


def render_table(command: str, data: Data, now: float, wide: bool = False) -> str:
    """The table for people; ``wide`` (``-o wide``) adds columns where a command has more to show
    (``gpus``: CPU affinity; ``containers``: the GPUs' minors and UUIDs)."""
    return BY_NAME[command].renderer(data, now, wide)


def resolve_socket(args: argparse.Namespace) -> None:
    """``args.socket`` from ``--socket``, ``$GPU_ISOLATOR_SOCKET`` or the default, and ``args.socket_from``
    saying which, for the messages."""
    if args.socket is None:
        from_env = os.environ.get(SOCKET_ENV, "")
        args.socket = from_env or configmod.DEFAULT_SOCKET
        args.socket_from = f" (from ${SOCKET_ENV})" if from_env else ""
    else:
        args.socket_from = ""


def run(args: argparse.Namespace) -> int:
    from isolator.rpc import isolator_pb2 as pb

    command = BY_NAME[args.command]
    resolve_socket(args)
    output = output_format(args)
    method = command.variant(args) or command.method
    request = getattr(pb, f"{method}Request")()
    command.request(args, request)
    answer = ask(args, method, request, command.error_exit)
    if isinstance(answer, int):
        return answer
    data = command.shape(answer, args)
    render.emit(formatted(args.command, data, output, now=time.time()))
    return command.exit_status(data)


def ask(args: argparse.Namespace, method: str, request: Any, error_exit: int = EXIT_ERROR) -> Data | int:
    """The sidecar's answer to ``method`` as its JSON shape, or the exit code after saying on stderr why
    there is none (``args.socket`` resolved, ``args.timeout`` the wait)."""
    import grpc

    from isolator.transport.client import Client, Unreachable, to_dict

    with Client(args.socket, timeout=args.timeout) as client:
        try:
            client.check_reachable()
            return to_dict(client.call(client.admin, method, request))
        except Unreachable as exc:
            render.fail(str(exc) + args.socket_from)
            return EXIT_UNREACHABLE
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                render.fail(f"cannot reach the sidecar at '{args.socket}'{args.socket_from}: {exc.details()}")
                return EXIT_UNREACHABLE
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                render.fail(f"the sidecar at '{args.socket}' did not answer within {args.timeout:g} s (see --timeout)")
                return EXIT_UNREACHABLE
            render.fail(f"{args.command}: {exc.details()} ({code.name})")
            return error_exit


# The hidden ``__complete`` waits this long at most: a shell waits for it at each TAB.
VALUES_TIMEOUT = 2.0


def run_values(args: argparse.Namespace) -> int:
    """``gpu-isolator __complete containers|gpus``: the running sidecar's container IDs (``parent.child``)
    or GPU indices, one a line, for the completion scripts. Whatever goes wrong (no sidecar, no
    permission, a timeout), it prints nothing and exits 0: a completion never shows an error."""
    try:
        from isolator.rpc import isolator_pb2 as pb
        from isolator.transport.client import Client, to_dict

        resolve_socket(args)
        method = "ListContainers" if args.kind == "containers" else "ListGpus"
        with Client(args.socket, timeout=VALUES_TIMEOUT) as client:
            client.check_reachable()
            data = to_dict(client.call(client.admin, method, getattr(pb, f"{method}Request")()))
    except Exception:  # quiet by design: a TAB must never print an error
        return EXIT_OK
    if args.kind == "containers":
        values = [str(c.get("id", "")) for c in data.get("containers", [])]
    else:
        values = [str(g.get("index", 0)) for g in data.get("gpus", [])]
    if values:
        render.emit("\n".join(values))
    return EXIT_OK


def with_socket_check(data: Data, path: str) -> Data:
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
    about: Data = {k: data[k] for k in ("version", "mode", "hostname") if k in data}
    return {"healthy": all(c.get("ok") for c in checks), "checks": checks, **about}


def _name(lookup: Callable[[int], Any], ident: int) -> str:
    try:
        return str(lookup(ident)[0])
    except KeyError:
        return str(ident)
