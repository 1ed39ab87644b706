"""The routes' conventions outside the messages, read from the contract (proto/gpuisolator/v1/wire.proto):
the gRPC metadata keys and the bridge socket's framing tokens. Each is the ``(wire)`` option of its
enum value, so the strings are written once, in proto/; the stdlib-only bridge executables
(isolator/bridge/command.py, bridge.c) spell them and tests/unit/transport/test_wire_names.py holds
them, and every other user, to these."""

from __future__ import annotations

from typing import Any

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from isolator.rpc import wire_pb2

# The `(wire)` extension; the generated stub types it as a plain FieldDescriptor, which the
# options' HasExtension and Extensions do not take.
_WIRE: Any = wire_pb2.wire


def wire_name(enum: EnumTypeWrapper, number: int) -> str:
    """The exact string on the wire of ``enum``'s value ``number``."""
    options = enum.DESCRIPTOR.values_by_number[number].GetOptions()
    if not options.HasExtension(_WIRE):
        raise LookupError(f"{enum.DESCRIPTOR.full_name} value {number} has no (wire) name in wire.proto")
    return str(options.Extensions[_WIRE])


# gRPC metadata: the absolute deadline our clients send beside gRPC's relative one (request), and
# gRFC A6's retry pushback of a load-shed RESOURCE_EXHAUSTED (trailing).
DEADLINE_METADATA = wire_name(wire_pb2.MetadataKey, wire_pb2.METADATA_KEY_DEADLINE)
RETRY_PUSHBACK_METADATA = wire_name(wire_pb2.MetadataKey, wire_pb2.METADATA_KEY_RETRY_PUSHBACK)

# The bridge socket: the request header's protocol and the reply line's first word.
BRIDGE_PROTOCOL_1 = wire_name(wire_pb2.BridgeToken, wire_pb2.BRIDGE_PROTOCOL_1).encode()
BRIDGE_PROTOCOL_2 = wire_name(wire_pb2.BridgeToken, wire_pb2.BRIDGE_PROTOCOL_2).encode()
BRIDGE_OK = wire_name(wire_pb2.BridgeToken, wire_pb2.BRIDGE_REPLY_OK).encode()
BRIDGE_ERROR = wire_name(wire_pb2.BridgeToken, wire_pb2.BRIDGE_REPLY_ERROR).encode()
BRIDGE_RETRY = wire_name(wire_pb2.BridgeToken, wire_pb2.BRIDGE_REPLY_RETRY).encode()
