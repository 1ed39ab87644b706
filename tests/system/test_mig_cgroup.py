"""MIG devices as units on the simulated DGX A100, with real cgroups (v1 and v2) and a real daemon.

A process placed in a container's cgroup opens device nodes: ENXIO means the cgroup let the open
through (the simulated node has no driver behind it), EPERM means the cgroup refused it.
"""

from __future__ import annotations

import grpc
import pytest
from cgroup_helpers import Prober
from watch_helpers import assert_no_limitation

from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.simhost.host import load_host, mig_caps_minors
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import running_sidecar

pytestmark = [pytest.mark.root]
VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]
HOST = load_host("dgx-a100")


# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("agent",)


@pytest.fixture(params=VERSIONS, scope="module")
def agent(request):
    with running_sidecar("dgx-a100", request.param) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        yield sidecar, isolator, Containerizer(isolator, sidecar.work)
        isolator.close()


def mig_config(containerizer: Containerizer, gpus: int | None = None, **mig: int) -> dict:
    config = containerizer.config(gpus=gpus, image=False)
    for profile, count in mig.items():
        name = "mig-" + profile.replace("_", ".")
        config["resources"].append({"name": name, "type": "SCALAR", "scalar": {"value": count}, "role": "*"})
    return config


def env_of(info: dict | None) -> dict[str, str]:
    return {v["name"]: v.get("value", "") for v in (info or {}).get("environment", {}).get("variables", [])}


def mig_devices(admin) -> dict[str, tuple[int, int, list[int], str]]:
    """MIG UUID -> (parent index, parent minor, caps minors, holder), from the admin view."""
    out = {}
    for g in admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus:
        for m in g.mig_devices:
            out[m.uuid] = (g.index, g.minor, list(m.caps_minors), m.holder)
    return out


def caps_nodes(sidecar, minors) -> list[str]:
    return [f"{sidecar.dev_root}/nvidia-caps/nvidia-cap{m}" for m in minors]


def all_gpu_nodes(sidecar) -> list[str]:
    return [f"{sidecar.dev_root}/nvidia{g.minor}" for g in HOST.gpus]


def allowed(prober: Prober, nodes: list[str]) -> set[str]:
    return {n for n, err in prober.open_errnos(nodes).items() if err == "ENXIO"}


def test_mig_holders_open_their_own_caps_only_and_coexist_on_one_gpu(agent):
    sidecar, isolator, containerizer = agent
    channel = grpc.insecure_channel(sidecar.address)
    admin = pb_grpc.AdminStub(channel)
    a, b = container_id("mig-a"), container_id("mig-b")
    info_a = isolator.prepare(a, mig_config(containerizer, **{"1g_5gb": 1}))
    info_b = isolator.prepare(b, mig_config(containerizer, **{"1g_5gb": 1}))
    pa, pb_ = Prober(), Prober()
    try:
        isolator.isolate(a, pa.pid)
        isolator.isolate(b, pb_.pid)
        uuid_a, uuid_b = env_of(info_a)["NVIDIA_VISIBLE_DEVICES"], env_of(info_b)["NVIDIA_VISIBLE_DEVICES"]
        devices = mig_devices(admin)
        assert devices[uuid_a][3] == "mig-a" and devices[uuid_b][3] == "mig-b"
        # Packed onto one parent GPU (placement keeps the others untouched): they coexist there.
        parent_a, parent_b = devices[uuid_a][1], devices[uuid_b][1]
        assert parent_a == parent_b
        caps_a, caps_b = caps_nodes(sidecar, devices[uuid_a][2]), caps_nodes(sidecar, devices[uuid_b][2])
        others = [u for u in devices if u not in (uuid_a, uuid_b)]
        other_caps = [n for u in others for n in caps_nodes(sidecar, devices[u][2])]
        # Every caps node of the host: config, monitor and every MIG device's GI/CI access.
        everything = caps_a + caps_b + other_caps + caps_nodes(sidecar, (1, 2)) + all_gpu_nodes(sidecar)
        parent = f"{sidecar.dev_root}/nvidia{parent_a}"
        assert allowed(pa, everything) == {*caps_a, parent}
        assert allowed(pb_, everything) == {*caps_b, parent}
        # The caps are exactly the driver's GI and CI access minors of the device.
        index = devices[uuid_a][0]
        gi = next(m.gpu_instance for m in HOST.gpus[index].mig_devices if m.uuid == uuid_a)
        assert devices[uuid_a][2] == list(mig_caps_minors(parent_a, gi, 0))
        # Releasing one leaves the other's access as it was.
        pb_.close()
        isolator.cleanup(b)
        assert allowed(pa, everything) == {*caps_a, parent}
    finally:
        pa.close()
        pb_.close()
        isolator.cleanup(a)
        isolator.cleanup(b)
        channel.close()


def test_whole_gpu_request_is_refused_while_mig_devices_on_that_gpu_are_held(agent):
    sidecar, isolator, containerizer = agent
    channel = grpc.insecure_channel(sidecar.address)
    admin = pb_grpc.AdminStub(channel)
    m, whole, after = container_id("mig-holder"), container_id("whole-8"), container_id("whole-after")
    info = isolator.prepare(m, mig_config(containerizer, **{"3g_20gb": 1}))
    try:
        parent = mig_devices(admin)[env_of(info)["NVIDIA_VISIBLE_DEVICES"]][1]
        with pytest.raises(HookFailed) as err:
            isolator.prepare(whole, mig_config(containerizer, gpus=8))
        assert err.value.code == "RESOURCE_EXHAUSTED" and "Requested 8 gpus but only 7 available" in str(err.value)
        seven = container_id("whole-7")
        isolator.prepare(seven, mig_config(containerizer, gpus=7))
        try:
            held = {g.minor for g in admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus if g.holder == "whole-7"}
            assert parent not in held and len(held) == 7
            # And the other way round: no MIG device of a GPU held whole is handed out (the only
            # 4g.20gb is on GPU 3, now held whole), while GPU 0's own 1g.5gb still is.
            with pytest.raises(HookFailed) as err:
                isolator.prepare(container_id("mig-more"), mig_config(containerizer, **{"4g_20gb": 1}))
            assert err.value.code == "RESOURCE_EXHAUSTED"
            assert "only 0 available (0 held, 1 on GPUs held whole or unhealthy)" in str(err.value)
            small = isolator.prepare(container_id("mig-small"), mig_config(containerizer, **{"1g_5gb": 1}))
            assert mig_devices(admin)[env_of(small)["NVIDIA_VISIBLE_DEVICES"]][1] == parent
        finally:
            isolator.cleanup(seven)
            isolator.cleanup(container_id("mig-more"))
            isolator.cleanup(container_id("mig-small"))
        isolator.cleanup(m)
        # Its MIG devices free again, the GPU can be held whole.
        isolator.prepare(after, mig_config(containerizer, gpus=8))
    finally:
        isolator.cleanup(m)
        isolator.cleanup(whole)
        isolator.cleanup(after)
        channel.close()


def test_mig_holdings_survive_a_sidecar_crash(agent):
    sidecar, isolator, containerizer = agent
    channel = grpc.insecure_channel(sidecar.address)
    cid = container_id("mig-durable")
    info = isolator.prepare(cid, mig_config(containerizer, **{"1g_10gb": 1}))
    prober = Prober()
    try:
        isolator.isolate(cid, prober.pid)
        uuid = env_of(info)["NVIDIA_VISIBLE_DEVICES"]
        before = mig_devices(pb_grpc.AdminStub(channel))[uuid]
        channel.close()
        sidecar.kill()
        sidecar.start()
        isolator.__init__(sidecar.socket)  # the module's fixture keeps using the restarted daemon
        channel = grpc.insecure_channel(sidecar.address)
        admin = pb_grpc.AdminStub(channel)
        assert mig_devices(admin)[uuid][3] == "mig-durable"
        nodes = [*caps_nodes(sidecar, before[2]), f"{sidecar.dev_root}/nvidia{before[1]}"]
        assert allowed(prober, nodes) == set(nodes)
        # The only 1g.10gb is held: a second request is refused rather than handed the same device.
        with pytest.raises(HookFailed) as err:
            isolator.prepare(container_id("mig-second"), mig_config(containerizer, **{"1g_10gb": 1}))
        assert err.value.code == "RESOURCE_EXHAUSTED"
        listed = {
            c.id: list(c.mig_uuids) for c in admin.ListContainers(pb.ListContainersRequest(), timeout=10).containers
        }
        assert listed["mig-durable"] == [uuid]
        health = {c.name: c.ok for c in admin.Health(pb.HealthRequest(), timeout=10).checks}
        assert health["consistency"], admin.Health(pb.HealthRequest(), timeout=10)
    finally:
        prober.close()
        isolator.cleanup(cid)
        isolator.cleanup(container_id("mig-second"))
        channel.close()


def test_bad_mig_requests_are_refused_with_the_reason(agent):
    _sidecar, isolator, containerizer = agent
    cases = [
        ({"7g_40gb": 1}, "INVALID_ARGUMENT", "offered as 'mig-7g.40gb'"),
        ({"1g_5gb": 0.5}, "INVALID_ARGUMENT", "'mig-1g.5gb' resource must be an unsigned integer"),
        ({"3g_20gb": 4}, "RESOURCE_EXHAUSTED", "Requested 4 mig-3g.20gb but only 3 available"),
    ]
    for i, (mig, code, text) in enumerate(cases):
        cid = container_id(f"bad-mig-{i}")
        with pytest.raises(HookFailed) as err:
            isolator.prepare(cid, mig_config(containerizer, **mig))
        assert err.value.code == code and text in str(err.value)
        isolator.cleanup(cid)


def test_whole_gpu_requests_take_gpus_not_in_mig_mode_first(agent):
    sidecar, isolator, containerizer = agent
    channel = grpc.insecure_channel(sidecar.address)
    admin = pb_grpc.AdminStub(channel)
    cid = container_id("whole-3")
    isolator.prepare(cid, mig_config(containerizer, gpus=3))
    try:
        held = {g.index for g in admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus if g.holder == "whole-3"}
        assert held == {g.index for g in HOST.gpus if not g.mig}
    finally:
        isolator.cleanup(cid)
        channel.close()


def test_update_keeps_shrinks_grows_and_releases_mig_holdings(agent):
    sidecar, isolator, containerizer = agent
    channel = grpc.insecure_channel(sidecar.address)
    stub, admin = pb_grpc.IsolatorStub(channel), pb_grpc.AdminStub(channel)
    cid = container_id("mig-update")
    isolator.prepare(cid, mig_config(containerizer, **{"1g_5gb": 2}))

    def update(*resources: tuple[str, float]) -> list[str]:
        request = pb.UpdateRequest(container_id=pb.ContainerID(value="mig-update"))
        for name, value in resources:
            request.resource_requests.add(name=name, type=pb.Value.SCALAR, role="*").scalar.value = value
        stub.Update(request, timeout=10)
        described = admin.DescribeContainer(
            pb.DescribeContainerRequest(container_id=pb.ContainerID(value="mig-update")), timeout=10
        )
        assert described.rules_agree, described  # the kernel grants exactly what is recorded
        return sorted(described.container.mig_uuids)

    try:
        # Mesos's Update carries the container's whole resources: the same MIG counts keep the same units.
        first = update(("cpus", 1), ("mig-1g.5gb", 2))
        assert len(first) == 2
        assert update(("cpus", 1), ("mig-1g.5gb", 1)) == first[:1], "a shrink keeps the lowest UUIDs"
        grown = update(("cpus", 1), ("mig-1g.5gb", 3))
        assert len(grown) == 3 and first[0] in grown
        with pytest.raises(grpc.RpcError) as err:
            update(("mig-1g.5gb", 99))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert update(("cpus", 1)) == [], "no mig-* left: every unit released"
    finally:
        isolator.cleanup(cid)
        channel.close()


# Last: it leaves a GPU unhealthy in the module's daemon.
def test_xid_on_the_parent_gpu_limits_every_container_on_it(agent):
    sidecar, isolator, containerizer = agent
    channel = grpc.insecure_channel(sidecar.address)
    stub, admin = pb_grpc.IsolatorStub(channel), pb_grpc.AdminStub(channel)
    a, b = container_id("xid-a"), container_id("xid-b")
    info_a = isolator.prepare(a, mig_config(containerizer, **{"2g_10gb": 1}))
    info_b = isolator.prepare(b, mig_config(containerizer, **{"2g_10gb": 1}))
    try:
        devices = mig_devices(admin)
        ua, ub = env_of(info_a)["NVIDIA_VISIBLE_DEVICES"], env_of(info_b)["NVIDIA_VISIBLE_DEVICES"]
        # Two 2g.10gb devices live on GPUs 0 and 3: one on each. An XID on b's GPU limits b only.
        assert devices[ua][0] != devices[ub][0]
        futures = {
            n: stub.Watch.future(pb.WatchRequest(container_id=pb.ContainerID(value=n)), timeout=30)
            for n in ("xid-a", "xid-b")
        }
        sidecar.sim.inject_xid(devices[ub][0], 79, gpu_instance=5, compute_instance=0)
        reply = futures["xid-b"].result()
        assert reply.limitation.reason == pb.REASON_CONTAINER_LIMITATION
        assert reply.limitation.resources[0].name == "mig-2g.10gb" and ub in reply.limitation.message
        assert "XID 79" in reply.limitation.message
        assert_no_limitation(stub, "xid-a")
        futures["xid-a"].cancel()
    finally:
        isolator.cleanup(a)
        isolator.cleanup(b)
        channel.close()
