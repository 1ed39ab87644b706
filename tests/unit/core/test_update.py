"""Update (isolator/core/update.py) in-process over the shipped fakes: grows booked, recorded, then granted;
shrinks revoked, then forgotten, then freed; a failure half-way gives back what it took. The same for
whole GPUs, MIG units and shares (which stay on their GPU).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hook_helpers import cid, free, gpus, granted, held, make_rig

from isolator.errors import (
    CgroupError,
    CgroupVanished,
    FailedPrecondition,
    GpusExhausted,
    InvalidGpuCount,
    NotFound,
    ResourceExhausted,
    StateError,
)
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.shares import SharesExhausted, parse_shared_gpus
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


# ---- shares (docs/sharing.md): to 0 released, the same kept, more or fewer on the same GPU ---------

# Time-sliced: a pooled holder of several shares grows and shrinks there (under MPS every sharer holds
# one share, test_mps_limits.py).
SHARED = parse_shared_gpus("4-7:4")  # dgx-1: GPUs 0-3 whole, 4-7 cut four ways


def shares(n: float) -> list[Resource]:
    """An executor's resources; with no shares left the agent names none (Mesos drops empty scalars)."""
    return [Resource("gpu_shares", n), Resource("cpus", 1.0)] if n else [Resource("cpus", 1.0)]


@pytest.fixture
def sharing() -> Rig:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=SHARED)
    rig.restart()
    return rig


def share_of(rig: Rig, c: ContainerId) -> tuple[int, int] | None:
    rec = rig.store.get(c)
    assert rec is not None
    share = rec.holding.share
    return None if share is None else (share.gpu, share.count)


def shares_booked(rig: Rig) -> dict[int, int]:
    booking = rig.service.core.booking
    with booking.lock:
        return {m: n for m, n in booking.shares_held().items() if n}


def test_an_update_to_zero_shares_releases_them_and_revokes_their_gpu(sharing: Rig) -> None:
    a = cid("a")
    sharing.service.prepare(a, ContainerConfig(resources=tuple(shares(2))))
    (gpu, _n) = share_of(sharing, a) or (None, 0)
    assert granted(sharing, a) == [gpu]
    sharing.service.update(a, shares(0))  # the agent shrinks the executor when its share task ends
    assert share_of(sharing, a) is None and granted(sharing, a) == [] and shares_booked(sharing) == {}
    assert sharing.service.inconsistencies() == []
    sharing.service.update(a, shares(0))  # and again: nothing held, nothing to do
    sharing.service.cleanup(a)
    assert sharing.store.get(a) is None and shares_booked(sharing) == {}


def test_an_update_with_the_same_shares_changes_nothing(sharing: Rig) -> None:
    a = cid("a")
    sharing.service.prepare(a, ContainerConfig(resources=tuple(shares(2))))
    before, rules = share_of(sharing, a), sharing.cgroups.rules_of(a)
    sharing.service.update(a, shares(2))
    assert share_of(sharing, a) == before and sharing.cgroups.rules_of(a) == rules
    assert shares_booked(sharing) == {before[0]: 2} if before else False


def test_an_update_grows_and_shrinks_shares_on_the_same_gpu(sharing: Rig) -> None:
    a = cid("a")
    sharing.service.prepare(a, ContainerConfig(resources=tuple(shares(1))))
    gpu = (share_of(sharing, a) or (-1, 0))[0]
    sharing.service.update(a, shares(3))
    assert share_of(sharing, a) == (gpu, 3) and granted(sharing, a) == [gpu] and shares_booked(sharing) == {gpu: 3}
    sharing.service.update(a, shares(1))
    assert share_of(sharing, a) == (gpu, 1) and granted(sharing, a) == [gpu] and shares_booked(sharing) == {gpu: 1}
    assert sharing.service.inconsistencies() == []


def test_a_share_grow_beyond_its_gpu_is_refused_naming_it_and_changes_nothing(sharing: Rig) -> None:
    a, b = cid("a"), cid("b")
    sharing.service.prepare(a, ContainerConfig(resources=tuple(shares(3))))
    gpu = (share_of(sharing, a) or (-1, 0))[0]
    index = next(g.index for g in sharing.inventory.topology().gpus if g.minor == gpu)
    for other in "cde":  # GPUs 5-7 take three each, then b goes to the least held: GPU 4, its last share
        sharing.service.prepare(cid(other), ContainerConfig(resources=tuple(shares(3))))
    sharing.service.prepare(b, ContainerConfig(resources=tuple(shares(1))))
    assert share_of(sharing, b) == (gpu, 1)
    with pytest.raises(SharesExhausted, match=rf"asks for 2 gpu_shares but holds 1 of GPU {index} \(.*0 free"):
        sharing.service.update(b, shares(2))  # GPU 7 has one free, but shares never move
    assert share_of(sharing, b) == (gpu, 1) and shares_booked(sharing)[gpu] == 4 and granted(sharing, b) == [gpu]


def test_a_share_grow_whose_record_fails_gives_the_shares_back(sharing: Rig) -> None:
    a = cid("a")
    sharing.service.prepare(a, ContainerConfig(resources=tuple(shares(1))))
    gpu = (share_of(sharing, a) or (-1, 0))[0]
    sharing.store.faults.fail_at("set_holding")
    with pytest.raises(StateError):
        sharing.service.update(a, shares(3))
    assert share_of(sharing, a) == (gpu, 1) and shares_booked(sharing) == {gpu: 1} and granted(sharing, a) == [gpu]


def test_a_release_of_shares_whose_revocation_fails_keeps_them(sharing: Rig) -> None:
    a = cid("a")
    sharing.service.prepare(a, ContainerConfig(resources=tuple(shares(2))))
    gpu = (share_of(sharing, a) or (-1, 0))[0]
    sharing.cgroups.faults.fail_at("apply")
    with pytest.raises(CgroupError):
        sharing.service.update(a, shares(0))
    assert share_of(sharing, a) == (gpu, 2) and shares_booked(sharing) == {gpu: 2} and granted(sharing, a) == [gpu]


def test_shares_released_by_an_update_stay_released_after_a_restart(sharing: Rig) -> None:
    a, b = cid("a"), cid("b")
    sharing.service.prepare(a, ContainerConfig(resources=tuple(shares(4))))
    sharing.service.update(a, shares(0))
    svc = sharing.restart()
    assert svc.inconsistencies() == []
    for name in "bcde":  # 16 shares in all are free again
        svc.prepare(cid(name), ContainerConfig(resources=tuple(shares(4))))
    assert share_of(sharing, b) is not None


# ---- MIG units (docs/mig.md): to 0 released, the same kept, a subset kept, more booked -------------


def mig(n: int, profile: str = "mig-1g.5gb") -> list[Resource]:
    return [Resource(profile, float(n)), Resource("cpus", 1.0)]


def units(rig: Rig, c: ContainerId) -> frozenset[str]:
    rec = rig.store.get(c)
    assert rec is not None
    return rec.holding.mig_uuids


def test_an_update_releases_keeps_shrinks_and_grows_mig_units() -> None:
    rig = fake_service("dgx-a100")
    a = cid("a")
    rig.service.prepare(a, ContainerConfig(resources=tuple(mig(3))))
    first = units(rig, a)
    rules = rig.cgroups.rules_of(a)
    rig.service.update(a, mig(3))
    assert units(rig, a) == first and rig.cgroups.rules_of(a) == rules
    rig.service.update(a, mig(1))
    assert units(rig, a) == {min(first)}, "a shrink keeps the lowest UUIDs"
    assert rig.service.inconsistencies() == []
    rig.service.update(a, mig(4))
    assert len(units(rig, a)) == 4 and min(first) in units(rig, a)
    assert rig.service.inconsistencies() == []
    rig.service.update(a, [Resource("cpus", 1.0)])
    assert units(rig, a) == frozenset() and rig.service.inconsistencies() == []
    rig.service.prepare(cid("b"), ContainerConfig(resources=tuple(mig(8))))  # every 1g.5gb free again


def test_a_mig_grow_beyond_what_is_free_is_refused_and_changes_nothing() -> None:
    rig = fake_service("dgx-a100")
    a = cid("a")
    rig.service.prepare(a, ContainerConfig(resources=tuple(mig(2))))
    rig.service.prepare(cid("b"), ContainerConfig(resources=tuple(mig(5))))
    before, rules = units(rig, a), rig.cgroups.rules_of(a)
    with pytest.raises(ResourceExhausted):
        rig.service.update(a, mig(4))
    assert units(rig, a) == before and rig.cgroups.rules_of(a) == rules
    rig.service.update(a, mig(3))  # the last one fits
    assert len(units(rig, a)) == 3 and before <= units(rig, a)


def test_a_mig_grow_whose_grant_fails_gives_the_units_back() -> None:
    rig = fake_service("dgx-a100")
    a = cid("a")
    rig.service.prepare(a, ContainerConfig(resources=tuple(mig(1))))
    before, rules = units(rig, a), rig.cgroups.rules_of(a)
    rig.cgroups.faults.fail_at("apply")
    with pytest.raises(CgroupError):
        rig.service.update(a, mig(2))
    assert units(rig, a) == before and rig.cgroups.rules_of(a) == rules
    rig.service.prepare(cid("b"), ContainerConfig(resources=tuple(mig(7))))  # the other seven are free


# ---- a whole-GPU shrink keeps the GPUs the container's processes use ------------------------------


def _shrunk_by_todays_rule(count: int, to: int) -> tuple[list[int], list[int]]:
    """(held, kept) by the rule that ignores use: the same rig, nothing running."""
    other = make_rig()
    other.service.prepare(cid("a"), gpus(count))
    before = held(other, cid("a"))
    other.service.update(cid("a"), [Resource("gpus", float(to))])
    return before, held(other, cid("a"))


def _run_on(rig: Rig, c: ContainerId, minor: int, pid: int, in_container: bool = True) -> None:
    if in_container:
        rig.cgroups.add_pid(c, pid)
    rig.inventory.start_process(rig.service.core.gpus[minor].index, pid, 512 << 20)


def test_a_shrink_keeps_the_gpu_its_remaining_process_uses_and_logs_what_it_dropped(rig: Rig, caplog) -> None:
    before, today = _shrunk_by_todays_rule(4, 1)
    a = cid("a")
    rig.service.prepare(a, gpus(4))
    assert held(rig, a) == before
    used = next(m for m in before if m not in today)  # a GPU today's rule would drop
    _run_on(rig, a, used, 4242)
    _run_on(rig, a, today[0], 999, in_container=False)  # a stranger's process counts for nothing
    with caplog.at_level("INFO", logger="isolator.core.update"):
        rig.service.update(a, [Resource("gpus", 1.0)])
    assert held(rig, a) == [used] == granted(rig, a)
    assert used not in free(rig)
    line = next(r.getMessage() for r in caplog.records if "drops GPUs" in r.getMessage())
    assert f"drops GPUs {sorted(set(before) - {used})}, keeps [{used}]" in line
    assert f"it keeps the GPUs its processes use [{used}]" in line


def test_a_shrink_with_nothing_or_everything_in_use_follows_todays_rule(rig: Rig) -> None:
    before, today = _shrunk_by_todays_rule(2, 1)
    a, b = cid("a"), cid("b")
    rig.service.prepare(a, gpus(2))
    rig.service.update(a, [Resource("gpus", 1.0)])
    assert held(rig, a) == today, "nothing in use"
    rig.service.update(a, [Resource("gpus", 0.0)])
    rig.service.prepare(b, gpus(2))
    assert held(rig, b) == before
    for pid, minor in enumerate(before, start=100):
        _run_on(rig, b, minor, pid)
    rig.service.update(b, [Resource("gpus", 1.0)])
    assert held(rig, b) == today, "everything in use"


def test_a_shrink_whose_process_list_fails_ignores_use_and_says_why(rig: Rig, caplog) -> None:
    before, today = _shrunk_by_todays_rule(4, 1)
    a = cid("a")
    rig.service.prepare(a, gpus(4))
    used = next(m for m in before if m not in today)
    _run_on(rig, a, used, 4242)
    rig.inventory.fail_gpu(rig.service.core.gpus[today[0]].index, "nvmlDeviceGetComputeRunningProcesses", 999)
    with caplog.at_level("INFO", logger="isolator.core.update"):
        rig.service.update(a, [Resource("gpus", 1.0)])
    assert held(rig, a) == today, "unknown use: the rule that ignores it, never a guess"
    assert any("is unknown" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
