"""One contract per port of the core (isolator/core/ports.py), run on the shipped fake AND the real edge.

A fake earns its place only by behaving like the real thing where the core can tell: each test
below runs on both. Real edges that need root or a cgroup version carry its marker and skip loudly
where the machine lacks it (tests/conftest.py); the fakes run everywhere, as any user.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from isolator.errors import (
    CgroupBusy,
    CgroupError,
    CgroupVanished,
    ContainerAlreadyRecorded,
    ContainerNotRecorded,
    GpuAlreadyHeld,
    InvalidArgument,
    NvmlError,
)
from isolator.host.system import LocalFilesystem, PasswdUsers, ProcProcesses, SystemClock
from isolator.model import (
    ContainerId,
    ContainerRecord,
    DrainRecord,
    EndedDrain,
    Holding,
    MaintenanceMark,
    Share,
    ShareMode,
    Topology,
)
from isolator.policy.devices import MESOS_DEFAULT_WHITELIST, DeviceRule, container_rules
from isolator.testing import (
    FakeCgroups,
    FakeCpusets,
    FakeDeviceNodes,
    FakeFilesystem,
    FakeInventory,
    FakeProcesses,
    FakeStore,
    FakeUsers,
    ManualClock,
)

CONTROL = FakeDeviceNodes().control_devices()


def rules_for(*gpus: int) -> tuple[DeviceRule, ...]:
    return container_rules(CONTROL, gpus)


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


# ---- CgroupBackend ------------------------------------------------------------------------------


@dataclass
class Backend:
    """A backend under test and what the test needs around it: a way to play Mesos and to end a process."""

    cgroups: Any
    mesos_creates: Callable[[ContainerId], None]
    process_exits: Callable[[int], None]


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "300"])


@contextlib.contextmanager
def _real(version: str, mode: str) -> Iterator[Backend]:
    from isolator.cgroups.v1 import V1DeviceController
    from isolator.cgroups.v2 import V2DeviceController
    from isolator.testing.cgroupfs import hierarchy_mounts, scratch_cgroups_root

    v1_mount, v2_mount = hierarchy_mounts()
    mount = v1_mount if version == "v1" else v2_mount
    assert mount is not None
    state_dir = tempfile.mkdtemp(prefix="gi-contract-")
    try:
        with scratch_cgroups_root(mount, f"contract-{version}") as root:
            ctl: V1DeviceController | V2DeviceController
            if version == "v1":
                ctl = V1DeviceController(mount, root, mode)
            else:
                ctl = V2DeviceController(mount, state_dir, root, mode)

            def mesos_creates(c: ContainerId) -> None:
                path = ctl.cgroup_path(c)
                os.makedirs(path)
                if version == "v1":  # Mesos's cgroups/devices: deny all, then its default whitelist
                    with open(os.path.join(path, "devices.deny"), "w") as fh:
                        fh.write("a *:* rwm")
                    for rule in MESOS_DEFAULT_WHITELIST:
                        with open(os.path.join(path, "devices.allow"), "w") as fh:
                            fh.write(str(rule))

            yield Backend(ctl, mesos_creates, lambda pid: None)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


BACKENDS = [
    pytest.param(("fake", "v1"), id="fake-v1"),
    pytest.param(("fake", "v2"), id="fake-v2"),
    pytest.param(("real", "v1"), id="real-v1", marks=[pytest.mark.root, pytest.mark.cgroup_v1]),
    pytest.param(("real", "v2"), id="real-v2", marks=[pytest.mark.root, pytest.mark.cgroup_v2]),
]


def _backend(kind: str, version: str, mode: str) -> contextlib.AbstractContextManager[Backend]:
    if kind == "real":
        return _real(version, mode)
    fake = FakeCgroups(mode=mode, version=version)
    return contextlib.nullcontext(Backend(fake, fake.mesos_creates, fake.kill))


@pytest.fixture(params=BACKENDS)
def standalone(request) -> Iterator[Backend]:
    kind, version = request.param
    with _backend(kind, version, "standalone") as backend:
        yield backend


@pytest.fixture(params=BACKENDS)
def mesos(request) -> Iterator[Backend]:
    kind, version = request.param
    with _backend(kind, version, "mesos") as backend:
        yield backend


@pytest.fixture
def process(standalone: Backend) -> Iterator[int]:
    proc = _sleeper()
    yield proc.pid
    proc.kill()
    proc.wait()
    standalone.process_exits(proc.pid)


def _exit(backend: Backend, pid: int, proc: subprocess.Popen[bytes] | None = None) -> None:
    if proc is not None:
        proc.kill()
        proc.wait()
    backend.process_exits(pid)


def test_standalone_prepare_creates_the_cgroup_denying_everything(standalone: Backend) -> None:
    cg = standalone.cgroups
    a = cid("contract-a")
    assert not cg.exists(a)
    cg.prepare(a)
    assert cg.exists(a)
    assert cg.current(a) == ()
    in_force = cg.in_force(a)
    assert in_force.present and in_force.rules == ()
    assert cg.pids(a) == ()


def test_apply_makes_exactly_the_rules_in_force_and_replaces_them(standalone: Backend) -> None:
    cg = standalone.cgroups
    a = cid("contract-a")
    cg.prepare(a)
    for gpus in ((0, 2), (0, 1, 2), (2,), ()):
        cg.apply(a, rules_for(*gpus))
        assert set(cg.current(a)) == set(rules_for(*gpus))
        assert set(cg.in_force(a).rules) == set(rules_for(*gpus))
        assert set(cg.recover(a)) == set(rules_for(*gpus))


def test_prepare_again_keeps_what_was_applied(standalone: Backend) -> None:
    cg = standalone.cgroups
    a = cid("contract-a")
    cg.prepare(a)
    cg.apply(a, rules_for(3))
    cg.prepare(a)
    assert set(cg.current(a)) == set(rules_for(3))


def test_processes_are_placed_listed_and_moved(standalone: Backend) -> None:
    cg = standalone.cgroups
    a, b = cid("contract-a"), cid("contract-b")
    cg.prepare(a)
    cg.prepare(b)
    proc = _sleeper()
    try:
        outside = cg.cgroup_of(proc.pid)
        assert outside is not None and not outside.startswith(cg.root_path() + "/"), "born outside our root"
        cg.add_pid(a, proc.pid)
        assert cg.pids(a) == (proc.pid,)
        assert cg.cgroup_of(proc.pid) == cg.cgroup_path(a) and cg.cgroup_path(a).startswith(cg.root_path() + "/")
        cg.add_pid(b, proc.pid)
        assert cg.pids(a) == () and cg.pids(b) == (proc.pid,)
    finally:
        _exit(standalone, proc.pid, proc)


def test_standalone_cleanup_refuses_a_cgroup_with_processes_and_keeps_isolating(standalone: Backend) -> None:
    cg = standalone.cgroups
    a = cid("contract-a")
    cg.prepare(a)
    cg.apply(a, rules_for(1))
    proc = _sleeper()
    try:
        cg.add_pid(a, proc.pid)
        with pytest.raises(CgroupBusy, match=str(proc.pid)):
            cg.cleanup(a)
        assert cg.exists(a) and set(cg.current(a)) == set(rules_for(1))
    finally:
        _exit(standalone, proc.pid, proc)
    cg.cleanup(a)
    assert not cg.exists(a)
    cg.cleanup(a)  # idempotent
    cg.cleanup(cid("never-prepared"))


def test_a_missing_cgroup_is_vanished_for_every_step_that_needs_it(standalone: Backend) -> None:
    cg = standalone.cgroups
    gone = cid("contract-gone")
    with pytest.raises(CgroupVanished):
        cg.apply(gone, rules_for(0))
    with pytest.raises(CgroupVanished):
        cg.current(gone)
    with pytest.raises(CgroupVanished):
        cg.pids(gone)
    with pytest.raises(CgroupVanished):
        cg.add_pid(gone, os.getpid())
    in_force = cg.in_force(gone)
    assert not in_force.present and in_force.source.startswith("none: ")
    assert cg.nested_names(gone) == ()


def test_nested_cgroups_are_listed_below_their_parent(standalone: Backend) -> None:
    cg = standalone.cgroups
    a = cid("contract-a")
    cg.prepare(a)
    cg.prepare(cid("contract-a.child-1"))
    cg.prepare(cid("contract-a.child-2"))
    assert cg.nested_names(a) == ("child-1", "child-2")
    cg.prepare(cid("contract-b"))
    assert cg.containers() == (a, cid("contract-b")), "top-level containers under our root, in order"
    assert cg.cgroup_path(cid("contract-a.child-1")).startswith(cg.cgroup_path(a) + "/mesos/child-1")
    cg.cleanup(a)
    assert not cg.exists(cid("contract-a.child-1"))


def test_mesos_mode_uses_the_cgroup_mesos_made_and_leaves_it(mesos: Backend) -> None:
    cg = mesos.cgroups
    a = cid("contract-m")
    with pytest.raises(CgroupVanished):
        cg.prepare(a)
    mesos.mesos_creates(a)
    cg.prepare(a)
    cg.apply(a, rules_for(0, 1))
    assert set(cg.current(a)) == set(rules_for(0, 1))
    cg.cleanup(a)
    assert cg.exists(a), "the cgroup is Mesos's to remove"
    kernel = set(cg.in_force(a).rules)
    assert not any(r.major == 195 for r in kernel), "our grants are gone"


def test_mesos_nested_cgroup_follows_a_grow_of_its_top_level_container(mesos: Backend) -> None:
    # Mesos makes <a>/mesos/<b> for a nested container with cgroups of its own; on v1 the kernel
    # copied <a>'s list into <a>/mesos then, and a grant below may never exceed the cgroup above.
    cg = mesos.cgroups
    a, b = cid("contract-n"), cid("contract-n.b")
    mesos.mesos_creates(a)
    cg.prepare(a)
    cg.apply(a, rules_for(0))
    mesos.mesos_creates(b)
    cg.prepare(b)
    cg.apply(a, rules_for(0, 1))
    cg.apply_nested(b, rules_for(0, 1))
    assert set(cg.current(b)) == set(rules_for(0, 1))
    cg.apply(a, rules_for(1))
    cg.apply_nested(b, rules_for(1))
    assert set(cg.current(b)) == set(rules_for(1))
    if cg.version == "v1":
        with pytest.raises(CgroupError):  # the kernel refuses more than the parent allows (EPERM)
            cg.apply_nested(b, rules_for(1, 2))
        assert set(cg.current(b)) == set(rules_for(1)), "a refused grant changes nothing"
    cg.cleanup(b)
    cg.cleanup(a)


def test_a_nested_cgroup_takes_its_parents_rules_through_apply_nested(mesos: Backend) -> None:
    cg = mesos.cgroups
    a, child = cid("contract-n"), cid("contract-n.task")
    mesos.mesos_creates(a)
    cg.prepare(a)
    cg.apply(a, rules_for(0, 1))
    mesos.mesos_creates(child)  # made after the grant: on v1 the kernel copied the parent's list
    cg.apply_nested(child, rules_for(0, 1))
    assert set(cg.current(child)) == set(rules_for(0, 1))
    cg.apply_nested(child, rules_for(1))
    assert set(cg.current(child)) == set(rules_for(1))
    assert set(cg.current(a)) == set(rules_for(0, 1)), "the parent keeps its own"


def test_mesos_mode_v1_refuses_a_cgroup_that_is_not_a_whitelist(mesos: Backend) -> None:
    # Mesos without its cgroups/devices isolator makes the cgroup but leaves the inherited
    # 'a *:* rwm': our rules would add nothing to an allow-all list, so prepare must refuse it.
    cg = mesos.cgroups
    a = cid("contract-w")
    if isinstance(cg, FakeCgroups):
        cg.mesos_creates(a)
        cg.grant_behind_our_back(a, (DeviceRule("a", None, None, "rwm"),))
    else:
        os.makedirs(cg.cgroup_path(a))
        if cg.version == "v1":
            with open(os.path.join(cg.cgroup_path(a), "devices.allow"), "w") as fh:
                fh.write("a *:* rwm")
    if cg.version == "v1":
        with pytest.raises(CgroupError, match="not a whitelist"):
            cg.prepare(a)
    else:
        cg.prepare(a)  # v2: no list to inherit; our program is what restricts
    cg.cleanup(a)


# ---- StateStore ----------------------------------------------------------------------------------


@pytest.fixture(params=["fake", "sqlite"])
def store(request, tmp_path) -> Iterator[FakeStore]:
    if request.param == "fake":
        yield FakeStore()
        return
    from isolator.host.state import StateStore

    real = StateStore(str(tmp_path / "state"))
    try:
        yield real
    finally:
        real.close()


def test_store_keeps_drain_rows_by_gpu_apart_from_containers(store: FakeStore) -> None:
    assert store.drains() == {}
    first = DrainRecord(3, since=1.5, since_mono=10.0, reason="processes [42] still run", pids=(42, 43), memory_used=7)
    store.set_drain(first)
    store.record(record("a", 3))  # a drain row does not hold the GPU: that is the allocator's job
    assert store.drains() == {3: first}
    later = DrainRecord(3, since=1.5, since_mono=10.0, reason="still busy", pids=(43,), timed_out=True)
    store.set_drain(later)
    assert store.drains() == {3: later}
    store.clear_drain(3)
    store.clear_drain(3)  # no row is success
    assert store.drains() == {}
    with pytest.raises(InvalidArgument):
        store.set_drain(DrainRecord(-1, 0.0, 0.0, ""))


def test_store_keeps_maintenance_drains_by_gpu_uuid(store: FakeStore) -> None:
    assert store.maintenance() == {}
    store.set_maintenance(MaintenanceMark("GPU-1", "a", 1.0, "uid 0"))
    store.set_maintenance(MaintenanceMark("GPU-2", "b", 2.0, "uid 0"))
    store.set_maintenance(MaintenanceMark("GPU-1", "a2", 1.0, "uid 5"))
    store.clear_maintenance("GPU-2")
    store.clear_maintenance("GPU-9")
    assert store.maintenance() == {"GPU-1": MaintenanceMark("GPU-1", "a2", 1.0, "uid 5")}
    with pytest.raises(InvalidArgument):
        store.set_maintenance(MaintenanceMark("GPU-3", "", 1.0, ""))


def test_store_ends_a_maintenance_drain_into_its_history_in_one_write(store: FakeStore) -> None:
    assert store.maintenance_history() == []
    store.set_maintenance(MaintenanceMark("GPU-1", "a", 1.0, "uid 0"))
    store.set_maintenance(MaintenanceMark("GPU-2", "b", 2.0, "uid 0"))
    store.end_maintenance(EndedDrain("GPU-2", "b", 2.0, "uid 0", ended=9.0, ended_by="uid 5", end_reason="fixed"))
    store.end_maintenance(EndedDrain("GPU-1", "a", 1.0, "uid 0", ended=5.0))
    assert store.maintenance() == {}
    assert store.maintenance_history() == [
        EndedDrain("GPU-1", "a", 1.0, "uid 0", 5.0, "", ""),
        EndedDrain("GPU-2", "b", 2.0, "uid 0", 9.0, "uid 5", "fixed"),
    ]
    with pytest.raises(InvalidArgument):
        store.end_maintenance(EndedDrain("", "a", 1.0, "", 2.0))


def record(name: str, *gpus: int, mig: frozenset[tuple[str, int]] = frozenset(), **kwargs: object) -> ContainerRecord:
    return ContainerRecord(cid(name), Holding(frozenset(gpus), mig), created=1.0, **kwargs)  # type: ignore[arg-type]


def test_store_records_reads_and_forgets(store: FakeStore) -> None:
    store.record(record("a", 0, 1))
    store.record(record("b"))
    assert store.get(cid("a")) == record("a", 0, 1)
    assert store.get(cid("nobody")) is None
    assert store.has(cid("a")) and store.has(cid("b")) and not store.has(cid("nobody"))
    assert set(store.load()) == {cid("a"), cid("b")}
    assert store.holders() == {0: cid("a"), 1: cid("a")}
    assert store.remove(cid("a")).holding.gpus == frozenset({0, 1})
    assert store.holders() == {} and store.get(cid("a")) is None and not store.has(cid("a"))
    assert store.check() == "ok"


def test_store_ids_with_dots_and_nesting_round_trip(store: FakeStore) -> None:
    odd = ContainerId.parse("b.1", ContainerId.parse("a.0"))
    store.record(ContainerRecord(odd, Holding(frozenset({3})), created=1.0))
    assert store.get(odd) is not None and store.holders() == {3: odd} and store.has(odd)
    assert store.get(cid("a.0.b.1")) is None and not store.has(cid("a.0.b.1"))


def test_store_refuses_doubles_and_changes_nothing(store: FakeStore) -> None:
    store.record(record("a", 0))
    with pytest.raises(ContainerAlreadyRecorded):
        store.record(record("a", 5))
    with pytest.raises(GpuAlreadyHeld, match="held by a"):
        store.record(record("b", 1, 0))
    assert store.get(cid("b")) is None and store.holders() == {0: cid("a")}
    with pytest.raises(GpuAlreadyHeld):
        store.add_gpus(cid("a"), [0])


def test_store_grows_and_shrinks(store: FakeStore) -> None:
    store.record(record("a", 0))
    assert store.add_gpus(cid("a"), [1, 2]).holding.gpus == frozenset({0, 1, 2})
    assert store.remove_gpus(cid("a"), [0]).holding.gpus == frozenset({1, 2})
    with pytest.raises(InvalidArgument, match="does not hold"):
        store.remove_gpus(cid("a"), [0])
    assert store.get(cid("a")).holding.gpus == frozenset({1, 2})


def test_store_replaces_a_holding_whole_and_refuses_what_another_holds(store: FakeStore) -> None:
    # An Update's change of shares or MIG units (core/update.py): the rows replaced in one write.
    store.record(ContainerRecord(cid("s"), Holding(share=Share(4, 2, ShareMode.MPS)), created=1.0))
    assert store.set_holding(cid("s"), Holding(share=Share(4, 3, ShareMode.MPS))).holding.shares == 3
    assert store.share_holders() == {cid("s"): (4, 3, "mps")}
    assert store.set_holding(cid("s"), Holding()).holding.empty and store.share_holders() == {}
    store.record(record("m", mig=frozenset({("MIG-1", 0), ("MIG-2", 0)})))
    assert store.set_holding(cid("m"), Holding(mig=frozenset({("MIG-2", 0)}))).holding.mig == {("MIG-2", 0)}
    with pytest.raises(GpuAlreadyHeld):
        store.set_holding(cid("s"), Holding(mig=frozenset({("MIG-2", 0)})))
    assert store.get(cid("s")).holding.empty and store.get(cid("m")).holding.mig == {("MIG-2", 0)}
    with pytest.raises(ContainerNotRecorded):
        store.set_holding(cid("nobody"), Holding())


def test_store_updates_metadata_and_refuses_unknowns(store: FakeStore) -> None:
    store.record(record("a", 0))
    rules = (DeviceRule.char(195, 0),)
    rec = store.update(cid("a"), state="isolated", rules=rules, volume_version="535")
    assert (rec.state, rec.rules, rec.volume_version, rec.holding.gpus) == ("isolated", rules, "535", frozenset({0}))
    with pytest.raises(InvalidArgument, match="unknown container state"):
        store.update(cid("a"), state="running")
    with pytest.raises(InvalidArgument):
        store.record(record("z", state="running"))
    for call in (
        lambda: store.update(cid("nobody"), state="isolated"),
        lambda: store.add_gpus(cid("nobody"), [4]),
        lambda: store.remove_gpus(cid("nobody"), []),
        lambda: store.remove(cid("nobody")),
    ):
        with pytest.raises(ContainerNotRecorded):
            call()


def test_store_lazy_update_is_read_back_and_costs_no_fsync(store: FakeStore) -> None:
    # Isolate's "isolated" mark (issue 45): written without an fsync of its own, read back at once,
    # and refused for an unknown container as any update is.
    store.record(record("a", 0))
    before = store.commits
    rec = store.update(cid("a"), state="isolated", lazy=True)
    assert rec.state == "isolated" and store.get(cid("a")).state == "isolated"
    assert store.commits == before  # no synced commit counted for it
    with pytest.raises(ContainerNotRecorded):
        store.update(cid("nobody"), state="isolated", lazy=True)
    store.update(cid("a"), volume_version="535")
    assert store.commits == before + 1


def test_store_holds_mig_devices_once_and_never_with_their_gpu_whole(store: FakeStore) -> None:
    store.record(record("m", mig=frozenset({("MIG-1", 0), ("MIG-2", 0)})))
    assert store.get(cid("m")).holding.mig == frozenset({("MIG-1", 0), ("MIG-2", 0)})
    assert store.mig_holders() == {"MIG-1": (cid("m"), 0), "MIG-2": (cid("m"), 0)}
    with pytest.raises(GpuAlreadyHeld, match="held by m"):
        store.record(record("n", mig=frozenset({("MIG-1", 0)})))
    with pytest.raises(GpuAlreadyHeld, match="held by m"):
        store.record(record("w", 0))  # GPU 0 whole while its MIG devices are held
    store.record(record("w", 1))
    with pytest.raises(GpuAlreadyHeld):
        store.record(record("x", mig=frozenset({("MIG-9", 1)})))  # a MIG device of a GPU held whole
    with pytest.raises(InvalidArgument):
        store.record(record("y", mig=frozenset({("GPU-1", 2)})))
    assert set(store.load()) == {cid("m"), cid("w")}
    store.remove(cid("m"))
    assert store.mig_holders() == {}
    store.record(record("n", 0))


# ---- Processes, Filesystem, Clock ----------------------------------------------------------------


def test_processes_exist_until_they_exit_and_a_pin_sees_it() -> None:
    fake = FakeProcesses()
    pid = fake.spawn()
    pinned = fake.pin(pid)
    assert fake.exists(pid) and pinned is not None and pinned.alive()
    fake.exit(pid)
    assert not fake.exists(pid) and not pinned.alive() and fake.pin(pid) is None
    pinned.close()

    real = ProcProcesses()
    proc = _sleeper()
    real_pin = real.pin(proc.pid)
    assert real.exists(proc.pid) and real_pin is not None and real_pin.alive()
    proc.kill()
    proc.wait()
    assert not real.exists(proc.pid) and not real_pin.alive() and real.pin(proc.pid) is None
    real_pin.close()


def test_kernel_threads_are_told_apart_from_processes() -> None:
    fake = FakeProcesses()
    for procs, process in ((fake, fake.spawn()), (ProcProcesses(), os.getpid())):
        assert procs.kernel_thread(2), "pid 2 is kthreadd in the initial pid namespace"
        assert not procs.kernel_thread(process)
        assert not procs.kernel_thread(4_000_000), "a pid that is gone is not a kernel thread"


# Threads, zombies and pid namespaces: what Isolate refuses (issue 33).
def _real_thread() -> tuple[int, threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    assert thread.native_id is not None
    return thread.native_id, stop, thread


def test_threads_and_zombies_are_told_apart_alike_by_the_fake_and_proc() -> None:
    fake = FakeProcesses()
    process = fake.spawn()
    cases: list[tuple[Any, int, int]] = [(fake, process, fake.thread(process))]
    tid, stop, thread = _real_thread()
    try:
        cases.append((ProcProcesses(), os.getpid(), tid))
        for procs, leader, thread_id in cases:
            assert procs.leader_of(leader) == leader
            assert procs.leader_of(thread_id) == leader
            assert procs.exists(thread_id) and procs.pin(thread_id) is None, procs
            assert not procs.exited(leader) and not procs.exited(thread_id)
    finally:
        stop.set()
        thread.join()

    zombie_fake = fake.spawn()
    fake.exit_unreaped(zombie_fake)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    real = ProcProcesses()
    pinned = real.pin(child.pid)
    try:
        for _ in range(100000):
            if real.exited(child.pid):
                break
        both: list[tuple[Any, int]] = [(fake, zombie_fake), (real, child.pid)]
        for procs, pid in both:
            assert procs.exists(pid) and procs.exited(pid), procs
        assert pinned is not None and not pinned.alive()  # a zombie is not alive to its pin
    finally:
        child.wait()
        if pinned is not None:
            pinned.close()
    assert real.leader_of(child.pid) is None and not real.exited(child.pid)


# unshare --pid needs CAP_SYS_ADMIN: an unprivileged `make test-unit` skips it with the reason
# (issue 44, item 7; tests/unit/test_root_markers.py keeps every such test marked).
@pytest.mark.root
def test_a_process_in_another_pid_namespace_is_told_apart_alike_by_the_fake_and_proc() -> None:
    fake = FakeProcesses()
    ours, theirs = fake.spawn(), fake.spawn()
    fake.foreign.add(theirs)
    # A process in a pid namespace of its own: unshare --pid --fork makes one.
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "600"])
    try:
        real = ProcProcesses()
        child = None
        for _ in range(1000):
            kids = real_children(inner.pid)
            if kids:
                child = kids[0]
                break
            time.sleep(0.01)
        assert child is not None, "unshare did not fork"
        for procs, same, other in ((fake, ours, theirs), (real, os.getpid(), child)):
            assert procs.same_pid_namespace(same) is True and procs.same_pid_namespace(other) is False, procs
        assert fake.same_pid_namespace(4_000_000) is None and real.same_pid_namespace(4_000_000) is None
    finally:
        inner.kill()
        inner.wait()


def real_children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def test_the_sidecars_own_pids_are_itself_and_its_ancestors() -> None:
    real = ProcProcesses().sidecar_pids()
    assert {os.getpid(), os.getppid()} <= real and 1 in real
    fake = FakeProcesses()
    assert 1 in fake.sidecar_pids() and not fake.sidecar_pids() & {fake.spawn()}


def test_a_process_descends_from_each_of_its_ancestors_and_a_gone_one_from_none() -> None:
    fake = FakeProcesses()
    parent = fake.spawn(parent=601)
    child = fake.spawn(parent=parent)
    assert all(fake.descends_from(child, a) for a in (parent, 601, 600, 1))
    assert not fake.descends_from(parent, child) and not fake.descends_from(child, child)
    assert not fake.descends_from(fake.spawn(), 601), "a child of pid 1 descends from nobody else"
    fake.exit(child)
    assert not fake.descends_from(child, parent)

    real = ProcProcesses()
    proc = _sleeper()
    try:
        assert all(real.descends_from(proc.pid, a) for a in (os.getpid(), os.getppid(), 1))
        assert not real.descends_from(os.getpid(), proc.pid) and not real.descends_from(proc.pid, proc.pid)
        other = _sleeper()
        try:
            assert not real.descends_from(proc.pid, other.pid), "a sibling is no ancestor"
        finally:
            other.kill()
            other.wait()
    finally:
        proc.kill()
        proc.wait()
    assert not real.descends_from(proc.pid, os.getpid())


@pytest.mark.parametrize("kind", ["fake", "local"])
def test_filesystem_makes_and_sees_directories(kind: str, tmp_path) -> None:
    fs: FakeFilesystem | LocalFilesystem = FakeFilesystem() if kind == "fake" else LocalFilesystem()
    base = str(tmp_path)
    if kind == "fake":
        fs.make_dirs(base)
    target = os.path.join(base, "rootfs", "usr", "local", "nvidia")
    assert not fs.is_dir(target)
    fs.make_dirs(target)
    fs.make_dirs(target)  # idempotent
    assert fs.is_dir(target) and fs.is_dir(os.path.join(base, "rootfs"))


@pytest.mark.parametrize("kind", ["fake", "passwd"])
def test_users_resolve_root_and_nobody_and_nothing_for_an_unknown_name(kind: str) -> None:
    users: FakeUsers | PasswdUsers = FakeUsers() if kind == "fake" else PasswdUsers()
    assert users.uid("root") == 0
    assert users.uid("nobody") == 65534  # Debian's, as the hosts we run on
    for unknown in ("no-such-user-here", "", "a\x00b"):
        assert users.uid(unknown) is None, unknown


@pytest.mark.parametrize("kind", ["fake", "local"])
def test_filesystem_makes_dirs_and_mount_targets_inside_an_image_rootfs(kind: str, tmp_path) -> None:
    fs: FakeFilesystem | LocalFilesystem = FakeFilesystem() if kind == "fake" else LocalFilesystem()
    rootfs = os.path.realpath(os.path.join(str(tmp_path), "rootfs"))
    os.makedirs(rootfs)
    if kind == "fake":
        fs.make_dirs(rootfs)
    made = fs.make_dirs_in(rootfs, "usr/local/nvidia")
    assert made == os.path.join(rootfs, "usr/local/nvidia") and fs.is_dir(made)
    assert fs.make_dirs_in(rootfs, "usr/local/nvidia") == made  # idempotent
    assert fs.mount_target(rootfs, "dev/nvidia0") == os.path.join(rootfs, "dev/nvidia0")
    for bad in ("relative/rootfs", rootfs + "/../rootfs", "/"):
        with pytest.raises(InvalidArgument, match="rootfs"):
            fs.make_dirs_in(bad, "usr/local/nvidia")
        with pytest.raises(InvalidArgument, match="rootfs"):
            fs.mount_target(bad, "dev/nvidia0")


@pytest.mark.parametrize("kind", ["manual", "system"])
def test_clock_sleep_moves_monotonic_time_forward(kind: str) -> None:
    clock: ManualClock | SystemClock = ManualClock() if kind == "manual" else SystemClock()
    start = clock.monotonic()
    clock.sleep(0.01)
    assert clock.monotonic() - start >= 0.01 - 1e-9
    assert clock.time() > 1.6e9


# ---- Inventory and DeviceNodes ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dgx-1", "dgx-a100", "workstation-4"])
def test_fake_inventory_of_a_host_agrees_with_nvml_on_the_simulated_host(name: str, short_tmp: str) -> None:
    from isolator.gpu.nvml import Inventory
    from isolator.simhost.sim import SimulatedHost

    host = SimulatedHost(name, os.path.join(short_tmp, name)).setup(make_devices=False)
    real = Inventory(library=host.library_path, proc_root=host.proc_root, sys_root=os.path.join(host.root, "sys"))
    real.open()
    try:
        real.read()
        fake = FakeInventory.of_host(name)
        assert (fake.driver_version, fake.cuda_driver_version) == (real.driver_version, real.cuda_driver_version)
        assert fake.topology() == real.topology()
        assert fake.healthy() == real.healthy()
        assert fake.device_count() == real.device_count()
        for f, r in zip(fake.records, real.records, strict=True):
            assert (f.gpu, f.mig_enabled, f.mig_devices, f.usable) == (r.gpu, r.mig_enabled, r.mig_devices, r.usable)
        index = fake.records[0].gpu.index
        assert fake.usage(index).memory_total == real.usage(index).memory_total
    finally:
        real.close()


def test_fake_inventory_reports_an_xid_to_subscribers() -> None:
    fake = FakeInventory(Topology(gpus=FakeInventory.of_host("single").topology().gpus))
    events = []
    fake.on_health_change(events.append)
    fake.xid(0, 79)
    assert [(e.index, e.healthy, e.xid) for e in events] == [(0, False, 79)]
    assert fake.healthy() == frozenset()
    assert fake.records[0].status == "XID 79"


@contextlib.contextmanager
def _handover_inventory(kind: str, short_tmp: str) -> Iterator[tuple[Any, Any]]:
    """(inventory, steering) for the handover contract: the fake steers itself; the real NVML edge
    runs on a simulated host, steered through its control files."""
    if kind == "fake":
        fake = FakeInventory.of_host("dgx-1")
        yield fake, fake
        return
    from isolator.gpu.nvml import Inventory
    from isolator.simhost.sim import SimulatedHost

    host = SimulatedHost("dgx-1", os.path.join(short_tmp, "handover")).setup(make_devices=False)
    real = Inventory(library=host.library_path, proc_root=host.proc_root, sys_root=os.path.join(host.root, "sys"))
    real.open()
    try:
        real.read()
        yield real, host
    finally:
        real.close()


@pytest.mark.parametrize("kind", ["fake", "nvml"])
def test_inventory_reports_processes_and_memory_left_on_a_gpu(kind: str, short_tmp: str) -> None:
    with _handover_inventory(kind, short_tmp) as (inv, steer):
        idle = inv.occupancy(3)
        assert idle.processes == () and idle.memory_used == 0 and idle.memory_total == 16160 << 20
        steer.start_process(3, 4242, 1 << 30)
        steer.start_process(3, 4343, 2 << 20, "graphics")
        busy = inv.occupancy(3)
        assert sorted((p.pid, p.used_memory, p.kind) for p in busy.processes) == [
            (4242, 1 << 30, "compute"),
            (4343, 2 << 20, "graphics"),
        ]
        assert busy.memory_used == (1 << 30) + (2 << 20)
        assert inv.occupancy(2).processes == (), "only the GPU the process runs on"
        steer.stop_process(3, 4242)
        assert [p.pid for p in inv.occupancy(3).processes] == [4343]
        steer.stop_process(3)
        assert inv.occupancy(3) == idle
        steer.fail_gpu(3, "nvmlDeviceGetComputeRunningProcesses", 999)
        with pytest.raises(NvmlError, match="GPU 3"):
            inv.occupancy(3)


@pytest.mark.parametrize("kind", ["fake", "nvml"])
def test_inventory_resets_application_clocks_and_compute_mode_and_reports_each_step(kind: str, short_tmp: str) -> None:
    with _handover_inventory(kind, short_tmp) as (inv, steer):
        default = steer.settings(1)
        assert default[0] == 0
        assert [s.changed for s in inv.reset_settings(1, 0)] == [False, False], "nothing changed, nothing reset"
        steer.set_application_clocks(1, 900, 700)
        steer.set_compute_mode(1, 3)  # EXCLUSIVE_PROCESS
        clocks, mode = inv.reset_settings(1, 0)
        assert (clocks.setting, clocks.changed, clocks.error) == ("application clocks", True, "")
        assert clocks.before == "graphics 900 MHz, memory 700 MHz"
        assert (mode.setting, mode.before, mode.after, mode.changed) == (
            "compute mode",
            "EXCLUSIVE_PROCESS",
            "DEFAULT",
            True,
        )
        assert steer.settings(1) == default
        steer.set_compute_mode(1, 2)
        steer.set_application_clocks(1, 900, 700)
        steer.fail_gpu(1, "nvmlDeviceResetApplicationsClocks", 4)  # NO_PERMISSION
        steer.fail_gpu(1, "nvmlDeviceSetComputeMode", 3)  # NOT_SUPPORTED
        clocks, mode = inv.reset_settings(1, 0)
        assert (clocks.changed, clocks.code) == (False, "NO_PERMISSION") and "Insufficient Permissions" in clocks.error
        assert (mode.changed, mode.code, mode.before) == (False, "NOT_SUPPORTED", "PROHIBITED")
        assert steer.settings(1) == (2, 900, 700), "a failed reset changes nothing"


@pytest.mark.root
def test_fake_device_nodes_agree_with_the_nodes_a_driver_makes(short_tmp: str) -> None:
    from isolator.host.devices import HostDevices
    from isolator.simhost import devnodes

    dev = os.path.join(short_tmp, "dev")
    devnodes.make_device_nodes(dev, [0, 1])
    real_nodes, fake_nodes = HostDevices(dev), FakeDeviceNodes(dev, caps_major=None)
    real, fake = real_nodes.control_devices(), fake_nodes.control_devices()
    assert (fake.nvidiactl.major, fake.nvidiactl.minor) == (real.nvidiactl.major, real.nvidiactl.minor)
    assert fake.nvidiactl.path == real.nvidiactl.path and fake.uvm.path == real.uvm.path
    assert fake.uvm.major != 195 and real.uvm.major != 195
    assert real_nodes.caps_major() is None and fake_nodes.caps_major() is None  # no MIG nodes
    mig_dev = os.path.join(short_tmp, "mig-dev")
    devnodes.make_device_nodes(mig_dev, [0], caps_minors=(1, 2))
    real_caps, fake_caps = HostDevices(mig_dev).caps_major(), FakeDeviceNodes(mig_dev).caps_major()
    for major in (real_caps, fake_caps):
        assert isinstance(major, int) and major not in (195, real.uvm.major)


# ---- VolumeBuilder --------------------------------------------------------------------------------


@pytest.fixture(params=["fake", "manager"])
def volumes(request, tmp_path) -> Any:
    if request.param == "fake":
        from isolator.testing import FakeVolumes

        return FakeVolumes(str(tmp_path / "volumes"))
    from isolator.simhost.driver import build_driver_root
    from volumes.manager import VolumeManager

    driver = build_driver_root(str(tmp_path / "driver"), "535.104.05")
    return VolumeManager(str(tmp_path / "volumes"), str(tmp_path / "driver"), path=driver.path)


def test_volumes_count_their_users_and_go_when_the_last_one_leaves(volumes: Any) -> None:
    first = volumes.acquire("a", "535.104.05")
    again = volumes.acquire("b", "535.104.05")
    assert first.path == again.path and first.path.endswith("nvidia_535.104.05")
    assert first.driver_version == "535.104.05"
    assert [sorted(v["users"]) for v in volumes.volumes()] == [["a", "b"]]
    assert volumes.reconcile(["a"]) == ("b",)
    assert [sorted(v["users"]) for v in volumes.volumes()] == [["a"]]
    assert volumes.release("a", "535.104.05") == (), "the running driver's volume stays"
    assert volumes.release("never-used", None) == ()
    assert volumes.volume_root.endswith("volumes")


# ---- Cpusets and CpuTopology (--cpu-affinity, docs/affinity.md) -----------------------------------

CPUSETS = [
    pytest.param("fake", id="fake"),
    pytest.param("v1", id="real-v1", marks=[pytest.mark.root, pytest.mark.cpuset_v1]),
    pytest.param("v2", id="real-v2", marks=[pytest.mark.root, pytest.mark.cpuset_v2]),
]


def _online() -> tuple[frozenset[int], frozenset[int]]:
    from isolator.host.cpus import SysCpus

    machine = SysCpus().machine()
    return machine.cpus, machine.mems


@pytest.fixture(params=CPUSETS)
def cpusets(request) -> Iterator[Any]:
    if request.param == "fake":
        from isolator.policy.affinity import Machine

        cpus, mems = _online()
        yield FakeCpusets(Machine(cpus, mems))
        return
    from isolator.cgroups.cpuset import CpusetController, find_cpuset
    from isolator.testing.cgroupfs import scratch_cgroups_root

    found = find_cpuset()
    assert found is not None and found[0] == request.param
    with scratch_cgroups_root(found[1], "contract-cpuset") as root:
        yield CpusetController(found[1], root, found[0])


def test_cpuset_apply_creates_sets_and_reads_back_exactly(cpusets: Any) -> None:
    cpus, mems = _online()
    a = cid("contract-a")
    assert not cpusets.exists(a) and cpusets.current(a) is None
    assert cpusets.allowed(a) in (cpus, frozenset())
    first = frozenset({min(cpus)})
    cpusets.apply(a, first, mems)
    assert cpusets.exists(a) and a in cpusets.containers()
    got = cpusets.current(a)
    assert got is not None and (got.cpus, got.mems) == (first, mems)
    cpusets.apply(a, cpus, mems)
    assert cpusets.current(a).cpus == cpus  # widened again
    assert cpusets.path(a).endswith("contract-a")
    assert cpusets.version in ("v1", "v2")


def test_cpuset_refuses_empty_and_cpus_the_machine_does_not_have(cpusets: Any) -> None:
    _cpus, mems = _online()
    a = cid("contract-a")
    with pytest.raises(CgroupError):
        cpusets.apply(a, frozenset(), mems)
    with pytest.raises(CgroupError):
        cpusets.apply(a, frozenset({4000}), mems)


def test_cpuset_holds_a_joined_process_and_is_removed_only_when_empty(cpusets: Any) -> None:
    cpus, mems = _online()
    a = cid("contract-a")
    one = frozenset({max(cpus)})
    with pytest.raises(CgroupVanished):
        cpusets.join(a, 1)
    cpusets.apply(a, one, mems)
    proc = _sleeper()
    try:
        cpusets.join(a, proc.pid)
        assert cpusets.pids(a) == (proc.pid,)
        from isolator.host.cpus import SysCpus

        topology = cpusets if isinstance(cpusets, FakeCpusets) else SysCpus()
        assert topology.allowed_of(proc.pid) == one, "the process is held to the cpuset"
        with pytest.raises(CgroupBusy):
            cpusets.remove(a)
        assert cpusets.exists(a)
    finally:
        proc.kill()
        proc.wait()
        if isinstance(cpusets, FakeCpusets):
            cpusets.exit(proc.pid)
    _wait_empty(cpusets, a)
    cpusets.remove(a)
    assert not cpusets.exists(a)
    cpusets.remove(a)  # idempotent


def _wait_empty(cpusets: Any, c: ContainerId) -> None:
    import time

    deadline = time.monotonic() + 30
    while cpusets.pids(c) and time.monotonic() < deadline:
        time.sleep(0.01)  # a killed process leaves its cgroup asynchronously


@pytest.mark.parametrize("kind", ["fake", "sys"])
def test_cpu_topology_reports_online_cpus_nodes_and_a_processes_allowed_cpus(kind: str) -> None:
    from isolator.host.cpus import SysCpus

    real = SysCpus().machine()
    topo: Any = SysCpus() if kind == "sys" else FakeCpusets(real)
    machine = topo.machine()
    assert machine.cpus == real.cpus and machine.mems == real.mems and machine.cpus
    assert topo.allowed_of(os.getpid()) <= machine.cpus
    if kind == "sys":
        assert topo.allowed_of(2**22 + 1) is None


def test_sys_cpus_reads_a_temp_tree(tmp_path) -> None:
    from isolator.host.cpus import SysCpus

    system = tmp_path / "devices" / "system"
    (system / "cpu").mkdir(parents=True)
    (system / "cpu" / "online").write_text("0-7\n")
    for n, cpus in ((0, "0-3"), (1, "4-7")):
        (system / "node" / f"node{n}").mkdir(parents=True)
        (system / "node" / f"node{n}" / "cpulist").write_text(cpus + "\n")
    (system / "node" / "online").write_text("0-1\n")
    (system / "node" / "has_memory").write_text("1\n")
    machine = SysCpus(str(tmp_path)).machine()
    assert machine.cpus == frozenset(range(8)) and machine.mems == frozenset({1})
    assert machine.node_cpus == {0: frozenset(range(4)), 1: frozenset(range(4, 8))}
    os.unlink(system / "node" / "has_memory")
    assert SysCpus(str(tmp_path)).machine().mems == frozenset({0, 1})
    (proc := tmp_path / "proc" / "42").mkdir(parents=True)
    (proc / "status").write_text("Name:\tx\nCpus_allowed_list:\t0-1,5\n")
    assert SysCpus(str(tmp_path), str(tmp_path / "proc")).allowed_of(42) == frozenset({0, 1, 5})


def test_store_records_a_cpuset_and_forgets_it(store: FakeStore) -> None:
    store.record(record("a", 0, cpus="0-3", mems="0"))
    assert (store.get(cid("a")).cpus, store.get(cid("a")).mems) == ("0-3", "0")  # type: ignore[union-attr]
    rec = store.set_cpuset(cid("a"), "4-7", "1")
    assert (rec.cpus, rec.mems) == ("4-7", "1") and store.load()[cid("a")].cpus == "4-7"
    store.set_cpuset(cid("a"), "", "")
    assert store.get(cid("a")).cpus == ""  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument):
        store.set_cpuset(cid("a"), "0", "")
    with pytest.raises(ContainerNotRecorded):
        store.set_cpuset(cid("nobody"), "0", "0")
    store.record(record("b", cpus="1", mems="0"))
    store.remove(cid("b"))
    assert store.get(cid("b")) is None
