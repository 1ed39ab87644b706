"""A bounded Watch that must come back empty, asked in a way a loaded machine cannot fail."""

from __future__ import annotations

from typing import Any

import grpc

from isolator.rpc import isolator_pb2 as pb

TRIES = 5


def assert_no_limitation(stub: Any, name: str) -> None:
    """A Watch with a deadline (the bridge's poll) answers OK with no limitation.

    The daemon answers 0.25 s before the caller's deadline after one last check on its pool; on a
    loaded machine that check can miss the quarter second and the call ends DEADLINE_EXCEEDED
    instead. Such a call is asked again (a few times): a limitation, any other error, or no empty
    answer in TRIES calls still fails.
    """
    request = pb.WatchRequest(container_id=pb.ContainerID(value=name))
    codes = []
    for _ in range(TRIES):
        try:
            reply = stub.Watch(request, timeout=1.0)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            codes.append(exc.code().name)
            continue
        assert not reply.HasField("limitation"), reply
        return
    raise AssertionError(f"no bounded Watch of {name} came back empty: {codes}")
