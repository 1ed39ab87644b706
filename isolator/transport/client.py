"""A small client of the sidecar's socket, for the CLI and the tests: connect, call, name the failure.

Generated code is imported here and in the server only. Nothing here prints.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from typing import Any

import grpc
from google.protobuf import json_format

from isolator.errors import IsolatorError
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc


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

    A plain connect(2) first: it tells a missing socket, a refused one (the sidecar is down and left
    its socket behind) and a forbidden one apart at once, where gRPC would only retry until its deadline.
    """
    where = f"cannot reach the sidecar at '{socket_path}'"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(socket_path)
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


# gRPC sends a call's deadline relative ("grpc-timeout"), so a server counts it from when it reads the
# call: a sidecar stopped past the deadline would still see it in the future. Our clients also send
# the deadline itself, on CLOCK_MONOTONIC (one clock for every process of the host), in milliseconds;
# the server keeps the earlier of the two (isolator/transport/serving.py, docs/operations.md "Stale hooks").
DEADLINE_METADATA = "gpu-isolator-deadline-ms"


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

    def check_reachable(self) -> None:
        probe(self.socket_path, timeout=min(self.timeout, 5.0))

    def call(self, stub: Any, method: str, request: Any) -> Any:
        return getattr(stub, method)(request, timeout=self.timeout, metadata=deadline_metadata(self.timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
