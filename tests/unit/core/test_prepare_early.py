"""A Prepare that answers before its grant is on disk and in force (isolator/core/prepare.py,
``answers_early``; docs/mesos-agent.md, "Prepare answers before its grant is in force"): the answer
comes once the GPUs are chosen; the grant is still recorded before its rules, the container's Isolate
answers only once both are done, and a failure after the answer fails that Isolate and leaves nothing.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from hook_helpers import cid, free, gpus, granted, held, image

from isolator.errors import CgroupError, CgroupVanished, FailedPrecondition, NotFound, StateError
from isolator.model import ContainerConfig, ContainerId, LaunchInfo, Resource
from isolator.policy.shares import parse_shared_gpus
from isolator.testing import Rig, fake_service


@pytest.fixture(params=["v1", "v2"])
def rig(request: pytest.FixtureRequest) -> Rig:
    return fake_service("dgx-1", mode="mesos", version=request.param)


def launched(rig: Rig, c: ContainerId) -> int:
    """What the agent does after Prepare: places the forked pid in the container's cgroup."""
    pid = rig.processes.spawn()
    rig.cgroups.add_pid(c, pid)
    return pid


def test_the_answer_comes_before_the_grant_is_recorded_or_in_force_and_both_follow(rig: Rig) -> None:
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    seen: list[tuple[LaunchInfo | None, object, list[int] | None]] = []

    def answer(info: LaunchInfo | None) -> None:
        seen.append((info, rig.store.get(a), granted(rig, a)))

    info = rig.service.prepare_early(a, gpus(1), answer)
    assert len(seen) == 1, "answered exactly once"
    answered, record, in_force = seen[0]
    assert answered == info, "the early answer is the launch info the Prepare returns"
    assert record is None and in_force == [], "nothing durable nor granted when the caller got its answer"
    assert len(held(rig, a)) == 1 and held(rig, a) == granted(rig, a), "recorded, then granted, before it returned"
    pid = launched(rig, a)
    rig.service.isolate(a, pid)
    assert rig.store.get(a).state == "isolated"  # type: ignore[union-attr]


def test_the_isolate_waits_for_the_grant_the_answer_went_ahead_of(rig: Rig) -> None:
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    answered = threading.Event()
    entered, gate = rig.store.faults.pause_at("record", container=a)  # a slow fsync
    preparing = threading.Thread(target=rig.service.prepare_early, args=(a, gpus(1), lambda _: answered.set()))
    preparing.start()
    try:
        assert answered.wait(10) and entered.wait(10)
        pid = launched(rig, a)
        isolated = threading.Event()
        isolating = threading.Thread(target=lambda: (rig.service.isolate(a, pid), isolated.set()))
        isolating.start()
        assert not isolated.wait(0.3), "Isolate answered while the grant was not yet on disk nor in force"
    finally:
        gate.set()
        preparing.join(10)
    isolating.join(10)
    assert isolated.is_set()
    assert len(granted(rig, a) or []) == 1


@pytest.mark.parametrize("step", ["record", "apply"])
def test_a_failure_after_the_answer_leaves_nothing_and_fails_the_isolate_with_its_reason(rig: Rig, step: str) -> None:
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    before = free(rig)
    answers: list[LaunchInfo | None] = []
    faults = rig.store.faults if step == "record" else rig.cgroups.faults
    faults.fail_at(step)
    with pytest.raises(StateError if step == "record" else CgroupError):
        rig.service.prepare_early(a, gpus(1), answers.append)
    assert len(answers) == 1, "the caller had its answer"
    assert free(rig) == before and rig.store.get(a) is None and granted(rig, a) == []
    pid = launched(rig, a)
    with pytest.raises(FailedPrecondition, match="Prepare answered, then failed to put its grant in force"):
        rig.service.isolate(a, pid)
    rig.cgroups.kill(pid)
    rig.service.cleanup(a)
    with pytest.raises(NotFound, match="unknown container"):  # the failure is forgotten with the container
        rig.service.isolate(a, rig.processes.spawn())


def test_a_refusal_before_the_answer_is_the_prepare_s_own_error_and_nothing_is_answered(rig: Rig) -> None:
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    answers: list[LaunchInfo | None] = []
    with pytest.raises(Exception, match="gpus"):
        rig.service.prepare_early(a, gpus(9), answers.append)  # dgx-1 has 8
    assert answers == []
    with pytest.raises(NotFound):
        rig.service.isolate(a, launched(rig, a))


def test_an_image_or_a_share_answers_only_once_everything_is_done() -> None:
    # An image's launch info has mounts made in its rootfs; a sharer's needs its MPS daemon and limits.
    rig = fake_service("dgx-1", mode="mesos")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4"))
    rig.restart()
    answers: list[LaunchInfo | None] = []
    configs: list[tuple[str, ContainerConfig]] = [
        ("img", image(1, "/rootfs/img")),
        ("share", ContainerConfig(resources=(Resource("gpu_shares", 1.0), Resource("cpus", 1.0)))),
    ]
    for name, config in configs:
        c = cid(name)
        rig.cgroups.mesos_creates(c)
        if config.has_image:
            rig.filesystem.make_dirs(config.rootfs)  # type: ignore[arg-type]
        rig.service.prepare_early(c, config, answers.append)
        assert rig.store.get(c) is not None
    assert answers == []


def test_a_container_without_the_agent_s_cgroup_is_refused_before_any_answer(rig: Rig) -> None:
    # Mesos's cgroups/devices isolator makes the cgroup before any module isolator prepares: without
    # it, Prepare itself says so (the misconfiguration's message belongs to Prepare, not Isolate).
    answers: list[LaunchInfo | None] = []
    before = free(rig)
    with pytest.raises(CgroupVanished):
        rig.service.prepare_early(cid("a"), gpus(1), answers.append)
    assert answers == [] and free(rig) == before and rig.store.get(cid("a")) is None


def test_isolate_puts_a_recorded_grant_the_kernel_lacks_in_force_before_it_answers(rig: Rig) -> None:
    # Whatever left a record without its rules (a kill between the two, before the start's repair or
    # the audit reached it; someone's write), the agent's Isolate must not answer while the kernel
    # lacks the grant: the task is exec'd once it answers.
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    core = rig.service.core
    with core.locks.hold(a):
        core.grants.revoke(a)  # recorded, nothing of ours in the kernel
    assert granted(rig, a) == [] and len(held(rig, a)) == 1
    rig.service.isolate(a, launched(rig, a))
    assert granted(rig, a) == held(rig, a)


def test_the_core_applies_a_record_only_where_the_kernel_grants_other_gpus(rig: Rig) -> None:
    # The one step behind Isolate's check and the start's repair (Core.grant_recorded_gpus).
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    core = rig.service.core
    rec = rig.store.get(a)
    assert rec is not None and core.compare_with_kernel(a, rec).gpus_agree
    with core.locks.hold(a):
        applies = rig.cgroups.faults.hits["apply"]
        core.grant_recorded_gpus(a, rec, "test")
        assert rig.cgroups.faults.hits["apply"] == applies, "applied although the kernel agreed"
        core.grants.revoke(a)
        assert not core.compare_with_kernel(a, rec).gpus_agree
        core.grant_recorded_gpus(a, rec, "test")
    assert core.compare_with_kernel(a, rec).gpus_agree and granted(rig, a) == held(rig, a)
