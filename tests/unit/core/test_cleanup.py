"""Cleanup (isolator/core/cleanup.py) in-process over the shipped fakes: rules, record, then the GPUs;
idempotent, and fine for a container never prepared.
"""

from __future__ import annotations

import pytest
from hook_helpers import cid, free, gpus, granted, held, image, make_rig

from isolator.errors import (
    CgroupBusy,
    CgroupError,
    StateError,
)
from isolator.model import ContainerConfig
from isolator.testing import Rig, fake_service


@pytest.fixture
def rig() -> Rig:
    return make_rig()


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
