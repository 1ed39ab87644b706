"""Update (isolator/core/update.py) in-process over the shipped fakes: grows booked, recorded, then granted;
shrinks revoked, then forgotten, then freed; a failure half-way gives back what it took.
"""

from __future__ import annotations

import pytest
from hook_helpers import cid, free, gpus, granted, held, make_rig

from isolator.errors import (
    CgroupError,
    CgroupVanished,
    FailedPrecondition,
    GpusExhausted,
    InvalidGpuCount,
    NotFound,
    StateError,
)
from isolator.model import ContainerConfig, Resource
from isolator.testing import Rig, fake_service


@pytest.fixture
def rig() -> Rig:
    return make_rig()


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
