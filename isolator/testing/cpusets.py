"""``FakeCpusets``: in-memory cpuset cgroups (isolator.core.ports.Cpusets) with fault points.

Same semantics as isolator/cgroups/cpuset.py where the core can tell (tests/contract/test_contracts.py runs
one suite on both): apply creates and sets exactly what it is given and refuses an empty set or
one outside the machine (the kernel's EINVAL); remove is idempotent and refused while processes
are inside; a process's allowed CPUs follow the cpuset it was placed in. ``faults`` fails any
step by name; ``drift(c, cpus, mems)`` changes a cpuset behind our back.
"""

from __future__ import annotations

import threading

from isolator.cgroups.base import mesos_relative_path
from isolator.errors import CgroupBusy, CgroupError, CgroupVanished
from isolator.model import CgroupVersion, ContainerId
from isolator.policy.affinity import Affinity, Machine, format_list
from isolator.testing.faults import Faults


class FakeCpusets:
    version = CgroupVersion.V1

    def __init__(self, machine: Machine | None = None, root: str = "/fake/cgroup/cpuset/mesos") -> None:
        self._machine = machine or Machine(
            cpus=frozenset({0, 1}), mems=frozenset({0}), node_cpus={0: frozenset({0, 1})}
        )
        self.root = root.rstrip("/")
        self._lock = threading.Lock()
        self.sets: dict[ContainerId, Affinity] = {}
        self.members: dict[int, ContainerId] = {}  # pid -> the cpuset it is in
        self.applied: list[tuple[ContainerId, Affinity]] = []
        self.parent_cpus: frozenset[int] | None = None  # what a cpuset's parent allows; None: the machine
        self.faults = Faults(
            lambda step, c: CgroupError(op=step, path=self.path(c) if c else self.root, cause="injected fault")
        )

    # ---- what a test does to the fake machine -------------------------------------------------

    def drift(self, container: ContainerId, cpus: frozenset[int], mems: frozenset[int]) -> None:
        with self._lock:
            self.sets[container.root] = Affinity(cpus=cpus, mems=mems)

    def set_machine(self, machine: Machine) -> None:
        self._machine = machine

    # ---- the port -----------------------------------------------------------------------------

    def machine(self) -> Machine:
        self.faults.check("machine")
        return self._machine

    def allowed_of(self, pid: int) -> frozenset[int] | None:
        with self._lock:
            where = self.members.get(pid)
            if where is not None and where in self.sets:
                return self.sets[where].cpus
        return self._machine.cpus

    def path(self, container: ContainerId) -> str:
        return f"{self.root}/{mesos_relative_path(container.root)}"

    def exists(self, container: ContainerId) -> bool:
        with self._lock:
            return container.root in self.sets

    def containers(self) -> tuple[ContainerId, ...]:
        with self._lock:
            return tuple(sorted(self.sets, key=ContainerId.chain))

    def current(self, container: ContainerId) -> Affinity | None:
        self.faults.check("current", container)
        with self._lock:
            return self.sets.get(container.root)

    def allowed(self, container: ContainerId) -> frozenset[int]:
        return self._machine.cpus if self.parent_cpus is None else self.parent_cpus

    def pids(self, container: ContainerId) -> tuple[int, ...]:
        with self._lock:
            if container.root not in self.sets:
                raise CgroupVanished(op="read", path=f"{self.path(container)}/cgroup.procs")
            return tuple(sorted(p for p, c in self.members.items() if c == container.root))

    def apply(self, container: ContainerId, cpus: frozenset[int], mems: frozenset[int]) -> None:
        self.faults.check("apply", container)
        if not cpus or not mems:
            raise CgroupError(op="apply", path=self.path(container), cause="an empty cpuset is never written")
        if not cpus <= self._machine.cpus or not mems <= self._machine.mems:
            raise CgroupError(
                op="write",
                path=f"{self.path(container)}/cpuset.cpus",
                cause=f"{format_list(cpus)!r}: Invalid argument",
            )
        with self._lock:
            self.sets[container.root] = Affinity(cpus=frozenset(cpus), mems=frozenset(mems))
            self.applied.append((container.root, self.sets[container.root]))

    def join(self, container: ContainerId, pid: int) -> None:
        self.faults.check("join", container)
        with self._lock:
            if container.root not in self.sets:
                raise CgroupVanished(op="write", path=f"{self.path(container)}/cgroup.procs")
            self.members[pid] = container.root

    def remove(self, container: ContainerId) -> None:
        self.faults.check("remove", container)
        with self._lock:
            if container.root not in self.sets:
                return
            inside = sorted(p for p, c in self.members.items() if c == container.root)
            if inside:
                raise CgroupBusy(op="remove", path=self.path(container), pids=inside)
            del self.sets[container.root]

    def exit(self, pid: int) -> None:
        """A process ended: it leaves its cpuset."""
        with self._lock:
            self.members.pop(pid, None)
