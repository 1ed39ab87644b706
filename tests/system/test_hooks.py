"""Hook semantics beyond one launch: update of a running container, watch, usage, nested containers,
orphans across a sidecar restart. A real daemon on a simulated host, real cgroups, over gRPC."""

from __future__ import annotations

import time

import grpc
import pytest
from cgroup_helpers import Prober
from google.protobuf import json_format
from watch_helpers import assert_no_limitation

from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import running_sidecar

pytestmark = [pytest.mark.root]
VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]


# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("agent",)


@pytest.fixture(params=VERSIONS, scope="module")
def agent(request):
    with running_sidecar("dgx-1", request.param) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        yield sidecar, isolator, Containerizer(isolator, sidecar.work)
        isolator.close()


def stubs(sidecar):
    channel = grpc.insecure_channel(sidecar.address)
    return channel, pb_grpc.IsolatorStub(channel), pb_grpc.AdminStub(channel)


def held_minors(admin, name: str) -> list[int]:
    for c in admin.ListContainers(pb.ListContainersRequest(), timeout=10).containers:
        if c.container_id.value == name and not c.container_id.HasField("parent"):
            return sorted(c.gpu_minors)
    raise AssertionError(f"container {name} is not listed")


def test_update_changes_access_of_the_running_process_at_once(agent):
    sidecar, isolator, containerizer = agent
    channel, _, admin = stubs(sidecar)
    cid = container_id("growing")
    isolator.prepare(cid, containerizer.config(gpus=1, image=False))
    prober = Prober()
    try:
        isolator.isolate(cid, prober.pid)
        nodes = [f"{sidecar.dev_root}/nvidia{i}" for i in range(8)]

        def granted() -> list[int]:
            opens = prober.open_errnos(nodes)
            return [i for i, n in enumerate(nodes) if opens[n] == "ENXIO"]

        assert granted() == held_minors(admin, "growing") and len(granted()) == 1
        isolator.update(cid, 3)  # grow: Mesos would overwrite and leak; we add
        assert len(granted()) == 3 and granted() == held_minors(admin, "growing")
        isolator.update(cid, 1)
        assert len(granted()) == 1 and granted() == held_minors(admin, "growing")
        isolator.update(cid, 0)
        assert granted() == [] and held_minors(admin, "growing") == []
    finally:
        prober.close()
        isolator.cleanup(cid)
        channel.close()


def test_update_beyond_what_is_free_is_resource_exhausted_and_changes_nothing(agent):
    sidecar, isolator, containerizer = agent
    channel, _, admin = stubs(sidecar)
    a, b = container_id("u-a"), container_id("u-b")
    isolator.prepare(a, containerizer.config(gpus=6, image=False))
    isolator.prepare(b, containerizer.config(gpus=1, image=False))
    try:
        with pytest.raises(HookFailed) as info:
            isolator.update(b, 3)
        assert info.value.code == "RESOURCE_EXHAUSTED"
        assert len(held_minors(admin, "u-b")) == 1
    finally:
        isolator.cleanup(a)
        isolator.cleanup(b)
        channel.close()


def test_watch_completes_with_a_limitation_naming_the_gpu_that_became_unhealthy(agent):
    sidecar, isolator, containerizer = agent
    channel, stub, admin = stubs(sidecar)
    cid = container_id("watched")
    isolator.prepare(cid, containerizer.config(gpus=2, image=False))
    try:
        minors = held_minors(admin, "watched")
        request = pb.WatchRequest(container_id=pb.ContainerID(value="watched"))
        # Nothing wrong yet: a bounded watch comes back empty (the bridge's poll).
        assert_no_limitation(stub, "watched")
        future = stub.Watch.future(request, timeout=30)
        gpus = admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus
        index = next(g.index for g in gpus if g.minor == minors[0])
        sidecar.sim.inject_xid(index, 79)
        reply = future.result()
        assert reply.limitation.reason == pb.REASON_CONTAINER_LIMITATION
        assert f"GPU {minors[0]}" in reply.limitation.message
        assert reply.limitation.resources[0].name == "gpus"
        # No deprecated role on any resource: a real agent aborts on one (CHECK(!resource.has_role())).
        assert [r.role for r in reply.limitation.resources] == [""]
        # The unhealthy GPU is never handed out again.
        other = container_id("after-xid")
        isolator.prepare(other, containerizer.config(gpus=6, image=False))
        try:
            assert minors[0] not in held_minors(admin, "after-xid")
            with pytest.raises(HookFailed) as info:
                isolator.prepare(container_id("too-many"), containerizer.config(gpus=1, image=False))
            assert info.value.code == "RESOURCE_EXHAUSTED"
        finally:
            isolator.cleanup(other)
            isolator.cleanup(container_id("too-many"))
    finally:
        isolator.cleanup(cid)
        # XID marks outlive a restart of the sidecar now: reset the GPU (the way back) so that the
        # module's sidecar is left as found for the tests that restart it.
        sick = [g.index for g in admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus if not g.healthy]
        for index in sick:
            sidecar.sim.unbind(index)
            sidecar.sim.bind(index)
        deadline = time.monotonic() + 60
        while not all(g.healthy for g in admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus):
            assert time.monotonic() < deadline, "the reset GPU did not come back"
            time.sleep(0.05)
        channel.close()


def test_usage_reports_memory_and_utilisation_of_the_containers_gpus(agent):
    sidecar, isolator, containerizer = agent
    channel, stub, admin = stubs(sidecar)
    cid = container_id("busy")
    isolator.prepare(cid, containerizer.config(gpus=1, image=False))
    try:
        minor = held_minors(admin, "busy")[0]
        gpu = next(g for g in admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus if g.minor == minor)
        sidecar.sim.set_usage(gpu.index, 3 * 2**30, 87, 40)
        reply = stub.Usage(pb.UsageRequest(container_id=pb.ContainerID(value="busy")), timeout=10)
        assert reply.statistics.timestamp > 0
        assert [(g.minor, g.memory_used_bytes, g.utilization_percent) for g in reply.gpus] == [(minor, 3 * 2**30, 87)]
        with pytest.raises(grpc.RpcError) as info:
            stub.Usage(pb.UsageRequest(container_id=pb.ContainerID(value="nobody")), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        sidecar.sim.clear()
        isolator.cleanup(cid)
        channel.close()


def test_nested_containers_use_their_parents_gpus_and_debug_ones_get_nothing(agent):
    sidecar, isolator, containerizer = agent
    channel, _, admin = stubs(sidecar)
    parent = container_id("executor")
    isolator.prepare(parent, containerizer.config(gpus=2, image=False))
    try:
        minors = held_minors(admin, "executor")
        task = container_id(["executor", "task"])
        info = isolator.prepare(task, containerizer.config(gpus=None))
        assert info is not None
        devices = sorted(m["target"].rsplit("/", 1)[1] for m in info["mounts"] if "/dev/nvidia" in m["target"])
        assert [d for d in devices if d[len("nvidia") :].isdigit()] == [f"nvidia{m}" for m in minors]
        assert any(m["target"].endswith("/usr/local/nvidia") for m in info["mounts"])
        debug = container_id(["executor", "debug"])
        assert isolator.prepare(debug, containerizer.config(gpus=None, container_class="DEBUG")) is None
        with pytest.raises(HookFailed) as refused:
            isolator.update(task, 1)
        assert refused.value.code == "FAILED_PRECONDITION"
        isolator.cleanup(task)
        isolator.cleanup(debug)
        assert held_minors(admin, "executor") == minors
    finally:
        isolator.cleanup(parent)
        channel.close()


def test_orphans_keep_their_gpus_across_a_restart_until_their_cleanup(agent):
    sidecar, isolator, containerizer = agent
    a = container_id("orphan-a")
    isolator.prepare(a, containerizer.config(gpus=4, image=False))
    channel, _, admin = stubs(sidecar)
    held = held_minors(admin, "orphan-a")
    channel.close()
    sidecar.kill()  # a crash: nothing cleaned up
    sidecar.start()
    isolator2 = GrpcIsolator(sidecar.socket)
    channel, _, admin = stubs(sidecar)
    try:
        isolator2.recover([], [a])
        assert held_minors(admin, "orphan-a") == held
        states = {c.container_id.value: c.state for c in admin.ListContainers(pb.ListContainersRequest()).containers}
        assert states["orphan-a"] == "orphan"
        # Its GPUs are not handed out while it waits for its cleanup.
        b = container_id("newcomer")
        isolator2.prepare(b, containerizer.config(gpus=4, image=False))
        assert set(held_minors(admin, "newcomer")).isdisjoint(held)
        with pytest.raises(HookFailed):
            isolator2.prepare(container_id("one-more"), containerizer.config(gpus=1, image=False))
        isolator2.cleanup(a)
        isolator2.cleanup(container_id("one-more"))
        # Its GPUs are free for the next task (a new ID: Mesos never prepares a cleaned-up one again).
        isolator2.prepare(container_id("next-task"), containerizer.config(gpus=4, image=False))
        isolator2.cleanup(container_id("next-task"))
        isolator2.cleanup(b)
    finally:
        channel.close()
        isolator2.close()
        isolator._channel.close()
        isolator.__init__(sidecar.socket)  # the module's fixture keeps using the restarted daemon


def test_launch_info_is_stout_compatible_json(agent):
    _sidecar, isolator, containerizer = agent
    cid = container_id("json")
    info = isolator.prepare(cid, containerizer.config(gpus=1))
    try:
        assert info is not None
        assert "rootfs" not in info and "user" not in info
        # Round-trips through the proto with field names as Mesos spells them.
        msg = json_format.ParseDict(info, pb.ContainerLaunchInfo())
        assert {m.target.rsplit("/", 1)[-1] for m in msg.mounts} >= {"nvidiactl", "nvidia-uvm", "nvidia"}
        assert all(v.type == pb.Environment.Variable.VALUE for v in msg.environment.variables)
    finally:
        isolator.cleanup(cid)


@pytest.mark.cgroup_v1
def test_mesos_mode_adds_only_our_rules_and_releases_containers_whose_cgroup_vanished(short_tmp):
    import os

    from isolator.policy.devices import MESOS_DEFAULT_WHITELIST

    with running_sidecar("dgx-1", "v1", extra=("--mode", "mesos", "--reap-interval", "0.2")) as sidecar:
        # Play the agent's cgroups/devices isolator: it makes the cgroup and its default whitelist
        # before any module isolator prepares.
        cgroup = os.path.join(sidecar.cgroup_parent, "mesos-task")
        os.makedirs(cgroup)
        with open(os.path.join(cgroup, "devices.deny"), "w") as fh:
            fh.write("a")
        for rule in MESOS_DEFAULT_WHITELIST:
            with open(os.path.join(cgroup, "devices.allow"), "w") as fh:
                fh.write(str(rule))
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, short_tmp)
        channel, _, admin = stubs(sidecar)
        try:
            isolator.prepare(container_id("mesos-task"), containerizer.config(gpus=2, image=False))

            def ours() -> int:
                with open(os.path.join(cgroup, "devices.list")) as fh:
                    listed = fh.read().split("\n")
                return sum(1 for line in listed if line.startswith("c 195:") and not line.startswith("c 195:255"))

            # Prepare answers before its rules are in force (the agent waits for Isolate, docs/
            # mesos-agent.md "Prepare answers before its grant is in force"); they follow at once.
            deadline = time.monotonic() + 30
            while ours() != 2:
                assert time.monotonic() < deadline, f"{ours()} GPU rules in force, not 2"
                time.sleep(0.01)
            # The agent destroys the container while nobody tells us (the bridge route's blind spot).
            os.rmdir(cgroup)
            deadline = time.monotonic() + 60
            while any(
                c.container_id.value == "mesos-task"
                for c in admin.ListContainers(pb.ListContainersRequest()).containers
            ):
                assert time.monotonic() < deadline, "the vanished container was never released"
                time.sleep(0.1)
            assert all(g.holder == "" for g in admin.ListGpus(pb.ListGpusRequest()).gpus)
            # A prepare for a container whose Mesos cgroup does not exist fails and leaves nothing.
            with pytest.raises(HookFailed) as info:
                isolator.prepare(container_id("no-cgroup"), containerizer.config(gpus=8, image=False))
            assert info.value.code == "NOT_FOUND"
            assert list(admin.ListContainers(pb.ListContainersRequest()).containers) == []
            assert all(g.holder == "" for g in admin.ListGpus(pb.ListGpusRequest()).gpus)
        finally:
            channel.close()
            isolator.close()
