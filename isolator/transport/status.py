"""The one place an error becomes a gRPC status: typed errors carry their code's name
(isolator/errors.py), anything else is a bug and INTERNAL. Used by the gRPC route (serving.py) and
the peer-credential gate's refusals (peergate.py); the bridge has its own protocol (bridge.py)."""

from __future__ import annotations

from typing import NoReturn

import grpc

from isolator.errors import IsolatorError, Overloaded
from isolator.transport.wire import RETRY_PUSHBACK_METADATA

# gRPC's standard trailing metadata for "retry after this many milliseconds" (gRFC A6), named in
# proto/gpuisolator/v1/wire.proto. Only load shedding carries it: a RESOURCE_EXHAUSTED without it
# (no free GPU) is final.
RETRY_PUSHBACK = RETRY_PUSHBACK_METADATA


def status_of(exc: BaseException, where: str) -> tuple[grpc.StatusCode, str]:
    """The status code and details for an error raised while serving ``where``."""
    if isinstance(exc, IsolatorError):
        return grpc.StatusCode[exc.code], exc.message
    return grpc.StatusCode.INTERNAL, f"internal error in {where}: {exc}"


def retry_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata for a refusal: ``grpc-retry-pushback-ms`` on load shedding, else none."""
    if isinstance(exc, Overloaded):
        return ((RETRY_PUSHBACK, str(exc.retry_after_ms)),)
    return ()


def mark_retryable(context: object, exc: BaseException) -> None:
    """Set the pushback trailer on ``context`` (sync or aio) before it aborts with ``exc``."""
    metadata = retry_metadata(exc)
    if metadata:
        context.set_trailing_metadata(metadata)  # type: ignore[attr-defined]


async def abort(context: grpc.aio.ServicerContext, exc: BaseException, where: str) -> NoReturn:
    """End an aio call with ``exc``'s status (and its retry pushback, on load shedding)."""
    mark_retryable(context, exc)
    await context.abort(*status_of(exc, where))
    raise AssertionError("unreachable: abort raises")
