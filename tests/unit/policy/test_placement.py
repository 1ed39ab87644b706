"""The pid-move rule of standalone Isolate (isolator/policy/placement.py): pure, facts in, a verdict out."""

from __future__ import annotations

import pytest

from isolator.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from isolator.model import UNKNOWN_CALLER, ContainerId, Mode
from isolator.policy import placement

A = ContainerId("a")
ROOT = "/sys/fs/cgroup/devices/gpu-isolator"
OWN = ROOT + "/a"


def test_pids_that_cannot_name_a_container_process_are_invalid() -> None:
    for pid in (-1, 0, 1, placement.MAX_PID, placement.MAX_PID + 1):
        with pytest.raises(InvalidArgument, match=f"pid {pid} is not a valid container pid"):
            placement.check_pid(pid)
    placement.check_pid(2)
    placement.check_pid(placement.MAX_PID - 1)


def test_the_sidecar_and_its_ancestors_are_never_moved() -> None:
    with pytest.raises(FailedPrecondition, match="pid 7 is the sidecar or one of its ancestors"):
        placement.check_not_sidecar(7, frozenset({1, 7}))
    placement.check_not_sidecar(8, frozenset({1, 7}))


def test_below_is_strictly_below() -> None:
    assert placement.below(OWN + "/x", OWN) and placement.below(OWN + "/x", OWN + "/")
    assert not placement.below(OWN, OWN) and not placement.below(OWN + "x/y", OWN)
    assert placement.below("/r/X/y", "/r/X")  # only slashes are trimmed off the top


def test_where_a_pid_is_decides_whether_it_is_inside_or_refused() -> None:
    def where(cgroup: str | None) -> bool:
        return placement.in_container(A, 9, cgroup, ROOT, OWN, "v1")

    assert where(OWN) and where(OWN + "/mesos/child")
    assert not where("/sys/fs/cgroup/devices/user.slice")  # outside our root: the caller's rule decides
    with pytest.raises(FailedPrecondition) as foreign:
        where(ROOT + "/b")
    assert foreign.value.message == (
        f"pid 9 is in the cgroup '{ROOT}/b' under our root, not in container a's; a process of another"
        " container or of a cgroup we do not know is never moved"
    )
    with pytest.raises(FailedPrecondition, match="pid 9 is gone, or its v1 devices cgroup cannot be read"):
        where(None)
    # Our root itself is not below it: a pid there is outside every container, and the caller's rule applies.
    assert not where(ROOT)


def test_only_a_remote_callers_pid_from_outside_is_checked() -> None:
    assert placement.needs_caller_check(False, 5)
    assert placement.needs_caller_check(False, UNKNOWN_CALLER)
    assert not placement.needs_caller_check(True, 5)
    assert not placement.needs_caller_check(False, None)


def test_an_unknown_caller_moves_nothing_from_outside() -> None:
    with pytest.raises(PermissionDenied) as refused:
        placement.check_caller_known(A, 9, UNKNOWN_CALLER)
    assert refused.value.message == (
        "pid 9 is not in container a's cgroup and the caller's own pid is unknown (a connection that did not"
        " pass the socket's gate); only a caller's own processes are moved"
    )
    placement.check_caller_known(A, 9, 5)


def test_the_caller_itself_or_its_descendant_is_the_callers() -> None:
    assert placement.is_callers(5, 5, False)
    assert placement.is_callers(9, 5, True)
    assert not placement.is_callers(9, 5, False)


def test_a_process_in_the_callers_cgroup_is_the_callers_and_any_other_is_refused() -> None:
    placement.check_callers_cgroup(A, 9, "/x/launcher", 5, "/x/launcher")
    with pytest.raises(PermissionDenied) as refused:
        placement.check_callers_cgroup(A, 9, "/x/other", 5, "/x/launcher")
    assert refused.value.message == (
        "pid 9 (cgroup '/x/other') is not the caller's: neither the caller (pid 5, cgroup '/x/launcher') nor one"
        " of its descendants, nor in its cgroup, nor in container a's cgroup; a process of someone else is never"
        " moved into a container"
    )
    with pytest.raises(PermissionDenied, match="cgroup 'unknown'"):
        placement.check_callers_cgroup(A, 9, "/x/other", 5, None)


@pytest.mark.parametrize(
    ("mode", "joins_cpuset", "waits"),
    [
        (Mode.STANDALONE, False, True),  # Isolate places the pid itself
        (Mode.STANDALONE, True, True),
        (Mode.MESOS, True, True),  # the pid joins its GPUs' cpuset before the task runs
        (Mode.MESOS, False, False),  # the agent places it; Isolate only checks
    ],
)
def test_a_launch_waits_for_isolate_unless_the_agent_places_the_pid_and_there_is_no_cpuset(
    mode: Mode, joins_cpuset: bool, waits: bool
) -> None:
    assert placement.launch_waits_for_isolate(mode, joins_cpuset) is waits
