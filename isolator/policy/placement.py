"""The pid-move rule of standalone Isolate: which process may be moved into a container's cgroup.
Pure: facts the caller read from /proc and the cgroups in, a verdict out (a typed error when refused).

A valid pid only; never the sidecar or an ancestor of it; never a process in another cgroup under
our root (another container's, or one we do not know); a process already in the container may be
moved; any other must be the caller's (issue 26): the caller itself, one of its descendants, or a
process in the caller's own cgroup (a launcher's sibling, e.g. the container a Mesos launcher forked
beside the bridge executable). The caller's pid comes from SO_PEERCRED; UNKNOWN_CALLER when a
connection did not pass the socket's gate, None for an in-process call (no peer to check).
"""

from __future__ import annotations

from isolator.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from isolator.model import UNKNOWN_CALLER, ContainerId, Mode

MAX_PID = 1 << 22  # PID_MAX_LIMIT on 64-bit Linux


def below(path: str, top: str) -> bool:
    """``path`` is a cgroup strictly below ``top``."""
    return path.startswith(top.rstrip("/") + "/")


def launch_waits_for_isolate(mode: Mode, joins_cpuset: bool) -> bool:
    """Whether a container's task must not run before its Isolate ended (said on Prepare's answer).

    Standalone: Isolate places the pid itself, so it must. Mesos: the agent places the pid, beside
    our Isolate and before the task runs (every isolator's isolate is collected first), in the cgroup
    whose device rules Prepare put in force (Prepare refuses a container without it); Isolate only
    checks that it did and marks the record, so a launch need not wait for that, unless Isolate also
    holds the pid to its GPUs' CPUs (``cpu_affinity = enforce``), which must precede the task."""
    return mode is not Mode.MESOS or joins_cpuset


def check_pid(pid: int) -> None:
    """A number that can name a container's process (not init, not past the kernel's limit)."""
    if pid <= 1 or pid >= MAX_PID:
        raise InvalidArgument(f"pid {pid} is not a valid container pid")


def check_not_sidecar(pid: int, sidecar_pids: frozenset[int]) -> None:
    if pid in sidecar_pids:
        raise FailedPrecondition(f"pid {pid} is the sidecar or one of its ancestors; it is never isolated")


def in_container(cid: ContainerId, pid: int, where: str | None, root: str, own: str, version: str) -> bool:
    """Whether the pid (in the cgroup ``where``) is already in the container whose top-level cgroup
    is ``own``; refuses a pid whose cgroup cannot be read and one in another cgroup under ``root``."""
    if where is None:
        raise FailedPrecondition(f"pid {pid} is gone, or its {version} devices cgroup cannot be read")
    inside = where == own or below(where, own)
    if below(where, root) and not inside:
        raise FailedPrecondition(
            f"pid {pid} is in the cgroup '{where}' under our root, not in container {cid}'s; "
            "a process of another container or of a cgroup we do not know is never moved"
        )
    return inside


def needs_caller_check(inside: bool, caller: int | None) -> bool:
    """A pid from outside the container is checked against a remote caller (an in-process call has none)."""
    return not inside and caller is not None


def check_caller_known(cid: ContainerId, pid: int, caller: int) -> None:
    if caller == UNKNOWN_CALLER:
        raise PermissionDenied(
            f"pid {pid} is not in container {cid}'s cgroup and the caller's own pid is unknown (a"
            " connection that did not pass the socket's gate); only a caller's own processes are moved"
        )


def is_callers(pid: int, caller: int, descends: bool) -> bool:
    """The pid is the caller or one of its descendants (``descends``: read from /proc)."""
    return pid == caller or descends


def check_callers_cgroup(cid: ContainerId, pid: int, where: str, caller: int, mine: str | None) -> None:
    """The last way a process is the caller's: it is in the caller's own cgroup (``mine``)."""
    if mine is not None and mine == where:
        return
    raise PermissionDenied(
        f"pid {pid} (cgroup '{where}') is not the caller's: neither the caller (pid {caller}, cgroup"
        f" '{mine or 'unknown'}') nor one of its descendants, nor in its cgroup, nor in container {cid}'s"
        " cgroup; a process of someone else is never moved into a container"
    )
