"""``FakeCgroups``: an in-memory devices cgroup backend (isolator.core.ports.CgroupBackend).

It records, per container, whether its cgroup exists, the rules in force and its processes, with
the semantics of the real v1 and v2 controllers that tests/contract/test_contracts.py checks on both:
standalone mode creates the cgroup denying everything and removes it on cleanup (refused while it
holds processes); mesos mode expects Mesos to have made the cgroup (``mesos_creates``) and removes
only our rules. ``faults`` fails any step by name (isolator/testing/faults.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from isolator.cgroups.base import check_mode, mesos_relative_path
from isolator.errors import CgroupBusy, CgroupError, CgroupVanished, InvalidArgument
from isolator.model import CgroupVersion, ContainerId, Mode
from isolator.policy.devices import MESOS_DEFAULT_WHITELIST, DeviceRule, KernelRules, permits
from isolator.testing.faults import Faults


class FakeCgroups:
    def __init__(
        self,
        mode: Mode | str = Mode.STANDALONE,
        version: CgroupVersion | str = CgroupVersion.V1,
        root: str = "/fake/cgroup/devices/mesos",
        base: Iterable[DeviceRule] = MESOS_DEFAULT_WHITELIST,
    ) -> None:
        if version not in tuple(CgroupVersion):
            raise ValueError(f"version {version!r} is not v1 or v2")
        self.mode = check_mode(mode)
        self.version = CgroupVersion(version)
        self.root = root.rstrip("/")
        self.base = tuple(base)
        self._lock = threading.Lock()
        self.cgroups: dict[ContainerId, tuple[DeviceRule, ...] | None] = {}  # None: exists, no rules of ours
        self.members: dict[int, ContainerId] = {}  # pid -> the cgroup it is in
        self.outside: dict[int, str] = {}  # pid -> a cgroup outside our root (``place``)
        self.applied: list[tuple[ContainerId, tuple[DeviceRule, ...]]] = []  # every successful apply
        # v1: the list of each ``<parent>/mesos`` cgroup between a container and its nested ones; the
        # kernel copies the parent's list into it when it is made, and a grant below may never exceed it.
        self.between: dict[ContainerId, tuple[DeviceRule, ...]] = {}
        self.faults = Faults(self._fault)

    def _fault(self, step: str, container: ContainerId | None) -> BaseException:
        path = self.cgroup_path(container) if container is not None else self.root
        return CgroupError(op=step, path=path, cause="injected fault")

    # ---- what Mesos or a test does to the fake machine ------------------------------------------

    def mesos_creates(self, container: ContainerId) -> None:
        """Mesos made the container's cgroup (v1: with its default whitelist; v2: its own program)."""
        with self._lock:
            self._made(container)
            self.cgroups.setdefault(container, None)

    def vanish(self, container: ContainerId) -> None:
        """The cgroup is removed behind our back (Mesos destroyed the container); its processes go."""
        with self._lock:
            self._remove(container)

    def grant_behind_our_back(self, container: ContainerId, rules: Iterable[DeviceRule]) -> None:
        """Rules in force that nobody recorded (a crash between a grant and its record)."""
        with self._lock:
            self.cgroups[container] = tuple(rules)

    def _remove(self, container: ContainerId) -> None:
        for cid in [c for c in self.cgroups if c == container or _below(c, container)]:
            del self.cgroups[cid]
            self.between.pop(cid, None)
        for pid in [p for p, c in self.members.items() if c == container or _below(c, container)]:
            del self.members[pid]

    # ---- CgroupBackend ----------------------------------------------------------------------------

    def cgroup_path(self, container: ContainerId) -> str:
        path = f"{self.root}/{mesos_relative_path(container)}"
        return f"{path}/leaf" if self.version is CgroupVersion.V2 and self.mode is Mode.MESOS else path

    def exists(self, container: ContainerId) -> bool:
        with self._lock:
            return container in self.cgroups

    def nested_names(self, container: ContainerId) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(c.value for c in self.cgroups if c.parent == container))

    def containers(self) -> tuple[ContainerId, ...]:
        with self._lock:
            return tuple(sorted((c for c in self.cgroups if not c.nested), key=ContainerId.chain))

    def prepare(self, container: ContainerId) -> None:
        self.faults.check("prepare", container)
        with self._lock:
            if self.mode is Mode.MESOS:
                if container not in self.cgroups:
                    raise CgroupVanished(op="prepare", path=self.cgroup_path(container))
                self._require_whitelist(container, "is Mesos's cgroups/devices isolator enabled?")
                return
            rules = self.cgroups.get(container)
            if rules is None:
                self._made(container)
                self.cgroups[container] = ()  # created, everything denied
            elif self.version is CgroupVersion.V1 and any(r.type == "a" for r in rules):
                self.cgroups[container] = ()  # v1 writes 'a' to devices.deny: a whitelist again
                self._propagate(container)

    def _require_whitelist(self, container: ContainerId, hint: str) -> None:
        """v1 refuses to work on a list that allows every device, as the real controller does."""
        if self.version is CgroupVersion.V1 and any(r.type == "a" for r in self._in_force(container)):
            raise CgroupError(
                op="use",
                path=f"{self.cgroup_path(container)}/devices.list",
                cause=f"the cgroup allows every device ('a *:* rwm'), it is not a whitelist; {hint}",
            )

    def apply(self, container: ContainerId, rules: Iterable[DeviceRule]) -> None:
        rules = tuple(rules)
        self.faults.check("apply", container)
        if self.version is CgroupVersion.V1 and any(r.type == "a" for r in rules):
            raise InvalidArgument(f"failed to apply 'a' rules to '{self.cgroup_path(container)}'")
        with self._lock:
            if container not in self.cgroups:
                raise CgroupVanished(op="write", path=self.cgroup_path(container))
            hint = "is Mesos's cgroups/devices isolator enabled?" if self.mode is Mode.MESOS else "was it prepared?"
            self._require_whitelist(container, hint)
            if self.version is CgroupVersion.V1 and container.parent in self.between:
                self._check_within(container, rules, self.between[container.parent])
            self.cgroups[container] = rules
            self.applied.append((container, rules))
            self._propagate(container)

    def apply_nested(self, container: ContainerId, rules: Iterable[DeviceRule]) -> None:
        rules = tuple(rules)
        self.faults.check("apply_nested", container)
        if self.version is CgroupVersion.V1 and container.parent is not None:
            with self._lock:
                if container.parent not in self.cgroups or container not in self.cgroups:
                    raise CgroupVanished(op="write", path=self.cgroup_path(container))
                self._check_within(container, rules, self._in_force(container.parent))
                self.between[container.parent] = rules
                self._propagate(container.parent)
        self.apply(container, rules)

    def _made(self, container: ContainerId) -> None:
        """A cgroup is created: on v1 its ``<parent>/mesos`` copies the parent's list the first time."""
        parent = container.parent
        if (
            self.version is CgroupVersion.V1
            and parent is not None
            and parent in self.cgroups
            and parent not in self.between
        ):
            self.between[parent] = self._in_force(parent)

    def _check_within(
        self, container: ContainerId, rules: tuple[DeviceRule, ...], above: tuple[DeviceRule, ...]
    ) -> None:
        beyond = [str(r) for r in rules if not permits(above, r)]
        if beyond:  # the v1 kernel refuses the write (EPERM) and the previous list stays
            raise CgroupError(
                op="write", path=self.cgroup_path(container), cause=f"{beyond[0]}: Operation not permitted"
            )

    def _propagate(self, container: ContainerId) -> None:
        """v1: what a cgroup no longer allows goes from every cgroup below it too (the kernel's
        revalidation of its children's exceptions)."""
        if self.version is not CgroupVersion.V1:
            return
        bound = self._in_force(container)
        if container in self.between:
            self.between[container] = tuple(r for r in self.between[container] if permits(bound, r))
            bound = self.between[container]
        for child in [c for c in self.cgroups if c.parent == container]:
            rules = self.cgroups[child]
            if rules is not None:
                self.cgroups[child] = tuple(r for r in rules if permits(bound, r))
            self._propagate(child)

    def current(self, container: ContainerId) -> tuple[DeviceRule, ...]:
        self.faults.check("current", container)
        with self._lock:
            if container not in self.cgroups:
                raise CgroupVanished(op="read", path=self.cgroup_path(container))
            return self._in_force(container)

    def _in_force(self, container: ContainerId) -> tuple[DeviceRule, ...]:
        rules = self.cgroups[container]
        if rules is None:  # Mesos's own: its default whitelist
            return self.base if self.version is CgroupVersion.V1 else ()
        return rules

    def recover(self, container: ContainerId) -> tuple[DeviceRule, ...]:
        self.faults.check("recover", container)
        with self._lock:
            if container not in self.cgroups:
                raise CgroupVanished(op="read", path=self.cgroup_path(container))
            return self._in_force(container)

    def in_force(self, container: ContainerId) -> KernelRules:
        self.faults.check("in_force", container)
        path = self.cgroup_path(container)
        with self._lock:
            if container not in self.cgroups:
                return KernelRules((), f"none: the cgroup '{path}' does not exist", present=False)
            if self.version is CgroupVersion.V2 and self.cgroups[container] is None:
                return KernelRules((), f"none: no device program of ours is attached to '{path}'", present=False)
            return KernelRules(self._in_force(container), f"fake rules of '{path}'")

    def add_pid(self, container: ContainerId, pid: int) -> None:
        self.faults.check("add_pid", container)
        with self._lock:
            if container not in self.cgroups:
                raise CgroupVanished(op="write", path=f"{self.cgroup_path(container)}/cgroup.procs")
            if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
                raise CgroupError(op="write", path=self.cgroup_path(container), cause=f"{pid!r} is not a process id")
            self.members[pid] = container
            self.outside.pop(pid, None)

    def root_path(self) -> str:
        return self.root

    def place(self, pid: int, cgroup: str) -> None:
        """Put ``pid`` in a cgroup outside our root, as another program would (default: user.slice)."""
        with self._lock:
            self.members.pop(pid, None)
            self.outside[pid] = cgroup

    def cgroup_of(self, pid: int) -> str | None:
        with self._lock:
            where = self.members.get(pid)
            if where is None:
                return self.outside.get(pid, "/fake/cgroup/devices/user.slice")
        return self.cgroup_path(where)

    def pids(self, container: ContainerId) -> tuple[int, ...]:
        self.faults.check("pids", container)
        with self._lock:
            if container not in self.cgroups:
                raise CgroupVanished(op="read", path=f"{self.cgroup_path(container)}/cgroup.procs")
            return tuple(sorted(p for p, c in self.members.items() if c == container))

    def cleanup(self, container: ContainerId) -> None:
        self.faults.check("cleanup", container)
        with self._lock:
            if container not in self.cgroups:
                return
            if self.mode is Mode.MESOS:
                self.cgroups[container] = None  # our rules go, Mesos's cgroup stays
                self._propagate(container)
                return
            busy = sorted(p for p, c in self.members.items() if c == container or _below(c, container))
            if busy:
                raise CgroupBusy(op="remove", path=self.cgroup_path(container), pids=busy)
            self._remove(container)

    # ---- for tests ------------------------------------------------------------------------------------

    def rules_of(self, container: ContainerId) -> tuple[DeviceRule, ...] | None:
        """The rules in force, or None when the cgroup does not exist."""
        with self._lock:
            return self._in_force(container) if container in self.cgroups else None

    def kill(self, pid: int) -> None:
        """A process exits: it leaves its cgroup."""
        with self._lock:
            self.members.pop(pid, None)


def _below(child: ContainerId, parent: ContainerId) -> bool:
    node = child.parent
    while node is not None:
        if node == parent:
            return True
        node = node.parent
    return False
