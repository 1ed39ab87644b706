"""Recovery in-process over the fakes: start-up booking, every Recover decision, and the reaper.

Each decision of isolator.policy.reconcile (revoke, reapply, release, mark orphan, keep) is driven through
the service with the fake kernel and store set up the way a crash or a restart leaves them.
"""

from __future__ import annotations

import pytest

from isolator.errors import CgroupError, ContainerGone, FailedPrecondition, GpusExhausted
from isolator.model import ContainerConfig, ContainerId, ContainerRecord, ContainerState, Holding, Resource
from isolator.policy.devices import NVIDIA_MAJOR, DeviceRule, container_rules, permits
from isolator.testing import Rig, fake_service


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def gpus(n: int) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpus", float(n)),))


def granted(rig: Rig, c: ContainerId) -> list[int] | None:
    rules = rig.cgroups.rules_of(c)
    if rules is None:
        return None
    return [m for m in range(16) if permits(rules, DeviceRule.char(NVIDIA_MAJOR, m, "rw"))]


def held(rig: Rig, c: ContainerId) -> list[int]:
    rec = rig.store.get(c)
    return sorted(rec.holding.gpus) if rec is not None else []


def rules_granting(rig: Rig, *minors: int) -> tuple[DeviceRule, ...]:
    return container_rules(rig.devices.control_devices(), minors)


def running(*names: str) -> list[ContainerState]:
    return [ContainerState(cid(n), pid=100 + i) for i, n in enumerate(names)]


# ---- start-up -----------------------------------------------------------------------------------


def test_a_restart_books_every_recorded_gpu_before_the_first_request() -> None:
    rig = fake_service("dgx-1")
    rig.service.prepare(cid("a"), gpus(6))
    service = rig.restart()  # the bridge route: Mesos never calls Recover
    assert service.core.booking.allocated == frozenset(held(rig, cid("a")))
    with pytest.raises(GpusExhausted):
        service.prepare(cid("b"), gpus(3))


def test_a_record_of_gpus_this_host_lacks_keeps_only_the_known_ones() -> None:
    rig = fake_service("dgx-1")
    rig.store.record(ContainerRecord(cid("a"), Holding(frozenset({1, 42})), mode="standalone"))
    service = rig.restart()
    assert service.core.booking.allocated == frozenset({1})


# ---- standalone Recover -------------------------------------------------------------------------


def test_recover_keeps_containers_whose_record_and_kernel_agree() -> None:
    rig = fake_service("dgx-1")
    rig.service.prepare(cid("a"), gpus(2))
    before = rig.cgroups.applied[:]
    result = rig.restart().recover([], [])
    assert (result.recovered, result.released) == (1, 0)
    assert granted(rig, cid("a")) == held(rig, cid("a"))
    assert rig.cgroups.applied == before, "nothing to re-apply"


def test_recover_remakes_the_cgroup_of_a_record_left_without_one() -> None:
    # A kill between recording and creating the cgroup (prepare), or between removing the cgroup and
    # forgetting the record (cleanup).
    rig = fake_service("dgx-1")
    rig.service.prepare(cid("a"), gpus(2))
    rig.cgroups.vanish(cid("a"))
    rig.restart().recover([], [])
    assert granted(rig, cid("a")) == held(rig, cid("a")) and len(held(rig, cid("a"))) == 2


def test_recover_reapplies_recorded_gpus_the_kernel_does_not_grant() -> None:
    # A kill between recording a grow (update) and granting it.
    rig = fake_service("dgx-1")
    rig.service.prepare(cid("a"), gpus(1))
    rig.store.add_gpus(cid("a"), [7])
    assert 7 not in (granted(rig, cid("a")) or [])
    rig.restart().recover([], [])
    assert granted(rig, cid("a")) == held(rig, cid("a")) and 7 in held(rig, cid("a"))
    assert DeviceRule.char(195, 7) in rig.store.get(cid("a")).rules  # type: ignore[union-attr]


def test_recover_revokes_what_the_kernel_grants_beyond_the_record() -> None:
    # Anything the kernel grants that is not recorded is revoked (a kill between a grant and its record).
    rig = fake_service("dgx-1")
    rig.service.prepare(cid("a"), gpus(1))
    mine = held(rig, cid("a"))
    rig.cgroups.grant_behind_our_back(cid("a"), rules_granting(rig, *mine, 5))
    rig.restart().recover([], [])
    assert granted(rig, cid("a")) == mine


# ---- mesos Recover ------------------------------------------------------------------------------


@pytest.fixture
def mesos() -> Rig:
    rig = fake_service("dgx-1", mode="mesos")
    for name in ("a", "b", "c"):
        rig.cgroups.mesos_creates(cid(name))
        rig.service.prepare(cid(name), gpus(2))
    return rig


def test_recover_releases_a_container_mesos_no_longer_knows(mesos: Rig) -> None:
    b_gpus = held(mesos, cid("b"))
    result = mesos.restart().recover(running("a", "c"), [])
    assert (result.recovered, result.released) == (2, 1)
    assert mesos.store.get(cid("b")) is None
    assert granted(mesos, cid("b")) == [], "its grants are revoked before its GPUs go back"
    assert set(b_gpus) <= mesos.service.core.booking.available


def test_recover_keeps_an_orphans_gpus_until_its_cleanup(mesos: Rig) -> None:
    c_gpus = held(mesos, cid("c"))
    result = mesos.restart().recover(running("a", "b"), [cid("c")])
    assert result.released == 0
    assert mesos.store.get(cid("c")).state == "orphan"  # type: ignore[union-attr]
    assert granted(mesos, cid("c")) == c_gpus
    assert not set(c_gpus) & mesos.service.core.booking.available
    mesos.service.cleanup(cid("c"))
    assert set(c_gpus) <= mesos.service.core.booking.available


def test_recover_reapplies_for_a_running_container_and_keeps_one_without_a_cgroup(mesos: Rig) -> None:
    mesos.cgroups.grant_behind_our_back(cid("a"), rules_granting(mesos))  # lost its grants
    mesos.cgroups.vanish(cid("b"))  # Mesos runs it, but its cgroup is not there (yet)
    mesos.restart().recover(running("a", "b", "c"), [])
    assert granted(mesos, cid("a")) == held(mesos, cid("a")) and len(held(mesos, cid("a"))) == 2
    assert len(held(mesos, cid("b"))) == 2, "its GPUs stay reserved until its cleanup"


def test_recover_ignores_nested_orphans_and_states_of_nested_containers(mesos: Rig) -> None:
    result = mesos.restart().recover(running("a", "b", "c", "a.child"), [cid("c.child")])
    assert (result.recovered, result.released) == (3, 0)


def test_a_recover_action_that_fails_is_reported_and_recover_can_run_again(mesos: Rig) -> None:
    mesos.cgroups.faults.fail_at("cleanup")
    with pytest.raises(CgroupError):
        mesos.restart().recover(running("a", "c"), [])
    assert mesos.store.get(cid("b")) is not None, "not forgotten while its rules may still be in force"
    result = mesos.service.recover(running("a", "c"), [])
    assert result.released == 1 and mesos.store.get(cid("b")) is None


def test_kernel_grants_reads_the_kernel_or_says_there_is_no_cgroup(mesos: Rig) -> None:
    recovery = mesos.service
    assert recovery.kernel_grants(cid("a")) == frozenset(held(mesos, cid("a")))
    assert recovery.kernel_grants(cid("nobody")) is None


# ---- reaper ---------------------------------------------------------------------------------------


def test_the_reaper_releases_containers_whose_mesos_cgroup_vanished(mesos: Rig) -> None:
    b_gpus = held(mesos, cid("b"))
    assert mesos.service.reap_vanished() == []
    mesos.cgroups.vanish(cid("b"))
    assert mesos.service.reap_vanished() == [cid("b")]
    assert mesos.store.get(cid("b")) is None and set(b_gpus) <= mesos.service.core.booking.available
    assert mesos.service.reap_vanished() == []


def test_a_reaped_container_is_gone_not_unknown_to_a_later_watch_or_prepare(mesos: Rig) -> None:
    # criteo's route runs one hook at a time for the whole agent: under load the reaper can find a
    # destroyed container's cgroup gone before its Cleanup, and criteo's module polls Watch once
    # more after that. Found by make test-mesos under load: that poll ended NOT_FOUND "unknown
    # container" and was counted in gpu_isolator_errors_total; a reaped container is one Mesos
    # ended, as a cleaned-up one is.
    mesos.cgroups.vanish(cid("b"))
    assert mesos.service.reap_vanished() == [cid("b")]
    with pytest.raises(ContainerGone):
        mesos.service.watch(cid("b"))
    with pytest.raises(FailedPrecondition, match="was cleaned up"):
        mesos.service.prepare(cid("b"), gpus(1))


def test_the_reaper_does_nothing_in_standalone_mode() -> None:
    rig = fake_service("dgx-1")
    rig.service.prepare(cid("a"), gpus(1))
    rig.cgroups.vanish(cid("a"))
    assert rig.service.reap_vanished() == []
    assert rig.store.get(cid("a")) is not None


# ---- issue 16: every cgroup under our root is reconciled before the first request -------------------

ALLOW_ALL = (DeviceRule("a", None, None, "rwm"),)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_start_repairs_a_recorded_cgroup_left_without_its_rules(version: str) -> None:
    # SIGKILL between creating a container's cgroup and restricting it (v2: no program attached yet;
    # v1: mkdir before the deny-all), with the record already written: the bridge route never calls
    # Recover, and a retried Prepare is ALREADY_EXISTS, so Isolate would put a process in it.
    rig = fake_service("dgx-1", version=version)
    a = cid("a")
    rig.store.record(ContainerRecord(a, Holding(frozenset({1})), mode="standalone", cgroup_version=int(version[1])))
    if version == "v2":
        rig.cgroups.mesos_creates(a)  # exists, nothing of ours attached
    else:
        rig.cgroups.grant_behind_our_back(a, ALLOW_ALL)
    rig.restart()
    assert rig.cgroups.in_force(a).present and granted(rig, a) == [1]
    assert ALLOW_ALL[0] not in (rig.cgroups.rules_of(a) or ())


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_start_denies_everything_in_an_unrecorded_cgroup_that_allows_everything(version: str) -> None:
    rig = fake_service("dgx-1", version=version)
    x = cid("x")
    if version == "v2":
        rig.cgroups.mesos_creates(x)
    else:
        rig.cgroups.grant_behind_our_back(x, ALLOW_ALL)
    rig.restart()
    assert rig.cgroups.rules_of(x) == () and rig.cgroups.in_force(x).present


def test_a_start_with_lost_state_rebuilds_the_records_from_the_kernel() -> None:
    rig = fake_service("dgx-1")
    rig.service.prepare(cid("a"), gpus(2))
    rig.service.prepare(cid("b"), gpus(1))
    rig.service.isolate(cid("b"), rig.processes.spawn())
    kernel = {c: granted(rig, cid(c)) for c in ("a", "b")}
    rig.store.lose_everything()  # the database deleted or replaced by an empty one
    service = rig.restart()
    assert {c: held(rig, cid(c)) for c in ("a", "b")} == kernel
    assert rig.store.get(cid("b")).state == "isolated"  # type: ignore[union-attr]
    assert service.core.booking.allocated == frozenset(kernel["a"] + kernel["b"])
    with pytest.raises(GpusExhausted):
        service.prepare(cid("c"), gpus(6))
    assert any("rebuilt" in c.detail for c in service.health() if c.name == "state")


def test_a_start_refuses_when_the_kernel_grants_one_gpu_to_two_unrecorded_cgroups() -> None:
    rig = fake_service("dgx-1")
    for name in ("x", "y"):
        rig.cgroups.grant_behind_our_back(cid(name), rules_granting(rig, 4))
    with pytest.raises(FailedPrecondition, match=r"GPU 4 .* x, y"):
        rig.restart()


def test_a_start_revokes_an_unrecorded_grant_of_a_gpu_recorded_for_another_container() -> None:
    rig = fake_service("dgx-1")
    rig.service.prepare(cid("a"), gpus(1))
    mine = held(rig, cid("a"))
    rig.cgroups.grant_behind_our_back(cid("intruder"), rules_granting(rig, *mine))
    rig.restart()
    assert granted(rig, cid("intruder")) == [] and granted(rig, cid("a")) == mine
    assert rig.store.get(cid("intruder")) is None


def test_a_mesos_mode_start_leaves_mesos_cgroups_without_our_grants_alone() -> None:
    rig = fake_service("dgx-1", mode="mesos")
    other = cid("not-ours")
    rig.cgroups.mesos_creates(other)
    before = rig.cgroups.rules_of(other)
    rig.restart()
    assert rig.cgroups.rules_of(other) == before and rig.store.get(other) is None


def test_a_mesos_mode_start_reapplies_a_record_whose_grants_drifted() -> None:
    rig = fake_service("dgx-1", mode="mesos")
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(2))
    rig.cgroups.grant_behind_our_back(a, rules_granting(rig))  # a daemon-reload rewrote the rules
    rig.restart()
    assert granted(rig, a) == held(rig, a) and len(held(rig, a)) == 2


# ---- issue 16: the drift audit ----------------------------------------------------------------------


def test_the_audit_reapplies_drifted_rules_and_counts_the_repairs() -> None:
    rig = fake_service("dgx-1")
    a, b = cid("a"), cid("b")
    rig.service.prepare(a, gpus(2))
    rig.service.prepare(b, gpus(1))
    report = rig.service.audit()
    assert (report.checked, report.repaired, report.repairs_total) == (2, (), 0)
    rig.cgroups.grant_behind_our_back(a, rules_granting(rig))  # a daemon-reload took a's GPUs away
    rig.cgroups.grant_behind_our_back(b, rules_granting(rig, *held(rig, b), 7))  # and gave b one more
    report = rig.service.audit()
    assert report.checked == 2 and report.repairs_total == 2
    assert [line.split(":")[0] for line in report.repaired] == ["container a", "container b"]
    assert "kernel grants GPUs [] " in report.repaired[0] and "7" in report.repaired[1]
    assert granted(rig, a) == held(rig, a) and granted(rig, b) == held(rig, b)
    assert rig.service.audit().repaired == () and rig.service.audit().repairs_total == 2


def test_the_audit_remakes_a_vanished_standalone_cgroup_and_skips_a_vanished_mesos_one() -> None:
    rig = fake_service("dgx-1")
    rig.service.prepare(cid("a"), gpus(1))
    rig.cgroups.vanish(cid("a"))
    assert len(rig.service.audit().repaired) == 1
    assert granted(rig, cid("a")) == held(rig, cid("a"))

    mesos = fake_service("dgx-1", mode="mesos")
    mesos.cgroups.mesos_creates(cid("m"))
    mesos.service.prepare(cid("m"), gpus(1))
    mesos.cgroups.vanish(cid("m"))
    assert mesos.service.audit().repaired == (), "a destroyed Mesos container is the reaper's"


def test_the_audit_in_mesos_mode_leaves_the_agents_own_rules_alone() -> None:
    rig = fake_service("dgx-1", mode="mesos")
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    fuse = DeviceRule.char(10, 229, "rwm")  # the agent's --allowed_devices
    rig.cgroups.grant_behind_our_back(a, (*(rig.cgroups.rules_of(a) or ()), fuse))
    assert rig.service.audit().repaired == ()
    assert fuse in (rig.cgroups.rules_of(a) or ())
