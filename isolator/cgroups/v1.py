"""The cgroup v1 devices whitelist of a container: diff, write, read back, roll back.

``whitelist_diff`` decides (pure); ``V1DeviceController`` writes ``devices.allow``/``devices.deny``
under a hierarchy passed in. It never touches entries of Mesos's default whitelist in mesos mode.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from isolator.cgroups.base import (
    cgroup_of,
    check_mode,
    child_names,
    container_dir,
    known_majors,
    read_pids,
    read_text,
    rmdir_tree,
    top_level_ids,
    write_pid,
)
from isolator.crashpoints import crashpoint
from isolator.devicerule import ACCESS_ORDER, DeviceRule
from isolator.errors import CgroupBusy, CgroupError, CgroupVanished, InvalidArgument, RuleParseError
from isolator.model import CgroupVersion, ContainerId, Mode
from isolator.policy.devices import (
    MESOS_DEFAULT_WHITELIST,
    KernelRules,
    is_owned,
    owned_majors,
    parse_rules,
    permits,
)

LOG = logging.getLogger(__name__)

Selector = tuple[str, int | None, int | None]


@dataclass(frozen=True)
class Write:
    """One line for ``devices.allow`` (``allow=True``) or ``devices.deny``."""

    allow: bool
    rule: DeviceRule

    @property
    def file(self) -> str:
        return "devices.allow" if self.allow else "devices.deny"

    def inverse(self) -> Write:
        return Write(not self.allow, self.rule)


def _by_selector(rules: Iterable[DeviceRule]) -> dict[Selector, set[str]]:
    out: dict[Selector, set[str]] = {}
    for rule in rules:
        out.setdefault(rule.selector, set()).update(rule.access)
    return out


def _rule(selector: Selector, access: set[str]) -> DeviceRule:
    return DeviceRule(selector[0], selector[1], selector[2], "".join(c for c in ACCESS_ORDER if c in access))


def _selector_order(selector: Selector) -> tuple[str, int, int]:
    """``DeviceRule.sort_key`` of a selector's rules, without building one: wildcards first."""
    kind, major, minor = selector
    return (kind, -1 if major is None else major, -1 if minor is None else minor)


def _uncovered(rules: Iterable[DeviceRule], grants: tuple[DeviceRule, ...], skip: set[Selector]) -> list[str]:
    """The rules (outside ``skip``) that no rule of ``grants`` encompasses, as the kernel judges.

    An entry of the same selector holding every access bit answers most rules at once; the rest
    take the full scan (a wildcard entry may cover them)."""
    exact = _by_selector(grants)
    out = []
    for rule in rules:
        if rule.selector in skip or set(rule.access) <= exact.get(rule.selector, set()):
            continue
        if not permits(grants, rule):
            out.append(str(rule))
    return out


def whitelist_diff(
    current: Iterable[DeviceRule], desired: Iterable[DeviceRule], untouchable: Iterable[DeviceRule] = ()
) -> tuple[Write, ...]:
    """The writes that turn ``current`` into ``desired``: allows first, so a grow never drops access.

    The kernel keeps one exception per selector (type, major, minor) and merges or strips access
    bits on it (security/device_cgroup.c ``dev_exception_add``/``dev_exception_rm``), so the diff
    is per selector and per access bit. Selectors that appear in ``untouchable`` (Mesos's own
    whitelist in mesos mode) are left alone.
    """
    frozen = {r.selector for r in untouchable}
    have = _by_selector(current)
    want = _by_selector(desired)
    allows: list[Write] = []
    denies: list[Write] = []
    for sel in sorted(set(have) | set(want), key=_selector_order):
        if sel in frozen:
            continue
        add = want.get(sel, set()) - have.get(sel, set())
        drop = have.get(sel, set()) - want.get(sel, set())
        if add:
            allows.append(Write(True, _rule(sel, add)))
        if drop:
            denies.append(Write(False, _rule(sel, drop)))
    return tuple(allows + denies)


@functools.lru_cache(maxsize=256)
def _parse_list(text: str) -> tuple[DeviceRule, ...]:
    """``devices.list`` text to rules. Rules are immutable, and a host's lists repeat (the same
    grants container after container), so parsed lists are kept by their text."""
    return parse_rules(text.splitlines())


class _Files:
    """``devices.allow`` and ``devices.deny`` of one cgroup, each opened once for a run of writes.

    The kernel takes one rule per write(2) (security/device_cgroup.c ``devcgroup_access_write``),
    so each rule is its own ``os.write``, never buffered with another. A cgroup removed meanwhile
    fails the open with ENOENT or a write with ENODEV: both mean it vanished.
    """

    def __init__(self, cgroup: str) -> None:
        self.cgroup = cgroup
        self._fds: dict[str, int] = {}

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def write(self, write: Write) -> None:
        name = write.file
        path = os.path.join(self.cgroup, name)
        try:
            fd = self._fds.get(name)
            if fd is None:
                fd = self._fds[name] = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            os.write(fd, str(write.rule).encode())
        except FileNotFoundError as exc:
            raise CgroupVanished(op="write", path=path) from exc
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                raise CgroupVanished(op="write", path=path) from exc
            raise CgroupError(op="write", path=path, cause=f"{write.rule}: {exc.strerror or exc}") from exc


class V1DeviceController:
    """Devices cgroup v1 at ``<hierarchy>/<cgroups_root>/<a>/mesos/<b>...`` (Mesos's layout).

    mesos mode: the cgroup is Mesos's, created and whitelisted by its cgroups/devices subsystem
    before our prepare (its defaults plus the agent's --allowed_devices); we add and remove only
    NVIDIA entries (character devices of the majors ``nvidia_majors()`` names, plus those of our
    rules) and leave every other entry exactly as the agent set it.
    standalone mode: we create the cgroup, deny everything, then allow the full set.
    """

    version = CgroupVersion.V1

    def __init__(
        self,
        hierarchy: str,
        cgroups_root: str = "mesos",
        mode: Mode = Mode.MESOS,
        base: Iterable[DeviceRule] = MESOS_DEFAULT_WHITELIST,
        nvidia_majors: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        self.hierarchy = hierarchy
        self.cgroups_root = cgroups_root
        self.mode = check_mode(mode)
        self.base = tuple(base)
        self.nvidia_majors = nvidia_majors

    def _owned(self, rules: Iterable[DeviceRule]) -> Callable[[DeviceRule], bool]:
        """Which entries are ours to write: all in standalone mode, NVIDIA's in mesos mode."""
        if self.mode is not Mode.MESOS:
            return lambda _rule: True
        majors = owned_majors(rules, self.base, known_majors(self.nvidia_majors))
        return lambda rule: is_owned(rule, majors)

    def cgroup_path(self, container: ContainerId) -> str:
        return container_dir(self.hierarchy, self.cgroups_root, container)

    def exists(self, container: ContainerId) -> bool:
        return os.path.isdir(self.cgroup_path(container))

    def nested_names(self, container: ContainerId) -> tuple[str, ...]:
        return child_names(self.cgroup_path(container))

    def root_path(self) -> str:
        return os.path.normpath(os.path.join(self.hierarchy, self.cgroups_root.strip("/")))

    def cgroup_of(self, pid: int) -> str | None:
        return cgroup_of(pid, self.hierarchy, "devices")

    def containers(self) -> tuple[ContainerId, ...]:
        return top_level_ids(os.path.join(self.hierarchy, self.cgroups_root.strip("/")))

    def in_force(self, container: ContainerId) -> KernelRules:
        path = self.cgroup_path(container)
        if not os.path.isdir(path):
            return KernelRules((), f"none: the cgroup '{path}' does not exist", present=False)
        return KernelRules(self.current(container), f"devices.list of '{path}'")

    # ---- reading ---------------------------------------------------------------------------

    def _read_list(self, cgroup: str) -> tuple[DeviceRule, ...]:
        path = os.path.join(cgroup, "devices.list")
        try:
            return _parse_list(read_text(path))
        except FileNotFoundError as exc:
            raise CgroupVanished(op="read", path=path) from exc
        except OSError as exc:
            raise CgroupError(op="read", path=path, cause=exc.strerror or str(exc)) from exc
        except RuleParseError as exc:
            raise CgroupError(op="parse", path=path, cause=exc.message) from exc

    def current(self, container: ContainerId) -> tuple[DeviceRule, ...]:
        return self._read_list(self.cgroup_path(container))

    def recover(self, container: ContainerId) -> tuple[DeviceRule, ...]:
        # v1 needs no checkpoint: the kernel's devices.list is the source of truth (as in Mesos).
        return self.current(container)

    def _require_whitelist(self, cgroup: str, rules: tuple[DeviceRule, ...]) -> None:
        if any(r.type == "a" for r in rules):
            hint = "is Mesos's cgroups/devices isolator enabled?" if self.mode is Mode.MESOS else "was it prepared?"
            raise CgroupError(
                op="use",
                path=os.path.join(cgroup, "devices.list"),
                cause=f"the cgroup allows every device ('a *:* rwm'), it is not a whitelist; {hint}",
            )

    # ---- writing ---------------------------------------------------------------------------

    def _write(self, cgroup: str, write: Write) -> None:
        with _Files(cgroup) as files:
            files.write(write)

    def _run(self, cgroup: str, writes: tuple[Write, ...]) -> None:
        done: list[Write] = []
        with _Files(cgroup) as files:
            try:
                for write in writes:
                    files.write(write)
                    done.append(write)
                    crashpoint("v1.write")
            except (CgroupError, CgroupVanished):
                for write in reversed(done):
                    try:
                        files.write(write.inverse())
                    except (CgroupError, CgroupVanished) as exc:
                        LOG.error("rollback of %s in '%s' failed: %s", write, cgroup, exc)
                raise

    def prepare(self, container: ContainerId) -> None:
        cgroup = self.cgroup_path(container)
        if self.mode is Mode.MESOS:
            if not os.path.isdir(cgroup):
                raise CgroupVanished(op="prepare", path=cgroup)
            self._require_whitelist(cgroup, self._read_list(cgroup))
            return
        try:
            os.makedirs(cgroup)
            created = True
        except FileExistsError:
            created = False
        except OSError as exc:
            raise CgroupError(op="create", path=cgroup, cause=exc.strerror or str(exc)) from exc
        allowed_all = not created and any(r.type == "a" for r in self._read_list(cgroup))
        if created or allowed_all:
            # Writing 'a' to devices.deny switches the cgroup to default-deny and drops every
            # exception (security/device_cgroup.c, DEVCG_DENY with DEVCG_DEV_ALL).
            self._write(cgroup, Write(False, DeviceRule("a", None, None, "rwm")))
        # Say what was done, and only that: a restart prepares every recorded container's existing
        # cgroup again, and must not claim to have created or emptied it (issue 26).
        if created:
            LOG.info("container %s: devices cgroup '%s' created with everything denied", container, cgroup)
        elif allowed_all:
            LOG.warning(
                "container %s: devices cgroup '%s' existed and allowed every device; now denies everything",
                container,
                cgroup,
            )
        else:
            LOG.debug("container %s: devices cgroup '%s' exists with a whitelist; left as it is", container, cgroup)

    def apply(self, container: ContainerId, rules: Iterable[DeviceRule]) -> None:
        self.apply_path(self.cgroup_path(container), rules, str(container))

    def apply_nested(self, container: ContainerId, rules: Iterable[DeviceRule]) -> None:
        rules = tuple(rules)
        parent = container.parent
        self.apply_path(os.path.dirname(self.cgroup_path(container)), rules, f"{parent} (mesos)")
        self.apply(container, rules)

    def apply_path(self, cgroup: str, rules: Iterable[DeviceRule], container: str = "") -> None:
        """``apply`` to a cgroup that is not a container's: the ``<parent>/mesos`` cgroup between a
        container and its nested ones, which the kernel filled with a copy of the parent's list
        when Mesos made it, and which a nested cgroup's grants may never exceed."""
        rules = tuple(rules)
        wild = [str(r) for r in rules if r.type == "a"]
        if wild:
            raise InvalidArgument(f"failed to apply {wild[0]!r} to '{cgroup}': v1 cannot allow type 'a' in a whitelist")
        current = self._read_list(cgroup)
        self._require_whitelist(cgroup, current)
        owned = self._owned(rules)
        untouchable = [r for r in (*current, *rules) if not owned(r)]
        writes = whitelist_diff(current, rules, untouchable)
        self._run(cgroup, writes)
        after = self._read_list(cgroup)
        frozen = {r.selector for r in untouchable}
        missing = _uncovered(rules, after, frozen)
        extra = _uncovered(after, rules, frozen)
        if missing or extra:
            self._run(cgroup, tuple(w.inverse() for w in reversed(writes)))
            raise CgroupError(
                op="verify",
                path=os.path.join(cgroup, "devices.list"),
                cause=f"the kernel holds {[str(r) for r in after]}; missing {missing}, unexpected {extra}",
            )
        if writes:
            LOG.info(
                "container %s: devices cgroup '%s' now allows %s",
                container,
                cgroup,
                ", ".join(str(r) for r in after if r.selector not in frozen),
            )

    def add_pid(self, container: ContainerId, pid: int) -> None:
        write_pid(self.cgroup_path(container), pid)

    def pids(self, container: ContainerId) -> tuple[int, ...]:
        return read_pids(self.cgroup_path(container))

    def cleanup(self, container: ContainerId) -> None:
        cgroup = self.cgroup_path(container)
        if not os.path.isdir(cgroup):
            return
        if self.mode is Mode.MESOS:
            try:
                current = self._read_list(cgroup)
            except CgroupVanished:
                return
            owned = self._owned(())
            writes = tuple(Write(False, r) for r in current if owned(r))
            try:
                self._run(cgroup, writes)
            except CgroupVanished:
                return
            LOG.info("container %s: removed %d entries from '%s'", container, len(writes), cgroup)
            return
        pids = self._pids_below(cgroup)
        if pids:
            raise CgroupBusy(op="remove", path=cgroup, pids=sorted(pids))
        rmdir_tree(cgroup)
        LOG.info("container %s: devices cgroup '%s' removed", container, cgroup)

    def _pids_below(self, cgroup: str) -> set[int]:
        pids: set[int] = set()
        for root, _dirs, _files in os.walk(cgroup):
            try:
                pids.update(read_pids(root))
            except CgroupVanished:
                continue
        return pids
