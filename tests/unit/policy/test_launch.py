"""The launch environment (isolator/policy/launch.py): pure, the container's kind and its devices in,
a LaunchInfo out."""

from __future__ import annotations

from isolator.model import LaunchInfo, MigDevice, Mount
from isolator.policy import launch
from isolator.policy.affinity import Affinity

UNITS = (
    MigDevice("GPU-p", "MIG-b", 2, 0, parent_index=1, parent_minor=1),
    MigDevice("GPU-p", "MIG-a", 1, 0, parent_index=1, parent_minor=1),
)
LOCAL = (("GPU_ISOLATOR_CPUS", "0-3"), ("GPU_ISOLATOR_NUMA_NODES", "0"))
VISIBLE = (("NVIDIA_VISIBLE_DEVICES", "MIG-a,MIG-b"),)
MOUNTS = (Mount("/r/usr/local/nvidia", "/v"), Mount("/r/dev/nvidia0", "/dev/nvidia0"))


def test_mig_holders_see_their_devices_in_order_and_others_see_nothing_added() -> None:
    assert launch.visible_env(UNITS) == VISIBLE
    assert launch.visible_env(iter(UNITS)) == VISIBLE
    assert launch.visible_env(()) == ()


def test_locality_is_the_affinity_environment_or_nothing() -> None:
    assert launch.locality_env(Affinity(frozenset({0, 1, 2, 3}), frozenset({0}))) == LOCAL
    assert launch.locality_env(None) == ()


def test_a_host_container_with_nothing_to_add_gets_none() -> None:
    assert launch.on_host(False, (), ()) is None
    assert launch.on_host(True, (), ()) is None


def test_a_host_container_gets_its_devices_and_locality_in_its_environment() -> None:
    assert launch.on_host(False, VISIBLE, LOCAL) == LaunchInfo(environment=VISIBLE + LOCAL)
    assert launch.on_host(False, VISIBLE, ()) == LaunchInfo(environment=VISIBLE)
    assert launch.on_host(True, VISIBLE, ()) == LaunchInfo(environment=VISIBLE)


def test_a_host_command_task_gets_its_locality_through_the_task_environment() -> None:
    assert launch.on_host(True, VISIBLE, LOCAL) == LaunchInfo(environment=VISIBLE, task_environment=LOCAL)
    assert launch.on_host(True, (), LOCAL) == LaunchInfo(environment=(), task_environment=LOCAL)


def test_an_image_gets_its_mounts_and_the_volumes_environment_with_the_mig_holders_devices_winning() -> None:
    volume_env = (("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64"), ("NVIDIA_VISIBLE_DEVICES", "all"))
    info = launch.in_image(False, list(MOUNTS), volume_env, VISIBLE, LOCAL)
    assert info == LaunchInfo(
        environment=(("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64"), *VISIBLE, *LOCAL), mounts=MOUNTS
    )
    assert launch.in_image(False, (), volume_env, (), ()) == LaunchInfo(environment=volume_env[:1])


def test_an_image_command_task_gets_everything_in_its_task_environment() -> None:
    info = launch.in_image(True, MOUNTS, (("PATH", "/usr/local/nvidia/bin"),), VISIBLE, ())
    assert info == LaunchInfo(task_environment=(("PATH", "/usr/local/nvidia/bin"), *VISIBLE), mounts=MOUNTS)
    assert info.environment == ()
