"""A small client of the sidecar's socket, for the CLI and the tests.

Generated code is imported here and in the server only.
"""

from __future__ import annotations

import os
from typing import Any

import grpc
from google.protobuf import json_format

from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc


class Unreachable(Exception):
    """The sidecar's socket cannot be reached (absent, refused, or not permitted)."""


def container_id(text: str) -> pb.ContainerID:
    """Parse Mesos's ``parent.child`` form. IDs containing '.' cannot be named this way."""
    parts = text.split(".")
    msg: pb.ContainerID | None = None
    for part in parts:
        node = pb.ContainerID(value=part)
        if msg is not None:
            node.parent.CopyFrom(msg)
        msg = node
    assert msg is not None
    return msg


def to_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


class Client:
    def __init__(self, socket_path: str, timeout: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel = grpc.insecure_channel("unix:" + os.path.abspath(socket_path))
        self.isolator = pb_grpc.IsolatorStub(self._channel)
        self.admin = pb_grpc.AdminStub(self._channel)

    def check_reachable(self) -> None:
        if not os.path.exists(self.socket_path):
            raise Unreachable(f"cannot reach the sidecar at '{self.socket_path}': no such socket")
        if not os.access(self.socket_path, os.R_OK | os.W_OK):
            raise Unreachable(f"cannot reach the sidecar at '{self.socket_path}': permission denied")
        try:
            grpc.channel_ready_future(self._channel).result(timeout=min(self.timeout, 5.0))
        except grpc.FutureTimeoutError:
            raise Unreachable(f"cannot reach the sidecar at '{self.socket_path}': nothing answers") from None

    def call(self, stub: Any, method: str, request: Any) -> Any:
        return getattr(stub, method)(request, timeout=self.timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
