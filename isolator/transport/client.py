"""A small client of the sidecar's socket, for the CLI and the tests: connect, call, name the failure.

Generated code is imported here and in the server only. Nothing here prints.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time
from typing import Any

import grpc
from google.protobuf import json_format

from isolator.errors import IsolatorError
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.transport.wire import BRIDGE_ERROR, BRIDGE_OK, BRIDGE_RETRY, DEADLINE_METADATA


class Unreachable(Exception):
    """The sidecar's socket cannot be reached (absent, refused, not permitted, or silent)."""


class BadContainerId(ValueError):
    """A container ID argument that is neither ``parent.child`` nor a ContainerID JSON object."""


def container_id(text: str) -> pb.ContainerID:
    """Parse a container ID argument.

    Mesos's ``parent.child`` form (stringify(ContainerID) joins the chain with '.'), or, for IDs that
    contain '.', the ContainerID JSON Mesos writes: ``{"value": "b", "parent": {"value": "a.1"}}``.
    Each ID is checked as the sidecar will check it, so a bad one is a usage error here.
    """
    # Here, not at the top: creating the model's dataclasses is ~50 ms of CPU, a fifth of the start-up
    # of an admin command that names no container.
    from isolator.model import ContainerId
    from isolator.transport.convert import container_id_from_proto, container_id_to_proto

    text = text.strip()
    if text.startswith("{"):
        try:
            msg = json_format.Parse(text, pb.ContainerID())
        except (json_format.ParseError, json.JSONDecodeError) as exc:
            raise BadContainerId(f"invalid container ID JSON: {exc}") from None
        try:
            return container_id_to_proto(container_id_from_proto(msg))
        except IsolatorError as exc:  # InvalidContainerId: its message names the ID and the reason
            raise BadContainerId(
                exc.message if not msg.HasField("parent") else f"{exc.message} (in {text!r})"
            ) from None
    chain = text.split(".")
    try:
        return container_id_to_proto(ContainerId.from_chain(chain))
    except IsolatorError as exc:
        raise BadContainerId(exc.message if len(chain) == 1 else f"{exc.message} (in {text!r})") from None


def to_dict(message: Any) -> dict[str, Any]:
    """Proto3 JSON with proto field names and every field present: the CLI's --json shape."""
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def probe(socket_path: str, timeout: float = 5.0) -> None:
    """Raise Unreachable with the reason when nothing we may talk to listens on ``socket_path``.

    The path first (stat): a directory, a regular file (a lock file, say) or anything else that is
    not a socket is named as such, with the socket to use where one is found. Then a plain connect(2):
    it tells a missing socket, a refused one (the sidecar is down and left its socket behind) and a
    forbidden one apart at once, where gRPC would only retry until its deadline. Then what answers
    (``sniff``): the bridge's framed protocol and an HTTP/1 metrics endpoint are named, with the
    path to use, instead of a wait for the deadline or gRPC's HTTP/2 parse errors.
    """
    where = f"cannot reach the sidecar at '{socket_path}'"
    _check_private(socket_path, where)
    _check_path(socket_path, where)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(socket_path)
        kind = sniff(sock, timeout)
    except FileNotFoundError:
        raise Unreachable(f"{where}: no such socket (is the sidecar running? pick another with --socket)") from None
    except PermissionError:
        raise Unreachable(
            f"{where}: permission denied (run as root or as a member of the socket's group, see --socket-group)"
        ) from None
    except ConnectionRefusedError:
        raise Unreachable(f"{where}: connection refused (the sidecar is not running)") from None
    except TimeoutError:
        raise Unreachable(f"{where}: connect timed out after {timeout:g} s") from None
    except OSError as exc:
        if exc.errno == errno.ENOTSOCK:
            raise Unreachable(f"{where}: not a socket") from None
        raise Unreachable(f"{where}: {exc.strerror or exc}") from None
    finally:
        sock.close()
    if kind == "bridge":
        raise Unreachable(
            f"{where}: '{socket_path}' is the command-module bridge's socket (the bridge executables' framed"
            f" protocol), not the sidecar's gRPC socket; {_use(_grpc_beside(socket_path))}"
        )
    if kind == "http":
        raise Unreachable(
            f"{where}: '{socket_path}' serves HTTP (Prometheus metrics), not the sidecar's gRPC; read it with"
            f" curl --unix-socket '{socket_path}' http://localhost/metrics, and {_use(_grpc_beside(socket_path))}"
        )


# The first bytes each of the sidecar's sockets sends. gRPC (HTTP/2) sends its SETTINGS frame as soon
# as a connection opens (RFC 9113 3.4, the server's connection preface); the bridge and an HTTP/1
# server wait for a request, which ``sniff`` then sends as HTTP/1: the bridge refuses it with its
# own reply line (isolator/bridge/listener.py), the metrics server answers with a status line.
HTTP2_FRAME_HEADER = 9
HTTP2_SETTINGS = 0x04
SNIFF_REQUEST = b"GET / HTTP/1.0\r\n\r\n"
SNIFF_WAIT_S = 0.25


def classify(first: bytes) -> str:
    """``grpc``, ``bridge``, ``http`` or ``unknown`` from the first bytes a socket sent."""
    if len(first) >= HTTP2_FRAME_HEADER and first[3] == HTTP2_SETTINGS:
        return "grpc"
    if first.startswith((BRIDGE_ERROR + b" ", BRIDGE_RETRY + b" ", BRIDGE_OK + b"\n")):
        return "bridge"
    if first.startswith(b"HTTP/"):
        return "http"
    return "unknown"


def sniff(sock: socket.socket, timeout: float) -> str:
    """What answers on the connected ``sock`` (see ``classify``). The decision rests on the bytes,
    never on the time: a gRPC server slow to send its SETTINGS still sends them first when the
    HTTP/1 request reaches it (then it closes), and the wait only decides when that request goes."""
    sock.settimeout(min(SNIFF_WAIT_S, timeout))
    try:
        first = sock.recv(64)
    except TimeoutError:
        sock.settimeout(timeout)
        try:
            sock.sendall(SNIFF_REQUEST)
            sock.shutdown(socket.SHUT_WR)
            first = sock.recv(64)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            return "unknown"
    return classify(first)


def _answers(path: str, timeout: float = 2.0) -> str:
    """``classify`` of what answers on ``path``; ``none`` when nothing does."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        return sniff(sock, timeout)
    except OSError:
        return "none"
    finally:
        sock.close()


def _grpc_beside(path: str) -> str | None:
    """The gRPC socket that goes with ``path``: ``<socket>`` for its ``<socket>.bridge`` or
    ``<socket>.lock``, else a socket in the same directory that answers gRPC; for a symbolic link,
    the same beside what it points to when nothing answers beside the link."""
    found = _grpc_beside_path(path)
    real = os.path.realpath(path)
    if found is None and real != os.path.abspath(path):
        found = _grpc_beside_path(real)
    return found


def _grpc_beside_path(path: str) -> str | None:
    for suffix in (".bridge", ".lock"):
        if path.endswith(suffix):
            base = path[: -len(suffix)]
            if base.endswith(".bridge") and suffix == ".lock":
                base = base[: -len(".bridge")]
            if _is_socket(base) and _answers(base) == "grpc":
                return base
    found = _grpc_sockets_in(os.path.dirname(path) or ".", skip=path)
    return found[0] if found else None


def _grpc_sockets_in(directory: str, skip: str = "") -> list[str]:
    """Sockets in ``directory`` that answer gRPC (at most 8 looked at: this is an error path)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    candidates = [os.path.join(directory, n) for n in names if _is_socket(os.path.join(directory, n))]
    return [c for c in candidates[:8] if c != skip and _answers(c) == "grpc"]


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _use(grpc_socket: str | None) -> str:
    if grpc_socket is not None:
        return f"use --socket '{grpc_socket}'"
    return "give --socket the sidecar's gRPC socket (its --socket; the bridge's is <socket>.bridge)"


def _check_private(path: str, where: str) -> None:
    """Refuse the socket's private directory ``<socket>.d`` and the sockets in it (the peer gate's,
    isolator/transport/peergate.py): the ``deny`` socket answers every call PERMISSION_DENIED for an
    unknown caller, and ``grpc`` is the server the gate splices allowed callers to, never a path to use."""
    from isolator.transport.peergate import ALLOWED_NAME, DENIED_NAME, PRIVATE_SUFFIX

    directory = path.rstrip("/") or "/"
    if os.path.basename(directory) in (ALLOWED_NAME, DENIED_NAME):
        directory = os.path.dirname(directory)
    if not directory.endswith(PRIVATE_SUFFIX):
        return
    public = directory[: -len(PRIVATE_SUFFIX)]
    if _is_socket(public) and os.path.isdir(directory):
        raise Unreachable(
            f"{where}: '{path}' is in the sidecar's private directory, where gRPC listens behind the peer gate"
            f" that checks each caller; use --socket '{public}'"
        )


def _check_path(path: str, where: str) -> None:
    """Refuse at once a path that exists and is not a socket, saying what it is."""
    try:
        st = os.stat(path)
    except OSError:
        return  # connect(2) names what is wrong (no such file, permission)
    mode = st.st_mode
    if stat.S_ISSOCK(mode):
        return
    if stat.S_ISDIR(mode):
        found = _grpc_sockets_in(path)
        hint = (
            _use(found[0])
            if found
            else f"--socket takes the socket's own path, e.g. '{os.path.join(path, 'isolator.sock')}'"
        )
        raise Unreachable(f"{where}: '{path}' is a directory, not a socket; {hint}")
    kind = "a regular file" if stat.S_ISREG(mode) else "a FIFO or a device"
    note = ""
    if stat.S_ISREG(mode) and path.endswith(".lock"):
        note = f" (the lock file of '{path[: -len('.lock')]}')"
    elif stat.S_ISREG(mode) and os.path.basename(path) == "gpu-isolator.pid":
        note = " (a work directory's lock file)"
    raise Unreachable(f"{where}: '{path}' is {kind}, not a socket{note}; {_use(_grpc_beside(path))}")


# gRPC sends a call's deadline relative ("grpc-timeout"), so a server counts it from when it reads the
# call: a sidecar stopped past the deadline would still see it in the future. Our clients also send
# the deadline itself, on CLOCK_MONOTONIC (one clock for every process of the host), in milliseconds;
# the server keeps the earlier of the two (isolator/transport/serving.py, docs/operations.md "Stale hooks").
# The key is the contract's (proto/gpuisolator/v1/wire.proto, through transport/wire.py).


def deadline_metadata(timeout: float) -> tuple[tuple[str, str], ...]:
    """The metadata of a call that gives up ``timeout`` seconds from now."""
    return ((DEADLINE_METADATA, str(int((time.monotonic() + timeout) * 1000))),)


class Client:
    def __init__(self, socket_path: str, timeout: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel = grpc.insecure_channel("unix:" + os.path.abspath(socket_path))
        self.isolator = pb_grpc.IsolatorStub(self._channel)
        self.admin = pb_grpc.AdminStub(self._channel)
        self._deadline: float | None = None

    def check_reachable(self) -> None:
        """Probe the socket (``probe``). The probe's wait counts against ``timeout``: the call after it
        gets what is left, so a socket that accepts and never answers (a stopped sidecar) is given up on
        after ``timeout`` seconds in all, as the CLI's --timeout and its message say."""
        self._deadline = time.monotonic() + self.timeout
        probe(self.socket_path, timeout=min(self.timeout, 5.0))

    def call(self, stub: Any, method: str, request: Any) -> Any:
        timeout = self.timeout
        if self._deadline is not None:
            timeout = max(self._deadline - time.monotonic(), 0.001)
        return getattr(stub, method)(request, timeout=timeout, metadata=deadline_metadata(timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
