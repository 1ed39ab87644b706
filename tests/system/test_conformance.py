"""The containerizer's view: a real daemon on a simulated host, driven hook by hook as Mesos does.

Each container runs the check program inside a small rootfs in its own mount namespace, in the
cgroup the sidecar configured, and reports what it can open and see.
"""

from __future__ import annotations

import os

import pytest

from isolator.testing.mesos import (
    BridgeIsolator,
    Containerizer,
    GrpcIsolator,
    HookFailed,
    affinity_hint_only,
    container_id,
)
from isolator.testing.sidecar import running_sidecar

pytestmark = [pytest.mark.root]

VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]


# "bridge-c": the compiled bridge executable (isolator/bridge/bridge.c) instead of the Python one.
ROUTES = ["grpc", "bridge", "bridge-c"]


# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("agent",)


@pytest.fixture(
    params=[(v, r) for v in VERSIONS for r in ROUTES], ids=lambda p: f"{p[0].values[0]}-{p[1]}", scope="module"
)
def agent(request):
    # One daemon per cgroup version and route for the module: every test cleans up its containers.
    version, route = request.param
    with running_sidecar("dgx-1", version.values[0]) as sidecar:
        if route == "grpc":
            isolator = GrpcIsolator(sidecar.socket)
        else:
            from isolator.bridge.command import compiled_bridge, install

            compiled = compiled_bridge() if route == "bridge-c" else None
            if route == "bridge-c" and compiled is None:
                pytest.fail("build/gpu-isolator-bridge is missing: run `make build` (it needs gcc)")
            bridge_dir = os.path.join(sidecar.work, "bridge")
            install(bridge_dir, sidecar.bridge_socket, compiled=compiled)
            isolator = BridgeIsolator(bridge_dir, sidecar.work)
        containerizer = Containerizer(isolator, sidecar.work)
        containerizer.recover()
        yield sidecar, containerizer
        isolator.close()


def all_gpu_nodes(n: int = 8) -> list[str]:
    return [f"/dev/nvidia{i}" for i in range(n)]


def test_container_with_two_gpus_opens_exactly_those_and_sees_the_volume(agent):
    _sidecar, containerizer = agent
    cid = container_id("two-gpus")
    launched = containerizer.launch(
        cid, containerizer.config(gpus=2), [*all_gpu_nodes(), "/dev/nvidiactl", "/dev/null"]
    )
    assert launched.exit_code == 0, launched.stderr
    report = launched.report
    opened = sorted(p for p, e in report["opens"].items() if e == "ENXIO" and "nvidia" in p and p[-1].isdigit())
    assert len(opened) == 2, report["opens"]
    denied = [p for p in all_gpu_nodes() if report["opens"][p] != "ENXIO"]
    # Nodes of unallocated GPUs are not even in the container's /dev (Mesos exposes them all).
    assert all(report["opens"][p] == "ENOENT" for p in denied), report["opens"]
    assert report["opens"]["/dev/nvidiactl"] == "ENXIO"
    assert report["opens"]["/dev/null"] == "OK"
    assert "nvidia-smi" in report["nvidia_bin"]
    assert "libnvidia-ml.so.1" in report["nvidia_lib64"]
    assert report["nvidia_writable"] == "EROFS"
    assert report["env"]["LD_LIBRARY_PATH"] == "/usr/local/cuda/compat:/usr/local/nvidia/lib:/usr/local/nvidia/lib64"
    assert report["env"]["PATH"].split(":")[-1] == "/usr/local/nvidia/bin"


def test_host_filesystem_container_is_gated_by_the_cgroup_alone(agent):
    sidecar, containerizer = agent
    nodes = [f"{sidecar.dev_root}/nvidia{i}" for i in range(8)]
    launched = containerizer.launch(container_id("no-image"), containerizer.config(gpus=1, image=False), nodes)
    assert launched.exit_code == 0, launched.stderr
    opens = launched.report["opens"]
    assert sorted(opens.values()).count("ENXIO") == 1, opens
    assert sorted(opens.values()).count("EPERM") == 7, opens
    assert affinity_hint_only(launched.launch_info)  # no image: nothing but the CPU affinity hint
    assert launched.report["nvidia_dir"] is None


def test_container_with_zero_gpus_opens_none_but_keeps_the_control_devices(agent):
    sidecar, containerizer = agent
    nodes = [f"{sidecar.dev_root}/nvidia{i}" for i in range(8)] + [f"{sidecar.dev_root}/nvidiactl"]
    launched = containerizer.launch(container_id("zero"), containerizer.config(gpus=0, image=False), nodes)
    assert launched.exit_code == 0, launched.stderr
    opens = launched.report["opens"]
    assert [opens[n] for n in nodes[:8]] == ["EPERM"] * 8
    # Mesos grants the control devices even with 0 GPUs so that nvidia-smi works.
    assert opens[nodes[8]] == "ENXIO"


def test_image_without_nvidia_env_gets_device_nodes_but_no_volume(agent):
    _sidecar, containerizer = agent
    config = containerizer.config(gpus=1, env=["PATH=/usr/bin:/bin"])
    launched = containerizer.launch(container_id("plain-image"), config, ["/dev/nvidiactl"])
    assert launched.exit_code == 0, launched.stderr
    assert launched.report["nvidia_dir"] is None
    assert launched.report["env"]["LD_LIBRARY_PATH"] is None


def test_failed_prepare_leaves_nothing_allocated_and_cleanup_succeeds(agent):
    _sidecar, containerizer = agent
    with pytest.raises(HookFailed) as info:
        containerizer.launch(container_id("greedy"), containerizer.config(gpus=9), [])
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert "Requested 9 gpus but only 8 available" in info.value.message
    # All eight are still there for the next container.
    launched = containerizer.launch(container_id("all"), containerizer.config(gpus=8, image=False), [])
    assert launched.exit_code == 0, launched.stderr


def test_second_prepare_of_the_same_container_is_already_exists(agent):
    _sidecar, containerizer = agent
    cid = container_id("twice")
    containerizer.isolator.prepare(cid, containerizer.config(gpus=1, image=False))
    try:
        with pytest.raises(HookFailed) as info:
            containerizer.isolator.prepare(cid, containerizer.config(gpus=1, image=False))
        assert info.value.code == "ALREADY_EXISTS"
    finally:
        containerizer.isolator.cleanup(cid)


@pytest.mark.parametrize("gpus", [-1, 1.5, float("nan"), 2.0**63])
def test_bad_gpu_counts_are_refused_with_mesos_message(agent, gpus):
    _sidecar, containerizer = agent
    with pytest.raises(HookFailed) as info:
        containerizer.launch(container_id("bad-count"), containerizer.config(gpus=gpus, image=False), [])
    assert info.value.code == "INVALID_ARGUMENT"
    assert "The 'gpus' resource must be an unsigned integer" in info.value.message


def test_rootfs_that_does_not_exist_is_refused(agent):
    _sidecar, containerizer = agent
    config = containerizer.config(gpus=1)
    config["rootfs"] = "/nonexistent/rootfs"
    with pytest.raises(HookFailed) as info:
        containerizer.launch(container_id("no-rootfs"), config, [])
    assert info.value.code == "INVALID_ARGUMENT"
    assert "/nonexistent/rootfs" in info.value.message


def test_isolate_of_a_pid_that_is_gone_is_refused(agent):
    _sidecar, containerizer = agent
    cid = container_id("gone")
    containerizer.isolator.prepare(cid, containerizer.config(gpus=1, image=False))
    try:
        with pytest.raises(HookFailed) as info:
            containerizer.isolator.isolate(cid, 4_000_000)
        assert info.value.code in ("FAILED_PRECONDITION", "INVALID_ARGUMENT")
    finally:
        containerizer.isolator.cleanup(cid)


def test_cleanup_of_a_container_never_prepared_succeeds(agent):
    _sidecar, containerizer = agent
    containerizer.isolator.cleanup(container_id("never-seen"))
    containerizer.isolator.cleanup(container_id(["parent", "child"]))


@pytest.mark.parametrize("kind", ["task", "debug"])
def test_nested_container_runs_with_exactly_its_top_level_containers_gpus(agent, kind):
    # Standalone mode makes no nested cgroups: a task of a task group, or a DEBUG container, runs in
    # its top-level container's cgroup (Isolate places it there) and opens exactly its GPUs.
    sidecar, containerizer = agent
    nodes = [f"{sidecar.dev_root}/nvidia{i}" for i in range(8)]
    parent = container_id(f"group-{kind}")
    launched = containerizer.start(parent, containerizer.config(gpus=2, kind="default-executor", image=False))
    try:
        child = container_id([f"group-{kind}", "child"])
        nested = containerizer.start(child, containerizer.config(gpus=None, kind=kind, image=False))
        try:
            assert affinity_hint_only(nested.launch_info)
            containerizer.run(nested, nested.config, nodes)
            assert nested.exit_code == 0, nested.stderr
            opens = nested.report["opens"]
            assert sorted(opens.values()) == ["ENXIO"] * 2 + ["EPERM"] * 6, opens
        finally:
            containerizer.destroy(child)
    finally:
        containerizer.destroy(parent)
    assert affinity_hint_only(launched.launch_info)  # no image: nothing but the CPU affinity hint
