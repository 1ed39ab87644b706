from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from isolator.errors import SocketError
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing import StubService, forkserver
from isolator.testing.cgroupfs import TEST_PARENT, unique_name
from isolator.transport.server import SidecarServer
from isolator.transport.settings import ServerSettings


@pytest.fixture
def server(short_tmp):
    srv = SidecarServer(ServerSettings(socket=os.path.join(short_tmp, "run", "s.sock")), StubService())
    srv.start()
    yield srv
    srv.stop(grace=0)


@pytest.fixture
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


def test_health_service_answers_serving_for_the_server_and_each_service(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", "gpuisolator.v1.Isolator", "gpuisolator.v1.Admin"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name


def test_reflection_lists_isolator_admin_and_health(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30)
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"gpuisolator.v1.Isolator", "gpuisolator.v1.Admin", "grpc.health.v1.Health"} <= names


def _reflect(channel, version: str, request):
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return next(iter(call(iter([request]), timeout=30)))


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_describes_every_service_and_method_in_both_versions(channel, version):
    """What `grpcurl describe` does: list the services, fetch the file of each service and of each
    method by symbol, build a pool from the answers and resolve every method's messages there."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    listed = _reflect(channel, version, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert names == {
        "gpuisolator.v1.Isolator",
        "gpuisolator.v1.Admin",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    described = 0
    for name in sorted(names):
        pool = descriptor_pool.DescriptorPool()
        reply = _reflect(channel, version, reflection_pb2.ServerReflectionRequest(file_containing_symbol=name))
        assert not reply.HasField("error_response"), (name, reply.error_response)
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(b)
            for b in reply.file_descriptor_response.file_descriptor_proto
        ]
        for proto in reversed(files):  # dependencies last in the answer, first into the pool
            pool.Add(proto)
        service = pool.FindServiceByName(name)
        assert service.methods
        for method in service.methods:
            by_method = _reflect(
                channel, version, reflection_pb2.ServerReflectionRequest(file_containing_symbol=method.full_name)
            )
            assert not by_method.HasField("error_response"), (method.full_name, by_method.error_response)
            assert pool.FindMessageTypeByName(method.input_type.full_name)
            assert pool.FindMessageTypeByName(method.output_type.full_name)
            described += 1
    assert described >= 20
    missing = _reflect(channel, version, reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.Such"))
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_socket_is_born_0600_and_its_directory_is_created(server):
    st = os.stat(server.settings.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600


# Hooks answer UNIMPLEMENTED until a later change implements them; this list shrinks as they land.
UNIMPLEMENTED = [
    ("Isolator", "Recover", pb.RecoverRequest()),
    ("Isolator", "Prepare", pb.PrepareRequest(container_id=pb.ContainerID(value="c1"))),
    ("Isolator", "Isolate", pb.IsolateRequest(container_id=pb.ContainerID(value="c1"), pid=1)),
    ("Isolator", "Watch", pb.WatchRequest(container_id=pb.ContainerID(value="c1"))),
    ("Isolator", "Update", pb.UpdateRequest(container_id=pb.ContainerID(value="c1"))),
    ("Isolator", "Usage", pb.UsageRequest(container_id=pb.ContainerID(value="c1"))),
    ("Isolator", "Status", pb.StatusRequest(container_id=pb.ContainerID(value="c1"))),
    ("Isolator", "Cleanup", pb.CleanupRequest(container_id=pb.ContainerID(value="c1"))),
    ("Admin", "ListContainers", pb.ListContainersRequest()),
    ("Admin", "DescribeContainer", pb.DescribeContainerRequest(container_id=pb.ContainerID(value="c1"))),
    ("Admin", "Volume", pb.VolumeRequest()),
    ("Admin", "Health", pb.HealthRequest()),
    ("Admin", "Release", pb.ReleaseRequest(container_id=pb.ContainerID(value="c1"))),
    ("Admin", "Audit", pb.AuditRequest()),
]


@pytest.mark.parametrize(("service", "method", "request_"), UNIMPLEMENTED, ids=[m for _, m, _ in UNIMPLEMENTED])
def test_hooks_not_yet_built_answer_unimplemented(channel, service, method, request_):
    stub = pb_grpc.IsolatorStub(channel) if service == "Isolator" else pb_grpc.AdminStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(request_, timeout=30)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert method in info.value.details()


@pytest.mark.parametrize(
    "value",
    ["", ".", "..", "a/b", "../etc", "nul\0byte", "tab\there", "x" * 256, "back\\slash"],
)
def test_malformed_container_ids_are_invalid_argument_before_any_hook_runs(channel, value):
    stub = pb_grpc.IsolatorStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Cleanup(pb.CleanupRequest(container_id=pb.ContainerID(value=value)), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid container ID" in info.value.details()


def test_stale_socket_from_a_crash_is_replaced(short_tmp):
    path = os.path.join(short_tmp, "s.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()  # bound but never listening: what a killed server leaves behind
    srv = SidecarServer(ServerSettings(socket=path), StubService())
    srv.start()
    try:
        with grpc.insecure_channel(srv.address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop(grace=0)
    assert not os.path.exists(path)


def test_live_socket_is_not_stolen(server):
    second = SidecarServer(ServerSettings(socket=server.settings.socket), StubService())
    with pytest.raises(SocketError, match="holds it and serves there"):
        second.start()
    with grpc.insecure_channel(server.address) as ch:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)


def test_live_socket_of_a_foreign_server_is_not_replaced(short_tmp):
    path = os.path.join(short_tmp, "s.sock")
    other = socket.socket(socket.AF_UNIX)
    other.bind(path)
    other.listen(1)
    try:
        with pytest.raises(SocketError, match="a live server answers on it"):
            SidecarServer(ServerSettings(socket=path), StubService()).start()
        assert os.path.exists(path)
        assert not os.path.exists(path + ".lock")
    finally:
        other.close()


def test_regular_file_at_socket_path_is_refused_and_kept(short_tmp):
    path = os.path.join(short_tmp, "s.sock")
    with open(path, "w") as fh:
        fh.write("precious")
    with pytest.raises(SocketError, match="it exists and is a regular file"):
        SidecarServer(ServerSettings(socket=path), StubService()).start()
    with open(path) as fh:
        assert fh.read() == "precious"


def test_socket_directory_that_cannot_be_made_is_refused_and_nothing_is_left(short_tmp):
    blocker = os.path.join(short_tmp, "file")
    open(blocker, "w").close()
    with pytest.raises(SocketError, match="is not a directory"):
        SidecarServer(ServerSettings(socket=os.path.join(blocker, "sub", "s.sock")), StubService()).start()
    assert os.listdir(short_tmp) == ["file"]


@pytest.mark.root
def test_socket_directory_on_a_read_only_mount_is_refused(short_tmp):
    ro = os.path.join(short_tmp, "ro")
    os.mkdir(ro)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", ro], check=True)
    try:
        with pytest.raises(SocketError, match=r"directory '.*/ro' is on a read-only file system"):
            SidecarServer(ServerSettings(socket=os.path.join(ro, "s.sock")), StubService()).start()
    finally:
        subprocess.run(["umount", ro], check=True)


def _cli(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return forkserver.run([sys.executable, "-m", "isolator", *argv], timeout=timeout)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("serve", "--no-such-flag"), "unrecognized arguments: --no-such-flag"),
        (("serve", "--mode"), "expected one argument"),
        (("frobnicate",), "invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_exit_2_with_one_line(argv, expected):
    result = _cli(*argv)
    assert result.returncode == 2
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_serve_errors_exit_1_or_78_with_one_line(short_tmp):
    """A runtime failure exits 1; a configuration error 78 (EX_CONFIG), which systemd does not retry."""
    bad = os.path.join(short_tmp, "bad.toml")
    with open(bad, "w") as fh:
        fh.write("[[[")
    for argv, expected, code in [
        (("serve", "--config", bad), "failed to parse config file", 78),
        # --work-dir: the machine's default state dir is not this test's to open (nor to create).
        (
            ("serve", "--resources", "gpus:0", "--work-dir", short_tmp, "--socket", "/proc/version/s.sock"),
            "is not a directory",
            1,
        ),
        (("serve", "--simulate", "x", "--nvml-library", "y"), "contradict", 78),
    ]:
        result = _cli(*argv)
        assert result.returncode == code, (argv, result.stderr)
        assert expected in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr


def test_serve_answers_health_and_stops_cleanly_on_sigterm(short_tmp):
    path = os.path.join(short_tmp, "s.sock")
    argv = [sys.executable, "-m", "isolator", "serve", "--socket", path, "--work-dir", short_tmp]
    argv += ["--resources", "gpus:0", "--cgroups-root", unique_name(TEST_PARENT)]  # one daemon per root (issue 33)
    proc = subprocess.Popen(
        argv,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with grpc.insecure_channel("unix:" + path) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "received SIGTERM" in proc.stderr.read()
    assert not os.path.exists(path)
    assert not os.path.exists(path + ".lock")


def test_admin_command_against_a_sidecar_that_is_down_exits_3_naming_the_socket(short_tmp):
    path = os.path.join(short_tmp, "absent.sock")
    # It fails at once rather than waiting out its deadline: with a --timeout of 600 s, a command
    # that waited would be killed by _cli's 120 s (a hang, not a timing: a loaded machine's
    # start-up takes seconds, not minutes), and the message is "cannot reach", not "did not answer".
    result = _cli("gpus", "--socket", path, "--timeout", "600", timeout=120)
    assert result.returncode == 3
    assert path in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "did not answer" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: open(p, "w").close(), "it exists and is a regular file; remove it or choose another path"),
        (os.mkdir, "is a directory; the socket option takes the socket's own path, e.g. '{p}/isolator.sock'"),
    ],
    ids=["file", "directory"],
)
def test_a_socket_path_that_is_a_file_or_a_directory_is_refused_saying_what_it_is(short_tmp, make, expected):
    path = os.path.join(short_tmp, "taken")
    make(path)
    result = _cli("serve", "--resources", "gpus:0", "--socket", path, "--work-dir", short_tmp)
    assert result.returncode == 1
    assert expected.format(p=path) in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert os.path.exists(path) and not os.path.exists(path + ".lock")


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon"])
def test_admin_timeout_must_be_a_positive_number_of_seconds(value):
    result = _cli("gpus", "--timeout", value, "--socket", "/nonexistent/s.sock")
    assert result.returncode == 2
    assert (
        result.stderr.strip() == f"gpu-isolator gpus: argument --timeout: '{value}' is not a number of seconds above 0"
    )


def test_a_lock_file_planted_as_a_symlink_is_refused_and_its_target_left_alone(short_tmp):
    # A local user who can write the socket's directory plants <socket>.lock -> a file of root's
    # choosing; the daemon, as root, must neither create nor open what the link names.
    path = os.path.join(short_tmp, "s.sock")
    victim = os.path.join(short_tmp, "victim")
    os.symlink(victim, path + ".lock")
    with pytest.raises(SocketError, match="is a symbolic link"):
        SidecarServer(ServerSettings(socket=path), StubService()).start()
    assert not os.path.lexists(victim) and os.path.islink(path + ".lock")
    with open(victim, "w") as fh:
        fh.write("precious")
    with pytest.raises(SocketError, match="is a symbolic link"):
        SidecarServer(ServerSettings(socket=path), StubService()).start()
    with open(victim) as fh:
        assert fh.read() == "precious"


def test_a_lock_file_that_is_not_a_regular_file_is_refused(short_tmp):
    path = os.path.join(short_tmp, "s.sock")
    os.mkfifo(path + ".lock")
    with pytest.raises(SocketError, match="not a regular file"):
        SidecarServer(ServerSettings(socket=path), StubService()).start()
