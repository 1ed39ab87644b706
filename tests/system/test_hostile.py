"""Hostile input, generated: every RPC and the bridge's JSON get what an attacker or a bug would send.

One sidecar for the module holds a resident container with two GPUs. Each example sends one
hostile request and checks the status code, that the sidecar still answers, and that nothing
changed: the records, the resident's kernel grants, and the cgroups on disk. Examples are drawn
deterministically (derandomize) so CI is stable; GPU_ISOLATOR_HOSTILE_EXAMPLES raises the count.
"""

from __future__ import annotations

import json
import math
import os
import socket
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from invariants import Observer, quick_sidecar, read_records

from isolator.daemon.config import Config
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing.mesos import GrpcIsolator, container_id
from isolator.transport.bridge import PROTOCOL

pytestmark = [pytest.mark.root, pytest.mark.cgroup_v1]

GPUS = 8
RESIDENT = "resident"
EXAMPLES = int(os.environ.get("GPU_ISOLATOR_HOSTILE_EXAMPLES", "30"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---- strategies -----------------------------------------------------------------------------------

CONTROL = st.sampled_from([chr(c) for c in range(0x20)] + ["\x7f"])
# Container IDs Mesos's validateID refuses (and that would escape a cgroup or state path).
BAD_IDS = st.one_of(
    st.sampled_from(["", ".", "..", "/", "../etc", "a/../../b", "\x00", "a\x00b", "\\", "a\\b"]),
    st.builds(lambda a, b: a + "/" + b, st.text(max_size=8), st.text(max_size=8)),
    st.builds(lambda a, c, b: a + c + b, st.text(max_size=8), CONTROL, st.text(max_size=8)),
    st.text(min_size=256, max_size=400).filter(lambda s: len(s.encode()) > 255),
    st.just("x" * 65536),
)
BAD_COUNTS = st.one_of(
    st.sampled_from([-1.0, -0.5, 0.5, 1.5, math.nan, math.inf, -math.inf, 2.0**63, 2.0**64, 1e300, -(2.0**63)]),
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda f: not (math.isfinite(f) and f == int(f) and f >= 0)),
    st.floats(min_value=2.0**31 + 1, max_value=1e18).map(math.floor),  # whole, beyond any count Mesos allows
)
# Whole counts that are fine as numbers but more than this host (8 GPUs) has.
TOO_MANY = st.integers(min_value=9, max_value=2**31)

# Every RPC that names a container: (service, method, request built from a ContainerID).
ID_RPCS: list[tuple[str, str, Any]] = [
    ("Isolator", "Prepare", lambda c: pb.PrepareRequest(container_id=c)),
    ("Isolator", "Isolate", lambda c: pb.IsolateRequest(container_id=c, pid=12345)),
    ("Isolator", "Watch", lambda c: pb.WatchRequest(container_id=c)),
    ("Isolator", "Update", lambda c: pb.UpdateRequest(container_id=c)),
    ("Isolator", "Usage", lambda c: pb.UsageRequest(container_id=c)),
    ("Isolator", "Status", lambda c: pb.StatusRequest(container_id=c)),
    ("Isolator", "Cleanup", lambda c: pb.CleanupRequest(container_id=c)),
    ("Isolator", "Recover", lambda c: pb.RecoverRequest(orphans=[c])),
    ("Admin", "DescribeContainer", lambda c: pb.DescribeContainerRequest(container_id=c)),
    ("Admin", "Release", lambda c: pb.ReleaseRequest(container_id=c, force=True)),
]
ALL_METHODS = [(s.name, m.name, m.input_type.name) for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods]


def gpus(value: float, type_: int = pb.Value.SCALAR) -> pb.Resource:
    return pb.Resource(name="gpus", type=type_, scalar=pb.Value.Scalar(value=value), role="*")


# ---- the sidecar under attack ---------------------------------------------------------------------


class Target:
    def __init__(self, sidecar: Any) -> None:
        self.sidecar = sidecar
        self.channel = grpc.insecure_channel(sidecar.address, options=[("grpc.max_send_message_length", 64 << 20)])
        self.stubs = {"Isolator": pb_grpc.IsolatorStub(self.channel), "Admin": pb_grpc.AdminStub(self.channel)}
        self.observer = Observer(sidecar, GPUS)
        self.baseline = self.snapshot()

    def call(self, service: str, method: str, request: Any) -> str:
        try:
            getattr(self.stubs[service], method)(request, timeout=30)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    def raw(self, service: str, method: str, data: bytes) -> str:
        path = f"/{pb.DESCRIPTOR.package}.{service}/{method}"
        try:
            self.channel.unary_unary(path)(data, timeout=30)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    def snapshot(self) -> tuple[Any, ...]:
        cgroups = sorted(self.observer.cgroups())
        users = os.path.join(self.sidecar.work, "volumes", ".users")
        volume_users = sorted(os.path.join(r, f) for r, _d, files in os.walk(users) for f in files)
        return (read_records(self.sidecar.work), cgroups, volume_users)

    def untouched(self) -> None:
        """The sidecar answers, and records, cgroups and the resident's kernel grants are as before."""
        assert self.sidecar.proc.poll() is None, self.sidecar.log()
        assert self.call("Admin", "Health", pb.HealthRequest()) == "OK"
        assert self.snapshot() == self.baseline


# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("target",)


@pytest.fixture(scope="module")
def target():
    with quick_sidecar("dgx-1", "v1") as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        isolator.prepare(container_id(RESIDENT), {"resources": [{"name": "gpus", "scalar": {"value": 2}}]})
        t = Target(sidecar)
        assert t.observer.problems() == []
        yield t
        assert t.observer.problems() == []  # the resident's grants survived everything
        isolator.cleanup(container_id(RESIDENT))
        isolator.close()
        t.channel.close()


# ---- gRPC -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("service", "method", "build"), ID_RPCS, ids=[m for _s, m, _b in ID_RPCS])
@SETTINGS
@given(bad=BAD_IDS, nested=st.booleans())
def test_container_ids_that_could_escape_a_path_are_invalid_argument_on_every_rpc(
    target, service, method, build, bad, nested
):
    cid = pb.ContainerID(value=bad)
    if nested:  # a good child under a bad parent, or a bad child under the resident
        cid = (
            pb.ContainerID(value="child", parent=cid)
            if len(bad) % 2
            else pb.ContainerID(value=bad, parent=pb.ContainerID(value=RESIDENT))
        )
    assert target.call(service, method, build(cid)) == "INVALID_ARGUMENT"
    target.untouched()


@SETTINGS
@given(count=BAD_COUNTS, repeat=st.integers(min_value=1, max_value=3))
def test_gpu_counts_that_are_not_unsigned_integers_are_invalid_argument_for_prepare_and_update(target, count, repeat):
    fresh = pb.ContainerID(value="fresh")
    prepare = pb.PrepareRequest(
        container_id=fresh, container_config=pb.ContainerConfig(resources=[gpus(count)] * repeat)
    )
    update = pb.UpdateRequest(container_id=pb.ContainerID(value=RESIDENT), resource_requests=[gpus(count)] * repeat)
    assert target.call("Isolator", "Prepare", prepare) == "INVALID_ARGUMENT"
    assert target.call("Isolator", "Update", update) == "INVALID_ARGUMENT"
    target.untouched()


@SETTINGS
@given(count=TOO_MANY)
def test_more_gpus_than_the_host_has_is_resource_exhausted_for_prepare_and_update(target, count):
    fresh = pb.ContainerID(value="fresh")
    prepare = pb.PrepareRequest(container_id=fresh, container_config=pb.ContainerConfig(resources=[gpus(count)]))
    update = pb.UpdateRequest(container_id=pb.ContainerID(value=RESIDENT), resource_requests=[gpus(count)])
    assert target.call("Isolator", "Prepare", prepare) == "RESOURCE_EXHAUSTED"
    assert target.call("Isolator", "Update", update) == "RESOURCE_EXHAUSTED"
    target.untouched()


@SETTINGS
@given(value_type=st.integers(min_value=1, max_value=2**31 - 1))
def test_gpus_of_a_type_other_than_scalar_even_an_unknown_enum_value_are_invalid_argument(target, value_type):
    request = pb.UpdateRequest(container_id=pb.ContainerID(value=RESIDENT), resource_requests=[gpus(2, value_type)])
    assert target.call("Isolator", "Update", request) == "INVALID_ARGUMENT"
    target.untouched()


def test_unknown_container_class_is_treated_as_default_as_mesos_drops_unknown_enum_values(target):
    # Mesos's ContainerClass is a proto2 enum: a value it does not know is dropped on parse, leaving
    # DEFAULT. The sidecar behaves the same: the container is prepared with its GPUs, and cleaned up.
    cid = pb.ContainerID(value="unknown-class")
    config = pb.ContainerConfig(resources=[gpus(1)], container_class=77)
    assert target.call("Isolator", "Prepare", pb.PrepareRequest(container_id=cid, container_config=config)) == "OK"
    assert target.call("Isolator", "Cleanup", pb.CleanupRequest(container_id=cid)) == "OK"
    target.untouched()


@pytest.mark.parametrize("pid", [0, 1, -1 & (2**64 - 1), 2**22, 2**63])
def test_pids_that_cannot_be_a_container_init_are_invalid_argument(target, pid):
    request = pb.IsolateRequest(container_id=pb.ContainerID(value=RESIDENT), pid=pid)
    assert target.call("Isolator", "Isolate", request) == "INVALID_ARGUMENT"
    target.untouched()


def test_huge_repeated_fields_are_answered_without_harm(target):
    # As many entries as the largest request holds (--max-message-bytes, 256 KiB): 7k gpus entries of
    # 1 each (a whole count, but one no host has); 20k orphans nobody knows.
    limit = Config().max_message_bytes
    many = pb.PrepareRequest(
        container_id=pb.ContainerID(value="many"), container_config=pb.ContainerConfig(resources=[gpus(1)] * 7_000)
    )
    assert many.ByteSize() < limit
    assert target.call("Isolator", "Prepare", many) == "RESOURCE_EXHAUSTED"
    orphans = pb.RecoverRequest(orphans=[pb.ContainerID(value=f"o{i}") for i in range(20_000)])
    assert orphans.ByteSize() < limit
    assert target.call("Isolator", "Recover", orphans) == "OK"
    bad_orphans = pb.RecoverRequest(orphans=[pb.ContainerID(value=f"o{i}/x") for i in range(20_000)])
    assert target.call("Isolator", "Recover", bad_orphans) == "INVALID_ARGUMENT"
    target.untouched()


def test_container_id_nested_deeper_than_mesos_allows_or_protobuf_parses_is_invalid_argument(target):
    for depth in (33, 99, 5000):
        cid = pb.ContainerID(value="leaf")
        data = cid.SerializeToString()
        for _ in range(depth):
            # Built as bytes: the Python runtime would itself refuse to build 5000 levels.
            data = b"\x0a\x01n\x12" + _varint(len(data)) + data
        assert target.raw("Isolator", "Status", b"\x0a" + _varint(len(data)) + data) == "INVALID_ARGUMENT", depth
    target.untouched()


def test_a_message_over_the_maximum_size_is_resource_exhausted(target):
    huge = pb.StatusRequest(container_id=pb.ContainerID(value="x" * (5 << 20)))
    assert target.call("Isolator", "Status", huge) == "RESOURCE_EXHAUSTED"
    target.untouched()


@pytest.mark.parametrize(("service", "method", "type_name"), ALL_METHODS, ids=[m for _s, m, _t in ALL_METHODS])
@SETTINGS
@given(data=st.binary(max_size=200))
def test_bytes_that_are_not_the_request_message_are_invalid_argument(target, service, method, type_name, data):
    request_type = getattr(pb, type_name)
    try:
        request_type.FromString(data)
        parses = True
    except Exception:  # any parse failure is what this test wants
        parses = False
    assume(not parses)
    assert target.raw(service, method, data) == "INVALID_ARGUMENT"
    target.untouched()


def test_invalid_utf8_in_a_container_id_is_invalid_argument(target):
    inner = b"\x0a\x03\xff\xfe/"
    assert target.raw("Isolator", "Cleanup", b"\x0a" + _varint(len(inner)) + inner) == "INVALID_ARGUMENT"
    target.untouched()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


# ---- the bridge -----------------------------------------------------------------------------------

BRIDGE_METHODS = ("prepare", "isolate", "watch", "usage", "cleanup")
KEYS = st.sampled_from(["container_id", "container_config", "value", "parent", "pid", "resources", "scalar", "name"])
JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers(min_value=-(2**70), max_value=2**70) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS | st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


def bridge_call(path: str, method: str, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(PROTOCOL + f" {method} 5000\n".encode() + payload)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def reply_code(reply: bytes) -> str:
    if reply.startswith(b"OK\n"):
        return "OK"
    assert reply.startswith(b"ERROR ") and reply.endswith(b"\n") and reply.count(b"\n") == 1, reply[:200]
    return reply.split(b" ", 2)[1].decode()


@pytest.mark.parametrize("method", BRIDGE_METHODS)
@SETTINGS
@given(bad=BAD_IDS)
def test_bridge_refuses_hostile_container_ids_with_invalid_argument(target, method, bad):
    body = {"container_id": {"value": bad}, "container_config": {}, "pid": 12345}
    reply = bridge_call(target.sidecar.bridge_socket, method, json.dumps(body).encode())
    assert reply_code(reply) == "INVALID_ARGUMENT", reply[:200]
    target.untouched()


@SETTINGS
@given(count=BAD_COUNTS)
def test_bridge_refuses_hostile_gpu_counts_with_invalid_argument(target, count):
    resources = [{"name": "gpus", "type": "SCALAR", "scalar": {"value": count}}]
    body = {"container_id": {"value": "fresh"}, "container_config": {"resources": resources}}
    reply = bridge_call(target.sidecar.bridge_socket, "prepare", json.dumps(body).encode())
    assert reply_code(reply) == "INVALID_ARGUMENT", reply[:200]
    target.untouched()


@pytest.mark.parametrize("method", BRIDGE_METHODS)
@SETTINGS
@given(value=JSON)
def test_bridge_answers_any_json_with_a_status_and_never_an_internal_error(target, method, value):
    reply = bridge_call(target.sidecar.bridge_socket, method, json.dumps(value).encode())
    code = reply_code(reply)
    assert code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"), reply[:300]
    if code == "OK" and method == "prepare":
        # A valid request slipped through: undo it so the next example starts from the baseline.
        target.call(
            "Isolator", "Cleanup", pb.CleanupRequest(container_id=pb.ContainerID(value=value["container_id"]["value"]))
        )
    target.untouched()


@SETTINGS
@given(payload=st.binary(max_size=300))
def test_bridge_refuses_bytes_that_are_not_a_json_object(target, payload):
    try:
        is_object = isinstance(json.loads(payload.decode()), dict)
    except (UnicodeDecodeError, ValueError):
        is_object = False
    assume(not is_object)
    assert reply_code(bridge_call(target.sidecar.bridge_socket, "cleanup", payload)) == "INVALID_ARGUMENT"
    target.untouched()


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_ids_naming_cgroup_files_and_kernel_thread_pids_get_a_status_that_says_so(version):
    # Each of these once came back INTERNAL: mkdir met the control file, the kernel refused to move
    # kthreadd. The caller sent them, so the caller is told.
    with quick_sidecar("dgx-1", version) as sidecar:
        t = Target(sidecar)
        for name in ("cgroup.procs", "tasks", "devices.allow", "cgroup.subtree_control"):
            request = pb.PrepareRequest(
                container_id=pb.ContainerID(value=name), container_config=pb.ContainerConfig(resources=[gpus(1)])
            )
            assert t.call("Isolator", "Prepare", request) == "INVALID_ARGUMENT", name
        cid = pb.ContainerID(value="kthread-target")
        prepare = pb.PrepareRequest(container_id=cid, container_config=pb.ContainerConfig(resources=[gpus(1)]))
        assert t.call("Isolator", "Prepare", prepare) == "OK"
        assert t.call("Isolator", "Isolate", pb.IsolateRequest(container_id=cid, pid=2)) == "FAILED_PRECONDITION"
        orphan = pb.ContainerID(value="child", parent=pb.ContainerID(value="never-prepared"))
        nested = pb.PrepareRequest(container_id=orphan, container_config=pb.ContainerConfig())
        assert t.call("Isolator", "Prepare", nested) == "FAILED_PRECONDITION"
        assert t.call("Isolator", "Cleanup", pb.CleanupRequest(container_id=cid)) == "OK"
        assert read_records(sidecar.work) == {}
        t.channel.close()
