"""Isolate: the container's init placed in its cgroup (standalone) or found there (mesos), and in
its cpuset. Which pid may be moved is decided by ``isolator.policy.placement`` over facts read here.
"""

from __future__ import annotations

import logging

from isolator.core.context import Core
from isolator.core.steps import Steps
from isolator.crashpoints import crashpoint
from isolator.errors import FailedPrecondition, InvalidArgument, IsolatorError
from isolator.model import UNKNOWN_CALLER, ContainerId, ContainerRecord, Mode, RecordState
from isolator.policy import placement
from isolator.policy.affinity import format_list

LOG = logging.getLogger(__name__)
# Mesos mode: how soon isolate looks again for the pid the agent is placing, and the longest pause.
PID_FIRST_LOOK_S = 0.00025
PID_LOOK_MAX_S = 0.004


class IsolateHook:
    """Isolate (part of IsolatorService, through ``hooks.Hooks``)."""

    core: Core  # set by IsolatorService, which composes the parts over one Core

    def isolate(self, container_id: ContainerId, pid: int, caller: int | None = None) -> None:
        core = self.core
        steps = Steps(core.clock.monotonic)
        placement.check_pid(pid)
        if caller is not None and caller != UNKNOWN_CALLER and core.edges.processes.same_pid_namespace(caller) is False:
            # Its pid is a number in its own namespace: here it names some other process, or none.
            raise InvalidArgument(
                f"pid {pid} comes from a caller (pid {caller} here) in another pid namespace than the sidecar's,"
                " where it names another process or none; call Isolate from the sidecar's pid namespace"
            )
        if not core.edges.processes.exists(pid):
            raise FailedPrecondition(f"pid {pid} does not exist (the container's init is gone)")
        if core.edges.processes.kernel_thread(pid):
            raise FailedPrecondition(f"pid {pid} is a kernel thread; only a container's own processes are isolated")
        leader = core.edges.processes.leader_of(pid)
        if leader is not None and leader != pid:
            # /proc/<tid> answers for any thread, but a cgroup takes processes (cgroup.procs moves
            # the whole group) and pidfd_open(2) holds none but a leader: the caller sent a thread id.
            raise InvalidArgument(
                f"pid {pid} is a thread of process {leader}, not a process; Isolate takes the process's"
                f" pid ({leader}, its thread group's leader)"
            )
        if core.edges.processes.exited(pid):
            raise FailedPrecondition(
                f"pid {pid} has exited (a zombie its parent has not reaped yet); the container's init is gone"
            )
        steps.mark("checks")
        with core.locks.hold(container_id):
            failed = core.failed_after_answer.get(container_id.root)
            if failed is not None:
                # Its Prepare answered, then could not make its grant durable and in force (and undid it).
                why = failed.message if isinstance(failed, IsolatorError) else f"{type(failed).__name__}: {failed}"
                raise FailedPrecondition(
                    f"container {container_id.root}'s Prepare answered, then failed to put its grant in force,"
                    f" so it holds no GPU: {why}"
                )
            rec = core.require(container_id.root)
            if core.settings.mode == Mode.MESOS and not container_id.nested:
                # The task is exec'd once this answers: the recorded GPUs are what the kernel grants.
                # A Prepare that answered early put them in force before it let go of the lock; a
                # sidecar killed between its record and its rules did not (docs/mesos-agent.md).
                core.grant_recorded_gpus(container_id, rec, "isolate")
                steps.mark("grant")
            target = core.grants.governing(container_id)
            seen = ""
            if core.settings.mode == Mode.STANDALONE:
                self._move(container_id, target, pid, caller)
                crashpoint("isolate.placed")
                steps.mark("placed")
            else:
                looks = self._wait_for_pid(target, pid)
                steps.mark("pid wait")
                seen = f", placed by the agent at look {looks}"
            self._join_cpuset(container_id, rec, pid)
            steps.mark("cpuset")
            if not container_id.nested and rec.state == RecordState.PREPARED:
                # Lazy (no fsync of its own): a mark that no decision reads and that recovery
                # rebuilds from the cgroup's pids, on the launch path (issue 45: 0.6-15 ms here).
                core.store.update(container_id, state=RecordState.ISOLATED, lazy=True)
                steps.mark("state commit")
        # The handler's own time, step by step, as Prepare's (issue 45).
        LOG.info("isolated pid %d in %s%s in %s", pid, core.describe(container_id, rec.holding.gpus), seen, steps)

    def isolate_awaited(self, container_id: ContainerId) -> bool:
        """Whether a launch must wait for this container's Isolate (placement.launch_waits_for_isolate);
        its record is read only when Isolate could join a cpuset."""
        core = self.core
        mode = Mode(core.settings.mode)
        if mode is not Mode.MESOS or not core.cpuset.enforcing:
            return placement.launch_waits_for_isolate(mode, joins_cpuset=False)
        rec = core.store.get(container_id.root)
        return placement.launch_waits_for_isolate(mode, core.cpuset.recorded_affinity(rec) is not None)

    def _move(self, cid: ContainerId, target: ContainerId, pid: int, caller: int | None) -> None:
        """Standalone mode places the container's init itself, by the pid rule (isolator/policy/
        placement.py) over facts read here. The process is held by a pidfd from the check to after
        the move, so the pid that was written named the process that was checked (if it exited
        meanwhile, the move is refused)."""
        core = self.core
        procs = core.edges.processes
        placement.check_not_sidecar(pid, procs.sidecar_pids())
        pinned = procs.pin(pid)
        if pinned is None:
            raise FailedPrecondition(f"pid {pid} does not exist (the container's init is gone)")
        try:
            where = core.cgroups.cgroup_of(pid)
            root = core.cgroups.root_path()
            own = core.cgroups.cgroup_path(cid.root)
            inside = placement.in_container(cid, pid, where, root, own, core.cgroups.version)
            if caller is not None and placement.needs_caller_check(inside, caller):
                assert where is not None  # in_container refused an unreadable cgroup
                self._check_caller(cid, pid, where, caller)
            core.cgroups.add_pid(target, pid)
            if not pinned.alive():
                raise FailedPrecondition(
                    f"pid {pid} exited while it was being isolated; its number may now name another process"
                )
        finally:
            pinned.close()

    def _join_cpuset(self, cid: ContainerId, rec: ContainerRecord, pid: int) -> None:
        """Put the pid in its top-level container's cpuset (mesos mode: ours, beside Mesos's cgroups;
        a nested container's pid comes from the agent, not from its parent, so it is placed too).
        A cpuset lost to a crash is made again from the record first."""
        core = self.core
        aff = core.cpuset.recorded_affinity(rec)
        if aff is None:
            return
        before = core.cpuset.cpus.allowed_of(pid)
        current = core.cpusets.current(cid.root)
        if current is None or current != aff:
            core.cpuset.apply_cpuset(cid.root, aff)
        core.cpusets.join(cid.root, pid)
        lost = (before or frozenset()) - aff.cpus
        if lost:
            LOG.info(
                "pid %d of container %s could run on CPUs %s; its GPUs' cpuset '%s' holds it to %s",
                pid,
                cid,
                format_list(before or ()),
                core.cpusets.path(cid),
                aff.cpu_list,
            )

    def _check_caller(self, cid: ContainerId, pid: int, where: str, caller: int) -> None:
        """Whether a process from outside the container is the caller's (placement's rule), reading
        /proc and the caller's cgroup only as far as the rule needs them."""
        core = self.core
        placement.check_caller_known(cid, pid, caller)
        if placement.is_callers(pid, caller, pid != caller and core.edges.processes.descends_from(pid, caller)):
            return
        placement.check_callers_cgroup(cid, pid, where, caller, core.cgroups.cgroup_of(caller))

    def _wait_for_pid(self, cid: ContainerId, pid: int) -> int:
        """Until Mesos has placed ``pid`` in the container's cgroup. The agent calls every isolator's
        isolate at once, ours beside its cgroups isolator, which places the pid: it is often not there
        yet, and it comes within a few milliseconds. A cgroup's process list cannot be waited on, so it
        is read again after 0.25 ms, then after twice as long each time up to 4 ms (a fixed 20 ms made
        a launch wait 20 ms for what took one; 1 ms doubling up to 20 ms overshot by up to 8 ms: seen
        under the agent, a pid absent at 7 ms was found at the next look, 16.5 ms in). A look costs a
        read of cgroup.procs. Answers how many times it looked."""
        clock = self.core.clock
        deadline = clock.monotonic() + self.core.settings.isolate_settle_s
        pause = PID_FIRST_LOOK_S
        looks = 0
        while True:
            looks += 1
            if pid in self.core.cgroups.pids(cid):
                return looks
            if clock.monotonic() >= deadline:
                raise FailedPrecondition(
                    f"pid {pid} is not in the cgroup '{self.core.cgroups.cgroup_path(cid)}' of container {cid}"
                )
            clock.sleep(pause)
            pause = min(pause * 2, PID_LOOK_MAX_S)
