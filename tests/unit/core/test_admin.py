"""The admin views of the core (gpus, topology, containers, describe, release, volume, health),
in-process over the fakes, and the service's lifecycle."""

from __future__ import annotations

import pytest

from isolator.errors import FailedPrecondition, NotFound
from isolator.host.system import EmptyInventory
from isolator.model import ContainerConfig, ContainerId, Resource, Topology
from isolator.policy.devices import NVIDIA_MAJOR, DeviceRule, permits
from isolator.testing import FakeInventory, Rig, fake_service


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def gpus(n: int, rootfs: str = "") -> ContainerConfig:
    env = ("NVIDIA_VISIBLE_DEVICES=all",) if rootfs else ()
    return ContainerConfig(resources=(Resource("gpus", float(n)),), rootfs=rootfs, image_env=env)


@pytest.fixture
def rig() -> Rig:
    return fake_service("dgx-1")


def test_list_gpus_shows_each_gpu_its_health_and_its_holder(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(2))
    rig.inventory.xid(7, 79, when=1.7e9)
    view = rig.service.list_gpus()
    assert (view.driver_version, view.cuda_driver_version) == ("535.104.05", "12.2")
    assert [g.index for g in view.gpus] == list(range(8))
    assert {g.minor: g.holder for g in view.gpus if g.holder} == {0: "a", 3: "a"}
    sick = view.gpus[7]
    assert (sick.healthy, sick.last_xid, sick.last_xid_time, sick.health_reason) == (False, 79, 1.7e9, "XID 79")
    assert view.gpus[0].numa_node == 0 and view.gpus[0].cpu_affinity == "0-19,40-59"


def test_topology_lists_every_pair_once_in_nvidia_smi_notation(rig: Rig) -> None:
    topo = rig.service.topology()
    assert topo.indices == tuple(range(8))
    assert len(topo.links) == 28 and all(k.a < k.b for k in topo.links)
    first = topo.links[0]
    assert (first.a, first.b, first.kind, first.nvlink_lanes) == (0, 1, "NV1", 1)
    assert topo.numa_nodes == (0, 0, 0, 0, 1, 1, 1, 1)


def test_views_of_a_host_without_gpus() -> None:
    rig = fake_service(inventory=EmptyInventory())  # type: ignore[arg-type]
    assert rig.service.list_gpus().gpus == () and rig.service.topology().links == ()
    detail = rig.service.health()[0].detail
    # Auto-discovery without NVML stops the start (exit 4): only the operator's gpus:0 gets here.
    assert detail.startswith("no GPUs managed") and "gpus:0" in detail and "auto-discovery" not in detail


def test_list_containers_shows_nested_containers_under_their_parent(rig: Rig) -> None:
    rig.filesystem.make_dirs("/rootfs/c")
    rig.service.prepare(cid("b"), gpus(1))
    rig.service.prepare(cid("a"), gpus(2))
    rig.service.prepare(cid("a.vol-child"), gpus(0, "/rootfs/c"))  # found through its volume user
    rig.cgroups.prepare(cid("a.cg-child"))  # found through the cgroup Mesos made for it
    rig.service.isolate(cid("a"), rig.processes.spawn())
    listed = rig.service.list_containers()
    assert [str(c.container_id) for c in listed] == ["a", "a.cg-child", "a.vol-child", "b"]
    a, cg_child, vol_child, _ = listed
    assert (a.state, a.gpu_minors, a.mode, a.nested) == ("isolated", (2, 3), "standalone", False)
    assert vol_child.nested and vol_child.gpu_minors == (2, 3) and vol_child.volume_version == "535.104.05"
    assert cg_child.cgroup == rig.cgroups.cgroup_path(cid("a.cg-child")), "v1: its own cgroup governs"
    assert a.created == rig.clock.time()


def test_describe_puts_the_record_beside_the_kernel(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(2))
    pid = rig.processes.spawn()
    rig.service.isolate(cid("a"), pid)
    d = rig.service.describe_container(cid("a"))
    assert d.rules_agree and d.only_kernel == () == d.only_recorded
    assert d.kernel_gpu_minors == (0, 3) and d.pids == (pid,)
    assert [g.minor for g in d.gpus] == [0, 3] and d.rules_cgroup == rig.cgroups.cgroup_path(cid("a"))
    assert d.recorded_rules == d.kernel_rules and "c 195:0 rwm" in d.recorded_rules

    rig.cgroups.grant_behind_our_back(
        cid("a"), tuple(r for r in rig.cgroups.rules_of(cid("a")) or () if str(r) != "c 195:3 rwm")
    )
    d = rig.service.describe_container(cid("a"))
    assert not d.rules_agree and d.only_recorded == ("c 195:3 rwm",) and d.kernel_gpu_minors == (0,)


def test_describe_of_a_container_whose_cgroup_is_gone(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    rig.cgroups.vanish(cid("a"))
    d = rig.service.describe_container(cid("a"))
    assert not d.rules_agree and d.kernel_source.startswith("none: ") and d.pids == ()


def test_describe_of_nested_and_unknown_containers(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    rig.cgroups.prepare(cid("a.child"))
    d = rig.service.describe_container(cid("a"))
    assert [str(c.container_id) for c in d.nested] == ["a.child"]
    child = rig.service.describe_container(cid("a.child"))
    assert child.container.nested and child.nested == ()
    for unknown in ("nobody", "a.nobody"):
        with pytest.raises(NotFound, match=f"unknown container {unknown}"):
            rig.service.describe_container(cid(unknown))


def test_release_refuses_a_container_with_processes_unless_forced(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(2))
    pid = rig.processes.spawn()
    rig.service.isolate(cid("a"), pid)
    with pytest.raises(FailedPrecondition, match=f"still has processes \\[{pid}\\]"):
        rig.service.release(cid("a"), force=False)
    released = rig.service.release(cid("a"), force=True)
    assert released.action == "revoked-kept-cgroup" and released.pids == (pid,)
    assert released.released_gpu_minors == (0, 3) and len(released.released_gpu_uuids) == 2
    kernel = rig.cgroups.rules_of(cid("a")) or ()
    assert rig.cgroups.exists(cid("a")) and not any(r.major == 195 and r.minor in (0, 3) for r in kernel)
    assert rig.store.get(cid("a")) is None and {0, 3} <= rig.service.core.booking.available


def test_release_of_an_idle_container_removes_its_cgroup(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    released = rig.service.release(cid("a"), force=False)
    assert released.action == "removed-cgroup" and "removed the cgroup" in released.detail
    assert not rig.cgroups.exists(cid("a"))


def test_release_in_mesos_mode_removes_only_our_rules() -> None:
    rig = fake_service("dgx-1", mode="mesos")
    rig.cgroups.mesos_creates(cid("a"))
    rig.service.prepare(cid("a"), gpus(1))
    pid = rig.processes.spawn()
    rig.cgroups.add_pid(cid("a"), pid)
    released = rig.service.release(cid("a"), force=True)
    assert "removed our device rules" in released.detail and "keep running without GPU access" in released.detail
    assert rig.cgroups.exists(cid("a"))


def test_release_refuses_nested_and_unknown_containers(rig: Rig) -> None:
    with pytest.raises(FailedPrecondition, match="release its top-level container a"):
        rig.service.release(cid("a.child"), force=True)
    with pytest.raises(NotFound):
        rig.service.release(cid("nobody"), force=True)


def test_volume_report(rig: Rig) -> None:
    rig.filesystem.make_dirs("/rootfs/a")
    rig.service.prepare(cid("a"), gpus(1, "/rootfs/a"))
    report = rig.service.volume()
    assert (report.driver_version, report.volume_root) == ("535.104.05", "/fake/volumes")
    assert [v["users"] for v in report.volumes] == [["a"]]


def test_volume_without_a_volume_root_is_a_failed_precondition() -> None:
    rig = fake_service("dgx-1")
    rig.volumes = None  # type: ignore[assignment]
    service = rig.restart()
    with pytest.raises(FailedPrecondition, match="--volume-root"):
        service.volume()
    rig.filesystem.make_dirs("/rootfs/a")
    with pytest.raises(FailedPrecondition, match="no volume root is configured"):
        service.prepare(cid("a"), gpus(1, "/rootfs/a"))
    assert service.list_containers() == []


def test_health_says_what_is_wrong(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    checks = {c.name: c for c in rig.service.health()}
    assert all(c.ok for c in checks.values()), checks
    assert checks["nvml"].detail == "driver 535.104.05, 8 GPUs managed, NVML sees 8, 0 not usable"
    assert checks["consistency"].detail == "records and kernel agree"

    rig.cgroups.vanish(cid("a"))
    rig.inventory.lose_nvml()
    rig.store.faults.fail_at("check")
    checks = {c.name: c for c in rig.service.health()}
    assert not checks["nvml"].ok and "NVML does not answer" in checks["nvml"].detail
    assert not checks["state"].ok and "injected fault" in checks["state"].detail
    assert not checks["consistency"].ok and "does not exist" in checks["consistency"].detail


def test_health_reports_a_kernel_that_grants_other_gpus_than_recorded(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    rig.cgroups.grant_behind_our_back(cid("a"), ())
    consistency = {c.name: c for c in rig.service.health()}["consistency"]
    assert not consistency.ok and consistency.detail == "container a: recorded GPUs [0], kernel grants []"


def test_an_inventory_without_a_driver_version_is_unhealthy() -> None:
    rig = fake_service(inventory=FakeInventory(FakeInventory.of_host("single").topology(), driver_version=""))
    assert not rig.service.health()[0].ok
    assert rig.service.list_gpus().gpus[0].uuid
    assert Topology(gpus=()) == FakeInventory(Topology(gpus=())).topology()


def test_close_closes_the_inventory_and_the_store(rig: Rig) -> None:
    rig.service.close()
    assert rig.inventory.closed and rig.store.closed


def test_mesos_forced_release_revokes_nested_cgroups_of_their_own_too() -> None:
    # v2: a nested cgroup's program is not below its top-level container's leaf; releasing the
    # top-level container's GPUs must not leave them granted there.
    rig = fake_service("dgx-1", mode="mesos", version="v2")
    a, b = cid("a"), cid("a.b")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, ContainerConfig(resources=(Resource("gpus", 2.0),)))
    rig.cgroups.mesos_creates(b)
    rig.service.prepare(b, ContainerConfig(share_cgroups=False))
    rig.cgroups.add_pid(b, rig.processes.spawn())
    rig.service.release(a, force=True)
    rules = rig.cgroups.rules_of(b) or ()
    assert not [m for m in range(8) if permits(rules, DeviceRule.char(NVIDIA_MAJOR, m, "rw"))]
