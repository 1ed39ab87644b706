"""A thread id and a zombie given to Isolate (issue 33, defect 4), in the core over the shipped fake
process table, and the process-table questions behind them asked of the fake and of /proc alike."""

from __future__ import annotations

import pytest

from isolator.errors import FailedPrecondition, InvalidArgument
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.testing import fake_service


def _gpus(n: int) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpus", float(n)),))


@pytest.mark.parametrize("mode", ["standalone", "mesos"])
def test_isolate_refuses_a_thread_as_invalid_argument_naming_its_process_and_moves_nothing(mode: str) -> None:
    rig = fake_service("dgx-1", mode=mode)
    a = ContainerId.parse("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, _gpus(1))
    process = rig.processes.spawn()
    tid = rig.processes.thread(process)
    with pytest.raises(InvalidArgument, match=f"pid {tid} is a thread of process {process}, not a process"):
        rig.service.isolate(a, tid)
    assert rig.cgroups.pids(a) == () and rig.store.get(a).state == "prepared"  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["standalone", "mesos"])
def test_isolate_refuses_a_zombie_as_failed_precondition(mode: str) -> None:
    rig = fake_service("dgx-1", mode=mode)
    a = ContainerId.parse("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, _gpus(1))
    pid = rig.processes.spawn()
    rig.processes.exit_unreaped(pid)
    with pytest.raises(FailedPrecondition, match=f"pid {pid} has exited"):
        rig.service.isolate(a, pid)
    assert rig.cgroups.pids(a) == () and rig.store.get(a).state == "prepared"  # type: ignore[union-attr]


def test_a_process_that_exits_unreaped_during_standalone_isolate_is_refused() -> None:
    """The pin said "alive" to a zombie before issue 33 (a signal 0 reaches one): a process that
    exited mid-call and was not yet reaped passed as isolated."""
    rig = fake_service("dgx-1", mode="standalone")
    a = ContainerId.parse("a")
    rig.service.prepare(a, _gpus(1))
    pid = rig.processes.spawn()
    real_add = rig.cgroups.add_pid

    def add_then_exit(c: ContainerId, p: int) -> None:
        real_add(c, p)
        rig.processes.exit_unreaped(p)

    rig.cgroups.add_pid = add_then_exit  # type: ignore[method-assign,assignment]
    with pytest.raises(FailedPrecondition, match="exited while it was being isolated"):
        rig.service.isolate(a, pid)


@pytest.mark.parametrize("mode", ["standalone", "mesos"])
def test_isolate_refuses_a_pid_from_a_caller_in_another_pid_namespace(mode: str) -> None:
    rig = fake_service("dgx-1", mode=mode)
    a = ContainerId.parse("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, _gpus(1))
    caller = rig.processes.spawn()
    rig.processes.foreign.add(caller)
    pid = rig.processes.spawn(parent=caller)
    with pytest.raises(InvalidArgument, match=f"pid {pid} comes from a caller .pid {caller} here. in another pid"):
        rig.service.isolate(a, pid, caller=caller)
    assert rig.cgroups.pids(a) == () and rig.store.get(a).state == "prepared"  # type: ignore[union-attr]
    if mode == "standalone":
        rig.service.isolate(a, pid)  # in-process (no caller to check): the same pid is isolated
