"""Who may call the sidecar: the socket's mode and group, and the gate's SO_PEERCRED allow-list.

Unprivileged callers are real processes run as ``nobody`` (setpriv), with the socket's mode and
group opened just enough to let them connect, so that each refusal seen is the sidecar's own.
"""

from __future__ import annotations

import grp
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap

import grpc
import paths
import pytest

from isolator.daemon import config as configmod
from isolator.errors import ConfigError, SocketError
from isolator.model import ContainerId
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing import StubService
from isolator.transport import peergate
from isolator.transport.server import SidecarServer
from isolator.transport.settings import ServerSettings

NOBODY = 65534

# Runs as the unprivileged caller: one Cleanup call (or a raw oversized one), prints the outcome.
CALLER = textwrap.dedent(
    """
    import json, sys, grpc
    from isolator.rpc import isolator_pb2 as pb, isolator_pb2_grpc as pb_grpc
    path, size = sys.argv[1], int(sys.argv[2])
    with grpc.insecure_channel("unix:" + path) as ch:
        try:
            if size:
                ch.unary_unary("/gpuisolator.v1.Isolator/Cleanup")(b"\\x0a" + b"\\xff" * size, timeout=10)
            else:
                pb_grpc.IsolatorStub(ch).Cleanup(
                    pb.CleanupRequest(container_id=pb.ContainerID(value="from-caller")), timeout=10
                )
            print(json.dumps({"code": "OK", "details": ""}))
        except grpc.RpcError as exc:
            print(json.dumps({"code": exc.code().name, "details": exc.details()}))
    """
)


class RecordingService(StubService):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def cleanup(self, container_id: ContainerId) -> None:
        self.calls.append(str(container_id))


def as_user(uid: int, gid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]


def call_as(uid: int, gid: int, path: str, size: int = 0) -> dict[str, str]:
    out = subprocess.run(
        [*as_user(uid, gid), sys.executable, "-c", CALLER, path, str(size)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=paths.ROOT,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def open_dir(short_tmp):
    os.chmod(short_tmp, 0o755)  # let nobody reach the socket; the socket's own mode decides the rest
    return short_tmp


def serve(directory: str, **kwargs: object) -> tuple[SidecarServer, RecordingService]:
    cfg = ServerSettings(socket=os.path.join(directory, "s.sock"), bridge_socket="", **kwargs)  # type: ignore[arg-type]
    service = RecordingService()
    server = SidecarServer(cfg, service)
    server.start()
    return server, service


def nogroup() -> int:
    return grp.getgrnam("nogroup").gr_gid


@pytest.mark.root
def test_caller_outside_the_allow_list_gets_permission_denied_and_the_service_never_runs(open_dir):
    # 0660 with group nogroup: the kernel lets nobody connect, so the refusal is the gate's.
    server, service = serve(open_dir, socket_mode=0o660, socket_group="nogroup")
    try:
        answer = call_as(NOBODY, nogroup(), server.settings.socket)
    finally:
        server.stop(grace=0)
    assert answer["code"] == "PERMISSION_DENIED", answer
    assert f"uid {NOBODY} (gid {nogroup()}) is not allowed" in answer["details"]
    assert service.calls == []


@pytest.mark.root
def test_uid_in_the_allow_list_gets_through(open_dir):
    server, service = serve(open_dir, socket_mode=0o660, socket_group="nogroup", allowed_uids=(0, NOBODY))
    try:
        answer = call_as(NOBODY, nogroup(), server.settings.socket)
    finally:
        server.stop(grace=0)
    assert answer["code"] == "OK", answer
    assert service.calls == ["from-caller"]


@pytest.mark.root
def test_primary_gid_in_the_allow_list_gets_through(open_dir):
    server, service = serve(open_dir, socket_mode=0o660, socket_group="nogroup", allowed_gids=(nogroup(),))
    try:
        answer = call_as(NOBODY, nogroup(), server.settings.socket)
    finally:
        server.stop(grace=0)
    assert answer["code"] == "OK", answer
    assert service.calls == ["from-caller"]


@pytest.mark.root
def test_denied_caller_is_refused_before_its_request_is_read(open_dir):
    # A request far over the deny server's 1 KiB inbox that would not even parse: the answer is
    # still PERMISSION_DENIED, because the refusal comes when the call's headers arrive.
    server, service = serve(open_dir, socket_mode=0o660, socket_group="nogroup")
    try:
        answer = call_as(NOBODY, nogroup(), server.settings.socket, size=100_000)
    finally:
        server.stop(grace=0)
    assert answer["code"] == "PERMISSION_DENIED", answer
    assert service.calls == []


@pytest.mark.root
def test_default_socket_is_0600_root_owned_and_grpc_itself_listens_only_in_a_private_0700_directory(open_dir):
    server, _ = serve(open_dir)
    try:
        st = os.stat(server.settings.socket)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
        private = peergate.private_dir(server.settings.socket)
        pst = os.lstat(private)
        assert stat.S_ISDIR(pst.st_mode) and stat.S_IMODE(pst.st_mode) == 0o700 and pst.st_uid == 0
        assert sorted(os.listdir(private)) == sorted([peergate.ALLOWED_NAME, peergate.DENIED_NAME])
        # nobody can reach neither the public socket (mode) nor the gRPC one (directory).
        for path in (server.settings.socket, os.path.join(private, peergate.ALLOWED_NAME)):
            answer = call_as(NOBODY, NOBODY, path)
            assert answer["code"] == "UNAVAILABLE", (path, answer)
            assert "Permission denied" in answer["details"] or "EACCES" in answer["details"], answer
    finally:
        server.stop(grace=0)
    assert not os.path.exists(private)


@pytest.mark.root
def test_a_flood_of_denied_connections_does_not_lock_out_allowed_callers(open_dir):
    server, service = serve(open_dir, socket_mode=0o660, socket_group="nogroup", max_connections=4)
    hog = subprocess.Popen(
        [
            *as_user(NOBODY, nogroup()),
            sys.executable,
            "-c",
            "import socket, sys\n"
            "conns = []\n"
            "for _ in range(64):\n"
            "    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); conns.append(s)\n"
            "print('held', flush=True); sys.stdin.read()\n",
            server.settings.socket,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
        with grpc.insecure_channel(server.address) as ch:
            pb_grpc.IsolatorStub(ch).Cleanup(pb.CleanupRequest(container_id=pb.ContainerID(value="root")), timeout=10)
        assert service.calls == ["root"]
        assert server._gate is not None
        _allowed, denied = server._gate.connections()
        assert denied <= peergate.MAX_DENIED_CONNECTIONS
    finally:
        hog.kill()
        hog.wait()
        server.stop(grace=0)


@pytest.mark.root
def test_connections_over_the_cap_are_refused_then_closed_and_the_cap_frees_up(open_dir):
    server, _ = serve(open_dir, max_connections=2)  # one uid may hold 1
    try:
        held = []
        # One within the share, then MAX_BUSY_CONNECTIONS spliced to the refusing server (each call
        # on them answers RESOURCE_EXHAUSTED; tests/system/test_load.py), then closed at once.
        for _ in range(1 + peergate.MAX_BUSY_CONNECTIONS):
            s = socket.socket(socket.AF_UNIX)
            s.connect(server.settings.socket)
            held.append(s)
        extra = socket.socket(socket.AF_UNIX)
        extra.connect(server.settings.socket)
        extra.settimeout(10)
        assert extra.recv(1) == b""  # closed by the gate, nothing spliced
        extra.close()
        for s in held:
            s.close()
        with grpc.insecure_channel(server.address) as ch:
            grpc.channel_ready_future(ch).result(timeout=10)
    finally:
        server.stop(grace=0)


def test_the_sidecar_offers_no_tcp_listener():
    # There is no TCP option at all: the one address a config can name is a Unix socket path.
    assert not any("port" in name or "tcp" in name or "tls" in name for name in configmod.PARSERS)


@pytest.mark.root
def test_private_directory_that_is_a_symlink_is_refused(open_dir):
    target = os.path.join(open_dir, "elsewhere")
    os.mkdir(target)
    os.symlink(target, os.path.join(open_dir, "s.sock.d"))
    with pytest.raises(SocketError, match="not a directory owned by us"):
        serve(open_dir)
    assert os.listdir(target) == []
    assert not os.path.exists(os.path.join(open_dir, "s.sock"))


@pytest.mark.root
def test_private_directory_left_by_a_crash_is_taken_over(open_dir):
    private = os.path.join(open_dir, "s.sock.d")
    os.mkdir(private, 0o755)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(os.path.join(private, "grpc"))
    stale.close()
    server, _ = serve(open_dir)
    try:
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
        with grpc.insecure_channel(server.address) as ch:
            grpc.channel_ready_future(ch).result(timeout=10)
    finally:
        server.stop(grace=0)


def test_socket_path_must_leave_room_for_the_private_grpc_sockets():
    assert configmod.PRIVATE_EXTRA == peergate.PRIVATE_EXTRA
    assert configmod.PRIVATE_SUFFIX == peergate.PRIVATE_SUFFIX
    ok = "/tmp/" + "s" * (107 - peergate.PRIVATE_EXTRA - 5)
    configmod.resolve({"socket": ok, "bridge_socket": ""})
    with pytest.raises(ConfigError, match="private gRPC sockets"):
        configmod.resolve({"socket": ok + "s", "bridge_socket": ""})


# ---- both doors: the public socket's gate and the direct socket (<socket>.d/grpc) --------------
# The direct socket admits only the sidecar's own uid (its directory is 0700), whatever the
# allow-list and the public socket's mode say: each case below is asked through both doors.
DOOR_CASES = {
    # name: (server settings, what nobody gets through the gate)
    "default-0600": ({}, "UNAVAILABLE"),
    "0660-not-allowed": ({"socket_mode": 0o660, "socket_group": "nogroup"}, "PERMISSION_DENIED"),
    "0660-uid-allowed": ({"socket_mode": 0o660, "socket_group": "nogroup", "allowed_uids": (0, NOBODY)}, "OK"),
    "0660-gid-allowed": ({"socket_mode": 0o660, "socket_group": "nogroup", "allowed_gids": ("nogroup",)}, "OK"),
}


@pytest.mark.root
@pytest.mark.parametrize("door", ["gate", "direct"])
@pytest.mark.parametrize("case", sorted(DOOR_CASES))
def test_each_door_admits_root_and_only_the_callers_its_rule_names(open_dir, case, door):
    kwargs, through_gate = DOOR_CASES[case]
    kwargs = {k: tuple(nogroup() if g == "nogroup" else g for g in v) if k == "allowed_gids" else v
              for k, v in kwargs.items()}  # fmt: skip
    server, service = serve(open_dir, **kwargs)
    path = server.settings.socket if door == "gate" else peergate.direct_path(server.settings.socket)
    try:
        answer = call_as(NOBODY, nogroup(), path)
        with grpc.insecure_channel("unix:" + path) as ch:
            pb_grpc.IsolatorStub(ch).Cleanup(pb.CleanupRequest(container_id=pb.ContainerID(value="root")), timeout=10)
    finally:
        server.stop(grace=0)
    if door == "direct" or through_gate == "UNAVAILABLE":
        # The kernel refuses the connect: the service never hears of the caller.
        assert answer["code"] == "UNAVAILABLE", answer
        assert "Permission denied" in answer["details"] or "EACCES" in answer["details"], answer
        assert service.calls == ["root"]
    elif through_gate == "OK":
        assert answer["code"] == "OK", answer
        assert service.calls == ["from-caller", "root"]
    else:
        assert answer["code"] == through_gate, answer
        assert service.calls == ["root"]


@pytest.mark.root
def test_the_direct_socket_names_no_caller_so_no_pid_rule_can_trust_one(open_dir):
    # Through the gate the service learns the caller's pid (Isolate's pid rules, admin records);
    # through the direct socket it learns none (0, the model's unknown caller), never a guess.
    seen: list[int] = []

    class Recording(RecordingService):
        def isolate(self, container_id: ContainerId, pid: int, caller: int | None = None) -> None:
            seen.append(-1 if caller is None else caller)

    cfg = ServerSettings(socket=os.path.join(open_dir, "s.sock"), bridge_socket="")
    server = SidecarServer(cfg, Recording())
    server.start()
    try:
        for path in (cfg.socket, peergate.direct_path(cfg.socket)):
            with grpc.insecure_channel("unix:" + path) as ch:
                pb_grpc.IsolatorStub(ch).Isolate(
                    pb.IsolateRequest(container_id=pb.ContainerID(value="c"), pid=os.getpid()), timeout=10
                )
    finally:
        server.stop(grace=0)
    assert seen == [os.getpid(), 0]


def test_the_module_calls_the_direct_socket_where_the_server_listens():
    # mesos/settings.cpp names the direct socket by its own constant; it must be the one gRPC listens on.
    with open(os.path.join(paths.ROOT, "mesos", "settings.cpp")) as f:
        text = f.read()
    assert f'DIRECT_SUFFIX[] = "{peergate.PRIVATE_SUFFIX}/{peergate.ALLOWED_NAME}";' in text
    assert peergate.direct_path("/run/s.sock") == "/run/s.sock" + peergate.PRIVATE_SUFFIX + "/" + peergate.ALLOWED_NAME
