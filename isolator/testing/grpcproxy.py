"""A gRPC proxy on a Unix socket, between a client (our Mesos module) and the sidecar, for tests.

It forwards every unary call as bytes (no message is parsed, so it cannot change one) and lets a
test make the sidecar look slow or busy to the client, which a real sidecar does only under load:

    proxy = GrpcProxy(sidecar.socket, path).start()
    gate = proxy.hold("Prepare")            # the next Prepare waits until gate.set()
    proxy.refuse("Prepare", pushback_ms=200) # the next Prepare: RESOURCE_EXHAUSTED + grpc-retry-pushback-ms
    proxy.fail("Isolate", grpc.StatusCode.FAILED_PRECONDITION, "...")  # the next Isolate: that error
    proxy.calls["Prepare"], proxy.max_open["Prepare"]

Isolate works through it only in the sidecar's mesos mode (the sidecar then waits for the agent to
place the pid; in standalone mode it checks the caller's pid, which would be the proxy's).
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent import futures
from typing import Any

import grpc

from isolator.transport.wire import RETRY_PUSHBACK_METADATA

__all__ = ["GrpcProxy"]

RETRY_PUSHBACK = RETRY_PUSHBACK_METADATA


class GrpcProxy:
    def __init__(self, target: str, path: str) -> None:
        self.target = target  # the sidecar's socket
        self.path = path  # where the proxy listens
        self.calls: Counter[str] = Counter()  # calls received per method (its last path element)
        self.open: Counter[str] = Counter()  # calls open now
        self.max_open: Counter[str] = Counter()  # the most calls open at once
        self.requests: dict[str, list[bytes]] = {}  # each call's request bytes, per method, in order
        self.replies: dict[str, list[bytes]] = {}  # each forwarded call's answer bytes, per method, in order
        self._lock = threading.Lock()
        self._holds: dict[str, list[threading.Event]] = {}
        self._refusals: dict[str, list[int]] = {}
        self._failures: dict[str, list[tuple[grpc.StatusCode, str]]] = {}
        self._server: grpc.Server | None = None
        self._channel: grpc.Channel | None = None

    def start(self) -> GrpcProxy:
        self._channel = grpc.insecure_channel("unix:" + self.target)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        server.add_generic_rpc_handlers((_Handler(self),))
        server.add_insecure_port("unix:" + self.path)
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        """Stop listening (the socket goes away: the client finds nothing there)."""
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        with self._lock:
            for gates in self._holds.values():
                for gate in gates:
                    gate.set()
            self._holds.clear()

    def hold(self, method: str) -> threading.Event:
        """Hold the next call of ``method`` before forwarding it until the returned event is set."""
        gate = threading.Event()
        with self._lock:
            self._holds.setdefault(method, []).append(gate)
        return gate

    def refuse(self, method: str, pushback_ms: int) -> None:
        """Answer the next call of ``method`` RESOURCE_EXHAUSTED with ``grpc-retry-pushback-ms``, as the
        sidecar's load shedding does (isolator/transport/status.py), without forwarding it."""
        with self._lock:
            self._refusals.setdefault(method, []).append(pushback_ms)

    def fail(self, method: str, code: grpc.StatusCode, message: str) -> None:
        """Answer the next call of ``method`` with ``code`` and ``message``, without forwarding it:
        a sidecar refusing it for a reason of its own."""
        with self._lock:
            self._failures.setdefault(method, []).append((code, message))

    def forward(self, full_method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        method = full_method.rsplit("/", 1)[-1]
        with self._lock:
            self.calls[method] += 1
            self.requests.setdefault(method, []).append(request)
            self.open[method] += 1
            self.max_open[method] = max(self.max_open[method], self.open[method])
            gates = self._holds.get(method)
            gate = gates.pop(0) if gates else None
            refusals = self._refusals.get(method)
            pushback = refusals.pop(0) if refusals else None
            failures = self._failures.get(method)
            failure = failures.pop(0) if failures else None
        try:
            if gate is not None:
                gate.wait()
            if pushback is not None:
                context.set_trailing_metadata(((RETRY_PUSHBACK, str(pushback)),))
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "proxy: load shedding (test)")
            if failure is not None:
                context.abort(*failure)
            channel = self._channel
            if channel is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, "proxy: stopped")
                raise AssertionError("unreachable: abort raises")
            call = channel.unary_unary(full_method)
            try:
                response: bytes = call(request, timeout=context.time_remaining())
            except grpc.RpcError as exc:
                context.set_trailing_metadata(tuple(exc.trailing_metadata() or ()))
                context.abort(exc.code(), exc.details() or "")
            with self._lock:
                self.replies.setdefault(method, []).append(response)
            return response
        finally:
            with self._lock:
                self.open[method] -= 1


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, proxy: GrpcProxy) -> None:
        self.proxy = proxy

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: self.proxy.forward(method, request, context)
        )
