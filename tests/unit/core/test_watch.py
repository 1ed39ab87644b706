"""Watch, usage and status (isolator/core/watch.py) in-process over the shipped fakes."""

from __future__ import annotations

import pytest
from hook_helpers import cid, gpus, held, make_rig

from isolator.errors import (
    ContainerGone,
    FailedPrecondition,
    GpusExhausted,
    NotFound,
    NvmlError,
)
from isolator.host.system import EmptyInventory
from isolator.testing import Rig, fake_service


@pytest.fixture
def rig() -> Rig:
    return make_rig()


def test_watch_answers_nothing_until_a_held_gpu_becomes_unhealthy(rig: Rig) -> None:
    a = cid("a")
    rig.service.prepare(a, gpus(2))
    assert rig.service.watch(a) is None
    rig.inventory.xid(7, 79)  # not one of a's
    assert rig.service.watch(a) is None
    rig.inventory.xid(held(rig, a)[0], 79)
    limitation = rig.service.watch(a)
    assert limitation is not None and limitation.gpus == 1
    assert limitation.reason == "REASON_CONTAINER_LIMITATION"
    assert "XID 79" in limitation.message and "container a holds a GPU that became unhealthy" in limitation.message
    assert rig.service.watch(cid("a.child")) is not None, "a nested container watches its parent's GPUs"


def test_subscribers_hear_of_their_containers_going_away_and_of_every_health_change(rig: Rig) -> None:
    # What a waiting Watch waits on (the transport's Watch awaits these callbacks; the core never waits).
    a, b = cid("a"), cid("b")
    rig.service.prepare(a, gpus(1))
    rig.service.prepare(b, gpus(1))
    heard: list[str] = []
    stop_a = rig.service.subscribe(lambda: heard.append("a"), cid("a.child"))  # by its top-level container
    stop_all = rig.service.subscribe(lambda: heard.append("all"))
    assert rig.service.core.changes.listeners() == 2
    rig.service.cleanup(b)
    assert heard == ["all"], "b going away is not a's business"
    rig.inventory.xid(held(rig, a)[0], 79)
    assert sorted(heard[1:]) == ["a", "all"]
    assert rig.service.watch(a) is not None  # what a woken Watch re-checks
    rig.service.cleanup(a)
    assert sorted(heard[3:]) == ["a", "all"]
    stop_a()
    stop_all()
    stop_a()  # idempotent
    assert rig.service.core.changes.listeners() == 0
    rig.inventory.xid(0, 79)
    assert len(heard) == 5


def test_a_failing_subscriber_does_not_fail_the_hook(rig: Rig) -> None:
    a = cid("a")
    rig.service.prepare(a, gpus(1))

    def broken() -> None:
        raise RuntimeError("listener bug")

    stop = rig.service.subscribe(broken, a)
    rig.service.cleanup(a)  # told, and the cleanup still succeeds
    assert rig.store.get(a) is None
    stop()


def test_watch_of_an_unknown_container(rig: Rig) -> None:
    with pytest.raises(NotFound):
        rig.service.watch(cid("nobody"))
    assert rig.service.watch(cid("nobody.child")) is None


def test_watch_of_a_container_cleaned_up_lately_is_told_apart_from_an_unknown_one(rig: Rig) -> None:
    # criteo's module polls Watch once more after each Cleanup; the servicer answers that poll "no
    # limitation" when it sees ContainerGone (tests/system/test_bridge.py), and NOT_FOUND to gRPC.
    a, failed = cid("a"), cid("failed")
    rig.service.prepare(a, gpus(1))
    rig.service.cleanup(a)
    with pytest.raises(ContainerGone):
        rig.service.watch(a)
    # Also after a cleanup of a container that was never prepared (its prepare failed).
    with pytest.raises(GpusExhausted):
        rig.service.prepare(failed, gpus(9))
    rig.service.cleanup(failed)
    with pytest.raises(ContainerGone):
        rig.service.watch(failed)
    # A container never seen is plainly unknown, and one cleaned up is never prepared again (Mesos
    # never reuses an ID: such a Prepare is stale, tests/system/test_stale_hooks.py).
    with pytest.raises(NotFound) as unknown:
        rig.service.watch(cid("nobody"))
    assert not isinstance(unknown.value, ContainerGone)
    with pytest.raises(FailedPrecondition, match="was cleaned up"):
        rig.service.prepare(a, gpus(1))
    with pytest.raises(ContainerGone):
        rig.service.watch(a)


def test_usage_and_status_report_the_held_gpus(rig: Rig) -> None:
    a = cid("a")
    rig.service.prepare(a, gpus(2))
    minor = held(rig, a)[0]
    rig.inventory.set_usage(minor, memory_used=1 << 30, utilization=40)
    usage = rig.service.usage(a)
    assert usage.timestamp == rig.clock.time()
    assert [g.minor for g in usage.gpus] == held(rig, a)
    assert (usage.gpus[0].memory_used_bytes, usage.gpus[0].utilization_percent) == (1 << 30, 40)
    status = rig.service.status(a)
    assert status.state == "prepared" and len(status.gpu_uuids) == 2
    assert rig.service.status(cid("a.child")) == status
    rig.inventory.lose_nvml()
    with pytest.raises(NvmlError):
        rig.service.usage(a)
    for call in (rig.service.usage, rig.service.status):
        with pytest.raises(NotFound):
            call(cid("nobody"))


def test_usage_of_a_container_without_gpus_is_empty() -> None:
    rig = fake_service(inventory=EmptyInventory())  # type: ignore[arg-type]
    rig.service.prepare(cid("a"), gpus(0))
    assert rig.service.usage(cid("a")).gpus == ()


@pytest.mark.parametrize("end", ["cleanup", "reaper"])
def test_a_watch_woken_by_its_container_going_away_sees_it_gone_not_unknown(end: str) -> None:
    # A waiting Watch asks again as soon as it is woken, on another thread, while the hook that woke
    # it is still running (an MPS sharer's cleanup goes on to stop the idle daemon). Found by
    # .ci/run under load (criteo-v2, MPS shares): the woken Watch found no record and no tombstone
    # yet, ended NOT_FOUND "unknown container" and was counted in gpu_isolator_errors_total.
    rig = fake_service("dgx-1", mode="mesos")
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    seen: list[object] = []

    def woken() -> None:  # the worst interleaving: the Watch's check runs inside the notify
        try:
            seen.append(rig.service.watch(a))
        except Exception as exc:
            seen.append(exc)

    stop = rig.service.subscribe(woken, a)
    if end == "cleanup":
        rig.service.cleanup(a)
    else:
        rig.cgroups.vanish(a)
        assert rig.service.reap_vanished() == [a]
    stop()
    assert seen and all(isinstance(s, ContainerGone) for s in seen), seen
