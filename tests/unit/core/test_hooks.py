"""The Mesos hooks of the core, in-process over the shipped fakes: every path and every error path.

No root, no cgroups, no daemon: ``make test-unit`` runs this as any user. What the "kernel" grants
is read from the fake cgroup backend; faults are injected at named steps (isolator/testing/faults.py).
"""

from __future__ import annotations

from unittest import mock

import pytest

from isolator.core import prepare
from isolator.errors import (
    AlreadyExists,
    CgroupBusy,
    CgroupError,
    CgroupVanished,
    ContainerGone,
    FailedPrecondition,
    GpusExhausted,
    Internal,
    InvalidArgument,
    InvalidGpuCount,
    NotFound,
    NvmlError,
    PermissionDenied,
    StateError,
)
from isolator.host.system import EmptyInventory
from isolator.model import ContainerConfig, ContainerId, Resource, Topology
from isolator.policy.devices import NVIDIA_MAJOR, DeviceRule, permits
from isolator.testing import FakeInventory, Rig, fake_service
from volumes import inject


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def gpus(n: float) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpus", n), Resource("cpus", 1.0)))


def image(n: float, rootfs: str = "/rootfs/a", *env: str) -> ContainerConfig:
    return ContainerConfig(
        resources=(Resource("gpus", n),), rootfs=rootfs, image_env=env or ("NVIDIA_VISIBLE_DEVICES=all",)
    )


def granted(rig: Rig, c: ContainerId) -> list[int] | None:
    """GPU minors the fake kernel lets ``c`` read and write; None when it has no cgroup."""
    rules = rig.cgroups.rules_of(c)
    if rules is None:
        return None
    return [m for m in range(16) if permits(rules, DeviceRule.char(NVIDIA_MAJOR, m, "rw"))]


def held(rig: Rig, c: ContainerId) -> list[int]:
    rec = rig.store.get(c)
    return sorted(rec.holding.gpus) if rec is not None else []


def free(rig: Rig) -> frozenset[int]:
    return rig.service.core.booking.available


@pytest.fixture
def rig() -> Rig:
    return fake_service("dgx-1")


# ---- prepare ------------------------------------------------------------------------------------


def test_prepare_records_then_grants_exactly_the_allocated_gpus(rig: Rig) -> None:
    a = cid("a")
    assert rig.service.prepare(a, gpus(2)) is None  # no image: the host's /dev, gated by the cgroup
    assert held(rig, a) == [0, 3] == granted(rig, a)  # topology: an NV2 pair that keeps 1-2 (NV2) for the next pair
    rec = rig.store.get(a)
    assert rec is not None and (rec.state, rec.mode, rec.cgroup_version) == ("prepared", "standalone", 1)
    assert rec.created == rig.clock.time()
    assert rec.rules == tuple(rig.cgroups.rules_of(a) or ())
    control = {str(r) for r in rig.cgroups.rules_of(a) or ()}
    assert {"c 195:255 rwm", "c 510:0 rwm", "c 510:1 rwm"} <= control, "control devices, as Mesos"
    assert free(rig) == frozenset(range(8)) - {0, 3}


def test_prepare_with_zero_gpus_grants_the_control_devices_only(rig: Rig) -> None:
    rig.service.prepare(cid("z"), gpus(0))
    assert granted(rig, cid("z")) == [] and held(rig, cid("z")) == []
    assert "c 195:255 rwm" in {str(r) for r in rig.cgroups.rules_of(cid("z")) or ()}


def test_prepare_on_a_host_without_gpus_grants_mesos_defaults_only() -> None:
    rig = fake_service(inventory=FakeInventory(Topology(gpus=())))
    rig.service.prepare(cid("a"), gpus(0))
    assert not any(r.major == 195 for r in rig.cgroups.rules_of(cid("a")) or ())
    with pytest.raises(GpusExhausted, match="Requested 1 gpus but only 0 available"):
        rig.service.prepare(cid("b"), gpus(1))


def test_prepare_twice_is_already_exists_and_changes_nothing(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    with pytest.raises(AlreadyExists):
        rig.service.prepare(cid("a"), gpus(3))
    assert held(rig, cid("a")) == granted(rig, cid("a")) and len(held(rig, cid("a"))) == 1


@pytest.mark.parametrize("count", [0.5, -1.0, float("nan"), float("inf"), 2.0**40])
def test_prepare_refuses_a_bad_gpu_count_with_mesos_message_before_anything(rig: Rig, count: float) -> None:
    with pytest.raises(InvalidGpuCount, match="The 'gpus' resource must be an unsigned integer"):
        rig.service.prepare(cid("a"), gpus(count))
    assert rig.store.load() == {} and rig.cgroups.cgroups == {}


def test_prepare_beyond_what_is_free_is_exhausted_and_leaves_nothing(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(6))
    with pytest.raises(GpusExhausted):
        rig.service.prepare(cid("b"), gpus(3))
    assert rig.store.get(cid("b")) is None and not rig.cgroups.exists(cid("b"))
    assert len(free(rig)) == 2


@pytest.mark.parametrize(
    ("edge", "step", "error"),
    [
        ("store", "record", StateError),
        ("cgroups", "prepare", CgroupError),
        ("cgroups", "apply", CgroupError),
        ("volumes", "acquire", Internal),  # the volumes package's error, mapped by its code
    ],
)
def test_a_failure_half_way_through_prepare_undoes_everything(rig: Rig, edge: str, step: str, error: type) -> None:
    rig.filesystem.make_dirs("/rootfs/a")
    getattr(rig, edge).faults.fail_at(step)
    with pytest.raises(error, match="injected fault"):
        rig.service.prepare(cid("a"), image(2))
    assert rig.store.get(cid("a")) is None, "the record is gone"
    assert not rig.cgroups.exists(cid("a")), "the cgroup is gone"
    assert free(rig) == frozenset(range(8)), "the GPUs are free"
    assert not rig.volumes.in_use_by("a")
    rig.service.cleanup(cid("a"))  # and the following cleanup succeeds
    rig.service.prepare(cid("b"), gpus(8))  # and every GPU can be prepared again


def test_prepare_records_before_the_kernel_grants(rig: Rig) -> None:
    seen = []
    real_apply = rig.cgroups.apply

    def apply(c, rules):
        seen.append(rig.store.get(c))
        real_apply(c, rules)

    rig.cgroups.apply = apply  # type: ignore[method-assign]
    rig.service.prepare(cid("a"), gpus(1))
    assert seen and seen[0] is not None and seen[0].holding.gpus == frozenset(held(rig, cid("a")))


def test_prepare_with_an_image_mounts_the_volume_and_only_the_allocated_nodes(rig: Rig) -> None:
    rig.filesystem.make_dirs("/rootfs/a")
    info = rig.service.prepare(cid("a"), image(2))
    assert info is not None
    targets = [m.target for m in info.mounts]
    assert targets[0] == "/rootfs/a/usr/local/nvidia"
    assert info.mounts[0].source == "/fake/volumes/nvidia_535.104.05"
    assert targets[1:] == [
        "/rootfs/a/dev/nvidia0",
        "/rootfs/a/dev/nvidia3",
        "/rootfs/a/dev/nvidiactl",
        "/rootfs/a/dev/nvidia-uvm",
        "/rootfs/a/dev/nvidia-uvm-tools",
    ]
    assert dict(info.environment)["LD_LIBRARY_PATH"].endswith("/usr/local/nvidia/lib64")
    assert rig.filesystem.is_dir("/rootfs/a/usr/local/nvidia")
    assert rig.store.get(cid("a")).volume_version == "535.104.05"  # type: ignore[union-attr]
    assert rig.volumes.in_use_by("a")


def test_prepare_with_an_image_not_asking_for_the_volume_gets_device_nodes_only(rig: Rig) -> None:
    rig.filesystem.make_dirs("/rootfs/a")
    info = rig.service.prepare(cid("a"), image(1, "/rootfs/a", "PATH=/bin"))
    assert info is not None and info.environment == ()
    assert info.mounts[0].target == "/rootfs/a/dev/nvidia0"
    assert not rig.volumes.in_use_by("a")


def test_prepare_refuses_a_missing_rootfs_and_a_too_new_cuda_before_allocating(rig: Rig) -> None:
    with pytest.raises(InvalidArgument, match="rootfs '/rootfs/nope' does not exist"):
        rig.service.prepare(cid("a"), image(1, "/rootfs/nope"))
    rig.filesystem.make_dirs("/rootfs/a")
    with pytest.raises(FailedPrecondition, match=r"12\.2"):
        rig.service.prepare(
            cid("a"), image(1, "/rootfs/a", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_REQUIRE_CUDA=cuda>=12.4")
        )
    assert rig.store.load() == {} and free(rig) == frozenset(range(8))


def test_prepare_decides_on_the_driver_volume_once(rig: Rig) -> None:
    # Issue 27: the decision (should_inject, check_cuda) is taken before anything is allocated and
    # not again when the volume is mounted. "Was not called again": counted where each is looked up.
    rig.filesystem.make_dirs("/rootfs/a")
    decide, check = mock.Mock(wraps=inject.should_inject), mock.Mock(wraps=inject.check_cuda)
    with (
        mock.patch.object(inject, "should_inject", decide),
        mock.patch.object(inject, "check_cuda", check),
        mock.patch.object(prepare, "should_inject", decide),
        mock.patch.object(prepare, "check_cuda", check),
    ):
        info = rig.service.prepare(cid("a"), image(1))
    assert info is not None and any(m.target == "/rootfs/a/usr/local/nvidia" for m in info.mounts)
    assert (decide.call_count, check.call_count) == (1, 1)


def test_prepare_on_a_mig_host_grants_and_mounts_the_mig_capabilities() -> None:
    rig = fake_service("dgx-a100")
    mig_gpus = [r.gpu.minor for r in rig.inventory.records if r.mig_enabled]
    assert mig_gpus, "dgx-a100 ships MIG-enabled GPUs"
    rig.filesystem.make_dirs("/rootfs/a")
    rig.service.prepare(cid("a"), image(8))
    caps = [r for r in rig.cgroups.rules_of(cid("a")) or () if r.major == 511]
    assert caps, "the nvidia-caps nodes of the MIG devices are granted"


def test_nested_containers_use_their_parents_gpus_and_debug_ones_get_nothing(rig: Rig) -> None:
    rig.filesystem.make_dirs("/rootfs/a")
    rig.filesystem.make_dirs("/rootfs/child")
    rig.service.prepare(cid("a"), gpus(2))
    assert rig.service.prepare(cid("a.debug"), ContainerConfig(container_class="DEBUG", rootfs="/rootfs/x")) is None
    info = rig.service.prepare(cid("a.child"), image(0, "/rootfs/child"))
    assert info is not None
    assert "/rootfs/child/dev/nvidia0" in [m.target for m in info.mounts]
    assert rig.volumes.in_use_by("a.child")
    assert rig.store.get(cid("a.child")) is None, "a nested container is never recorded"


@pytest.mark.parametrize("container_class", ["DEFAULT", "DEBUG"])
def test_a_nested_prepare_whose_top_level_container_was_never_prepared_is_refused(
    rig: Rig, container_class: str
) -> None:
    rig.filesystem.make_dirs("/rootfs/child")
    config = ContainerConfig(
        resources=(Resource("gpus", 0.0),), rootfs="/rootfs/child", container_class=container_class
    )
    with pytest.raises(FailedPrecondition, match="top-level container b was never prepared"):
        rig.service.prepare(cid("b.child"), config)
    assert not rig.volumes.in_use_by("b.child") and rig.store.load() == {}


def test_a_failed_nested_prepare_releases_its_volume(rig: Rig) -> None:
    rig.filesystem.make_dirs("/rootfs/child")
    rig.service.prepare(cid("a"), gpus(1))
    rig.filesystem.make_dirs = lambda path: (_ for _ in ()).throw(OSError("read-only"))  # type: ignore[method-assign]
    with pytest.raises(OSError):
        rig.service.prepare(cid("a.child"), image(0, "/rootfs/child"))
    assert not rig.volumes.in_use_by("a.child")


# ---- isolate --------------------------------------------------------------------------------------


def test_isolate_places_the_pid_and_marks_the_container_isolated(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    pid = rig.processes.spawn()
    rig.service.isolate(cid("a"), pid)
    assert rig.cgroups.pids(cid("a")) == (pid,)
    assert rig.store.get(cid("a")).state == "isolated"  # type: ignore[union-attr]


@pytest.mark.parametrize("pid", [-1, 0, 1, 1 << 22])
def test_isolate_refuses_an_impossible_pid(rig: Rig, pid: int) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    with pytest.raises(InvalidArgument, match=f"pid {pid} is not a valid container pid"):
        rig.service.isolate(cid("a"), pid)


def test_isolate_refuses_a_pid_that_is_gone_and_an_unknown_container(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    with pytest.raises(FailedPrecondition, match="does not exist"):
        rig.service.isolate(cid("a"), 4242)
    with pytest.raises(NotFound, match="unknown container nobody"):
        rig.service.isolate(cid("nobody"), rig.processes.spawn())


def test_isolate_that_fails_to_place_the_pid_keeps_the_container_prepared(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    rig.cgroups.faults.fail_at("add_pid")
    with pytest.raises(CgroupError):
        rig.service.isolate(cid("a"), rig.processes.spawn())
    assert rig.store.get(cid("a")).state == "prepared"  # type: ignore[union-attr]


def test_isolate_of_a_nested_container_on_v1_uses_the_top_level_cgroup(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    pid = rig.processes.spawn()
    rig.service.isolate(cid("a.child"), pid)
    assert rig.cgroups.pids(cid("a")) == (pid,)


def test_mesos_mode_isolate_waits_for_mesos_to_place_the_pid() -> None:
    rig = fake_service(mode="mesos")
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    pid = rig.processes.spawn()
    with pytest.raises(FailedPrecondition, match=f"pid {pid} is not in the cgroup"):
        rig.service.isolate(a, pid)
    assert rig.clock.slept >= 2.0, "it waited the settle time (on the manual clock, at once)"
    # It looked again after 1 ms, then twice as long each time, up to 20 ms.
    assert rig.clock.sleeps[:7] == [0.001, 0.002, 0.004, 0.008, 0.016, 0.02, 0.02]
    rig.cgroups.add_pid(a, pid)  # Mesos's cgroups isolator did it
    rig.service.isolate(a, pid)
    assert rig.store.get(a).state == "isolated"  # type: ignore[union-attr]


# ---- update ---------------------------------------------------------------------------------------


def test_update_grows_by_adding_and_shrinks_by_revoking(rig: Rig) -> None:
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    first = held(rig, a)
    rig.service.update(a, [Resource("gpus", 3.0)])
    assert len(held(rig, a)) == 3 and set(first) <= set(held(rig, a)) and granted(rig, a) == held(rig, a)
    rig.service.update(a, [Resource("gpus", 1.0)])
    assert len(held(rig, a)) == 1 and granted(rig, a) == held(rig, a)
    rig.service.update(a, [Resource("gpus", 0.0)])
    assert held(rig, a) == [] == granted(rig, a) and free(rig) == frozenset(range(8))


def test_update_beyond_what_is_free_is_exhausted_and_changes_nothing(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(6))
    rig.service.prepare(cid("b"), gpus(1))
    before = held(rig, cid("b"))
    with pytest.raises(GpusExhausted):
        rig.service.update(cid("b"), [Resource("gpus", 4.0)])
    assert held(rig, cid("b")) == before == granted(rig, cid("b"))


def test_update_refuses_nested_unknown_and_bad_counts(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    with pytest.raises(FailedPrecondition, match="nested"):
        rig.service.update(cid("a.child"), [Resource("gpus", 1.0)])
    with pytest.raises(NotFound):
        rig.service.update(cid("nobody"), [Resource("gpus", 1.0)])
    with pytest.raises(InvalidGpuCount):
        rig.service.update(cid("a"), [Resource("gpus", 1.5)])


@pytest.mark.parametrize(("edge", "step"), [("store", "add_gpus"), ("cgroups", "apply")])
def test_a_grow_that_fails_gives_the_new_gpus_back(rig: Rig, edge: str, step: str) -> None:
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    before = held(rig, a)
    getattr(rig, edge).faults.fail_at(step)
    with pytest.raises((StateError, CgroupError)):
        rig.service.update(a, [Resource("gpus", 3.0)])
    assert held(rig, a) == before == granted(rig, a)
    assert free(rig) == frozenset(range(8)) - set(before)


def test_a_shrink_whose_revocation_fails_keeps_the_gpus_recorded(rig: Rig) -> None:
    a = cid("a")
    rig.service.prepare(a, gpus(3))
    before = held(rig, a)
    rig.cgroups.faults.fail_at("apply")
    with pytest.raises(CgroupError):
        rig.service.update(a, [Resource("gpus", 1.0)])
    assert held(rig, a) == before == granted(rig, a), "never release what the kernel still grants"


# ---- watch, usage, status -------------------------------------------------------------------------


def test_watch_answers_nothing_until_a_held_gpu_becomes_unhealthy(rig: Rig) -> None:
    a = cid("a")
    rig.service.prepare(a, gpus(2))
    assert rig.service.watch(a) is None
    rig.inventory.xid(7, 79)  # not one of a's
    assert rig.service.watch(a) is None
    rig.inventory.xid(held(rig, a)[0], 79)
    limitation = rig.service.watch(a)
    assert limitation is not None and limitation.gpus == 1
    assert limitation.reason == "REASON_CONTAINER_LIMITATION"
    assert "XID 79" in limitation.message and "container a holds a GPU that became unhealthy" in limitation.message
    assert rig.service.watch(cid("a.child")) is not None, "a nested container watches its parent's GPUs"


def test_subscribers_hear_of_their_containers_going_away_and_of_every_health_change(rig: Rig) -> None:
    # What a waiting Watch waits on (the transport's Watch awaits these callbacks; the core never waits).
    a, b = cid("a"), cid("b")
    rig.service.prepare(a, gpus(1))
    rig.service.prepare(b, gpus(1))
    heard: list[str] = []
    stop_a = rig.service.subscribe(lambda: heard.append("a"), cid("a.child"))  # by its top-level container
    stop_all = rig.service.subscribe(lambda: heard.append("all"))
    assert rig.service.core.changes.listeners() == 2
    rig.service.cleanup(b)
    assert heard == ["all"], "b going away is not a's business"
    rig.inventory.xid(held(rig, a)[0], 79)
    assert sorted(heard[1:]) == ["a", "all"]
    assert rig.service.watch(a) is not None  # what a woken Watch re-checks
    rig.service.cleanup(a)
    assert sorted(heard[3:]) == ["a", "all"]
    stop_a()
    stop_all()
    stop_a()  # idempotent
    assert rig.service.core.changes.listeners() == 0
    rig.inventory.xid(0, 79)
    assert len(heard) == 5


def test_a_failing_subscriber_does_not_fail_the_hook(rig: Rig) -> None:
    a = cid("a")
    rig.service.prepare(a, gpus(1))

    def broken() -> None:
        raise RuntimeError("listener bug")

    stop = rig.service.subscribe(broken, a)
    rig.service.cleanup(a)  # told, and the cleanup still succeeds
    assert rig.store.get(a) is None
    stop()


def test_watch_of_an_unknown_container(rig: Rig) -> None:
    with pytest.raises(NotFound):
        rig.service.watch(cid("nobody"))
    assert rig.service.watch(cid("nobody.child")) is None


def test_watch_of_a_container_cleaned_up_lately_is_told_apart_from_an_unknown_one(rig: Rig) -> None:
    # criteo's module polls Watch once more after each Cleanup; the servicer answers that poll "no
    # limitation" when it sees ContainerGone (tests/system/test_bridge.py), and NOT_FOUND to gRPC.
    a, failed = cid("a"), cid("failed")
    rig.service.prepare(a, gpus(1))
    rig.service.cleanup(a)
    with pytest.raises(ContainerGone):
        rig.service.watch(a)
    # Also after a cleanup of a container that was never prepared (its prepare failed).
    with pytest.raises(GpusExhausted):
        rig.service.prepare(failed, gpus(9))
    rig.service.cleanup(failed)
    with pytest.raises(ContainerGone):
        rig.service.watch(failed)
    # A container never seen is plainly unknown, and one cleaned up is never prepared again (Mesos
    # never reuses an ID: such a Prepare is stale, tests/system/test_stale_hooks.py).
    with pytest.raises(NotFound) as unknown:
        rig.service.watch(cid("nobody"))
    assert not isinstance(unknown.value, ContainerGone)
    with pytest.raises(FailedPrecondition, match="was cleaned up"):
        rig.service.prepare(a, gpus(1))
    with pytest.raises(ContainerGone):
        rig.service.watch(a)


def test_usage_and_status_report_the_held_gpus(rig: Rig) -> None:
    a = cid("a")
    rig.service.prepare(a, gpus(2))
    minor = held(rig, a)[0]
    rig.inventory.set_usage(minor, memory_used=1 << 30, utilization=40)
    usage = rig.service.usage(a)
    assert usage.timestamp == rig.clock.time()
    assert [g.minor for g in usage.gpus] == held(rig, a)
    assert (usage.gpus[0].memory_used_bytes, usage.gpus[0].utilization_percent) == (1 << 30, 40)
    status = rig.service.status(a)
    assert status.state == "prepared" and len(status.gpu_uuids) == 2
    assert rig.service.status(cid("a.child")) == status
    rig.inventory.lose_nvml()
    with pytest.raises(NvmlError):
        rig.service.usage(a)
    for call in (rig.service.usage, rig.service.status):
        with pytest.raises(NotFound):
            call(cid("nobody"))


def test_usage_of_a_container_without_gpus_is_empty() -> None:
    rig = fake_service(inventory=EmptyInventory())  # type: ignore[arg-type]
    rig.service.prepare(cid("a"), gpus(0))
    assert rig.service.usage(cid("a")).gpus == ()


# ---- cleanup ----------------------------------------------------------------------------------------


def test_cleanup_removes_the_cgroup_then_the_record_then_frees_the_gpus(rig: Rig) -> None:
    a = cid("a")
    rig.filesystem.make_dirs("/rootfs/a")
    rig.service.prepare(a, image(2))
    rig.service.cleanup(a)
    assert not rig.cgroups.exists(a) and rig.store.get(a) is None and free(rig) == frozenset(range(8))
    assert not rig.volumes.in_use_by("a")
    rig.service.cleanup(a)  # idempotent
    rig.service.cleanup(cid("never-seen"))  # MESOS-6059


def test_cleanup_of_a_nested_container_releases_only_its_volume(rig: Rig) -> None:
    rig.filesystem.make_dirs("/rootfs/child")
    rig.service.prepare(cid("a"), gpus(1))
    rig.service.prepare(cid("a.child"), image(0, "/rootfs/child"))
    rig.service.cleanup(cid("a.child"))
    assert not rig.volumes.in_use_by("a.child") and len(held(rig, cid("a"))) == 1


def test_cleanup_that_cannot_remove_the_cgroup_keeps_the_record_and_the_grant(rig: Rig) -> None:
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    rig.service.isolate(a, rig.processes.spawn())
    with pytest.raises(CgroupBusy):
        rig.service.cleanup(a)
    assert len(held(rig, a)) == 1 and granted(rig, a) == held(rig, a)
    rig.cgroups.faults.fail_at("cleanup")
    with pytest.raises(CgroupError):
        rig.service.cleanup(a)
    assert len(held(rig, a)) == 1


def test_cleanup_whose_record_removal_fails_leaves_the_gpus_booked(rig: Rig) -> None:
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    rig.store.faults.fail_at("remove")
    with pytest.raises(StateError):
        rig.service.cleanup(a)
    assert len(held(rig, a)) == 1 and free(rig) == frozenset(range(8)) - set(held(rig, a))
    rig.service.cleanup(a)  # Mesos retries; the cgroup is already gone, the record goes now
    assert rig.store.get(a) is None and free(rig) == frozenset(range(8))


def test_a_volume_release_failure_does_not_fail_cleanup(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    rig.volumes.faults.fail_at("release")
    rig.service.cleanup(cid("a"))
    assert rig.store.get(cid("a")) is None


# ---- issue 16: isolation holds under faults ---------------------------------------------------------


def test_a_grow_whose_state_write_fails_after_the_grant_revokes_it(rig: Rig) -> None:
    # core.grants.apply grants in the kernel, then records the rules: the record fails after the grant.
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    before = held(rig, a)
    rig.store.faults.fail_at("update", container=a)
    with pytest.raises(StateError):
        rig.service.update(a, [Resource("gpus", 3.0)])
    assert granted(rig, a) == before, "the kernel must not keep GPUs the record let go"
    assert held(rig, a) == before and free(rig) == frozenset(range(8)) - set(before)


@pytest.mark.parametrize("mode", ["standalone", "mesos"])
def test_prepare_refuses_a_cgroup_that_already_has_processes(mode: str) -> None:
    # Left behind by a forced release, or made by someone else under our root: its processes would
    # get the new GPUs at once, without any Isolate.
    rig = fake_service("dgx-1", mode=mode)
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    squatter = rig.processes.spawn()
    rig.cgroups.add_pid(a, squatter)
    with pytest.raises(FailedPrecondition, match=rf"already has processes \[{squatter}\]"):
        rig.service.prepare(a, gpus(2))
    assert granted(rig, a) == [] and rig.store.get(a) is None and free(rig) == frozenset(range(8))
    rig.cgroups.kill(squatter)
    rig.service.prepare(a, gpus(2))
    assert len(granted(rig, a) or []) == 2


@pytest.mark.parametrize("container_class", ["DEFAULT", "DEBUG"])
def test_v1_a_container_sharing_the_cgroups_of_a_nested_one_with_its_own_isolates_there(container_class: str) -> None:
    # Mesos 1.10+ on v1 (cgroups isolator, findCgroupInfo): a nested container that shares cgroups
    # (share_cgroups=true, or any DEBUG container) joins its closest ancestor with cgroups of its own;
    # below a nested container with share_cgroups=false that is that container's, not the top-level one.
    rig = fake_service("dgx-1", mode="mesos")
    a, b, c = cid("a"), cid("a.b"), cid("a.b.c")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(2))
    rig.cgroups.mesos_creates(b)  # a/mesos/b: share_cgroups=false
    rig.service.prepare(b, ContainerConfig(share_cgroups=False))
    b_pid = rig.processes.spawn()
    rig.cgroups.add_pid(b, b_pid)
    rig.service.isolate(b, b_pid)
    rig.service.prepare(c, ContainerConfig(container_class=container_class))
    c_pid = rig.processes.spawn()
    rig.cgroups.add_pid(b, c_pid)  # Mesos's cgroups isolator: the closest ancestor with cgroups
    rig.service.isolate(c, c_pid)
    assert granted(rig, b) == held(rig, a)


def test_mesos_nested_cgroups_of_their_own_follow_every_update_of_their_top_level_container() -> None:
    rig = fake_service("dgx-1", mode="mesos")
    a, b, c = cid("a"), cid("a.b"), cid("a.b.c")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    rig.cgroups.mesos_creates(b)  # share_cgroups=false: a/mesos/b
    rig.service.prepare(b, ContainerConfig(share_cgroups=False))
    rig.service.prepare(c, ContainerConfig())  # shares b's
    core = rig.service.core
    assert core.grants.nested_cgroups(a) == [b]
    assert (core.grants.governing(b), core.grants.governing(c), core.grants.governing(cid("a.x"))) == (b, b, a)
    assert granted(rig, b) == held(rig, a)
    rig.service.update(a, [Resource("gpus", 3.0)])
    assert len(held(rig, a)) == 3 and granted(rig, b) == held(rig, a)
    rig.cgroups.faults.fail_at("apply", container=b)  # the nested cgroup cannot take the grow: no GPUs, never more
    rig.service.update(a, [Resource("gpus", 4.0)])
    assert granted(rig, b) == [] and len(granted(rig, a) or []) == 4
    rig.service.update(a, [Resource("gpus", 0.0)])
    assert granted(rig, a) == [] == granted(rig, b)
    rig.service.cleanup(c)
    rig.service.cleanup(b)
    assert rig.cgroups.rules_of(b) == rig.cgroups.base, "only Mesos's whitelist is left in its cgroup"
    rig.service.cleanup(a)
    assert rig.store.get(a) is None and free(rig) == frozenset(range(8))


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_mesos_cleanup_of_a_top_level_container_before_its_nested_ones_leaves_them_no_gpus(version: str) -> None:
    # Mesos destroys nested containers first, but a parent cleaned up first (an orphan, an
    # operator) frees its GPUs for others: a nested cgroup of its own must not keep granting them
    # (on v2 its program is not below the parent's leaf, so nothing else would revoke them).
    rig = fake_service("dgx-1", mode="mesos", version=version)
    a, b = cid("a"), cid("a.b")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(2))
    rig.cgroups.mesos_creates(b)
    rig.service.prepare(b, ContainerConfig(share_cgroups=False))
    assert granted(rig, b) == held(rig, a) != []
    rig.service.cleanup(a)
    assert free(rig) == frozenset(range(8))
    assert granted(rig, b) == [], "the freed GPUs are still granted to the nested container"
    rig.service.cleanup(b)


# ---- nested containers with cgroups of their own (mesos mode, share_cgroups=false) ---------------


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_nested_cgroup_follows_its_top_level_containers_grants(version: str) -> None:
    rig = fake_service("dgx-1", mode="mesos", version=version)
    a, child = cid("a"), cid("a.task")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    rig.cgroups.mesos_creates(child)  # the agent makes <a>/mesos/task for the nested container
    core = rig.service.core
    assert core.grants.nested_cgroups(a) == [child]
    assert core.grants.governing(child) == child and core.grants.governing(cid("a.shared")) == a
    rig.service.update(a, [Resource("gpus", 2.0)])
    assert granted(rig, child) == held(rig, a) and len(held(rig, a)) == 2
    rig.service.update(a, [Resource("gpus", 0.0)])
    assert granted(rig, child) == [] == held(rig, a)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_apply_nested_gives_a_nested_cgroup_exactly_the_rules_asked(version: str) -> None:
    rig = fake_service("dgx-1", mode="mesos", version=version)
    a, child = cid("a"), cid("a.task")
    rig.cgroups.mesos_creates(a)
    rig.cgroups.mesos_creates(child)
    core = rig.service.core
    with core.locks.hold(child):
        if version == "v1":  # the kernel refuses a grant below beyond what the parent allows (EPERM)
            with pytest.raises(CgroupError):
                core.grants.apply_nested(child, core.grants.rules(frozenset({3})))
            rig.cgroups.apply(a, core.grants.rules(frozenset({3})))  # once the parent allows it, it passes
        core.grants.apply_nested(child, core.grants.rules(frozenset({3})))
    assert granted(rig, child) == [3]


def test_isolate_of_a_nested_container_with_its_own_cgroup_waits_for_the_pid_there() -> None:
    rig = fake_service("dgx-1", mode="mesos")
    a, child = cid("a"), cid("a.task")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    rig.cgroups.mesos_creates(child)
    pid = rig.processes.spawn()
    rig.cgroups.add_pid(child, pid)
    rig.service.isolate(child, pid)
    with pytest.raises(FailedPrecondition, match="is not in the cgroup"):
        rig.service.isolate(child, rig.processes.spawn())


def test_a_grow_into_a_vanished_cgroup_keeps_only_what_was_held(rig: Rig) -> None:
    # Nothing can be granted in a cgroup that is gone, so nothing granted needs revoking: the new
    # GPUs go back, the old ones stay recorded (the container may still live).
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    before = held(rig, a)
    rig.cgroups.vanish(a)
    with pytest.raises(NotFound):
        rig.service.update(a, [Resource("gpus", 2.0)])
    assert held(rig, a) == before and free(rig) == frozenset(range(8)) - set(before)


# ---- issue 16: which pids a standalone Isolate may move ---------------------------------------------


def test_isolate_never_moves_another_containers_process(rig: Rig) -> None:
    a, b = cid("a"), cid("b")
    rig.service.prepare(a, gpus(1))
    rig.service.prepare(b, gpus(1))
    b_init = rig.processes.spawn()
    rig.service.isolate(b, b_init)
    with pytest.raises(FailedPrecondition, match=f"pid {b_init} is in the cgroup '.*/b'"):
        rig.service.isolate(a, b_init)
    assert rig.cgroups.pids(b) == (b_init,) and rig.cgroups.pids(a) == ()


def test_isolate_never_moves_a_process_of_a_foreign_cgroup_under_our_root(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    rig.cgroups.prepare(cid("not-ours"))  # made by someone else under our root
    stranger = rig.processes.spawn()
    rig.cgroups.add_pid(cid("not-ours"), stranger)
    with pytest.raises(FailedPrecondition, match="not-ours"):
        rig.service.isolate(cid("a"), stranger)


def test_isolate_refuses_a_process_that_is_not_the_callers(rig: Rig) -> None:
    """Issue 26: a process someone placed in a cgroup of its own, outside our root, was moved."""
    rig.service.prepare(cid("a"), gpus(1))
    caller = rig.processes.spawn()
    stranger = rig.processes.spawn()  # a child of pid 1: nobody's descendant
    rig.cgroups.place(stranger, "/fake/cgroup/devices/elsewhere")
    with pytest.raises(PermissionDenied, match=f"pid {stranger} .*'/fake/cgroup/devices/elsewhere'.* not the caller's"):
        rig.service.isolate(cid("a"), stranger, caller)
    assert rig.cgroups.pids(cid("a")) == () and rig.cgroups.cgroup_of(stranger) == "/fake/cgroup/devices/elsewhere"


def test_isolate_moves_the_callers_own_descendant_or_a_process_of_its_cgroup(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    caller = rig.processes.spawn()
    rig.cgroups.place(caller, "/fake/cgroup/devices/agent.service")
    grandchild = rig.processes.spawn(parent=rig.processes.spawn(parent=caller))
    rig.cgroups.place(grandchild, "/fake/cgroup/devices/elsewhere")
    rig.service.isolate(cid("a"), grandchild, caller)
    sibling = rig.processes.spawn()  # the launcher's sibling, in the caller's cgroup
    rig.cgroups.place(sibling, "/fake/cgroup/devices/agent.service")
    rig.service.isolate(cid("a"), sibling, caller)
    assert rig.cgroups.pids(cid("a")) == tuple(sorted((grandchild, sibling)))


def test_isolate_by_an_unknown_remote_caller_moves_nothing_from_outside(rig: Rig) -> None:
    from isolator.model import UNKNOWN_CALLER

    rig.service.prepare(cid("a"), gpus(1))
    pid = rig.processes.spawn()
    with pytest.raises(PermissionDenied, match="the caller's own pid is unknown"):
        rig.service.isolate(cid("a"), pid, UNKNOWN_CALLER)
    rig.cgroups.add_pid(cid("a"), pid)  # already in the container: a retry, whoever asks
    rig.service.isolate(cid("a"), pid, UNKNOWN_CALLER)
    assert rig.cgroups.pids(cid("a")) == (pid,)


def test_isolate_never_moves_the_sidecar_or_its_ancestors(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    for pid in sorted(rig.processes.own - {1}):  # pid 1 is refused as INVALID_ARGUMENT before
        with pytest.raises(FailedPrecondition, match="the sidecar"):
            rig.service.isolate(cid("a"), pid)
    assert rig.cgroups.pids(cid("a")) == ()


def test_isolate_of_a_process_already_in_its_own_cgroup_is_a_retry(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    pid = rig.processes.spawn()
    rig.service.isolate(cid("a"), pid)
    rig.service.isolate(cid("a"), pid)
    assert rig.cgroups.pids(cid("a")) == (pid,)


def test_isolate_of_a_process_that_exits_during_the_move_fails(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(1))
    pid = rig.processes.spawn()
    real_add = rig.cgroups.add_pid

    def add_then_exit(c: ContainerId, p: int) -> None:
        real_add(c, p)
        rig.processes.exit(p)  # the pid may now name another process: the move is not trusted

    rig.cgroups.add_pid = add_then_exit  # type: ignore[method-assign]
    with pytest.raises(FailedPrecondition, match="exited while it was being isolated"):
        rig.service.isolate(cid("a"), pid)
    assert rig.store.get(cid("a")).state == "prepared"  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["standalone", "mesos"])
def test_isolate_refuses_a_kernel_thread(mode: str) -> None:
    rig = fake_service("dgx-1", mode=mode)
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    with pytest.raises(FailedPrecondition, match="pid 2 is a kernel thread"):
        rig.service.isolate(a, 2)
    assert rig.cgroups.pids(a) == () and rig.store.get(a).state == "prepared"  # type: ignore[union-attr]


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize(
    "name", ["cgroup.procs", "tasks", "devices.allow", "notify_on_release", "cgroup.subtree_control"]
)
def test_an_id_that_names_a_cgroup_control_file_is_invalid_and_books_nothing(version: str, name: str) -> None:
    rig = fake_service("dgx-1", version=version)
    with pytest.raises(InvalidArgument, match="cannot name a cgroup"):
        rig.service.prepare(ContainerId.parse(name), gpus(1))
    assert rig.store.load() == {} and free(rig) == frozenset(range(8)) and rig.cgroups.cgroups == {}


def test_mesos_update_is_not_failed_by_a_nested_cgroup_that_vanishes_meanwhile() -> None:
    # A task of a task group ends (Mesos removes its cgroup) while the executor's Update arrives:
    # nothing is granted in a cgroup that is gone, so the Update of its top-level container succeeds.
    rig = fake_service("dgx-1", mode="mesos")
    a, b = cid("a"), cid("a.b")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    rig.cgroups.mesos_creates(b)
    rig.service.prepare(b, ContainerConfig(share_cgroups=False))
    gone = CgroupVanished(op="write", path=rig.cgroups.cgroup_path(b))
    rig.cgroups.faults.fail_at("apply_nested", gone, container=b)
    rig.cgroups.faults.fail_at("apply", gone, container=b)
    rig.service.update(a, [Resource("gpus", 3.0)])
    assert len(held(rig, a)) == 3 and granted(rig, a) == held(rig, a)
