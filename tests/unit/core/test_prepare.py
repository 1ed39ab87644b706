"""Prepare (isolator/core/prepare.py) in-process over the shipped fakes: what is booked, recorded and
granted, in that order; every refusal and failure half-way leaves nothing; nested and image containers.
"""

from __future__ import annotations

import re
from unittest import mock

import pytest
from hook_helpers import cid, free, gpus, granted, held, image, make_rig

from isolator.core import prepare
from isolator.errors import (
    AlreadyExists,
    CgroupError,
    FailedPrecondition,
    GpusExhausted,
    Internal,
    InvalidArgument,
    InvalidGpuCount,
    StateError,
)
from isolator.model import ContainerConfig, ContainerId, Resource, Topology
from isolator.testing import FakeInventory, Rig, fake_service
from volumes import inject


@pytest.fixture
def rig() -> Rig:
    return make_rig()


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


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize(
    "name", ["cgroup.procs", "tasks", "devices.allow", "notify_on_release", "cgroup.subtree_control"]
)
def test_an_id_that_names_a_cgroup_control_file_is_invalid_and_books_nothing(version: str, name: str) -> None:
    rig = fake_service("dgx-1", version=version)
    with pytest.raises(InvalidArgument, match="cannot name a cgroup"):
        rig.service.prepare(ContainerId.parse(name), gpus(1))
    assert rig.store.load() == {} and free(rig) == frozenset(range(8)) and rig.cgroups.cgroups == {}


def test_prepare_logs_its_own_time_step_by_step_in_order(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    # Every read of the monotonic clock moves it 1 ms: each step spends at least one of them.
    ticks = iter(range(1_000_000))
    rig.clock.monotonic = lambda: 1000.0 + next(ticks) / 1000  # type: ignore[method-assign]
    with caplog.at_level("INFO", logger="isolator.core.prepare"):
        rig.service.prepare(cid("a"), gpus(1))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepared container a ")]
    steps = re.findall(r"(booking|choice|state commit|rules|launch info) (\d+\.\d\d)", line)
    assert [name for name, _ in steps] == ["booking", "choice", "state commit", "rules", "launch info"], line
    assert all(float(ms) >= 1.0 for _, ms in steps), line
    total = float(re.search(r" in (\d+\.\d\d) ms \(booking", line).group(1))  # type: ignore[union-attr]
    assert total == pytest.approx(sum(float(ms) for _, ms in steps), abs=0.05)
