"""The cpuset edge's file protocol on a temp tree (isolator/cgroups/cpuset.py): which hierarchy it
picks, and on cgroup2 which ``cgroup.subtree_control`` files it writes. The kernel's own behaviour is
checked on real cgroups by tests/contract/test_contracts.py and tests/system/test_affinity.py; this machine's cgroup2
offers no cpuset, so the v2 file protocol is pinned here as well.
"""

from __future__ import annotations

import pytest

from isolator.cgroups.cpuset import CpusetController, find_cpuset
from isolator.errors import CgroupError
from isolator.model import ContainerId


def mounts(tmp_path, lines: list[str]) -> str:
    path = tmp_path / "mounts"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_find_cpuset_prefers_the_v1_hierarchy_then_cgroup2_offering_it(tmp_path) -> None:
    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("hugetlb\n")
    hybrid = [
        "cgroup /sys/fs/cgroup/cpuset cgroup rw,relatime,cpuset 0 0",
        f"cgroup2 {v2} cgroup2 rw,relatime 0 0",
    ]
    assert find_cpuset(mounts(tmp_path, hybrid)) == ("v1", "/sys/fs/cgroup/cpuset")
    assert find_cpuset(mounts(tmp_path, hybrid[1:])) is None, "cgroup2 without the controller"
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert find_cpuset(mounts(tmp_path, hybrid[1:])) == ("v2", str(v2))


def v2_tree(tmp_path, offered: str = "cpuset memory") -> str:
    mount = tmp_path / "cg2"
    root = mount / "mesos"
    root.mkdir(parents=True)
    for d in (mount, root):
        (d / "cgroup.controllers").write_text(offered + "\n")
        (d / "cgroup.subtree_control").write_text("\n")
    return str(mount)


def test_v2_enables_cpuset_below_the_root_and_writes_the_containers_cpus_and_mems(tmp_path) -> None:
    mount = v2_tree(tmp_path)
    ctl = CpusetController(mount, "mesos", "v2")
    a = ContainerId.parse("a")
    ctl.apply(a, frozenset({2, 3}), frozenset({1}))
    assert (tmp_path / "cg2" / "mesos" / "cgroup.subtree_control").read_text() == "+cpuset"
    assert (tmp_path / "cg2" / "cgroup.subtree_control").read_text() == "\n", "above our root: untouched"
    assert (tmp_path / "cg2" / "mesos" / "a" / "cpuset.cpus").read_text() == "2-3"
    got = ctl.current(a)
    assert got is not None and (got.cpu_list, got.mem_list) == ("2-3", "1")


def test_v2_refuses_when_the_controller_is_not_offered_below_the_mount(tmp_path) -> None:
    mount = v2_tree(tmp_path, offered="memory")
    with pytest.raises(CgroupError, match="cpuset controller is not offered"):
        CpusetController(mount, "mesos", "v2").apply(ContainerId.parse("a"), frozenset({0}), frozenset({0}))


def test_an_empty_set_is_never_written(tmp_path) -> None:
    ctl = CpusetController(v2_tree(tmp_path), "mesos", "v2")
    with pytest.raises(CgroupError, match="never written"):
        ctl.apply(ContainerId.parse("a"), frozenset(), frozenset({0}))
    assert not ctl.exists(ContainerId.parse("a"))
