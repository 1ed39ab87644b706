"""MIG units end to end as an agent would use them: the containerizer launches an image container
asking for `mig-1g.5gb: 2`, over gRPC and over the command-module bridge, on v1 and v2 cgroups."""

from __future__ import annotations

import os
import threading

import pytest

from isolator.simhost.host import load_host, mig_caps_minors
from isolator.testing.mesos import BridgeIsolator, Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import running_sidecar

pytestmark = [pytest.mark.root]
VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]
ROUTES = ["grpc", "bridge"]
HOST = load_host("dgx-a100")


# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("agent",)


@pytest.fixture(
    params=[(v, r) for v in VERSIONS for r in ROUTES], ids=lambda p: f"{p[0].values[0]}-{p[1]}", scope="module"
)
def agent(request):
    version, route = request.param
    with running_sidecar("dgx-a100", version.values[0]) as sidecar:
        if route == "grpc":
            isolator = GrpcIsolator(sidecar.socket)
        else:
            from isolator.bridge.command import install

            bridge_dir = os.path.join(sidecar.work, "bridge")
            install(bridge_dir, sidecar.bridge_socket)
            isolator = BridgeIsolator(bridge_dir, sidecar.work)
        containerizer = Containerizer(isolator, sidecar.work)
        containerizer.recover()
        yield sidecar, containerizer
        isolator.close()


def with_mig(config: dict, name: str, count: float) -> dict:
    # The Resource JSON an agent sends for a custom scalar (stout's JSON::protobuf of mesos.Resource).
    config["resources"].append({"name": name, "type": "SCALAR", "scalar": {"value": count}, "role": "*"})
    return config


def test_image_container_with_two_mig_devices_opens_exactly_their_caps(agent):
    _sidecar, containerizer = agent
    gpu1 = HOST.gpus[1]
    mine = [m for m in gpu1.mig_devices if m.gpu_instance in (7, 8)]  # the placement's first two picks
    caps = [f"/dev/nvidia-caps/nvidia-cap{c}" for m in mine for c in mig_caps_minors(1, m.gpu_instance, 0)]
    theirs = [
        f"/dev/nvidia-caps/nvidia-cap{c}"
        for g in HOST.gpus
        for m in g.mig_devices
        if m not in mine
        for c in mig_caps_minors(g.minor, m.gpu_instance, m.compute_instance)
    ]
    gpus = [f"/dev/nvidia{g.minor}" for g in HOST.gpus]
    config = with_mig(containerizer.config(gpus=None), "mig-1g.5gb", 2)
    launched = containerizer.launch(container_id("mig-image"), config, [*caps, *theirs, *gpus, "/dev/nvidiactl"])
    assert launched.exit_code == 0, launched.stderr
    opens = launched.report["opens"]
    assert [opens[p] for p in caps] == ["ENXIO"] * 4, opens
    assert opens["/dev/nvidia1"] == "ENXIO" and opens["/dev/nvidiactl"] == "ENXIO"
    # Nothing else is even in the container's /dev.
    assert {opens[p] for p in theirs} == {"ENOENT"}
    assert {opens[p] for p in gpus if p != "/dev/nvidia1"} == {"ENOENT"}
    # The image said NVIDIA_VISIBLE_DEVICES=all; the container is told its two MIG devices.
    assert launched.report["env"]["NVIDIA_VISIBLE_DEVICES"] == ",".join(m.uuid for m in mine)
    assert launched.report["env"]["LD_LIBRARY_PATH"].endswith("/usr/local/nvidia/lib64")


def test_concurrent_mig_requests_never_share_a_device(agent):
    _sidecar, containerizer = agent
    isolator = containerizer.isolator
    names = [f"par-{i}" for i in range(9)]
    results: dict[str, object] = {}

    def prepare(name: str) -> None:
        config = with_mig(containerizer.config(gpus=None, image=False), "mig-1g.5gb", 1)
        try:
            results[name] = isolator.prepare(container_id(name), config)
        except HookFailed as exc:
            results[name] = exc

    threads = [threading.Thread(target=prepare, args=(n,)) for n in names]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        ok = {n: r for n, r in results.items() if not isinstance(r, HookFailed)}
        failed = [r for r in results.values() if isinstance(r, HookFailed)]
        # The host has 8 1g.5gb devices: 8 holders, each a different one, and one refusal.
        assert len(ok) == 8 and len(failed) == 1, results
        assert failed[0].code == "RESOURCE_EXHAUSTED"
        uuids = [
            next(v["value"] for v in r["environment"]["variables"] if v["name"] == "NVIDIA_VISIBLE_DEVICES")
            for r in ok.values()
        ]
        assert len(set(uuids)) == 8
    finally:
        for n in names:
            isolator.cleanup(container_id(n))
