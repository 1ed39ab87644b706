"""Isolate (isolator/core/isolate.py) in-process over the shipped fakes: the pid placed in its container's
cgroup, never another container's, a foreign cgroup's, the sidecar's or a kernel thread.
"""

from __future__ import annotations

import pytest
from hook_helpers import cid, gpus, granted, held, make_rig

from isolator.errors import (
    CgroupError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from isolator.model import ContainerConfig, ContainerId
from isolator.testing import Rig, fake_service


@pytest.fixture
def rig() -> Rig:
    return make_rig()


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
    # It looked again after 0.25 ms, then twice as long each time, up to 4 ms.
    assert rig.clock.sleeps[:7] == [0.00025, 0.0005, 0.001, 0.002, 0.004, 0.004, 0.004]
    rig.cgroups.add_pid(a, pid)  # Mesos's cgroups isolator did it
    rig.service.isolate(a, pid)
    assert rig.store.get(a).state == "isolated"  # type: ignore[union-attr]


def test_a_launch_waits_for_isolate_only_where_isolate_does_something_the_task_needs() -> None:
    # Mesos mode: the agent places the pid in the cgroup whose rules Prepare put in force, so the
    # launch need not wait (Prepare's answer says so, docs/mesos-agent.md "Isolate"), also for a
    # nested container and without GPUs; unless the pid must join its GPUs' cpuset first.
    rig = fake_service("numa-2", mode="mesos", cpu_affinity="hint")
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    assert rig.service.isolate_awaited(a) is False
    assert rig.service.isolate_awaited(cid("a.child")) is False
    # Standalone: Isolate places the pid itself.
    standalone = fake_service("numa-2", cpu_affinity="enforce")
    standalone.service.prepare(a, gpus(1))
    assert standalone.service.isolate_awaited(a) is True
    # Enforced affinity: a container holding GPUs gets a cpuset its pid joins in Isolate; one
    # without GPUs has none (and neither does one never prepared).
    enforce = fake_service("numa-2", mode="mesos", cpu_affinity="enforce")
    b, none = cid("b"), cid("none")
    for c, n in ((b, 1), (none, 0)):
        enforce.cgroups.mesos_creates(c)
        enforce.service.prepare(c, gpus(n))
    assert enforce.service.isolate_awaited(b) is True
    assert enforce.service.isolate_awaited(cid("b.child")) is True
    assert enforce.service.isolate_awaited(none) is False
    assert enforce.service.isolate_awaited(cid("nobody")) is False


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
