"""Serving under load (issue 17): Watch as a wait on an event, and bounds that keep one caller from
starving another. Functional checks only (no timing asserted); the figures are in `make bench`'s
load part (scripts/bench_load.py). Hogs are real processes, run as ``nobody`` (setpriv) where the
test is about another user.
"""

from __future__ import annotations

import grp
import os
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import paths
import pytest
from invariants import proc_status, watch_checks

from isolator.bridge import command as bridge
from isolator.daemon.config import Config
from isolator.model import ContainerId
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing import StubService
from isolator.testing.mesos import GrpcIsolator, container_id
from isolator.testing.sidecar import running_sidecar
from isolator.transport import bridge as bridge_server
from isolator.transport import peergate
from isolator.transport.server import SidecarServer
from isolator.transport.settings import ServerSettings

NOBODY = 65534
ROOT = paths.ROOT


def gpus(n: int) -> dict[str, object]:
    return {"resources": [{"name": "gpus", "type": "SCALAR", "scalar": {"value": n}, "role": "*"}]}


def until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def held_minor(channel: grpc.Channel, value: str) -> int:
    admin = pb_grpc.AdminStub(channel)
    listed = admin.ListContainers(pb.ListContainersRequest(), timeout=10).containers
    return next(c for c in listed if c.container_id.value == value).gpu_minors[0]


def index_of(channel: grpc.Channel, minor: int) -> int:
    gpus_ = pb_grpc.AdminStub(channel).ListGpus(pb.ListGpusRequest(), timeout=10).gpus
    return next(g.index for g in gpus_ if g.minor == minor)


# ---- Watch ----------------------------------------------------------------------------------------


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_watch_without_a_deadline_waits_and_answers_the_limitation_when_an_xid_hits_its_gpu(short_tmp):
    # What a Mesos agent does: its watch "never completes" unless a limitation fires.
    metrics = os.path.join(short_tmp, "m.sock")
    with running_sidecar("dgx-1", "v1", extra=("--metrics-address", f"unix:{metrics}")) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        channel = grpc.insecure_channel(sidecar.address)
        try:
            isolator.prepare(container_id("held"), gpus(1))
            future = pb_grpc.IsolatorStub(channel).Watch.future(
                pb.WatchRequest(container_id=pb.ContainerID(value="held"))
            )
            # Its first check has run and found nothing to answer: it waits (it used to fail at once: INTERNAL).
            until(lambda: watch_checks(metrics) + watch_checks(metrics, "error") >= 1)
            assert watch_checks(metrics, "error") == 0
            assert not future.done(), future.exception()
            sidecar.sim.inject_xid(index_of(channel, held_minor(channel, "held")), 79)
            reply = future.result(timeout=30)
            assert reply.HasField("limitation") and reply.limitation.message, reply
        finally:
            isolator.cleanup(container_id("held"))
            isolator.close()
            channel.close()


@pytest.mark.root
@pytest.mark.cgroup_v1
@pytest.mark.xdist_group("measures")  # reads a process's memory or threads: its own worker, one at a time
def test_open_watches_take_no_worker_so_health_and_hooks_answer_and_cancelling_them_frees_everything(short_tmp):
    # Four workers; 64 open Watch calls used to take every one of them (16 did by default).
    metrics = os.path.join(short_tmp, "m.sock")
    flags = ("--max-workers", "4", "--metrics-address", f"unix:{metrics}")
    with running_sidecar("dgx-1", "v1", extra=flags) as sidecar:
        assert sidecar.proc is not None
        isolator = GrpcIsolator(sidecar.socket)
        channel = grpc.insecure_channel(sidecar.address)
        stub, admin = pb_grpc.IsolatorStub(channel), pb_grpc.AdminStub(channel)
        try:
            isolator.prepare(container_id("watched"), gpus(1))
            admin.Health(pb.HealthRequest(), timeout=10)
            threads = proc_status(sidecar.proc.pid, "Threads")
            request = pb.WatchRequest(container_id=pb.ContainerID(value="watched"))
            watches = [stub.Watch.future(request) for _ in range(64)]
            until(lambda: watch_checks(metrics) >= 64)  # every one checked once, and open
            assert not any(w.done() for w in watches)
            for _ in range(5):
                admin.Health(pb.HealthRequest(), timeout=10)
            isolator.prepare(container_id("other"), gpus(1))
            isolator.cleanup(container_id("other"))
            # No thread per open Watch: at most the four workers (started on demand) and a couple more.
            assert proc_status(sidecar.proc.pid, "Threads") <= threads + 4 + 2
            for w in watches:
                w.cancel()
            assert all(w.cancelled() for w in watches)
            until(lambda: proc_status(sidecar.proc.pid, "Threads") <= threads + 4 + 2)
            admin.Health(pb.HealthRequest(), timeout=10)
        finally:
            isolator.cleanup(container_id("watched"))
            isolator.close()
            channel.close()


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_an_open_watch_ends_when_its_container_is_cleaned_up_and_when_the_sidecar_stops(short_tmp):
    metrics = os.path.join(short_tmp, "m.sock")
    with running_sidecar("dgx-1", "v1", extra=("--metrics-address", f"unix:{metrics}")) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        channel = grpc.insecure_channel(sidecar.address)
        stub = pb_grpc.IsolatorStub(channel)
        try:
            isolator.prepare(container_id("gone"), gpus(1))
            isolator.prepare(container_id("stays"), gpus(1))
            gone = stub.Watch.future(pb.WatchRequest(container_id=pb.ContainerID(value="gone")))
            stays = stub.Watch.future(pb.WatchRequest(container_id=pb.ContainerID(value="stays")))
            until(lambda: watch_checks(metrics) >= 2)  # both open before the cleanup
            isolator.cleanup(container_id("gone"))
            with pytest.raises(grpc.RpcError) as ended:
                gone.result(timeout=30)
            assert ended.value.code() == grpc.StatusCode.NOT_FOUND
            assert not stays.done()
            assert sidecar.terminate() == 0, sidecar.log()
            with pytest.raises(grpc.RpcError) as stopped:
                stays.result(timeout=30)
            assert stopped.value.code() == grpc.StatusCode.UNAVAILABLE, stopped.value
        finally:
            isolator.close()
            channel.close()


# ---- connections and the bridge under another user's load -----------------------------------------


class RecordingService(StubService):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def cleanup(self, container_id: ContainerId) -> None:
        self.calls.append(str(container_id))


@pytest.fixture
def open_server(short_tmp):
    os.chmod(short_tmp, 0o755)  # nobody reaches the sockets; their mode and the gates decide the rest
    made: list[SidecarServer] = []

    def serve(**kwargs: object) -> tuple[SidecarServer, RecordingService]:
        cfg = ServerSettings(
            socket=os.path.join(short_tmp, "s.sock"), socket_mode=0o660, socket_group="nogroup", **kwargs
        )  # type: ignore[arg-type]
        service = RecordingService()
        server = SidecarServer(cfg, service)
        server.start()
        made.append(server)
        return server, service

    yield serve
    for server in made:
        server.stop(grace=0)


# Held by the hog (run as nobody): idle gRPC-socket connections, and bridge connections that trickle
# a byte every quarter second and never finish their request. It says "held" once every connection
# is open, and "trickled" once a few bytes went down each bridge connection.
HOG = textwrap.dedent(
    """
    import socket, sys, time
    grpc_path, bridge_path, idle, trickling = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    held, slow = [], []
    for _ in range(idle):
        s = socket.socket(socket.AF_UNIX); s.connect(grpc_path); held.append(s)
    for _ in range(trickling):
        s = socket.socket(socket.AF_UNIX); s.connect(bridge_path); s.setblocking(False); slow.append(s)
    print("held", flush=True)
    rounds = 0
    while True:
        for s in slow:
            try:
                s.send(b"g")
            except OSError:
                pass
        rounds += 1
        if rounds == 3:
            print("trickled", flush=True)
        time.sleep(0.25)
    """
)


def cleanup_over_the_bridge(short_tmp: str, bridge_path: str, value: str) -> subprocess.CompletedProcess[bytes]:
    directory = os.path.join(short_tmp, "bin")
    bridge.install(directory, socket_path=bridge_path)
    payload = os.path.join(short_tmp, "in.json")
    with open(payload, "w") as fh:
        fh.write(f'{{"container_id": {{"value": "{value}"}}}}')
    out, err = os.path.join(short_tmp, "out"), os.path.join(short_tmp, "err")
    run = subprocess.run(
        [os.path.join(directory, "gpu-isolator-cleanup"), payload, out, err],
        capture_output=True,
        timeout=60,
        env={"PATH": os.environ.get("PATH", ""), bridge.TIMEOUT_ENV: "20"},
    )
    if run.returncode and os.path.exists(err):
        with open(err, "rb") as fh:
            run.stderr += fh.read()
    return run


@pytest.mark.root
@pytest.mark.parametrize("hog_allowed", [True, False], ids=["hog-allowed", "hog-denied"])
def test_another_users_idle_connections_and_trickling_bridge_clients_do_not_starve_the_agent(
    open_server, short_tmp, hog_allowed
):
    allowed = (0, NOBODY) if hog_allowed else (0,)
    server, service = open_server(allowed_uids=allowed)
    nogroup = grp.getgrnam("nogroup").gr_gid
    hog = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={nogroup}",
            "--clear-groups",
            sys.executable,
            "-c",
            HOG,
            server.settings.socket,
            server.settings.bridge_path,
            "300",
            "300",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
        assert hog.stdout.readline().strip() == "trickled"  # a few bytes went down each bridge connection
        with grpc.insecure_channel(server.address) as ch:
            pb_grpc.IsolatorStub(ch).Cleanup(pb.CleanupRequest(container_id=pb.ContainerID(value="grpc")), timeout=20)
        run = cleanup_over_the_bridge(short_tmp, server.settings.bridge_path, "bridge")
        assert run.returncode == 0, run.stderr
        assert service.calls == ["grpc", "bridge"]
        assert server._gate is not None
        allowed_now, denied_now = server._gate.connections()
        if hog_allowed:
            assert allowed_now <= server.settings.max_connections * peergate.UID_SHARE + 1
        else:
            assert denied_now <= peergate.MAX_DENIED_CONNECTIONS
        assert server._bridge is not None
        slots = server._bridge.slots()
        assert slots["refusal"] <= bridge_server.MAX_REFUSALS
        if not hog_allowed:
            assert slots["connection"] == 0  # the peer is checked before a slot
    finally:
        hog.kill()
        hog.wait()


@pytest.mark.root
def test_a_connection_over_a_uids_share_is_answered_resource_exhausted_not_dropped(open_server):
    server, service = open_server(max_connections=4)  # root may hold 2
    own = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel, not one shared
    cleanup = pb.CleanupRequest(container_id=pb.ContainerID(value="c"))
    held = []
    try:
        for _ in range(2):
            ch = grpc.insecure_channel(server.address, options=own)
            grpc.channel_ready_future(ch).result(timeout=10)
            held.append(ch)
        with grpc.insecure_channel(server.address, options=own) as extra, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.IsolatorStub(extra).Cleanup(cleanup, timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        assert "share" in refused.value.details()
        # Load shedding says "retry" in gRPC's standard way (a final RESOURCE_EXHAUSTED does not).
        assert dict(refused.value.trailing_metadata() or ()).get("grpc-retry-pushback-ms") == "20"
        assert service.calls == []
    finally:
        for ch in held:
            ch.close()
    # Once the held connections close, the share frees up.
    until(lambda: server._gate is not None and server._gate.connections()[0] == 0)
    with grpc.insecure_channel(server.address, options=own) as ch:
        pb_grpc.IsolatorStub(ch).Cleanup(cleanup, timeout=10)
    assert service.calls == ["c"]


@pytest.mark.root
def test_a_bridge_client_trickling_past_its_deadline_loses_its_slot(short_tmp):
    os.chmod(short_tmp, 0o755)
    cfg = ServerSettings(socket=os.path.join(short_tmp, "s.sock"))
    server = SidecarServer(cfg, RecordingService())
    server.start()
    try:
        assert server._bridge is not None
        bridge_ = server._bridge
        bridge_._io_timeout = 1.0  # the per-connection deadline (10 s by default)
        # The slot is held for only that second: rather than polling for it (a loaded machine may
        # not look within the second), every slot taken is recorded.
        taken: list[str] = []
        real_take = bridge_._slots.take

        def take(allowed: bool, uid: int) -> tuple[str, str, bool]:
            kind, why, got = real_take(allowed, uid)
            if got:
                taken.append(kind)
            return kind, why, got

        bridge_._slots.take = take  # type: ignore[method-assign]
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.connect(cfg.bridge_path)
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.2):
                try:
                    s.send(b"g")  # a byte at a time, always within any per-read timeout
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        # Cut at the overall deadline although bytes keep coming: the server closes the connection
        # (with the trickled bytes unread, the close may reach this end as a reset), without an answer.
        s.settimeout(60)
        try:
            assert s.recv(4096) == b"", "the server answered a request that never finished"
        except ConnectionResetError:
            pass
        stop.set()
        s.close()
        assert taken == ["allowed"]
        until(lambda: bridge_.slots()["connection"] == 0)  # and the slot is given back
    finally:
        server.stop(grace=0)


# ---- memory ---------------------------------------------------------------------------------------


def large_config(size: int) -> pb.ContainerConfig:
    """A ContainerConfig about ``size`` bytes, its bulk a Docker manifest's Env as Mesos sends it."""
    config = pb.ContainerConfig(directory="/var/lib/mesos/slaves/S0/frameworks/F0/executors/e/runs/r")
    variable = "X" * 200
    config.docker.manifest.config.Env.extend(f"VAR_{i}={variable}" for i in range(size // 210))
    return config


@pytest.mark.root
@pytest.mark.cgroup_v1
@pytest.mark.xdist_group("measures")  # reads a process's memory or threads: its own worker, one at a time
def test_concurrent_requests_of_the_largest_allowed_size_do_not_balloon_memory():
    with running_sidecar("dgx-1", "v1") as sidecar:
        assert sidecar.proc is not None
        pid = sidecar.proc.pid
        channel = grpc.insecure_channel(sidecar.address, options=[("grpc.max_send_message_length", 8 * 1024 * 1024)])
        stub = pb_grpc.IsolatorStub(channel)
        try:
            config = large_config(Config().max_message_bytes - 4096)
            # A request over the limit is refused, as before; the limit is 256 KiB now, not 4 MiB.
            with pytest.raises(grpc.RpcError) as too_big:
                stub.Prepare(
                    pb.PrepareRequest(container_id=pb.ContainerID(value="big"), container_config=large_config(1 << 20)),
                    timeout=20,
                )
            assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            pb_grpc.AdminStub(channel).Health(pb.HealthRequest(), timeout=10)
            rest = proc_status(pid, "VmRSS")
            for wave in range(3):
                futures = [
                    stub.Prepare.future(
                        pb.PrepareRequest(container_id=pb.ContainerID(value=f"m{wave}-{i}"), container_config=config),
                        timeout=60,
                    )
                    for i in range(100)
                ]
                codes = []
                for f in futures:
                    try:
                        f.result()
                        codes.append("OK")
                    except grpc.RpcError as exc:
                        codes.append(exc.code().name)
                # Every one answered: done, or refused for load (never dropped).
                assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, set(codes)
                for i, code in enumerate(codes):
                    if code == "OK":
                        stub.Cleanup(pb.CleanupRequest(container_id=pb.ContainerID(value=f"m{wave}-{i}")), timeout=20)
            peak = proc_status(pid, "VmHWM")
            # 100 requests of 256 KiB are 25 MiB; today's daemon peaked at 2.5 GiB with 4 MiB ones.
            assert peak - rest < 200 * 1024, (rest, peak)
            until(lambda: proc_status(pid, "VmRSS") - rest < 64 * 1024)
        finally:
            channel.close()
