"""A reviewer's attacks on issue 41's MPS work, over the fake service and FakeMps (the stand-in's
model, simhost/mpsmodel.py): a sharer that runs as root (the default: a container without a user
runs as the agent's root) lifting the limits on its GPU's daemon, the daemon killed under its
sharers and started again (at a supervise pass or by the next Prepare), and a restart that re-cuts a
held GPU (docs/sharing.md, "Limits a task cannot lift", "MPS", "Changing which GPUs are shared")."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hook_helpers import minor_of, uuid_of

from isolator.core.mps import limit_bytes
from isolator.errors import FailedPrecondition, IsolatorError
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.shares import parse_shared_gpus
from isolator.testing import Rig, fake_service


@pytest.fixture
def rig() -> Rig:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps"))
    rig.restart()
    return rig


def sharer() -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpu_shares", 1.0),))


def quarter_mib(rig: Rig) -> int:
    return rig.service.core.gpus[minor_of(rig, 4)].memory_total // (1 << 20) // 4


def lift(rig: Rig, uuid: str, server: int) -> None:
    """What a root sharer can send through the pipe directory (its control socket is 0666, and a
    read-only bind still connects): every limit of its GPU's daemon lifted."""
    for text in (
        f"set_active_thread_percentage {server} 100",
        f"set_device_pinned_mem_limit {server} 0 1000000M",
        "set_default_active_thread_percentage 100",
        "set_default_device_pinned_mem_limit 0 1000000M",
    ):
        rig.mps.command(uuid, text, peer_uid=0)


def test_limits_a_root_sharer_lifted_on_its_daemon_are_set_back_at_the_next_supervise_pass(rig: Rig) -> None:
    rig.service.prepare(ContainerId("a"), sharer())  # no user: root, the agent's own
    uuid, mib = uuid_of(rig, 4), quarter_mib(rig)
    (server,) = rig.mps.daemon(uuid).servers
    lift(rig, uuid, server)
    rig.service.supervise_mps()
    assert rig.mps.command(uuid, f"get_active_thread_percentage {server}") == "25.0"
    assert limit_bytes(rig.mps.command(uuid, f"get_device_pinned_mem_limit {server} 0")) == mib << 20
    assert rig.mps.command(uuid, "get_default_active_thread_percentage") == "25.0"
    assert limit_bytes(rig.mps.command(uuid, "get_default_device_pinned_mem_limit 0")) == mib << 20
    client = rig.mps.connect(uuid, pid=4200, uid=0, env={})
    assert (client.threads, client.pinned) == (25.0, mib << 20)
    # A client connected in between keeps what it got: the GPU's sharers end, the lifter among them.
    limitation = rig.service.watch(ContainerId("a"))
    assert limitation is not None and "limits changed behind the sidecar's back" in limitation.message


def test_a_sidecar_killed_between_a_daemons_start_and_its_limits_ends_the_sharers_of_the_daemon_it_adopts(
    rig: Rig,
) -> None:
    # The supervise pass had started the daemon again (-d) and the sidecar was SIGKILLed before it set
    # the limits (crash point mps.spawned): the new sidecar adopts a daemon at 100 %.
    rig.service.prepare(ContainerId("a"), sharer())
    uuid = uuid_of(rig, 4)
    rig.mps.kill(uuid)
    rig.mps.start(uuid)
    rig.restart()
    rig.service.supervise_mps()
    assert rig.mps.command(uuid, "get_default_active_thread_percentage") == "25.0"
    limitation = rig.service.watch(ContainerId("a"))
    assert limitation is not None and "adopted without the limits" in limitation.message


def test_a_sidecar_restarted_beside_a_daemon_that_holds_its_limits_ends_nobody(rig: Rig) -> None:
    rig.service.prepare(ContainerId("a"), sharer())
    rig.mps.connect(uuid_of(rig, 4), pid=4400, uid=0)
    rig.restart()
    rig.service.supervise_mps()
    rig.service.prepare(ContainerId("b"), sharer())
    for name in "ab":
        assert rig.service.watch(ContainerId(name)) is None, name


@pytest.mark.xfail(
    strict=True,
    reason="a root sharer reaches the daemon's privileged commands through its pipe directory; what it lifts"
    " holds for its clients until the next supervise pass (and for clients connected meanwhile, for good):"
    " closing it needs a user namespace or a non-root sharer, not a check of ours",
)
def test_a_root_sharer_cannot_lift_its_limits_even_between_two_passes(rig: Rig) -> None:
    rig.service.prepare(ContainerId("a"), sharer())
    uuid = uuid_of(rig, 4)
    (server,) = rig.mps.daemon(uuid).servers
    lift(rig, uuid, server)
    assert rig.mps.connect(uuid, pid=4201, uid=0, env={}).threads == 25.0


def test_a_daemon_killed_under_its_sharers_ends_them_when_the_supervise_pass_starts_it_again(rig: Rig) -> None:
    # Measured on driver 580 (docs/gpu-host-results.md, second MPS run): the daemon's death takes its
    # server along, every connected client fails for good (806), a client that came while it was down
    # ran without MPS (the whole GPU), and the started daemon forgot its limits until they are set again.
    svc, uuid = rig.service, uuid_of(rig, 4)
    a = ContainerId("a")
    svc.prepare(a, sharer())
    rig.mps.connect(uuid, pid=4300, uid=0)
    rig.mps.kill(uuid)
    svc.supervise_mps()
    assert rig.mps.running() == {uuid}
    limitation = svc.watch(a)
    assert limitation is not None and "MPS control daemon" in limitation.message, limitation
    minor = minor_of(rig, 4)
    assert svc.core.mps.restarts[minor] == 1
    b = ContainerId("b")
    svc.prepare(b, sharer())  # a new sharer is served by the daemon set up again, and is not ended
    svc.supervise_mps()
    assert svc.watch(b) is None


def test_a_daemon_killed_under_its_sharers_and_started_again_by_a_prepare_is_counted_and_ends_them(rig: Rig) -> None:
    svc, uuid = rig.service, uuid_of(rig, 4)
    minor = minor_of(rig, 4)
    a, b = ContainerId("a"), ContainerId("b")
    svc.prepare(a, sharer())
    rig.mps.kill(uuid)
    svc.prepare(b, sharer())  # finds it dead before any supervise pass
    assert svc.core.mps.restarts[minor] == 1, "a restart under sharers counts, whoever finds it"
    limitation = svc.watch(a)
    assert limitation is not None and "MPS control daemon" in limitation.message
    assert svc.watch(b) is None, "the sharer whose Prepare started it again is not ended"


def test_a_restart_that_re_cuts_a_held_mps_gpu_is_refused(rig: Rig) -> None:
    # Was a strict xfail until the records kept the cut (state schema 11, share_cut).
    rig.service.prepare(ContainerId("a"), sharer())
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:8:mps"))
    with pytest.raises(FailedPrecondition, match="container a"):
        rig.restart()


def test_a_daemon_stopped_after_its_last_sharer_is_not_a_restart_when_the_next_sharer_starts_it(rig: Rig) -> None:
    svc = rig.service
    minor = minor_of(rig, 4)
    svc.prepare(ContainerId("a"), sharer())
    svc.cleanup(ContainerId("a"))  # the last sharer: its daemon stops
    assert rig.mps.running() == frozenset()
    svc.core.handover.recheck()
    svc.prepare(ContainerId("b"), sharer())
    svc.supervise_mps()
    assert svc.core.mps.restarts[minor] == 0 and svc.watch(ContainerId("b")) is None


def test_a_daemon_that_failed_to_start_again_ends_its_sharers_at_once_and_is_counted_once_it_is_back(rig: Rig) -> None:
    svc, uuid = rig.service, uuid_of(rig, 4)
    minor = minor_of(rig, 4)
    svc.prepare(ContainerId("a"), sharer())
    rig.mps.kill(uuid)
    rig.mps.faults.fail_at("start")
    svc.supervise_mps()  # found dead, not started again: its clients failed all the same
    limitation = svc.watch(ContainerId("a"))
    assert limitation is not None and "found dead" in limitation.message
    assert svc.core.mps.restarts[minor] == 0 and uuid not in rig.mps.running()
    svc.supervise_mps()  # started again now
    assert svc.core.mps.restarts[minor] == 1
    assert svc.watch(ContainerId("a")) is not None


def test_two_users_racing_for_an_empty_single_user_mps_gpu_never_both_get_it() -> None:
    import threading

    from isolator.errors import IsolatorError

    for _ in range(10):
        rig = fake_service("dgx-1")
        rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps"))
        rig.users.names.update(alice=1000, bob=1001)
        rig.restart()
        barrier, out = threading.Barrier(2), {}

        def prepare(
            name: str, user: str, rig: Rig = rig, barrier: threading.Barrier = barrier, out: dict = out
        ) -> None:
            barrier.wait()
            try:
                rig.service.prepare(
                    ContainerId(name), ContainerConfig(resources=(Resource("gpu_shares", 1.0),), user=user)
                )
                out[name] = "ok"
            except IsolatorError as exc:
                out[name] = type(exc).__name__

        threads = [threading.Thread(target=prepare, args=a) for a in (("a", "alice"), ("b", "bob"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(out.values()) == ["SharesExhausted", "ok"], out
        uuid = uuid_of(rig, 4)
        assert len(rig.mps.daemon(uuid).servers) == 1


def test_the_handover_override_on_a_mig_parent_whose_units_are_held_is_refused_and_changes_nothing() -> None:
    rig = fake_service("dgx-a100")
    svc = rig.service
    svc.prepare(ContainerId("m"), ContainerConfig(resources=(Resource("mig-1g.5gb", 1.0),)))
    parent = next(g for g in svc.list_gpus().gpus if any(m.holder for m in g.mig_devices))
    before = rig.inventory.settings(parent.index)
    with pytest.raises(FailedPrecondition, match=r"has MIG devices held \(container m\); the handover override"):
        svc.undrain(parent.uuid)
    assert rig.inventory.settings(parent.index) == before
    assert any(m.holder for m in svc.list_gpus().gpus[parent.index].mig_devices)
    svc.cleanup(ContainerId("m"))
    svc.undrain(parent.uuid)  # no unit held: the override is the admin's again


def test_a_sharer_prepared_between_a_fault_and_the_pass_that_sees_it_is_ended_with_the_others(rig: Rig) -> None:
    svc, uuid = rig.service, uuid_of(rig, 4)
    svc.prepare(ContainerId("a"), sharer())
    rig.mps.connect(uuid, pid=4500, uid=0)
    (server,) = rig.mps.daemon(uuid).servers
    rig.mps.command(uuid, f"sim_fault {server}")
    svc.prepare(ContainerId("b"), sharer())  # the pass has not seen it: placed, its client would get 807
    svc.supervise_mps()
    for name in "ab":
        limitation = svc.watch(ContainerId(name))
        assert limitation is not None and f"MPS server {server} in FAULT" in limitation.message, name
    assert rig.mps.running() == {uuid}, "the daemon stays: its sharers end through the agent"


def test_a_sidecar_killed_after_restarting_a_daemon_but_before_ending_its_sharers_still_ends_them(rig: Rig) -> None:
    # Was a strict xfail until the sharers a lost daemon ends were recorded before it starts again
    # (state schema 12, mps_ended).
    svc, core = rig.service, rig.service.core
    svc.prepare(ContainerId("a"), sharer())
    rig.mps.kill(uuid_of(rig, 4))
    # The pass's first half (the daemon started again and set up), then the sidecar dies.
    core.mps.supervise([(g, core.mps_plan(g.minor)) for g in core.mps_wanted()], [], core.idle_share)
    rig.restart()
    rig.service.supervise_mps()
    assert rig.service.watch(ContainerId("a")) is not None


def test_a_prepare_that_starts_a_dead_daemon_again_records_the_others_ended_and_not_itself(rig: Rig) -> None:
    # The sidecar killed right after such a Prepare: its restart ends the others, never the new one.
    a, b = ContainerId("a"), ContainerId("b")
    rig.service.prepare(a, sharer())
    rig.mps.kill(uuid_of(rig, 4))
    rig.service.prepare(b, sharer())
    assert set(rig.store.mps_ended()) == {a}
    rig.restart()
    rig.service.supervise_mps()
    limitation = rig.service.watch(a)
    assert limitation is not None and "found dead and is started again" in limitation.message
    assert rig.service.watch(b) is None


def test_a_loss_that_cannot_be_recorded_still_ends_the_sharers_sets_the_daemon_up_and_is_recorded_later(
    rig: Rig,
) -> None:
    # A full disk must not keep the GPU from a daemon with its limits: the sharers end in memory, the
    # daemon is started again, and the record is tried again at the next pass.
    a = ContainerId("a")
    uuid = uuid_of(rig, 4)
    rig.service.prepare(a, sharer())
    rig.mps.kill(uuid)
    rig.store.faults.fail_at("end_mps_sharers", times=2)  # when found, and the pass's own retry at its end
    rig.service.supervise_mps()
    assert uuid in rig.mps.running() and rig.store.mps_ended() == {}
    assert rig.service.watch(a) is not None
    assert rig.mps.command(uuid, "get_default_active_thread_percentage") == "25.0"
    rig.service.supervise_mps()  # the disk is back
    assert set(rig.store.mps_ended()) == {a}


def test_a_supervise_pass_that_finds_the_daemon_dead_during_a_prepare_never_ends_that_sharer(rig: Rig) -> None:
    # The pass takes the daemon's lock after the new sharer is booked and before its own ensure: its
    # client comes after the daemon is set up again, so it is not lost, in memory or on disk.
    a, b = ContainerId("a"), ContainerId("b")
    svc, core = rig.service, rig.service.core
    svc.prepare(a, sharer())
    rig.mps.kill(uuid_of(rig, 4))
    ensure = core.mps.ensure

    def pass_first(gpu, plan, under_sharers=False, verify=False, served=None):  # type: ignore[no-untyped-def]
        ensure(gpu, plan, under_sharers=True, verify=True)  # the pass wins the daemon's lock
        return ensure(gpu, plan, under_sharers, verify, served)

    core.mps.ensure = pass_first  # type: ignore[method-assign]
    svc.prepare(b, sharer())
    core.mps.ensure = ensure  # type: ignore[method-assign]
    svc.supervise_mps()
    assert set(core.booking.mps_ended) == {"a"} and set(rig.store.mps_ended()) == {a}
    rig.restart()
    rig.service.supervise_mps()
    assert rig.service.watch(a) is not None and rig.service.watch(b) is None


def test_limits_lifted_by_a_root_sharer_are_set_back_even_when_the_loss_cannot_be_recorded(rig: Rig) -> None:
    rig.service.prepare(ContainerId("a"), sharer())
    uuid = uuid_of(rig, 4)
    (server,) = rig.mps.daemon(uuid).servers
    lift(rig, uuid, server)
    rig.store.faults.fail_at("end_mps_sharers", times=None)
    rig.service.supervise_mps()
    assert rig.mps.command(uuid, "get_default_active_thread_percentage") == "25.0"
    assert rig.mps.connect(uuid, pid=4300, uid=0, env={}).threads == 25.0
    assert rig.service.watch(ContainerId("a")) is not None


def test_a_store_that_cannot_record_an_end_at_start_does_not_stop_the_start(rig: Rig) -> None:
    rig.service.prepare(ContainerId("a"), sharer())
    rig.mps.kill(uuid_of(rig, 4))
    rig.store.faults.fail_at("end_mps_sharers", times=None)
    rig.restart()  # the start's pass finds the daemon dead and cannot record the end
    assert rig.service.watch(ContainerId("a")) is not None


def test_a_cleanup_takes_its_ended_mark_with_it(rig: Rig) -> None:
    a = ContainerId("a")
    rig.service.prepare(a, sharer())
    rig.mps.kill(uuid_of(rig, 4))
    rig.service.supervise_mps()
    assert set(rig.store.mps_ended()) == {a}
    rig.service.cleanup(a)
    assert rig.store.mps_ended() == {}


def test_a_loss_found_after_a_sharers_daemon_was_set_up_ends_it_even_before_its_prepare_returns(rig: Rig) -> None:
    # b's Prepare is past its daemon's set-up (its client may come at any time) when the daemon dies
    # and a pass starts it again: b is lost with the others, even though its Prepare has not ended.
    import threading

    a, b = ContainerId("a"), ContainerId("b")
    svc, core = rig.service, rig.service.core
    uuid = uuid_of(rig, 4)
    svc.prepare(a, sharer())
    end_lost = core.end_lost_mps_sharers
    died: list[int] = []

    def then_the_daemon_dies() -> None:
        end_lost()
        if threading.current_thread().name == "prepare-b" and not died:
            died.append(1)
            rig.mps.kill(uuid)
            svc.supervise_mps()  # before b's Prepare has ended

    core.end_lost_mps_sharers = then_the_daemon_dies  # type: ignore[method-assign]
    prepare = threading.Thread(target=svc.prepare, args=(b, sharer()), name="prepare-b")
    prepare.start()
    prepare.join(10)
    core.end_lost_mps_sharers = end_lost  # type: ignore[method-assign]
    assert set(core.booking.mps_ended) == {"a", "b"} and set(rig.store.mps_ended()) == {a, b}


def test_a_record_failing_with_a_raw_database_error_still_sets_the_daemon_up(rig: Rig) -> None:
    import sqlite3

    uuid = uuid_of(rig, 4)
    rig.service.prepare(ContainerId("a"), sharer())
    rig.mps.kill(uuid)

    def failing(ends: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")  # what a failed SAVEPOINT reaches the caller as

    rig.store.end_mps_sharers = failing  # type: ignore[method-assign]
    rig.service.supervise_mps()
    assert uuid in rig.mps.running() and rig.service.watch(ContainerId("a")) is not None


def test_a_prepare_that_cannot_start_the_dead_daemon_again_ends_its_other_sharers_at_once(rig: Rig) -> None:
    a, b = ContainerId("a"), ContainerId("b")
    rig.service.prepare(a, sharer())
    rig.mps.kill(uuid_of(rig, 4))
    rig.mps.faults.fail_at("start")
    with pytest.raises(IsolatorError):
        rig.service.prepare(b, sharer())
    assert rig.service.watch(a) is not None and rig.store.get(b) is None
    assert rig.service.core.mps_preparing == set()
