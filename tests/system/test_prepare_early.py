"""gRPC's Prepare answered before its handler ends (isolator/transport/serving.py,
``Dispatcher.execute_early``; docs/mesos-agent.md, "Prepare answers before its grant is in force"):
the caller gets the early answer, which tells it to wait for Isolate; the call still counts against
the in-flight limit until the handler ends; an error before any answer is the call's status; the
bridge route answers only at the end.

Real server, real sockets, real gRPC; the service is the shipped stub, its Prepare held on a gate.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

from isolator.errors import FailedPrecondition, StateError
from isolator.model import ContainerConfig, ContainerId, LaunchInfo
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing import StubService
from isolator.transport.server import SidecarServer
from isolator.transport.settings import ServerSettings
from system.test_admission import WAIT, bridge_call, in_background, until

INFO = LaunchInfo(environment=(("NVIDIA_VISIBLE_DEVICES", "3"),))


class EarlyService(StubService):
    """Its Prepare answers (``prepare_early``) or fails (``refuse``) at once, then waits on ``gate``
    and fails with ``then`` if set; ``ended`` is set when a Prepare ends."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.ended = threading.Event()
        self.refuse: Exception | None = None
        self.then: Exception | None = None
        self.early_calls = 0
        self.plain_calls = 0

    def prepare_early(
        self, container_id: ContainerId, config: ContainerConfig, answer: Callable[[LaunchInfo | None], None]
    ) -> LaunchInfo | None:
        self.early_calls += 1
        try:
            if self.refuse is not None:
                raise self.refuse
            answer(INFO)
            self.gate.wait(WAIT)
            if self.then is not None:
                raise self.then
            return INFO
        finally:
            self.ended.set()

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        self.plain_calls += 1
        self.gate.wait(WAIT)
        self.ended.set()
        return INFO


@pytest.fixture
def early(short_tmp: str) -> Iterator[tuple[SidecarServer, EarlyService, pb_grpc.IsolatorStub]]:
    service = EarlyService()
    cfg = ServerSettings(socket=os.path.join(short_tmp, "run", "s.sock"), max_concurrent_rpcs=1, max_workers=2)
    server = SidecarServer(cfg, service)
    server.start()
    channel = grpc.insecure_channel("unix:" + cfg.socket)
    try:
        yield server, service, pb_grpc.IsolatorStub(channel)
    finally:
        service.gate.set()
        channel.close()
        server.stop(grace=0)


def prepare(stub: pb_grpc.IsolatorStub, value: str) -> pb.PrepareResponse:
    request = pb.PrepareRequest(container_id=pb.ContainerID(value=value), container_config=pb.ContainerConfig())
    return stub.Prepare(request, timeout=WAIT)


def test_the_caller_has_the_early_answer_while_the_handler_goes_on_and_the_call_still_counts(early) -> None:
    _server, service, stub = early
    reply = prepare(stub, "a")
    assert not service.ended.is_set(), "the answer came only once the handler ended"
    assert reply.HasField("launch_info") and reply.launch_info.environment.variables[0].value == "3"
    assert reply.isolate_unawaited is False, "an early answer must make the launch wait for Isolate"
    assert list(reply.update_reads), "the answer says what an Update acts on, as a late one does"
    # The handler still runs: with --max-concurrent-rpcs 1 the next call is shed, not run beside it.
    with pytest.raises(grpc.RpcError) as shed:
        prepare(stub, "b")
    assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    service.gate.set()
    until(lambda: service.ended.is_set(), "the first Prepare ended")
    service.ended.clear()
    until(lambda: _admits(stub), "the call counted out once its handler ended")


def _admits(stub: pb_grpc.IsolatorStub) -> bool:
    try:
        prepare(stub, "c")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        return False
    return True


def test_an_error_before_any_answer_is_the_call_s_status(early) -> None:
    _server, service, stub = early
    service.refuse = FailedPrecondition("no cgroup for container a")
    with pytest.raises(grpc.RpcError) as refused:
        prepare(stub, "a")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no cgroup for container a" in refused.value.details()


def test_an_error_after_the_answer_reaches_nobody_and_the_server_goes_on(early) -> None:
    _server, service, stub = early
    service.then = StateError(op="record", path="/state", cause="disk full")
    service.gate.set()
    assert prepare(stub, "a").isolate_unawaited is False
    until(lambda: service.ended.is_set(), "the Prepare ended")
    service.then = None
    until(lambda: _admits(stub), "the next call served")


def test_the_bridge_route_answers_only_when_the_handler_ends(early) -> None:
    server, service, _stub = early
    replies: list[bytes] = []
    thread = in_background(lambda: replies.append(bridge_call(server.settings.bridge_path, "prepare", "a")))
    until(lambda: service.plain_calls == 1, "the bridge's Prepare inside the service")
    thread.join(0.3)
    assert replies == [] and service.early_calls == 0
    service.gate.set()
    thread.join(WAIT)
    assert replies and replies[0].startswith(b"OK"), replies
