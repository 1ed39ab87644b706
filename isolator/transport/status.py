"""The one place an error becomes a gRPC status: typed errors carry their code's name
(isolator/errors.py), anything else is a bug and INTERNAL. Used by the servicers (server.py),
the peer-credential gate's refusals (peergate.py) and, through the servicers, the bridge."""

from __future__ import annotations

import grpc

from isolator.errors import IsolatorError


def status_of(exc: BaseException, where: str) -> tuple[grpc.StatusCode, str]:
    """The status code and details for an error raised while serving ``where``."""
    if isinstance(exc, IsolatorError):
        return grpc.StatusCode[exc.code], exc.message
    return grpc.StatusCode.INTERNAL, f"internal error in {where}: {exc}"
