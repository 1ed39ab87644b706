"""The transport's plain handlers (isolator/transport/handlers.py), each route's one error mapping and
the one connection-slot accounting of both sockets (peergate.ConnectionSlots). In-process: no socket,
no gRPC server; the core is the shipped StubService or a subclass of it."""

from __future__ import annotations

import time

import pytest

from isolator.errors import ContainerGone, Internal, NotFound, Overloaded
from isolator.model import ContainerConfig, ContainerId, LaunchInfo, Limitation
from isolator.rpc import isolator_pb2 as pb
from isolator.testing import StubService
from isolator.transport import bridge, peergate
from isolator.transport.handlers import BRIDGE, GRPC, CallFacts, IsolatorHandlers


class Service(StubService):
    def __init__(self, error: Exception | None = None) -> None:
        super().__init__()
        self.error = error
        self.callers: list[int | None] = []

    def watch(self, container_id: ContainerId) -> Limitation | None:
        if self.error is not None:
            raise self.error
        return None

    def isolate(self, container_id: ContainerId, pid: int, caller: int | None = None) -> None:
        self.callers.append(caller)

    def cleanup(self, container_id: ContainerId) -> None:
        if self.error is not None:
            raise self.error

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        return None


def facts(route: str = GRPC, peer: str = "") -> CallFacts:
    return CallFacts(peer, None, route)


WATCH = pb.WatchRequest(container_id=pb.ContainerID(value="c"))


def test_a_watch_of_a_container_gone_is_no_limitation_to_the_modules_poll_and_not_found_to_grpc() -> None:
    handlers = IsolatorHandlers(Service(ContainerGone(container="c")))
    assert not handlers.handle("Watch", WATCH, facts(BRIDGE)).HasField("limitation")
    with pytest.raises(ContainerGone):
        handlers.handle("Watch", WATCH, facts(GRPC))


def test_a_watch_of_a_container_gone_is_observed_as_routine_not_as_an_error() -> None:
    """The native module's Watch may reach the sidecar after the Cleanup it raced (seen under load in
    make test-mesos): NOT_FOUND to gRPC ends it, but it is no error of anyone's, so it must not count
    in gpu_isolator_errors_total; an unknown container's Watch still does."""
    seen: list[tuple[str, str]] = []
    observer = lambda hook, code, s, r: seen.append((hook, code))  # noqa: E731
    with pytest.raises(ContainerGone):
        IsolatorHandlers(Service(ContainerGone(container="c")), observer).handle("Watch", WATCH, facts(GRPC))
    with pytest.raises(NotFound):
        IsolatorHandlers(Service(NotFound("unknown container c")), observer).handle("Watch", WATCH, facts(GRPC))
    assert seen == [("Watch", "OK"), ("Watch", "NOT_FOUND")]


def test_an_unexpected_exception_leaves_the_handlers_as_internal_and_is_observed_once() -> None:
    seen: list[tuple[str, str]] = []
    handlers = IsolatorHandlers(Service(KeyError("bug")), lambda hook, code, s, r: seen.append((hook, code)))
    with pytest.raises(Internal) as raised:
        handlers.handle("Cleanup", pb.CleanupRequest(container_id=pb.ContainerID(value="c")), facts())
    assert raised.value.message == "internal error in Cleanup: 'bug'"
    assert seen == [("Cleanup", "INTERNAL")]


def test_a_typed_error_leaves_the_handlers_unchanged() -> None:
    error = NotFound("unknown container c")
    with pytest.raises(NotFound) as raised:
        IsolatorHandlers(Service(error)).handle("Watch", WATCH, facts())
    assert raised.value is error


def test_isolate_is_told_the_caller_the_gate_named_on_either_route() -> None:
    service = Service()
    handlers = IsolatorHandlers(service)
    peer = peergate.peer_name(peergate.PeerCredentials(pid=4242, uid=0, gid=0), "1")[1:]
    request = pb.IsolateRequest(container_id=pb.ContainerID(value="c"), pid=7)
    handlers.handle("Isolate", request, facts(GRPC, "unix-abstract:" + peer))
    handlers.handle("Isolate", request, facts(BRIDGE, "bridge:" + peer))
    handlers.handle("Isolate", request, facts(GRPC, "unix:/somewhere"))
    assert service.callers == [4242, 4242, 0]


def answer(service: Service, method: str, payload: bytes) -> bytes:
    return bridge.answer(IsolatorHandlers(service), method, payload, time.monotonic() + 5)


def test_the_bridge_maps_errors_once_into_its_own_lines() -> None:
    payload = b'{"container_id": {"value": "c"}}'
    assert answer(Service(NotFound("unknown container c")), "cleanup", payload) == (
        b"ERROR NOT_FOUND unknown container c\n"
    )
    busy = answer(Service(Overloaded("the sidecar is busy; try again")), "cleanup", payload)
    assert busy == b"RETRY 20 RESOURCE_EXHAUSTED the sidecar is busy; try again\n"
    assert answer(Service(KeyError("bug")), "cleanup", payload) == b"ERROR INTERNAL internal error in Cleanup: 'bug'\n"
    assert answer(Service(ContainerGone(container="c")), "watch", payload) == b"OK\n"


# ---- connection slots ---------------------------------------------------------------------------


def test_a_uid_holds_at_most_its_share_then_every_slot_counts_and_refusals_have_their_own_caps() -> None:
    slots = peergate.ConnectionSlots(4, {"denied": 1, "busy": 1})
    assert [slots.take(True, 1000) for _ in range(3)] == [
        ("allowed", "", True),
        ("allowed", "", True),
        ("busy", "share", True),
    ]
    assert slots.take(True, 1000) == ("busy", "share", False)  # the busy cap is full: closed at once
    assert slots.take(True, 2000)[2] and slots.take(True, 2000)[2]
    slots.give_back("busy", 1000)
    assert slots.take(True, 3000) == ("busy", "full", True)
    assert slots.take(False, 1000) == ("denied", "", True)
    assert slots.take(False, 1000) == ("denied", "", False)
    assert slots.taken() == {"allowed": 4, "denied": 1, "busy": 1}
    slots.give_back("allowed", 1000)
    assert slots.take(True, 1000) == ("allowed", "", True)


def test_pooled_refusals_share_one_cap() -> None:
    slots = peergate.ConnectionSlots(2, {"refused": 1}, pooled=True)
    assert slots.take(False, 5) == ("denied", "", True)
    assert slots.take(True, 1)[:2] == ("allowed", "")
    assert slots.take(True, 1) == ("busy", "share", False)  # the one refusal slot is the denied caller's
    slots.give_back("denied", 5)
    assert slots.take(True, 1) == ("busy", "share", True)
    assert slots.taken() == {"allowed": 1, "refused": 1}


def test_prepares_answer_says_what_an_update_acts_on_whether_or_not_it_adds_launch_info() -> None:
    # This prepare adds nothing (None): the list is on the answer anyway.
    reply = IsolatorHandlers(Service()).handle(
        "Prepare", pb.PrepareRequest(container_id=pb.ContainerID(value="c")), facts()
    )
    assert list(reply.update_reads) == ["gpus", "gpu_shares", "gpu-share-*", "mig-*"]


def test_prepares_answer_says_whether_the_launch_waits_for_isolate_and_by_default_it_does() -> None:
    request = pb.PrepareRequest(container_id=pb.ContainerID(value="c"))
    assert IsolatorHandlers(Service()).handle("Prepare", request, facts()).isolate_unawaited is False

    class Unawaited(Service):
        def isolate_awaited(self, container_id: ContainerId) -> bool:
            return False

    assert IsolatorHandlers(Unawaited()).handle("Prepare", request, facts()).isolate_unawaited is True
