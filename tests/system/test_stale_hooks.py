"""Stale hooks (issue 33, defect 2): a hook whose caller gave up is never carried out.

With the sidecar stopped (SIGSTOP) past a bridge's deadline, Mesos's prepare failed, the agent ran
cleanup, and on thaw the sidecar ran the cleanup first and then the stale prepare, booking GPUs for
a container that no longer existed. Three rules, each shown here on both routes:

* a call carries its caller's deadline, absolute (gRPC's own; the bridge's ``gpu-isolator-bridge/2``
  header), and one found past it when a worker would start it is answered DEADLINE_EXCEEDED unserved;
* a Prepare for a container that was cleaned up is refused (Mesos never reuses a container ID);
* so a Cleanup that overtakes the same container's queued Prepare (Cleanup runs first, by design)
  leaves nothing booked: that Prepare is refused when it starts.

The first part runs in-process (no root); the second freezes a real daemon on a simulated host.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from isolator.bridge import command as bridge
from isolator.model import ContainerConfig, ContainerId, LaunchInfo
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing import StubService
from isolator.testing.mesos import Containerizer, container_id
from isolator.testing.sidecar import Sidecar, running_sidecar
from isolator.transport import bridge as listener
from isolator.transport.client import DEADLINE_METADATA, deadline_metadata
from isolator.transport.handlers import BRIDGE, GRPC, CallFacts, IsolatorHandlers
from isolator.transport.server import SidecarServer
from isolator.transport.settings import ServerSettings
from system.test_bridge import ScriptedListener

WAIT = 60.0


def until(predicate: Callable[[], bool], what: str, budget: float = WAIT) -> None:
    deadline = time.monotonic() + budget
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


class Recording(StubService):
    """Prepares wait on ``gate`` (when set) and are listed; Cleanups are listed."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: threading.Event | None = None
        self.inside = 0
        self.prepared: list[str] = []
        self.cleaned: list[str] = []

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        self.prepared.append(str(container_id))
        if self.gate is not None:
            self.inside += 1
            self.gate.wait(WAIT)
        return None

    def cleanup(self, container_id: ContainerId) -> None:
        self.cleaned.append(str(container_id))


def prepare_request(value: str) -> pb.PrepareRequest:
    return pb.PrepareRequest(container_id=pb.ContainerID(value=value), container_config=pb.ContainerConfig())


# ---- the rule, in-process -------------------------------------------------------------------------


@pytest.mark.parametrize("route", [GRPC, BRIDGE])
def test_a_call_found_past_its_deadline_when_a_worker_starts_it_is_not_run(route):
    from isolator.errors import DeadlineExceeded

    service = Recording()
    handlers = IsolatorHandlers(service)
    past = CallFacts("pid:1", time.monotonic() - 0.5, route)
    with pytest.raises(DeadlineExceeded) as refused:
        handlers.handle("Prepare", prepare_request("late"), past)
    assert refused.value.code == "DEADLINE_EXCEEDED"
    assert refused.value.message.startswith("Prepare of container late not run: its caller's deadline passed 0.")
    assert service.prepared == []
    # Cleanup only frees: it runs however late (and leaves the tombstone a stale Prepare is refused by).
    handlers.handle("Cleanup", pb.CleanupRequest(container_id=pb.ContainerID(value="late")), past)
    assert service.cleaned == ["late"]
    # A call with time left, or with no deadline at all, runs.
    handlers.handle("Prepare", prepare_request("on-time"), CallFacts("pid:1", time.monotonic() + WAIT, route))
    handlers.handle("Prepare", prepare_request("no-deadline"), CallFacts("pid:1", None, route))
    assert service.prepared == ["on-time", "no-deadline"]


def test_a_grpc_call_whose_deadline_passed_before_the_loop_could_cancel_it_is_not_run(short_tmp):
    """The thaw race, made deterministic: the caller gave up and gRPC would cancel the queued call,
    but the event loop (which turns that into a cancelled job) has not run yet when the worker
    frees up and takes the call. The worker itself must see that the deadline has passed."""
    service = Recording()
    service.gate = threading.Event()
    cfg = ServerSettings(socket=os.path.join(short_tmp, "run", "s.sock"), max_workers=1, bridge_socket="")
    server = SidecarServer(cfg, service)
    server.start()
    stall = threading.Event()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.IsolatorStub(channel)
            held = stub.Prepare.future(prepare_request("held"), timeout=WAIT)
            until(lambda: service.inside == 1, "the one worker is busy")
            late = stub.Prepare.future(prepare_request("late"), timeout=1.0)
            after = stub.Prepare.future(prepare_request("after"), timeout=WAIT)
            dispatcher = server._dispatcher
            assert dispatcher is not None
            until(lambda: dispatcher.calls == 3, "both calls queued behind it")
            read = time.monotonic()  # the server has read "late" by now: its deadline is 1 s after at most
            # Stop the loop, as SIGSTOP stops every thread, but let the worker run.
            server._loop.loop.call_soon_threadsafe(stall.wait, WAIT)
            with pytest.raises(grpc.RpcError) as gave_up:
                late.result()
            assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The server counts the deadline from when it read the request, after the client sent it
            # (and gRPC rounds the timeout it sends up a little): let it pass there too.
            until(lambda: time.monotonic() > read + 1.2, "the server's deadline of the late call passed")
            service.gate.set()  # the worker takes "late", then "after", while the loop stands still
            until(lambda: "after" in service.prepared, "the call queued after the late one ran")
            stall.set()
            held.result()
            after.result()
        assert service.prepared == ["held", "after"], "the late call ran after its caller gave up"
    finally:
        stall.set()
        service.gate.set()
        server.stop(grace=0)


@pytest.mark.parametrize(
    ("metadata", "runs"),
    [
        (lambda: deadline_metadata(WAIT), True),
        (lambda: ((DEADLINE_METADATA, str(int((time.monotonic() - 1) * 1000))),), False),  # read late
        (lambda: (), True),  # a plain gRPC client: gRPC's own deadline only
    ],
)
def test_a_grpc_call_keeps_the_absolute_deadline_its_client_sent_beside_grpcs_relative_one(short_tmp, metadata, runs):
    service = Recording()
    cfg = ServerSettings(socket=os.path.join(short_tmp, "run", "s.sock"), bridge_socket="")
    server = SidecarServer(cfg, service)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            call = pb_grpc.IsolatorStub(channel).Prepare
            if runs:
                call(prepare_request("c"), timeout=WAIT, metadata=metadata())
                assert service.prepared == ["c"]
            else:
                with pytest.raises(grpc.RpcError) as refused:
                    call(prepare_request("c"), timeout=WAIT, metadata=metadata())
                assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert refused.value.details().startswith("Prepare of container c not run")
                assert service.prepared == []
    finally:
        server.stop(grace=0)


@pytest.mark.parametrize("value", ["soon", "-1", "1" * 30, ""])
def test_a_malformed_absolute_deadline_is_invalid_argument_and_runs_nothing(short_tmp, value):
    service = Recording()
    cfg = ServerSettings(socket=os.path.join(short_tmp, "run", "s.sock"), bridge_socket="")
    server = SidecarServer(cfg, service)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.IsolatorStub(channel).Prepare(
                prepare_request("c"), timeout=WAIT, metadata=((DEADLINE_METADATA, value),)
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert DEADLINE_METADATA in refused.value.details()
        assert service.prepared == []
    finally:
        server.stop(grace=0)


def frame(data: bytes) -> listener.Frame:
    return listener.parse_frame(data)


def test_a_version_2_request_keeps_its_callers_absolute_deadline_however_late_it_is_read():
    f = frame(b"gpu-isolator-bridge/2 prepare 25000 1000000\n{}")
    assert (f.method, f.timeout, f.deadline, f.payload) == ("prepare", 25.0, 1000.0, b"{}")
    assert f.deadline_from(arrived=990.0) == 1000.0  # read 15 s late: 10 s left, not 25
    assert f.deadline_from(arrived=1020.0) == 1000.0  # read after it: already expired
    # A deadline far beyond the timeout (a client on another clock) is bounded by the timeout.
    assert frame(b"gpu-isolator-bridge/2 watch 1000 999999999999\n{}").deadline_from(arrived=5.0) == 6.0


def test_a_version_1_request_from_an_older_bridge_is_still_served_its_timeout_counted_from_arrival():
    f = frame(b"gpu-isolator-bridge/1 cleanup 2500\n{}")
    assert (f.method, f.deadline, f.deadline_from(arrived=100.0)) == ("cleanup", None, 102.5)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"gpu-isolator-bridge/2 prepare 1000\n{}", "expected '<protocol> <method> <ms> <deadline_ms>'"),
        (b"gpu-isolator-bridge/2 prepare 1000 -5\n{}", "expected '<protocol> <method> <ms> <deadline_ms>'"),
        (b"gpu-isolator-bridge/1 prepare 1000 5\n{}", "expected '<protocol> <method> <ms>'"),
        (b"gpu-isolator-bridge/3 prepare 1000 5\n{}", "speaks gpu-isolator-bridge/2 and gpu-isolator-bridge/1"),
    ],
)
def test_a_malformed_deadline_header_is_refused_with_the_shape_expected(data, error):
    from isolator.errors import IsolatorError

    with pytest.raises(IsolatorError, match=error):
        frame(data)


class Listener(ScriptedListener):
    """A bridge socket that records each request's header with our clock's reading as it arrived,
    and answers each with the next scripted reply (then the last)."""

    def record(self, data: bytes) -> tuple[float, bytes]:
        return time.monotonic(), data.partition(b"\n")[0]


@pytest.fixture(params=["python", "c"])
def install_bridge(request) -> Callable[..., list[str]]:
    if request.param == "python":
        return bridge.install
    compiled = bridge.compiled_bridge()
    if compiled is None:
        pytest.fail("build/gpu-isolator-bridge is missing: run `make build` (it needs gcc)")
    return functools.partial(bridge.install, compiled=compiled)


def run_bridge(directory: str, method: str, body: dict[str, Any], env: dict[str, str] | None = None) -> tuple:
    """``gpu-isolator-<method> IN OUT ERR`` as the module runs it: (exit status, OUT, ERR)."""
    with tempfile.TemporaryDirectory(prefix="criteo-mesos-", dir="/tmp") as tmp:
        paths = [os.path.join(tmp, name) for name in ("in", "out", "err")]
        with open(paths[0], "w") as fh:
            json.dump(body, fh)
        for path in paths[1:]:
            open(path, "w").close()
        result = subprocess.run(
            [os.path.join(directory, f"gpu-isolator-{method}"), *paths],
            capture_output=True,
            env={**os.environ, **(env or {})},
            timeout=WAIT,
        )
        with open(paths[1]) as out, open(paths[2]) as err:
            return result.returncode, out.read(), err.read()


def test_both_bridges_send_their_absolute_deadline_the_same_on_every_attempt(short_tmp, install_bridge):
    path = os.path.join(short_tmp, "b.sock")
    peer = Listener(path, [b"RETRY 10 RESOURCE_EXHAUSTED busy\n", b"RETRY 10 RESOURCE_EXHAUSTED busy\n", b"OK\n"])
    try:
        directory = os.path.join(short_tmp, "bin")
        install_bridge(directory, socket_path=path, timeout=20)
        started = time.monotonic()
        status, _, err = run_bridge(directory, "prepare", {"container_id": {"value": "c"}})
        ended = time.monotonic()
    finally:
        peer.close()
    assert status == 0, err
    assert len(peer.requests) == 3
    deadlines = set()
    for arrived, header in peer.requests:
        protocol, method, left_ms, deadline_ms = header.split(b" ")
        assert (protocol, method) == (b"gpu-isolator-bridge/2", b"prepare")
        deadline = int(deadline_ms) / 1000
        # On our clock (CLOCK_MONOTONIC is one clock for every process on the host): its start + 20 s.
        assert started + 20 - 0.01 <= deadline <= ended + 20
        # The relative timeout is what was left of that deadline when the request was sent.
        assert deadline - 0.01 <= arrived + int(left_ms) / 1000 + 0.001
        deadlines.add(deadline_ms)
    assert len(deadlines) == 1, "a RETRY's next attempt keeps the first attempt's deadline"


# ---- a real daemon, frozen ------------------------------------------------------------------------


# Module-scoped: its users share one xdist worker (conftest.py), and run one at a time.
SHARED_FIXTURES = ("sidecar",)


@pytest.fixture(scope="module")
def sidecar():
    # One worker, so that a Cleanup arriving behind other calls is run first, on the Cleanup lane,
    # as the issue saw under load (serving.HookPool).
    with running_sidecar("dgx-1", "v1", extra=("--max-workers", "1")) as daemon:
        yield daemon


def holdings(daemon: Sidecar) -> dict[str, list[int]]:
    with grpc.insecure_channel(daemon.address) as channel:
        listed = pb_grpc.AdminStub(channel).ListContainers(pb.ListContainersRequest(), timeout=WAIT)
    return {c.container_id.value: sorted(c.gpu_minors) for c in listed.containers}


def full_log(daemon: Sidecar) -> str:
    with open(daemon.log_path) as fh:
        return fh.read()


def settled(daemon: Sidecar, name: str) -> str:
    """Wait until the daemon has carried out or refused the Prepare of ``name``; its log line."""
    outcomes = (
        f"[{name}]: prepared container {name} ",
        f"Prepare of container {name} not run",
        f"container {name} was cleaned up",
    )

    def line() -> str:
        return next((ln for ln in full_log(daemon).splitlines() if any(o in ln for o in outcomes)), "")

    until(lambda: bool(line()), f"the daemon answered the Prepare of {name}")
    return line()


def mesos_config(daemon: Sidecar, gpus: int) -> dict[str, Any]:
    return Containerizer(None, daemon.work).config(gpus=gpus, image=False)  # type: ignore[arg-type]


def grpc_prepare(stub: pb_grpc.IsolatorStub, name: str, config: dict[str, Any], timeout: float) -> Any:
    request = json_format.ParseDict(
        {"container_id": container_id(name), "container_config": config},
        pb.PrepareRequest(),
        ignore_unknown_fields=True,
    )
    return stub.Prepare.future(request, timeout=timeout, metadata=deadline_metadata(timeout))


def grpc_cleanup(stub: pb_grpc.IsolatorStub, name: str) -> Any:
    request = pb.CleanupRequest(container_id=pb.ContainerID(value=name))
    return stub.Cleanup.future(request, timeout=WAIT, metadata=deadline_metadata(WAIT))


@pytest.fixture
def bridges(sidecar, install_bridge, tmp_path) -> Callable[[float], str]:
    """Bridge executables (Python or compiled) installed against the daemon, with a given timeout."""

    def install(timeout: float) -> str:
        directory = str(tmp_path / f"bin-{timeout:g}")
        install_bridge(directory, socket_path=sidecar.bridge_socket, timeout=timeout)
        return directory

    return install


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_the_issues_story_a_bridge_prepare_that_gave_up_while_the_sidecar_was_stopped_books_nothing(sidecar, bridges):
    """Issue 33's story on the bridge: prepare gpus:2 times out against a stopped sidecar, the agent
    runs cleanup, the sidecar is continued; then every GPU is free for the next task (the issue's
    gpus:7 failed)."""
    name = f"story-{os.urandom(3).hex()}"
    quick, patient = bridges(1.0), bridges(WAIT)
    body = {"container_id": container_id(name), "container_config": mesos_config(sidecar, 2)}
    with sidecar.frozen():
        status, _, err = run_bridge(quick, "prepare", body)
        assert status == 4 and "no answer from the sidecar" in err, err  # EXIT_DEADLINE, as the agent saw
        cleanup, cleaned = in_background(lambda: run_bridge(patient, "cleanup", {"container_id": container_id(name)}))
    cleanup.join(WAIT)
    assert cleaned and cleaned[0][0] == 0, cleaned
    outcome = settled(sidecar, name)
    assert "prepared container" not in outcome, outcome
    assert name not in holdings(sidecar)
    big = f"big-{name}"
    status, _, err = run_bridge(
        patient, "prepare", {"container_id": container_id(big), "container_config": mesos_config(sidecar, 8)}
    )
    assert status == 0, err
    assert holdings(sidecar)[big] == list(range(8))
    assert run_bridge(patient, "cleanup", {"container_id": container_id(big)})[0] == 0


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_bridge_prepare_read_after_its_callers_deadline_is_answered_deadline_exceeded_unserved(sidecar, bridges):
    """The deadline alone (no cleanup follows, so no tombstone helps): the bridge's absolute deadline
    reaches the sidecar, which refuses the call it reads too late."""
    name = f"late-{os.urandom(3).hex()}"
    body = {"container_id": container_id(name), "container_config": mesos_config(sidecar, 2)}
    with sidecar.frozen():
        status, _, err = run_bridge(bridges(1.0), "prepare", body)
    assert status == 4, err
    outcome = settled(sidecar, name)
    assert f"Prepare of container {name} not run: its caller's deadline passed" in outcome, outcome
    assert name not in holdings(sidecar)


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_grpc_prepare_that_gave_up_while_the_sidecar_was_stopped_books_nothing(sidecar):
    """gRPC sends its deadline relative, so the stopped sidecar would count it from the thaw; the
    absolute one our clients send beside it (``client.DEADLINE_METADATA``) expires the call. (The
    client's cancellation reaches the sidecar too, on thaw, and won the race against the worker in
    every run on the code before, where this test passes; the race is forced in-process above.) A
    later call on the same connection, with the one worker, is answered only once the stale one is
    settled."""
    name = f"late-grpc-{os.urandom(3).hex()}"
    with grpc.insecure_channel(sidecar.address) as channel:
        stub = pb_grpc.IsolatorStub(channel)
        grpc_prepare(stub, f"warm-{name}", mesos_config(sidecar, 0), WAIT).result()  # the connection is up
        with sidecar.frozen():
            late = grpc_prepare(stub, name, mesos_config(sidecar, 2), 1.0)
            with pytest.raises(grpc.RpcError) as gave_up:
                late.result()
            assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        grpc_prepare(stub, f"after-{name}", mesos_config(sidecar, 0), WAIT).result()
        try:
            assert name not in holdings(sidecar)
            assert f"prepared container {name} " not in full_log(sidecar)
        finally:
            for done in (f"warm-{name}", f"after-{name}", name):
                grpc_cleanup(stub, done).result()


def bridge_send(path: str, method: str, body: dict[str, Any]) -> socket.socket:
    """One request on the bridge socket as a bridge from before deadlines sends it (version 1: still
    served; the deadline is not what these tests are about), a minute to live; the write side shut.
    Connecting and sending succeed while the sidecar is stopped (the accept queue and the socket's
    buffer hold them), in the order sent."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(WAIT)
    sock.connect(path)
    header = b"gpu-isolator-bridge/1 %s %d\n" % (method.encode(), WAIT * 1000)
    sock.sendall(header + json.dumps(body).encode())
    sock.shutdown(socket.SHUT_WR)
    return sock


def bridge_reply(sock: socket.socket) -> bytes:
    with sock:
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


FILLERS = 4


@pytest.mark.root
@pytest.mark.cgroup_v1
@pytest.mark.parametrize("route", [GRPC, BRIDGE])
def test_a_cleanup_that_overtakes_its_containers_queued_prepare_leaves_nothing_booked(sidecar, route):
    """Under load (the one worker busy with earlier Prepares), a Cleanup is run first, on its own
    lane, across containers by design: the same container's Prepare queued before it must then not
    book anything. Sent in this order while the sidecar is stopped: fillers, Prepare(c), Cleanup(c)."""
    tag = os.urandom(3).hex()
    name, fillers = f"overtaken-{tag}", [f"filler-{tag}-{i}" for i in range(FILLERS)]
    zero, two = mesos_config(sidecar, 0), mesos_config(sidecar, 2)
    with grpc.insecure_channel(sidecar.address) as channel:
        stub = pb_grpc.IsolatorStub(channel)
        grpc_prepare(stub, f"warm-{name}", zero, WAIT).result()
        try:
            with sidecar.frozen():
                if route == GRPC:
                    calls = [grpc_prepare(stub, f, zero, WAIT) for f in fillers]
                    prepare = grpc_prepare(stub, name, two, WAIT)
                    cleanup = grpc_cleanup(stub, name)
                else:
                    path = sidecar.bridge_socket
                    socks = [
                        bridge_send(path, "prepare", {"container_id": container_id(f), "container_config": zero})
                        for f in fillers
                    ]
                    prepare_sock = bridge_send(
                        path, "prepare", {"container_id": container_id(name), "container_config": two}
                    )
                    cleanup_sock = bridge_send(path, "cleanup", {"container_id": container_id(name)})
            if route == GRPC:
                cleanup.result()
                for call in calls:
                    call.result()
                try:
                    prepare.result()
                    answer = "OK"
                except grpc.RpcError as exc:
                    answer = f"{exc.code().name} {exc.details()}"
            else:
                assert bridge_reply(cleanup_sock) == b"OK\n"
                for sock in socks:
                    assert bridge_reply(sock).startswith(b"OK\n")
                answer = bridge_reply(prepare_sock).decode().removeprefix("ERROR ").strip()
            settled(sidecar, name)
            # Either the Prepare ran before the Cleanup (which then freed it), or it was refused.
            assert answer.startswith("OK") or (
                answer.startswith("FAILED_PRECONDITION") and "was cleaned up" in answer
            ), answer
            assert name not in holdings(sidecar), f"GPUs booked for a cleaned-up container (Prepare answered {answer})"
        finally:
            for done in (f"warm-{name}", *fillers, name):
                grpc_cleanup(stub, done).result()


@pytest.mark.root
@pytest.mark.cgroup_v1
@pytest.mark.parametrize("route", [GRPC, BRIDGE])
def test_a_prepare_after_its_containers_cleanup_is_refused(sidecar, route):
    """The tombstone: Mesos never reuses a container ID, so a Prepare for one cleaned up is stale."""
    name = f"tomb-{os.urandom(3).hex()}"
    body = {"container_id": container_id(name), "container_config": mesos_config(sidecar, 1)}
    with grpc.insecure_channel(sidecar.address) as channel:
        stub = pb_grpc.IsolatorStub(channel)
        grpc_cleanup(stub, name).result()  # the agent's cleanup of a prepare that failed (never arrived)
        try:
            if route == GRPC:
                with pytest.raises(grpc.RpcError) as refused:
                    grpc_prepare(stub, name, body["container_config"], WAIT).result()
                answer = f"{refused.value.code().name} {refused.value.details()}"
            else:
                answer = bridge_reply(bridge_send(sidecar.bridge_socket, "prepare", body)).decode()
                answer = answer.removeprefix("ERROR ").strip()
            assert answer == (
                f"FAILED_PRECONDITION container {name} was cleaned up; a Prepare after its Cleanup is stale"
                " and is refused (Mesos never reuses a container ID)"
            )
            assert name not in holdings(sidecar)
        finally:
            grpc_cleanup(stub, name).result()
