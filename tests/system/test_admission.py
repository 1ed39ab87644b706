"""One admission for both routes: gRPC calls and the bridge socket's calls pass the same Dispatcher
(isolator/transport/serving.py), so they share one in-flight limit (--max-concurrent-rpcs) and one
Cleanup lane, and each route answers load shedding in its own protocol (RETRY on the bridge,
RESOURCE_EXHAUSTED with grpc-retry-pushback-ms on gRPC).

Real server, real sockets, real gRPC; the service is the shipped stub, holding Prepares on a gate.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from isolator.model import ContainerConfig, ContainerId, LaunchInfo
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing import StubService
from isolator.transport.server import SidecarServer
from isolator.transport.settings import ServerSettings

LIMIT = 4
WAIT = 60.0
BUSY = "the sidecar is busy: 4 calls in flight (--max-concurrent-rpcs 4); try again"


class HeldService(StubService):
    """Prepares wait on ``gate``, and the most Prepares inside at once is recorded; Cleanups are listed."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self._lock = threading.Lock()
        self.inside = 0
        self.most_inside = 0
        self.prepared: list[str] = []
        self.cleaned: list[str] = []

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.prepared.append(str(container_id))
        try:
            self.gate.wait(WAIT)
        finally:
            with self._lock:
                self.inside -= 1
        return None

    def cleanup(self, container_id: ContainerId) -> None:
        with self._lock:
            self.cleaned.append(str(container_id))


@pytest.fixture
def held(short_tmp):
    """A sidecar with LIMIT calls in flight at most and as many workers: LIMIT held Prepares take
    every admission slot and every worker."""
    service = HeldService()
    cfg = ServerSettings(socket=os.path.join(short_tmp, "run", "s.sock"), max_concurrent_rpcs=LIMIT, max_workers=LIMIT)
    server = SidecarServer(cfg, service)
    server.start()
    try:
        yield server, service
    finally:
        service.gate.set()
        server.stop(grace=0)


def until(predicate: Callable[[], bool], what: str, budget: float = WAIT) -> None:
    deadline = time.monotonic() + budget
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def bridge_call(path: str, method: str, value: str, timeout_ms: int = 30000) -> bytes:
    """One request on the bridge socket, as the bridge executables send it; the raw reply."""
    body = json.dumps({"container_id": {"value": value}, "container_config": {}}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(WAIT)
        s.connect(path)
        s.sendall(b"gpu-isolator-bridge/1 %s %d\n" % (method.encode(), timeout_ms) + body)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def grpc_prepare(stub: pb_grpc.IsolatorStub, value: str) -> Any:
    request = pb.PrepareRequest(container_id=pb.ContainerID(value=value), container_config=pb.ContainerConfig())
    return stub.Prepare.future(request, timeout=WAIT)


def in_background(fn: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def hold_limit_over_the_bridge(server: SidecarServer, service: HeldService) -> list[threading.Thread]:
    replies: list[bytes] = []
    threads = [
        in_background(lambda i=i: replies.append(bridge_call(server.settings.bridge_path, "prepare", f"held-{i}")))
        for i in range(LIMIT)
    ]
    until(lambda: service.inside >= LIMIT, f"{LIMIT} bridge Prepares inside the service")
    return threads


def test_the_dispatcher_counts_both_routes_against_one_limit_and_never_sheds_cleanup():
    from isolator.errors import Overloaded
    from isolator.transport.serving import Dispatcher

    dispatcher = Dispatcher(workers=1, max_calls=2)
    try:
        assert dispatcher.admit("grpc", "Prepare", 10) is None
        assert dispatcher.admit("bridge", "Prepare", 10) is None
        busy = dispatcher.admit("bridge", "Usage", 10)
        assert isinstance(busy, Overloaded) and busy.message == (
            "the sidecar is busy: 2 calls in flight (--max-concurrent-rpcs 2); try again"
        )
        assert isinstance(dispatcher.admit("grpc", "Status", 10), Overloaded)
        assert dispatcher.admit("bridge", "Cleanup", 10) is None  # over the limit, and admitted
        assert dispatcher.admit("grpc", "Cleanup", 10) is None
        assert (dispatcher.calls, dispatcher.limited, dispatcher.peak, dispatcher.bytes) == (4, 2, 2, 40)
        assert (dict(dispatcher.admitted), dict(dispatcher.shed)) == (
            {"grpc": 2, "bridge": 2},
            {"bridge": 1, "grpc": 1},
        )
        for method in ("Cleanup", "Cleanup", "Prepare"):
            dispatcher.release(method, 10)
        # Cleanups in flight count among the calls: with one Prepare left, the limit has room again.
        assert (dispatcher.calls, dispatcher.limited) == (1, 1)
        assert dispatcher.admit("bridge", "Prepare", 10) is None
    finally:
        dispatcher.shutdown()


def test_a_flood_of_bridge_prepares_at_the_limit_still_admits_a_bridge_cleanup(held):
    server, service = held
    path = server.settings.bridge_path
    holders = hold_limit_over_the_bridge(server, service)
    dispatcher = server._dispatcher
    assert dispatcher is not None
    assert dispatcher.limited == LIMIT, "the bridge's calls are the Dispatcher's calls"
    # Prepares keep coming (shed, asked again), and others are still arriving: connections that
    # sent half a request hold their connection slots (the old listener's cleanup reserve, 8
    # slots of which root could hold 4, was taken by such connections).
    stop = threading.Event()
    flood_replies: list[bytes] = []

    def flood() -> None:
        n = 0
        while not stop.is_set():
            flood_replies.append(bridge_call(path, "prepare", f"flood-{threading.get_ident()}-{n}"))
            n += 1

    flooders = [in_background(flood) for _ in range(3)]
    arriving = []
    for _ in range(6):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(b"gpu-isolator-bridge/1 prepare 30000\n{")
        arriving.append(s)
    try:
        until(lambda: len(flood_replies) >= 6, "the flood being answered")
        # Cleanup is admitted (never shed) and runs although every worker is stuck: the lane.
        assert bridge_call(path, "cleanup", "c") == b"OK\n"
        assert service.cleaned == ["c"]
        assert service.inside == LIMIT, "the held Prepares were still running"
    finally:
        stop.set()
        for s in arriving:
            s.close()
        for thread in flooders:
            thread.join(WAIT)
        service.gate.set()
        for thread in holders:
            thread.join(WAIT)
    # Every flooding Prepare was load shedding, answered RETRY, and never reached the service.
    assert flood_replies
    # (A Cleanup in flight counts among the calls the message gives: "4" or "5 calls in flight".)
    assert all(r.startswith(b"RETRY 20 RESOURCE_EXHAUSTED the sidecar is busy: ") for r in flood_replies), flood_replies
    assert not any(v.startswith("flood") for v in service.prepared)


def test_grpc_prepares_at_the_limit_shed_bridge_prepares_and_still_admit_a_bridge_cleanup(held):
    server, service = held
    path = server.settings.bridge_path
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.IsolatorStub(channel)
        futures = [grpc_prepare(stub, f"grpc-{i}") for i in range(LIMIT)]
        try:
            until(lambda: service.inside == LIMIT, f"{LIMIT} gRPC Prepares inside the service")
            # The limit is shared: the bridge's Prepare is shed, in the bridge's protocol.
            reply = bridge_call(path, "prepare", "bridge-1")
            assert reply == b"RETRY 20 RESOURCE_EXHAUSTED " + BUSY.encode() + b"\n"
            assert "bridge-1" not in service.prepared
            # The Cleanup lane is shared too: every worker is stuck, the bridge's Cleanup still runs.
            assert bridge_call(path, "cleanup", "c") == b"OK\n"
            assert service.cleaned == ["c"]
        finally:
            service.gate.set()
        for future in futures:
            future.result(WAIT)
    assert server._dispatcher is not None
    assert (server._dispatcher.shed["bridge"], server._dispatcher.admitted["grpc"]) == (1, LIMIT)


def test_bridge_prepares_at_the_limit_shed_grpc_prepares_and_still_admit_a_grpc_cleanup(held):
    server, service = held
    holders = hold_limit_over_the_bridge(server, service)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.IsolatorStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                grpc_prepare(stub, "grpc-1").result(WAIT)
            # gRPC's load shedding: RESOURCE_EXHAUSTED with the standard retry pushback.
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.value.details() == BUSY
            assert dict(refused.value.trailing_metadata() or ()).get("grpc-retry-pushback-ms") == "20"
            assert "grpc-1" not in service.prepared
            stub.Cleanup(pb.CleanupRequest(container_id=pb.ContainerID(value="c")), timeout=WAIT)
            assert service.cleaned == ["c"]
            assert service.inside == LIMIT
    finally:
        service.gate.set()
        for thread in holders:
            thread.join(WAIT)


def test_calls_in_flight_never_exceed_the_limit_across_both_routes(short_tmp):
    # More workers than the limit, so that only admission can hold the calls inside to LIMIT.
    service = HeldService()
    cfg = ServerSettings(
        socket=os.path.join(short_tmp, "run", "s.sock"), max_concurrent_rpcs=LIMIT, max_workers=4 * LIMIT
    )
    server = SidecarServer(cfg, service)
    server.start()
    stop = threading.Event()
    shed = {"grpc": 0, "bridge": 0}
    done = {"grpc": 0, "bridge": 0}
    lock = threading.Lock()

    def count(counter: dict[str, int], route: str) -> None:
        with lock:
            counter[route] += 1

    def grpc_client(stub: pb_grpc.IsolatorStub, name: str) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                grpc_prepare(stub, f"{name}-{n}").result(WAIT)
                count(done, "grpc")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                count(shed, "grpc")

    def bridge_client(name: str) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            reply = bridge_call(server.settings.bridge_path, "prepare", f"{name}-{n}")
            if reply.startswith(b"RETRY "):
                count(shed, "bridge")
            else:
                assert reply == b"OK\n", reply
                count(done, "bridge")

    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.IsolatorStub(channel)
    clients = [in_background(lambda i=i: grpc_client(stub, f"g{i}")) for i in range(2 * LIMIT)]
    clients += [in_background(lambda i=i: bridge_client(f"b{i}")) for i in range(2 * LIMIT)]
    try:
        # Held at the limit while both routes keep asking...
        until(lambda: service.inside >= LIMIT, "the limit reached")
        until(lambda: shed["grpc"] >= 10 and shed["bridge"] >= 10, "both routes shed while the limit is held")
        # ...then let through, calls coming and going on both routes.
        service.gate.set()
        until(lambda: done["grpc"] >= 2 * LIMIT and done["bridge"] >= 2 * LIMIT, "both routes served")
    finally:
        stop.set()
        service.gate.set()
        for thread in clients:
            thread.join(WAIT)
        channel.close()
        dispatcher = server._dispatcher
        server.stop(grace=0)
    assert service.most_inside == LIMIT, f"{service.most_inside} Prepares ran at once; the limit is {LIMIT}"
    assert dispatcher is not None
    assert dispatcher.peak == LIMIT
    assert dispatcher.admitted["grpc"] >= 2 * LIMIT and dispatcher.admitted["bridge"] >= 2 * LIMIT
