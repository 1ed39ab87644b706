"""Hierarchy detection from /proc/self/mounts text, and Mesos's cgroup layout."""

from __future__ import annotations

import pytest

from isolator.cgroups.base import container_dir, mesos_relative_path
from isolator.cgroups.detect import parse_mounts, select
from isolator.errors import HierarchyError
from isolator.model import ContainerId

HYBRID = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/devices cgroup rw,relatime,devices 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
UNIFIED = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n"
V1_ONLY = "cgroup /sys/fs/cgroup/cpu,devices cgroup rw,cpu,devices 0 0\n"


def test_hybrid_host_is_detected_and_auto_follows_the_v1_devices_controller() -> None:
    mounts = parse_mounts(HYBRID)
    assert mounts.layout == "hybrid"
    assert select(mounts).version == "v1"
    assert select(mounts).mount == "/sys/fs/cgroup/devices"


def test_override_picks_v2_on_a_hybrid_host() -> None:
    assert select(parse_mounts(HYBRID), "v2").mount == "/sys/fs/cgroup/unified"


def test_unified_host_uses_v2() -> None:
    mounts = parse_mounts(UNIFIED)
    assert mounts.layout == "v2"
    assert select(mounts).mount == "/sys/fs/cgroup"


def test_co_mounted_v1_controllers_are_found() -> None:
    assert select(parse_mounts(V1_ONLY)).mount == "/sys/fs/cgroup/cpu,devices"


def test_escaped_mount_points_are_unescaped() -> None:
    assert parse_mounts("cgroup2 /mnt/my\\040cg cgroup2 rw 0 0\n").v2 == "/mnt/my cg"


@pytest.mark.parametrize(
    ("text", "override", "message"),
    [
        (UNIFIED, "v1", "no cgroup v1 'devices' hierarchy"),
        (V1_ONLY, "v2", "no cgroup2 hierarchy"),
        ("proc /proc proc rw 0 0\n", "auto", "nor a cgroup v1 'devices'"),
        (HYBRID, "v3", "not one of"),
    ],
)
def test_missing_hierarchy_is_a_typed_error(text: str, override: str, message: str) -> None:
    with pytest.raises(HierarchyError, match=message):
        select(parse_mounts(text), override)


@pytest.mark.parametrize(
    ("text", "override", "has"),
    [
        (UNIFIED, "v1", 'this host has cgroup2 alone at \'/sys/fs/cgroup\': set cgroup_version = "v2" or "auto"'),
        (V1_ONLY, "v2", 'this host has cgroup v1 alone: set cgroup_version = "v1" or "auto"'),
    ],
)
def test_a_version_the_host_does_not_mount_is_a_config_error_naming_what_it_has(text, override, has) -> None:
    """Seen on a node booted with cgroup2 alone (Debian 12's default) with the walkthrough's
    ``cgroup_version = "v1"``: the daemon exited 1, which the unit restarts, five times, until the
    start limit; the layout of a booted host does not change, so it is a configuration error (exit
    78, not restarted), and it says which version this host has."""
    from isolator.cli.exits import EXIT_CONFIG, exit_code_of

    with pytest.raises(HierarchyError) as caught:
        select(parse_mounts(text), override)
    assert exit_code_of(caught.value) == EXIT_CONFIG
    assert has in caught.value.message


def test_auto_on_a_host_without_any_hierarchy_is_not_a_config_error() -> None:
    from isolator.cli.exits import EXIT_ERROR, exit_code_of

    with pytest.raises(HierarchyError) as caught:
        select(parse_mounts("proc /proc proc rw 0 0\n"))
    assert exit_code_of(caught.value) == EXIT_ERROR


def test_nested_containers_map_to_mesos_cgroup_paths() -> None:
    top = ContainerId.parse("a")
    nested = ContainerId.parse("c", ContainerId.parse("b", top))
    assert mesos_relative_path(nested) == "a/mesos/b/mesos/c"
    assert container_dir("/sys/fs/cgroup/devices", "/mesos/", top) == "/sys/fs/cgroup/devices/mesos/a"
