"""A container's eBPF device program on cgroup2: checkpoint, check the ancestors, attach or replace.

v2 has no readable device list, so the applied rule set is checkpointed under a state dir passed in
before the program is attached. Programs on a cgroup and its ancestors combine with AND; we never
detach programs we did not load (recognised by name), but we refuse when one of them denies our GPUs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from isolator.cgroups import bpf, bpfprog
from isolator.cgroups.base import (
    cgroup_of,
    check_mode,
    child_names,
    container_dir,
    known_majors,
    read_pids,
    rmdir_tree,
    top_level_ids,
    write_pid,
)
from isolator.crashpoints import crashpoint
from isolator.errors import (
    BpfError,
    CgroupBusy,
    CgroupError,
    CgroupVanished,
    DeviceProgramConflict,
    RuleParseError,
)
from isolator.model import CgroupVersion, ContainerId, Mode
from isolator.policy.devices import MESOS_DEFAULT_WHITELIST, DeviceRule, KernelRules, owned_majors, parse_rules

LOG = logging.getLogger(__name__)

# Our programs' name (BPF_OBJ_NAME_LEN is 16 with the NUL); how we tell ours from Mesos's or systemd's.
PROG_NAME = "gpu_isolator"
CHECKPOINT_FILE = "device-rules.json"
NESTED_DIR = "nested"


@dataclass(frozen=True)
class Attached:
    """One program attached to a cgroup. ``fd`` is -1 when the kernel would not let us open it."""

    id: int
    name: str
    fd: int
    insns: bytes
    tag: str = ""  # the kernel's hash of the loaded instructions (bpftool prog show: tag)


def allowed_devices_remedy(rules: Iterable[DeviceRule], device_path: Callable[[str, int, int], str | None]) -> str:
    """What to give the Mesos agent so that its program on ``<id>`` lets ``rules`` through: its
    ``--allowed_devices``, a JSON DeviceWhitelist of device *paths* (the agent refuses an entry
    without one and stats each at start; cgroups2/controllers/devices.cpp), never cgroup rules."""
    paths: list[str] = []
    missing: list[str] = []
    for rule in rules:
        path = None if rule.major is None or rule.minor is None else device_path(rule.type, rule.major, rule.minor)
        if path is None:
            missing.append(f"'{rule.type} {rule.major}:{rule.minor}'")
        elif path not in paths:
            paths.append(path)
    access = {"read": True, "write": True, "mknod": True}
    flag = json.dumps(
        {"allowed_devices": [{"device": {"path": p}, "access": access} for p in paths]}, separators=(",", ":")
    )
    text = f"add {', '.join(paths) or 'their nodes'} to the Mesos agent's --allowed_devices (device paths only"
    text += f", read at start: restart the agent), e.g. --allowed_devices='{flag}'" if paths else ")"
    if missing:
        text += f"; no node found for {', '.join(missing)} (create it before the agent starts)"
    return text


@functools.lru_cache(maxsize=256)
def _program(rules: tuple[DeviceRule, ...], decide_majors: frozenset[int] | None) -> bytes:
    """``bpfprog.build_bytes``, kept by its inputs: it is a pure function of them, and a host
    builds the same few programs (the deny-all one, each grant size) container after container."""
    return bpfprog.build_bytes(rules, None if decide_majors is None else sorted(decide_majors))


class V2DeviceController:
    """eBPF device programs at Mesos's cgroup2 layout under ``mount``.

    mesos mode: the program goes on ``<mount>/<cgroups_root>/<id>/leaf`` (where Mesos puts the
    processes), never on ``<id>`` itself, whose single program belongs to Mesos's devices controller
    (Mesos fails "Detected multiple BPF_CGROUP_DEVICE" if it finds two there). standalone mode: we
    create ``<mount>/<cgroups_root>/<id>``, attach a deny-all program, and processes live there.
    """

    version = CgroupVersion.V2

    def __init__(
        self,
        mount: str,
        state_dir: str,
        cgroups_root: str = "mesos",
        mode: Mode = Mode.MESOS,
        base: Iterable[DeviceRule] = MESOS_DEFAULT_WHITELIST,
        prog_name: str = PROG_NAME,
        nvidia_majors: Callable[[], Iterable[int]] | None = None,
        device_path: Callable[[str, int, int], str | None] | None = None,
    ) -> None:
        """``device_path(type, major, minor)``: the host's node for a device (HostDevices.node_path),
        so that a conflict with the agent's program names what its --allowed_devices takes."""
        self.mount = mount
        self.state_dir = state_dir
        self.cgroups_root = cgroups_root
        self.mode = check_mode(mode)
        self.base = tuple(base)
        self.prog_name = prog_name
        self.nvidia_majors = nvidia_majors
        self.device_path = device_path or (lambda _type, _major, _minor: None)

    def program(self, rules: tuple[DeviceRule, ...]) -> bytes:
        """Our program for ``rules``. In mesos mode it decides for NVIDIA's character majors only and
        allows every other device, which the agent's program on ``<id>`` decides (all programs on a
        cgroup and its ancestors must allow): the agent's --allowed_devices stay in force."""
        if self.mode is not Mode.MESOS:
            return _program(tuple(rules), None)
        return _program(tuple(rules), frozenset(owned_majors(rules, self.base, known_majors(self.nvidia_majors))))

    # ---- paths and checkpoint --------------------------------------------------------------

    def container_dir(self, container: ContainerId) -> str:
        return container_dir(self.mount, self.cgroups_root, container)

    def cgroup_path(self, container: ContainerId) -> str:
        top = self.container_dir(container)
        return os.path.join(top, "leaf") if self.mode is Mode.MESOS else top

    def exists(self, container: ContainerId) -> bool:
        return os.path.isdir(self.cgroup_path(container))

    def nested_names(self, container: ContainerId) -> tuple[str, ...]:
        return child_names(self.container_dir(container))

    def root_path(self) -> str:
        return os.path.normpath(os.path.join(self.mount, self.cgroups_root.strip("/")))

    def cgroup_of(self, pid: int) -> str | None:
        return cgroup_of(pid, self.mount, None)

    def containers(self) -> tuple[ContainerId, ...]:
        return top_level_ids(os.path.join(self.mount, self.cgroups_root.strip("/")))

    def in_force(self, container: ContainerId) -> KernelRules:
        path = self.cgroup_path(container)
        if not os.path.isdir(path):
            return KernelRules((), f"none: the cgroup '{path}' does not exist", present=False)
        ours = self._our_programs(container)
        if not ours:
            return KernelRules((), f"none: no device program of ours is attached to '{path}'", present=False)
        # A program cannot be read back as rules; the checkpoint is what the attached one was built
        # from, as long as the kernel's tag of the attached program is the one checkpointed with its
        # rules. A kill between checkpoint and attach leaves the old program under the new rules.
        rules, tag = self._read_checkpoint_and_tag(container)
        progs = ", ".join(str(i) for i, _tag in ours)
        if rules is None or len(ours) != 1 or not tag or ours[0][1] != tag:
            return KernelRules(
                (),
                f"none: the device program {progs} on '{path}' is not the one its checkpoint was built from",
                present=False,
            )
        return KernelRules(rules, f"device program {progs} on '{path}' (rules from its checkpoint)")

    def checkpoint_path(self, container: ContainerId) -> str:
        # <state>/<a>/nested/<b>/device-rules.json: IDs only ever name directories next to
        # 'nested' and the file, so no ID can collide with either.
        parts: list[str] = []
        for i, value in enumerate(container.chain()):
            if i:
                parts.append(NESTED_DIR)
            parts.append(value)
        return os.path.join(self.state_dir, *parts, CHECKPOINT_FILE)

    def _read_checkpoint(self, container: ContainerId) -> tuple[DeviceRule, ...] | None:
        return self._read_checkpoint_and_tag(container)[0]

    def _read_checkpoint_and_tag(self, container: ContainerId) -> tuple[tuple[DeviceRule, ...] | None, str]:
        """The checkpointed rules (None without a checkpoint) and the tag of the program built from
        them ('' in checkpoints written before tags were kept: never taken as proof)."""
        path = self.checkpoint_path(container)
        try:
            with open(path) as fh:
                data = json.load(fh)
            return parse_rules(data["rules"]), str(data.get("tag", ""))
        except FileNotFoundError:
            return None, ""
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RuleParseError) as exc:
            raise CgroupError(op="read checkpoint", path=path, cause=str(exc)) from exc

    def _our_programs(self, container: ContainerId) -> list[tuple[int, str]]:
        """(id, tag) of our programs on the container's cgroup (empty when the cgroup is gone)."""
        path = self.cgroup_path(container)
        try:
            fd = self._open(path, "query")
        except CgroupVanished:
            return []
        try:
            with self._attached(fd, path) as progs:
                return [(p.id, p.tag) for p in self._ours(progs)]
        finally:
            os.close(fd)

    def _write_checkpoint(self, container: ContainerId, rules: tuple[DeviceRule, ...] | None, tag: str = "") -> None:
        path = self.checkpoint_path(container)
        if rules is None:
            self._remove_checkpoint(container)
            return
        body: dict[str, object] = {"container": list(container.chain()), "cgroup": self.cgroup_path(container)}
        body["rules"] = [str(r) for r in rules]
        body["tag"] = tag
        tmp = path + ".tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "w") as fh:
                json.dump(body, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            dirfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dirfd)
            finally:
                os.close(dirfd)
        except OSError as exc:
            raise CgroupError(op="write checkpoint", path=path, cause=exc.strerror or str(exc)) from exc

    def _remove_checkpoint(self, container: ContainerId) -> None:
        path = self.checkpoint_path(container)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        # Prune now-empty directories of this container's chain, never the state dir itself.
        directory = os.path.dirname(path)
        stop = os.path.normpath(self.state_dir)
        while os.path.normpath(directory) != stop:
            try:
                os.rmdir(directory)
            except OSError:
                break
            directory = os.path.dirname(directory)

    # ---- the kernel side -------------------------------------------------------------------

    def _open(self, path: str, op: str) -> int:
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise CgroupVanished(op=op, path=path) from exc
        except OSError as exc:
            raise CgroupError(op=op, path=path, cause=exc.strerror or str(exc)) from exc

    @contextlib.contextmanager
    def _attached(self, cgroup_fd: int, path: str) -> Iterator[list[Attached]]:
        """The programs on one cgroup, opened; their fds are closed on exit."""
        progs: list[Attached] = []
        try:
            for prog_id in bpf.prog_query(cgroup_fd, path):
                try:
                    fd = bpf.prog_fd_by_id(prog_id)
                except BpfError as exc:
                    # LSM-labelled programs (systemd under SELinux) refuse to open: treat as opaque,
                    # and a detached-in-between program (ENOENT) as gone (runc does the same).
                    LOG.debug("cannot open device program %d on '%s': %s", prog_id, path, exc)
                    progs.append(Attached(prog_id, "", -1, b""))
                    continue
                try:
                    info = bpf.prog_info(fd)
                except BpfError:
                    os.close(fd)
                    raise
                progs.append(Attached(prog_id, info.name, fd, info.insns, info.tag))
            yield progs
        finally:
            for prog in progs:
                if prog.fd >= 0:
                    os.close(prog.fd)

    def _ours(self, progs: list[Attached]) -> list[Attached]:
        return [p for p in progs if p.fd >= 0 and p.name == self.prog_name]

    def _ancestors(self, path: str) -> list[str]:
        out: list[str] = []
        stop = os.path.normpath(self.mount)
        current = os.path.normpath(path)
        while current != stop and current.startswith(stop + os.sep):
            current = os.path.dirname(current)
            out.append(current)
        return out

    def _check_conflicts(self, path: str, own_progs: list[Attached], rules: tuple[DeviceRule, ...]) -> None:
        base = set(self.base)
        needed = [r for r in rules if r not in base and not r.is_wildcard]
        if not needed:
            return
        ours = {p.id for p in self._ours(own_progs)}
        self._check_programs(path, path, [p for p in own_progs if p.id not in ours], needed)
        for ancestor in self._ancestors(path):
            try:
                fd = os.open(ancestor, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                raise CgroupError(op="open", path=ancestor, cause=exc.strerror or str(exc)) from exc
            try:
                with self._attached(fd, ancestor) as progs:
                    self._check_programs(path, ancestor, progs, needed)
            finally:
                os.close(fd)

    def _check_programs(self, path: str, at: str, progs: list[Attached], needed: list[DeviceRule]) -> None:
        for prog in progs:
            if not prog.insns:
                LOG.warning(
                    "device program %d on '%s' cannot be inspected; if it denies the GPUs, they will fail to open",
                    prog.id,
                    at,
                )
                continue
            try:
                refused = bpfprog.denied(prog.insns, needed)
            except bpfprog.UnsupportedProgram as exc:
                LOG.warning("device program %d (%r) on '%s' cannot be evaluated (%s)", prog.id, prog.name, at, exc)
                continue
            if refused:
                devices = list(dict.fromkeys(DeviceRule(q.type, q.major, q.minor, "rwm") for q in refused))
                rules = " ".join(f"'{r.type} {r.major}:{r.minor} rwm'" for r in devices)
                if prog.name == self.prog_name:
                    remedy = "grant these devices to the parent container first"
                elif self.mode is Mode.MESOS:
                    remedy = (
                        f"{allowed_devices_remedy(devices, self.device_path)}; or detach program {prog.id} "
                        f"(e.g. bpftool cgroup detach {at} device id {prog.id})"
                    )
                else:
                    remedy = f"detach program {prog.id} or make it allow {rules}"
                raise DeviceProgramConflict(
                    op="attach device program to",
                    path=path,
                    prog_id=prog.id,
                    prog_name=prog.name,
                    at=at,
                    denied=", ".join(f"'{q}'" for q in refused),
                    remedy=remedy,
                )

    def _apply(self, container: ContainerId, rules: tuple[DeviceRule, ...], checkpoint: bool) -> None:
        path = self.cgroup_path(container)
        cgroup_fd = self._open(path, "attach device program to")
        try:
            with self._attached(cgroup_fd, path) as progs:
                self._check_conflicts(path, progs, rules)
                ours = self._ours(progs)
                prog_fd = bpf.prog_load(self.program(rules), self.prog_name)
                previous, previous_tag = self._read_checkpoint_and_tag(container)
                try:
                    if checkpoint:
                        # Checkpoint first (as Mesos's DeviceManager does): a crash between the
                        # two steps leaves a record that recover() can re-apply. The program's tag
                        # goes with it, so that in_force can tell whether the attach happened.
                        self._write_checkpoint(container, rules, bpf.prog_info(prog_fd).tag)
                        crashpoint("v2.checkpoint")
                    try:
                        bpf.prog_attach(cgroup_fd, prog_fd, ours[0].fd if ours else None, path)
                    except BpfError:
                        if checkpoint:
                            self._write_checkpoint(container, previous, previous_tag)
                        raise
                finally:
                    os.close(prog_fd)
                crashpoint("v2.attach")
                # More than one of ours means an earlier run died between attach and detach.
                for extra in ours[1:]:
                    bpf.prog_detach(cgroup_fd, extra.fd, path)
        finally:
            os.close(cgroup_fd)
        LOG.info(
            "container %s: device program on '%s' now allows %s",
            container,
            path,
            ", ".join(str(r) for r in rules if r not in set(self.base))
            or ("only the base whitelist" if rules else "nothing"),
        )

    # ---- DeviceController ------------------------------------------------------------------

    def prepare(self, container: ContainerId) -> None:
        path = self.cgroup_path(container)
        if self.mode is Mode.MESOS:
            if not os.path.isdir(path):
                raise CgroupVanished(op="prepare", path=path)
            return
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise CgroupError(op="create", path=path, cause=exc.strerror or str(exc)) from exc
        if self._read_checkpoint(container) is None:
            self.apply(container, ())  # deny everything until the first real apply

    def apply(self, container: ContainerId, rules: Iterable[DeviceRule]) -> None:
        self._apply(container, tuple(rules), checkpoint=True)

    def apply_nested(self, container: ContainerId, rules: Iterable[DeviceRule]) -> None:
        # A nested cgroup's program is attached to it alone: no cgroup in between filters it.
        self.apply(container, rules)

    def current(self, container: ContainerId) -> tuple[DeviceRule, ...]:
        # The checkpoint outlives a cgroup removed behind our back; what is in force then is nothing.
        path = self.cgroup_path(container)
        if not os.path.isdir(path):
            raise CgroupVanished(op="read", path=path)
        return self._read_checkpoint(container) or ()

    def recover(self, container: ContainerId) -> tuple[DeviceRule, ...]:
        """Re-attach the checkpointed set (replacing ours atomically) and return it."""
        rules = self._read_checkpoint(container)
        if rules is None:
            return ()
        self._apply(container, rules, checkpoint=False)
        return rules

    def add_pid(self, container: ContainerId, pid: int) -> None:
        write_pid(self.cgroup_path(container), pid)

    def pids(self, container: ContainerId) -> tuple[int, ...]:
        return read_pids(self.cgroup_path(container))

    def cleanup(self, container: ContainerId) -> None:
        path = self.cgroup_path(container)
        if self.mode is Mode.STANDALONE and os.path.isdir(path):
            busy: set[int] = set()
            for root, _dirs, _files in os.walk(path):
                with contextlib.suppress(CgroupVanished):
                    busy.update(read_pids(root))
            if busy:
                raise CgroupBusy(op="remove", path=path, pids=sorted(busy))
        try:
            cgroup_fd = self._open(path, "detach device programs from")
        except CgroupVanished:
            # Programs are released with their cgroup; only our record is left to remove.
            self._remove_checkpoint(container)
            return
        try:
            with self._attached(cgroup_fd, path) as progs:
                for prog in self._ours(progs):
                    try:
                        bpf.prog_detach(cgroup_fd, prog.fd, path)
                    except BpfError as exc:
                        if not isinstance(exc.__cause__, OSError) or exc.__cause__.errno != errno.ENOENT:
                            raise
        finally:
            os.close(cgroup_fd)
        if self.mode is Mode.STANDALONE:
            rmdir_tree(path)
        self._remove_checkpoint(container)
        LOG.info("container %s: device programs on '%s' removed", container, path)
