"""Issue 16 item 9: hostile names, pids, JSON and files get a typed refusal with a message, never INTERNAL.

One real sidecar (standalone, v1, simulated DGX-1). Each case was seen giving INTERNAL (or
succeeding) before its fix.
"""

from __future__ import annotations

import json
import os
import socket

import grpc
import pytest
from invariants import quick_sidecar

from isolator.errors import InvalidArgument, SocketError
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing import StubService
from isolator.transport.bridge import PROTOCOL, decode_input
from isolator.transport.server import SidecarServer
from isolator.transport.settings import ServerSettings


def gpus(value: float) -> pb.Resource:
    return pb.Resource(name="gpus", type=pb.Value.SCALAR, scalar=pb.Value.Scalar(value=value), role="*")


class Client:
    def __init__(self, sidecar) -> None:
        self.sidecar = sidecar
        self.channel = grpc.insecure_channel(sidecar.address)
        self.stub = pb_grpc.IsolatorStub(self.channel)

    def call(self, method: str, request) -> tuple[str, str]:
        try:
            getattr(self.stub, method)(request, timeout=30)
            return "OK", ""
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or ""


# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("client",)


@pytest.fixture(scope="module")
def client():
    with quick_sidecar("dgx-1", "v1") as sidecar:
        c = Client(sidecar)
        yield c
        c.channel.close()


@pytest.mark.root
@pytest.mark.cgroup_v1
@pytest.mark.parametrize(
    "name", ["cgroup.procs", "tasks", "devices.allow", "notify_on_release", "cgroup.subtree_control", "memory.max"]
)
def test_ids_that_name_cgroup_control_files_are_invalid_argument_and_allocate_nothing(client, name):
    cid = pb.ContainerID(value=name)
    code, message = client.call(
        "Prepare", pb.PrepareRequest(container_id=cid, container_config=pb.ContainerConfig(resources=[gpus(1)]))
    )
    assert code == "INVALID_ARGUMENT", message
    assert "cannot name a cgroup" in message
    # Nothing stayed allocated: all 8 GPUs can still be taken by one container.
    ok = pb.ContainerID(value="after-" + name.replace(".", "-"))
    assert (
        client.call(
            "Prepare", pb.PrepareRequest(container_id=ok, container_config=pb.ContainerConfig(resources=[gpus(8)]))
        )[0]
        == "OK"
    )
    assert client.call("Cleanup", pb.CleanupRequest(container_id=ok))[0] == "OK"


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_isolating_a_kernel_thread_is_failed_precondition_with_a_reason(client):
    cid = pb.ContainerID(value="kthread-target")
    assert (
        client.call(
            "Prepare", pb.PrepareRequest(container_id=cid, container_config=pb.ContainerConfig(resources=[gpus(1)]))
        )[0]
        == "OK"
    )
    try:
        code, message = client.call("Isolate", pb.IsolateRequest(container_id=cid, pid=2))  # kthreadd
        assert code == "FAILED_PRECONDITION", message
        assert "kernel thread" in message
    finally:
        client.call("Cleanup", pb.CleanupRequest(container_id=cid))


@pytest.mark.root
@pytest.mark.cgroup_v1
@pytest.mark.parametrize("klass", [pb.DEFAULT, pb.DEBUG])
def test_nested_prepare_under_a_parent_never_prepared_is_failed_precondition(client, klass):
    cid = pb.ContainerID(value="child", parent=pb.ContainerID(value="never-prepared"))
    config = pb.ContainerConfig(container_class=klass)
    code, message = client.call("Prepare", pb.PrepareRequest(container_id=cid, container_config=config))
    assert code == "FAILED_PRECONDITION", message
    assert "never-prepared" in message


@pytest.mark.parametrize(
    "body",
    [
        {"container_id": {"value": "a"}, "pid": True},
        {"container_id": {"value": "a"}, "pid": False},
    ],
)
def test_bridge_json_true_where_a_number_is_expected_is_invalid_argument(body):
    with pytest.raises(InvalidArgument, match="boolean"):
        decode_input(json.dumps(body).encode(), pb.IsolateRequest)


def test_bridge_json_true_as_a_gpu_count_is_invalid_argument_not_one_gpu():
    body = {
        "container_id": {"value": "a"},
        "container_config": {"resources": [{"name": "gpus", "type": "SCALAR", "scalar": {"value": True}}]},
    }
    with pytest.raises(InvalidArgument, match=r"scalar\.value.*boolean"):
        decode_input(json.dumps(body).encode(), pb.PrepareRequest)


def test_bridge_json_number_where_a_boolean_or_string_is_expected_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        decode_input(json.dumps({"container_id": {"value": 7}}).encode(), pb.CleanupRequest)


def test_bridge_numeric_strings_stay_accepted_as_stout_writes_int64(short_tmp):
    request = decode_input(json.dumps({"container_id": {"value": "a"}, "pid": "123"}).encode(), pb.IsolateRequest)
    assert request.pid == 123


def test_lock_file_planted_as_a_symlink_is_refused_and_its_target_untouched(short_tmp):
    path = os.path.join(short_tmp, "s.sock")
    victim = os.path.join(short_tmp, "victim")
    os.symlink(victim, path + ".lock")
    with pytest.raises(SocketError, match="symbolic link"):
        SidecarServer(ServerSettings(socket=path), StubService()).start()
    assert not os.path.lexists(victim)  # the server did not create the link's target
    assert os.path.islink(path + ".lock")  # and left the planted link for the operator to see


def test_lock_file_planted_as_a_symlink_to_an_existing_file_is_refused(short_tmp):
    path = os.path.join(short_tmp, "s.sock")
    victim = os.path.join(short_tmp, "victim")
    with open(victim, "w") as fh:
        fh.write("precious")
    os.symlink(victim, path + ".lock")
    with pytest.raises(SocketError, match="symbolic link"):
        SidecarServer(ServerSettings(socket=path), StubService()).start()
    with open(victim) as fh:
        assert fh.read() == "precious"


@pytest.mark.root
def test_lock_file_owned_by_another_user_is_refused(short_tmp):
    path = os.path.join(short_tmp, "s.sock")
    with open(path + ".lock", "w"):
        pass
    os.chown(path + ".lock", 65534, 65534)
    with pytest.raises(SocketError, match="not a regular file owned by uid"):
        SidecarServer(ServerSettings(socket=path), StubService()).start()


def test_bridge_frame_with_true_pid_over_the_socket_is_refused(short_tmp):
    # The same through the bridge's wire, end to end against a stub service.
    server = SidecarServer(ServerSettings(socket=os.path.join(short_tmp, "s.sock")), StubService())
    server.start()
    try:
        body = json.dumps({"container_id": {"value": "a"}, "pid": True}).encode()
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(server.settings.bridge_path)
            conn.sendall(PROTOCOL + b" isolate 5000\n" + body)
            conn.shutdown(socket.SHUT_WR)
            reply = b"".join(iter(lambda: conn.recv(4096), b""))
        assert reply.startswith(b"ERROR INVALID_ARGUMENT "), reply
    finally:
        server.stop()
