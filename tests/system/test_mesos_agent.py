"""What a real Mesos agent sends, through the real bridge executables, against the sidecar in mesos mode.

The harness plays the agent: its ContainerConfig JSON is written field by field from Mesos's protos
the way stout serialises them (isolator/testing/mesos_json.py), the module's IN/OUT/ERR protocol runs the
installed ``gpu-isolator-<method>`` executables, and ``MesosCgroups`` makes the cgroups and places
the pids as Mesos's cgroups isolator and launcher do (v1: 1.6+ layout; v2: master's). Each container
then runs the check program and reports what it can open and which environment it got.

One scenario per kind of container the agent launches: a command task, a task group under the
default executor with its nested task, a DEBUG container, a custom executor, and a nested container
with ``LinuxInfo.share_cgroups = false``.
"""

from __future__ import annotations

import os

import pytest
from cgroup_helpers import Prober

from isolator.bridge import install
from isolator.testing.mesos import (
    BridgeIsolator,
    Containerizer,
    GrpcIsolator,
    HookFailed,
    MesosCgroups,
    affinity_hint_only,
    container_id,
)
from isolator.testing.sidecar import running_sidecar

pytestmark = [pytest.mark.root]

VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]
GPUS = 8
# An image that sets its own paths, as CUDA images do (nvidia/cuda sets both).
IMAGE_ENV = [
    "PATH=/opt/conda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LD_LIBRARY_PATH=/opt/conda/lib",
    "NVIDIA_VISIBLE_DEVICES=all",
]


# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("agent",)


@pytest.fixture(params=VERSIONS, scope="module")
def agent(request):
    version = request.param
    with running_sidecar("dgx-1", version, extra=("--mode", "mesos")) as sidecar:
        bridge_dir = os.path.join(sidecar.work, "bridge")
        install(bridge_dir, sidecar.bridge_socket)
        isolator = BridgeIsolator(bridge_dir, sidecar.work)
        cgroups = MesosCgroups(version, sidecar.cgroup_parent)
        yield sidecar, Containerizer(isolator, sidecar.work, cgroups)


def host_nodes(sidecar) -> list[str]:
    return [f"{sidecar.dev_root}/nvidia{i}" for i in range(GPUS)]


def granted(sidecar, opens: dict[str, str]) -> list[int]:
    """GPU minors the container could open (a simulated node answers ENXIO once the cgroup lets it through)."""
    out = []
    for i, node in enumerate(host_nodes(sidecar)):
        assert opens[node] in ("ENXIO", "EPERM"), opens
        if opens[node] == "ENXIO":
            out.append(i)
    return out


def variables(environment: dict | None) -> dict[str, str]:
    return {v["name"]: v["value"] for v in (environment or {}).get("variables", [])}


@pytest.mark.parametrize("mesos", ["1.6", "1.9", "1.11", "master"])
def test_command_task_gets_the_volume_environment_in_task_environment_over_the_images_own(agent, mesos):
    _sidecar, containerizer = agent
    config = containerizer.config(gpus=2, kind="command", env=IMAGE_ENV, version=mesos)
    launched = containerizer.launch(container_id(f"command-{mesos}"), config, ["/dev/nvidiactl"])
    assert launched.exit_code == 0, launched.stderr
    info = launched.launch_info
    # Mesos's isolator: a command task's env goes in task_environment, where the command executor
    # applies it over docker/runtime's (the image's PATH); in `environment` the image's would win.
    assert "environment" not in info
    ours = variables(info["task_environment"])
    assert ours["PATH"] == IMAGE_ENV[0].removeprefix("PATH=") + ":/usr/local/nvidia/bin"
    env = launched.report["env"]
    assert env["PATH"] == ours["PATH"]
    assert env["LD_LIBRARY_PATH"] == ours["LD_LIBRARY_PATH"]
    assert env["LD_LIBRARY_PATH"].split(":")[0] == "/opt/conda/lib"  # the image's, kept first
    assert env["LD_LIBRARY_PATH"].split(":")[-2:] == ["/usr/local/nvidia/lib", "/usr/local/nvidia/lib64"]
    assert "nvidia-smi" in launched.report["nvidia_bin"]
    gpus = sorted(n for n in launched.report["dev"] if n.startswith("nvidia") and n[6:].isdigit())
    assert len(gpus) == 2


def test_image_asking_for_the_volume_only_by_its_label_gets_it(agent):
    _sidecar, containerizer = agent
    config = containerizer.config(
        gpus=1, env=["PATH=/usr/bin:/bin"], labels={"com.nvidia.volumes.needed": "nvidia_driver"}
    )
    assert config["docker"]["manifest"]["config"]["Labels"] == {"com.nvidia.volumes.needed": "nvidia_driver"}
    launched = containerizer.launch(container_id("by-label"), config, [])
    assert launched.exit_code == 0, launched.stderr
    assert "nvidia-smi" in launched.report["nvidia_bin"]
    assert launched.report["env"]["PATH"] == "/usr/bin:/bin:/usr/local/nvidia/bin"


def test_image_labelled_for_a_newer_cuda_than_the_driver_is_refused_and_holds_nothing(agent):
    _sidecar, containerizer = agent
    labels = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "99.0"}
    config = containerizer.config(gpus=8, env=["PATH=/usr/bin:/bin"], labels=labels)
    with pytest.raises(HookFailed) as info:
        containerizer.launch(container_id("cuda-99"), config, [])
    assert info.value.code == "FAILED_PRECONDITION"
    assert "the image needs CUDA 99.0 (label com.nvidia.cuda.version)" in info.value.message
    # Nothing was allocated: all eight are there for the next container.
    launched = containerizer.launch(container_id("all-eight"), containerizer.config(gpus=8, image=False), [])
    assert launched.exit_code == 0, launched.stderr


def test_custom_executor_gets_its_gpus_and_the_volume_environment_in_environment(agent):
    _sidecar, containerizer = agent
    config = containerizer.config(gpus=3, kind="custom", env=IMAGE_ENV)
    launched = containerizer.launch(container_id("custom"), config, ["/dev/nvidiactl"])
    assert launched.exit_code == 0, launched.stderr
    info = launched.launch_info
    assert "task_environment" not in info
    assert variables(info["environment"])["PATH"].endswith(":/usr/local/nvidia/bin")
    assert launched.report["env"]["PATH"] == IMAGE_ENV[0].removeprefix("PATH=") + ":/usr/local/nvidia/bin"
    assert launched.report["opens"]["/dev/nvidiactl"] == "ENXIO"
    assert len([n for n in launched.report["dev"] if n.startswith("nvidia") and n[6:].isdigit()]) == 3


def test_task_group_under_the_default_executor_and_its_nested_tasks_use_the_executors_gpus(agent):
    sidecar, containerizer = agent
    executor = container_id("default-executor")
    launched = containerizer.start(executor, containerizer.config(gpus=2, kind="default-executor", image=False))
    try:
        assert affinity_hint_only(launched.launch_info)  # no image: the host's /dev, gated by the cgroup
        containerizer.run(launched, launched.config, host_nodes(sidecar))
        assert launched.exit_code == 0, launched.stderr
        mine = granted(sidecar, launched.report["opens"])
        assert len(mine) == 2

        # A task with an image: the volume and exactly the executor's device nodes, env in `environment`.
        task = container_id(["default-executor", "trainer"])
        nested = containerizer.start(task, containerizer.config(gpus=2, kind="task", env=IMAGE_ENV))
        try:
            containerizer.run(nested, nested.config, [f"/dev/nvidia{i}" for i in range(GPUS)])
            assert nested.exit_code == 0, nested.stderr
            assert "task_environment" not in nested.launch_info
            assert nested.report["env"]["PATH"].endswith(":/usr/local/nvidia/bin")
            assert "nvidia-smi" in nested.report["nvidia_bin"]
            opens = nested.report["opens"]
            assert sorted(i for i in range(GPUS) if opens[f"/dev/nvidia{i}"] == "ENXIO") == mine
            assert all(opens[f"/dev/nvidia{i}"] == "ENOENT" for i in range(GPUS) if i not in mine)
        finally:
            containerizer.destroy(task)

        # A task without an image shares the host's /dev: only the cgroup keeps it to the executor's GPUs.
        sidecar_task = container_id(["default-executor", "sidecar"])
        plain = containerizer.start(sidecar_task, containerizer.config(gpus=None, kind="task", image=False))
        try:
            containerizer.run(plain, plain.config, host_nodes(sidecar))
            assert plain.exit_code == 0, plain.stderr
            assert granted(sidecar, plain.report["opens"]) == mine
            # v1: it shares the executor's cgroup; v2 (master): its own leaf, not below the executor's.
            if containerizer.cgroups.version == "v1":
                assert plain.cgroup == containerizer.cgroups.path(["default-executor"])
            else:
                assert plain.cgroup.endswith("/default-executor/mesos/sidecar/leaf")
        finally:
            containerizer.destroy(sidecar_task)
    finally:
        containerizer.destroy(executor)


def test_debug_container_gets_no_launch_info_and_exactly_its_parents_gpus(agent):
    sidecar, containerizer = agent
    executor = container_id("debugged")
    launched = containerizer.start(executor, containerizer.config(gpus=1, kind="custom", image=False))
    try:
        containerizer.run(launched, launched.config, host_nodes(sidecar))
        mine = granted(sidecar, launched.report["opens"])
        assert len(mine) == 1
        debug = container_id(["debugged", "debug-shell"])
        config = containerizer.config(gpus=None, container_class="DEBUG")
        assert config["container_class"] == "DEBUG" and "rootfs" not in config
        session = containerizer.start(debug, config)
        try:
            assert session.launch_info is None  # Mesos: DEBUG containers inherit everything
            containerizer.run(session, config, host_nodes(sidecar))
            assert session.exit_code == 0, session.stderr
            assert granted(sidecar, session.report["opens"]) == mine
        finally:
            containerizer.destroy(debug)
    finally:
        containerizer.destroy(executor)


def test_nested_container_with_cgroups_of_its_own_gets_the_rules_there_and_isolate_finds_its_pid(agent):
    sidecar, containerizer = agent
    cgroups = containerizer.cgroups
    executor = container_id("own-cgroups")
    launched = containerizer.start(executor, containerizer.config(gpus=2, kind="default-executor", image=False))
    try:
        containerizer.run(launched, launched.config, host_nodes(sidecar))
        mine = granted(sidecar, launched.report["opens"])
        task = container_id(["own-cgroups", "isolated-task"])
        config = containerizer.config(gpus=2, kind="task", image=False, share_cgroups=False)
        assert config["container_info"]["linux_info"] == {"share_cgroups": False}
        nested = containerizer.start(task, config)
        try:
            own = cgroups.path(["own-cgroups", "isolated-task"])
            if cgroups.version == "v1":
                # Mesos made it deny-all plus its defaults: the GPUs are there only if we added them.
                with open(os.path.join(own, "devices.list")) as fh:
                    listed = fh.read().splitlines()
                assert len([r for r in listed if r.startswith("c 195:") and not r.startswith("c 195:255")]) == 2
            containerizer.run(nested, config, host_nodes(sidecar))
            assert nested.exit_code == 0, nested.stderr
            assert nested.cgroup == (own if cgroups.version == "v1" else os.path.join(own, "leaf"))
            assert granted(sidecar, nested.report["opens"]) == mine
        finally:
            containerizer.destroy(task)
    finally:
        containerizer.destroy(executor)


def test_debug_container_below_a_nested_container_with_cgroups_of_its_own_runs_in_that_cgroup(agent):
    # Mesos's cgroups isolator (findCgroupInfo) puts a sharing or DEBUG container's pid in its closest
    # ancestor with cgroups of its own; isolate used to wait for it in the top-level cgroup and fail.
    sidecar, containerizer = agent
    cgroups = containerizer.cgroups
    executor = container_id("debug-below")
    launched = containerizer.start(executor, containerizer.config(gpus=1, kind="default-executor", image=False))
    try:
        containerizer.run(launched, launched.config, host_nodes(sidecar))
        mine = granted(sidecar, launched.report["opens"])
        task = container_id(["debug-below", "task"])
        config = containerizer.config(gpus=1, kind="task", image=False, share_cgroups=False)
        nested = containerizer.start(task, config)
        try:
            containerizer.run(nested, config, host_nodes(sidecar))
            assert nested.exit_code == 0, nested.stderr
            debug = container_id(["debug-below", "task", "debug"])
            debug_config = containerizer.config(gpus=None, kind="debug", image=False)
            shell = containerizer.start(debug, debug_config)
            try:
                containerizer.run(shell, debug_config, host_nodes(sidecar))
                assert shell.exit_code == 0, shell.stderr
                own = cgroups.path(["debug-below", "task"])
                if cgroups.version == "v1":
                    assert shell.cgroup == own, "the task's cgroup, not the executor's"
                assert granted(sidecar, shell.report["opens"]) == mine
            finally:
                containerizer.destroy(debug)
        finally:
            containerizer.destroy(task)
    finally:
        containerizer.destroy(executor)


def test_nested_container_with_cgroups_of_its_own_that_mesos_did_not_make_is_refused(agent):
    _sidecar, containerizer = agent
    executor = container_id("no-nested-cgroup")
    containerizer.start(executor, containerizer.config(gpus=1, kind="default-executor", image=False))
    try:
        config = containerizer.config(gpus=1, kind="task", image=False, share_cgroups=False)
        # Straight to the sidecar: the agent's cgroups isolator never made the nested cgroup.
        with pytest.raises(HookFailed) as info:
            containerizer.isolator.prepare(container_id(["no-nested-cgroup", "t"]), config)
        assert info.value.code == "FAILED_PRECONDITION"
        assert "share_cgroups=false" in info.value.message
    finally:
        containerizer.destroy(executor)


def test_update_of_the_top_level_container_reaches_nested_cgroups_of_their_own(agent):
    # The module does not forward update; gRPC callers do. A nested cgroup of its own must follow a
    # shrink at once (on v2 its program is not below the parent's, so nothing else would revoke).
    sidecar, containerizer = agent
    grpc_isolator = GrpcIsolator(sidecar.socket)
    cgroups = containerizer.cgroups
    executor = container_id("updated")
    prober = Prober()
    try:
        containerizer.start(executor, containerizer.config(gpus=1, kind="default-executor", image=False))
        task = container_id(["updated", "worker"])
        containerizer.start(task, containerizer.config(gpus=None, kind="task", image=False, share_cgroups=False))
        cgroups.place(["updated", "worker"], prober.pid)
        grpc_isolator.isolate(task, prober.pid)

        def opened() -> list[int]:
            return granted(sidecar, prober.open_errnos(host_nodes(sidecar)))

        assert len(opened()) == 1
        grpc_isolator.update(executor, 3)
        assert len(opened()) == 3
        grpc_isolator.update(executor, 0)
        assert opened() == []
    finally:
        prober.close()
        containerizer.destroy(container_id(["updated", "worker"]))
        containerizer.destroy(executor)
        grpc_isolator.close()


def test_task_group_before_mesos_1_9_gets_no_gpus_through_this_route(agent):
    # Before 1.9 the agent did not add a task group's resources to the default executor's, so its
    # GPUs could only arrive through update, which the module does not forward (docs/mesos-agent.md).
    sidecar, containerizer = agent
    config = containerizer.config(gpus=2, kind="default-executor", image=False, version="1.8")
    assert not [r for r in config["resources"] if r["name"] == "gpus"]
    launched = containerizer.launch(container_id("task-group-1.8"), config, host_nodes(sidecar))
    assert launched.exit_code == 0, launched.stderr
    assert granted(sidecar, launched.report["opens"]) == []
