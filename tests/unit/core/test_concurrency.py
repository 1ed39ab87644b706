"""Per-container concurrency of the core: one container's slow step never stalls another container.

The fakes hold a step (``faults.pause_at``) the way a slow fsync, volume build or cgroup write
would; the test checks that other containers' hooks complete meanwhile, that the same container's
hooks wait, that Recover waits for hooks in flight, and that many threads never double-book a GPU.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest

from isolator.core.locks import ContainerLocks, LockNotHeld, OwnedLock
from isolator.errors import AlreadyExists, GpusExhausted
from isolator.model import ContainerConfig, ContainerId, Holding, Resource
from isolator.policy.affinity import Affinity
from isolator.policy.devices import NVIDIA_MAJOR, DeviceRule, permits
from isolator.policy.request import Request
from isolator.testing import Rig, fake_service

WAIT = 30.0  # seconds a thread may take before the test calls it stuck (a loaded machine is slow)


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def gpus(n: int) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpus", float(n)),))


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # the test inspects it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# ---- the lock table -------------------------------------------------------------------------------


def test_locks_of_different_containers_are_independent_and_one_container_waits() -> None:
    locks = ContainerLocks()
    with locks.hold(cid("a")):
        other, _ = in_thread(lambda: locks.hold(cid("b")).__enter__())
        other.join(WAIT)
        assert not other.is_alive(), "b must not wait for a"
        same, _ = in_thread(lambda: locks.hold(cid("a.child")).__enter__())
        same.join(0.2)
        assert same.is_alive(), "a nested container shares its top-level container's lock"
    same.join(WAIT)
    assert not same.is_alive()


def test_exclusive_waits_for_holders_and_keeps_new_ones_out() -> None:
    locks = ContainerLocks()
    order: list[str] = []
    entered = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with locks.hold(cid("a")):
            entered.set()
            release.wait(WAIT)
            order.append("hook")

    def recover() -> None:
        with locks.exclusive():
            order.append("recover")

    h, _ = in_thread(holder)
    entered.wait(WAIT)
    r, _ = in_thread(recover)
    r.join(0.2)
    assert r.is_alive(), "recover waits for the hook in flight"
    release.set()
    r.join(WAIT)
    h.join(WAIT)
    assert order == ["hook", "recover"]
    assert locks.busy() == 0


# ---- the service ------------------------------------------------------------------------------------


@pytest.fixture
def rig() -> Rig:
    return fake_service("dgx-1")


@pytest.mark.parametrize(("edge", "step"), [("store", "record"), ("cgroups", "apply"), ("volumes", "acquire")])
def test_a_slow_step_of_one_container_does_not_stall_another(rig: Rig, edge: str, step: str) -> None:
    rig.filesystem.make_dirs("/rootfs/a")
    slow = ContainerConfig(
        resources=(Resource("gpus", 1.0),), rootfs="/rootfs/a", image_env=("NVIDIA_VISIBLE_DEVICES=all",)
    )
    entered, gate = getattr(rig, edge).faults.pause_at(step, container=cid("a") if edge != "volumes" else None)
    a, a_out = in_thread(lambda: rig.service.prepare(cid("a"), slow))
    assert entered.wait(WAIT), "a reached its slow step"
    b, b_out = in_thread(lambda: (rig.service.prepare(cid("b"), gpus(2)), rig.service.cleanup(cid("b"))))
    b.join(WAIT)
    assert not b.is_alive() and not isinstance(b_out[0], BaseException), "b completed while a was held"
    status, _ = in_thread(lambda: rig.service.list_gpus())
    status.join(WAIT)
    assert not status.is_alive(), "the admin views answer meanwhile"
    gate.set()
    a.join(WAIT)
    assert not a.is_alive() and not isinstance(a_out[0], BaseException)


def test_hooks_of_one_container_run_one_at_a_time(rig: Rig) -> None:
    entered, gate = rig.cgroups.faults.pause_at("apply", container=cid("a"))
    first, _ = in_thread(lambda: rig.service.prepare(cid("a"), gpus(1)))
    assert entered.wait(WAIT)
    second, out = in_thread(lambda: rig.service.prepare(cid("a"), gpus(1)))
    second.join(0.2)
    assert second.is_alive(), "the second prepare of a waits for the first"
    gate.set()
    first.join(WAIT)
    second.join(WAIT)
    assert isinstance(out[0], AlreadyExists)


def test_recover_waits_for_hooks_in_flight(rig: Rig) -> None:
    entered, gate = rig.cgroups.faults.pause_at("apply", container=cid("a"))
    hook, _ = in_thread(lambda: rig.service.prepare(cid("a"), gpus(1)))
    assert entered.wait(WAIT)
    recover, out = in_thread(lambda: rig.service.recover([], []))
    recover.join(0.2)
    assert recover.is_alive()
    gate.set()
    hook.join(WAIT)
    recover.join(WAIT)
    assert out[0].recovered == 1  # type: ignore[attr-defined]


def test_many_threads_never_grant_a_gpu_to_two_containers(rig: Rig) -> None:
    errors: list[BaseException] = []
    violations: list[str] = []
    most_at_once = [0]
    real_apply = rig.cgroups.apply

    def checked_apply(c: ContainerId, rules: tuple[DeviceRule, ...]) -> None:
        # Every grant, at the moment it is made, against what every other cgroup grants then.
        real_apply(c, rules)
        with rig.cgroups._lock:
            live = {k: v for k, v in rig.cgroups.cgroups.items() if v}
        for m in range(8):
            holders = {k for k, v in live.items() if permits(v, DeviceRule.char(NVIDIA_MAJOR, m, "rw"))}
            if len(holders) > 1:
                violations.append(f"GPU {m} granted to {sorted(map(str, holders))}")
        with_gpus = {k for m in range(8) for k, v in live.items() if permits(v, DeviceRule.char(NVIDIA_MAJOR, m, "rw"))}
        most_at_once[0] = max(most_at_once[0], len(with_gpus))

    rig.cgroups.apply = checked_apply  # type: ignore[method-assign]

    together = threading.Barrier(8)

    def worker(n: int) -> None:
        rnd = random.Random(n)
        for i in range(10):
            c = cid(f"w{n}-{i}")
            try:
                # The first round: one GPU each, all eight held at once (the barrier), however the
                # threads happen to be scheduled; then random sizes.
                rig.service.prepare(c, gpus(1 if i == 0 else rnd.choice([0, 1, 1, 2, 3])))
            except GpusExhausted:
                continue
            finally:
                if i == 0:
                    together.wait(WAIT)
            try:
                rig.service.isolate(c, rig.processes.spawn())
                if rnd.random() < 0.5:
                    rig.service.update(c, [Resource("gpus", float(rnd.choice([0, 1, 2])))])
            except GpusExhausted:
                pass
            except BaseException as exc:
                errors.append(exc)
            for pid in rig.cgroups.pids(c):
                rig.cgroups.kill(pid)
            rig.service.cleanup(c)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert violations == []
    assert most_at_once[0] >= 2, "containers held GPUs at the same time"
    assert rig.store.load() == {} and rig.service.core.booking.available == frozenset(range(8))


# ---- the booking lock's contract is checked, not commented -------------------------------------


def test_booking_outside_the_booking_lock_is_refused_and_changes_nothing(rig: Rig) -> None:
    core = rig.service.core
    before = set(core.booking.available)
    for call in (
        lambda: core.booking.allocate_whole(1),
        lambda: core.booking.choose_mig({"mig-1g.5gb": 1}),
        core.sync_health,
        # Booking is the only way to the books: each of its changes checks the lock.
        lambda: core.booking.allocate_set({0}),
        lambda: core.booking.restore("a", Holding.whole({0})),
        lambda: core.booking.book("a", Request(gpus=1)),
        lambda: core.booking.resize("a", Holding(), Request(gpus=1)),
        lambda: core.booking.free("a", Holding.whole({0})),
        lambda: core.booking.deallocate(set()),
        lambda: core.booking.set_draining(0, True),
        lambda: core.booking.plan_update((), 1),
    ):
        with pytest.raises(LockNotHeld, match="booking lock"):
            call()
    with pytest.raises(LockNotHeld):
        core.handover.mark_pending([0])
    assert set(core.booking.available) == before and not core.handover.marks
    with core.booking.lock:
        choice = core.booking.allocate_whole(1)  # the same call inside the section books
        core.booking.deallocate(frozenset(choice.gpus))


def test_an_owned_lock_knows_its_holder_thread() -> None:
    lock = OwnedLock("test")
    assert not lock.held()
    seen: list[bool] = []
    with lock:
        assert lock.held()
        other = threading.Thread(target=lambda: seen.append(lock.held()))
        other.start()
        other.join()
    assert seen == [False] and not lock.held()


# ---- the kernel grant's lock contract is checked, not commented ---------------------------------


def test_a_container_lock_is_held_by_its_thread_only_and_the_exclusive_table_holds_every_container() -> None:
    locks = ContainerLocks()
    a = cid("a")
    assert not locks.held(a)
    seen: list[bool] = []
    with locks.hold(cid("a.child")):  # a nested container's hook holds its top-level container's lock
        assert locks.held(a) and locks.held(cid("a.other")) and not locks.held(cid("b"))
        other = threading.Thread(target=lambda: seen.append(locks.held(a)))
        other.start()
        other.join(WAIT)
    assert seen == [False] and not locks.held(a)
    with locks.exclusive():
        assert locks.held(a) and locks.held(cid("b"))
    with pytest.raises(LockNotHeld, match="container a's lock"):
        locks.require(cid("a.child"), "apply")


def test_kernel_grant_writes_outside_the_container_lock_are_refused_and_change_nothing(rig: Rig) -> None:
    core = rig.service.core
    a = cid("a")
    rig.service.prepare(a, gpus(2))
    minors = rig.store.get(a).holding.gpus  # type: ignore[union-attr]
    before = rig.cgroups.rules_of(a)
    grants, cpuset = core.grants, core.cpuset
    writes: list[Callable[[], object]] = [
        lambda: grants.apply(a, frozenset()),
        lambda: grants.write(a, ()),
        lambda: grants.create(a),
        lambda: grants.revoke(a),
        lambda: grants.cleanup(a),
        lambda: grants.apply_nested(cid("a.child"), ()),
        lambda: cpuset.apply_cpuset(a, Affinity(frozenset({0}), frozenset({0}))),
        lambda: cpuset.remove_cpuset(a),
        lambda: cpuset.release(a),
    ]
    for call in writes:
        with pytest.raises(LockNotHeld, match="container a's lock"):
            call()
    with core.locks.hold(a), core.booking.lock:  # never a kernel write inside a booking decision
        for call in writes:
            with pytest.raises(LockNotHeld, match="booking lock held"):
                call()
    # Another thread holding the container's lock does not make this one's call legal.
    entered, release = threading.Event(), threading.Event()

    def holder() -> None:
        with core.locks.hold(a):
            entered.set()
            release.wait(WAIT)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    assert entered.wait(WAIT)
    try:
        with pytest.raises(LockNotHeld):
            grants.apply(a, frozenset())
    finally:
        release.set()
        thread.join(WAIT)
    assert rig.cgroups.rules_of(a) == before and rig.store.get(a).holding.gpus == minors  # type: ignore[union-attr]
    with core.locks.hold(a):
        grants.apply(a, frozenset())  # the same call with the lock held revokes
    assert rig.cgroups.rules_of(a) == core.grants.rules(frozenset())
