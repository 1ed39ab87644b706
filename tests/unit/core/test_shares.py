"""gpu_shares in the core, in-process over the shipped fakes (docs/sharing.md): Prepare books shares on
one shared GPU and grants exactly it, recorded before granted; refusals leave nothing; Cleanup frees;
a restart recovers; an XID ends every sharer; a shared GPU is never handed out whole; reloads that
would switch a held GPU are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hook_helpers import minor_of, uuid_of

from isolator.errors import FailedPrecondition, GpusExhausted, InvalidArgument, StateError
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.devices import NVIDIA_MAJOR, DeviceRule, permits
from isolator.policy.shares import (
    InvalidShareCount,
    RoleChangeRefused,
    ShareRequestTooLarge,
    SharesExhausted,
    parse_shared_gpus,
)
from isolator.testing import Rig, fake_service

SHARED = parse_shared_gpus("4-7:4:mps")  # dgx-1: GPUs 0-3 whole, 4-7 cut four ways
# The same cut time-sliced: where a pooled request of several shares goes (under MPS every sharer holds
# one share: tests/unit/core/test_mps_limits.py).
TIME_SLICED = parse_shared_gpus("4-7:4")


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def shares(n: float) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpu_shares", n), Resource("cpus", 1.0)))


def gpus(n: float) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpus", n),))


def granted(rig: Rig, c: ContainerId) -> list[int] | None:
    rules = rig.cgroups.rules_of(c)
    if rules is None:
        return None
    return [m for m in range(16) if permits(rules, DeviceRule.char(NVIDIA_MAJOR, m, "rw"))]


@pytest.fixture(params=["v1", "v2"])
def rig(request) -> Rig:
    rig = fake_service("dgx-1", version=request.param)
    rig.settings = replace(rig.settings, shared_gpus=SHARED)
    rig.restart()
    return rig


@pytest.fixture(params=["v1", "v2"])
def ts_rig(request) -> Rig:
    rig = fake_service("dgx-1", version=request.param)
    rig.settings = replace(rig.settings, shared_gpus=TIME_SLICED)
    rig.restart()
    return rig


def booked(rig: Rig) -> dict[int, int]:
    booking = rig.service.core.booking
    with booking.lock:
        return booking.shares_held()


def test_four_one_share_tasks_spread_over_the_shared_gpus_each_granted_exactly_its_own(rig: Rig) -> None:
    shared = [minor_of(rig, i) for i in (4, 5, 6, 7)]
    for name in "abcd":
        rig.service.prepare(cid(name), shares(1))
    got = {name: granted(rig, cid(name)) for name in "abcd"}
    assert got == {"a": [shared[0]], "b": [shared[1]], "c": [shared[2]], "d": [shared[3]]}, "fewest shares first"
    rig.service.prepare(cid("e"), shares(1))
    assert granted(rig, cid("e")) == [shared[0]], "then the lowest minor among the equally loaded"
    rec = rig.store.get(cid("e"))
    assert rec is not None and (rec.holding.share.gpu, rec.holding.shares, rec.holding.share.mode) == (
        shared[0],
        1,
        "mps",
    )
    assert rec.holding.gpus == frozenset()
    assert booked(rig) == {shared[0]: 2, shared[1]: 1, shared[2]: 1, shared[3]: 1}


def test_shares_fill_one_gpu_then_move_to_the_next(ts_rig: Rig) -> None:
    rig = ts_rig
    shared = [minor_of(rig, i) for i in (4, 5, 6, 7)]
    rig.service.prepare(cid("big"), shares(4))
    for name in "abc":
        rig.service.prepare(cid(name), shares(4))
    assert [granted(rig, cid(n)) for n in ("big", "a", "b", "c")] == [[m] for m in shared]
    with pytest.raises(SharesExhausted, match="Requested 1 gpu_shares but no shared GPU has that many free"):
        rig.service.prepare(cid("x"), shares(1))
    assert rig.store.get(cid("x")) is None and not rig.cgroups.exists(cid("x"))


def test_whole_gpu_requests_never_get_a_shared_gpu(rig: Rig) -> None:
    shared = {minor_of(rig, i) for i in (4, 5, 6, 7)}
    rig.service.prepare(cid("w"), gpus(4))
    assert not set(granted(rig, cid("w")) or []) & shared
    with pytest.raises(GpusExhausted):
        rig.service.prepare(cid("x"), gpus(1))
    assert rig.store.get(cid("x")) is None


@pytest.mark.parametrize("value", [0.0, -1.0, 0.5, float("nan"), float("inf"), 1e12])
def test_hostile_share_counts_are_refused_before_anything_is_booked(rig: Rig, value: float) -> None:
    with pytest.raises(InvalidShareCount):
        rig.service.prepare(cid("a"), shares(value))
    assert rig.store.get(cid("a")) is None and not rig.cgroups.exists(cid("a"))
    assert sum(booked(rig).values()) == 0


def test_a_request_larger_than_one_gpu_is_refused_clearly(rig: Rig) -> None:
    with pytest.raises(ShareRequestTooLarge, match="a shared GPU here holds at most 4"):
        rig.service.prepare(cid("a"), shares(5))
    assert rig.store.get(cid("a")) is None


def test_shares_with_whole_gpus_in_one_container_are_refused(rig: Rig) -> None:
    config = ContainerConfig(resources=(Resource("gpus", 1.0), Resource("gpu_shares", 1.0)))
    with pytest.raises(InvalidArgument, match="not both"):
        rig.service.prepare(cid("a"), config)
    assert rig.store.get(cid("a")) is None and sum(booked(rig).values()) == 0


@pytest.mark.parametrize(("edge", "step"), [("store", "record"), ("cgroups", "prepare"), ("cgroups", "apply")])
def test_a_failure_half_way_through_prepare_frees_the_shares(ts_rig: Rig, edge: str, step: str) -> None:
    rig = ts_rig
    getattr(rig, edge).faults.fail_at(step)
    with pytest.raises(Exception, match="injected fault"):
        rig.service.prepare(cid("a"), shares(2))
    assert rig.store.get(cid("a")) is None and not rig.cgroups.exists(cid("a"))
    assert sum(booked(rig).values()) == 0
    rig.service.prepare(cid("a"), shares(2))
    assert sum(booked(rig).values()) == 2


def test_cleanup_frees_the_shares_and_the_last_sharer_hands_the_gpu_over(ts_rig: Rig) -> None:
    rig = ts_rig
    first = minor_of(rig, 4)
    rig.service.prepare(cid("a"), shares(3))
    rig.service.prepare(cid("b"), shares(3))  # on the next GPU: a's has 1 left
    rig.service.prepare(cid("c"), shares(1))  # the fewest held: GPUs 6 and 7 hold none
    assert booked(rig)[first] == 3
    index = 4
    rig.inventory.start_process(index, 4242, memory_used=1 << 30)  # something of a's still runs
    rig.service.cleanup(cid("a"))
    assert booked(rig)[first] == 0
    assert first in rig.service.core.booking.draining, "checked after its last sharer"
    rig.inventory.stop_process(index, 4242)
    rig.service.core.handover.recheck()
    assert first not in rig.service.core.booking.draining
    assert first in rig.service.core.booking.allocated, "still booked for sharing, never whole"


def test_the_handover_waits_for_the_last_sharer(ts_rig: Rig) -> None:
    rig = ts_rig
    first = minor_of(rig, 4)
    rig.service.prepare(cid("a"), shares(2))
    rig.service.prepare(cid("b"), shares(2))
    rig.service.prepare(cid("c"), shares(2))  # GPU 6
    rig.service.prepare(cid("d"), shares(2))  # GPU 7
    rig.service.prepare(cid("e"), shares(2))  # back on GPU 4, beside a
    assert granted(rig, cid("e")) == [first]
    rig.inventory.start_process(4, 4242, memory_used=1 << 30)
    rig.service.cleanup(cid("a"))
    assert first not in rig.service.core.booking.draining, "e still shares it"
    rig.service.cleanup(cid("e"))
    assert first in rig.service.core.booking.draining


def test_a_restart_recovers_the_sharers_and_their_grants(rig: Rig) -> None:
    for name in "abcde":
        rig.service.prepare(cid(name), shares(1))
    before = {n: granted(rig, cid(n)) for n in "abcde"}
    held = booked(rig)
    rig.restart()
    assert booked(rig) == held
    assert {n: granted(rig, cid(n)) for n in "abcde"} == before
    rig.service.prepare(cid("f"), shares(1))
    assert granted(rig, cid("f")) == [minor_of(rig, 5)], "placed against the recovered books"


def test_the_start_up_audit_puts_back_a_sharers_grant(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))
    rig.cgroups.apply(cid("a"), ())  # someone took the grant away while we were down
    rig.restart()
    assert granted(rig, cid("a")) == [minor_of(rig, 4)]
    rig.cgroups.apply(cid("a"), ())
    report = rig.service.audit()
    assert report.repaired and granted(rig, cid("a")) == [minor_of(rig, 4)]


def test_an_xid_on_a_shared_gpu_limits_every_sharer_and_nobody_else(ts_rig: Rig) -> None:
    rig = ts_rig
    for name in "abcde":
        rig.service.prepare(cid(name), shares(1))  # a and e on GPU 4
    rig.service.prepare(cid("w"), gpus(1))
    rig.inventory.xid(4, 79)
    for name in "ae":
        lim = rig.service.watch(cid(name))
        assert lim is not None, name
        assert lim.gpus == 0 and lim.mig == (("gpu_shares", 1),)
        assert f"its 1 gpu_shares of GPU {minor_of(rig, 4)} (time-slice)" in lim.message
        assert "XID 79" in lim.message
    for name in "bcdw":
        assert rig.service.watch(cid(name)) is None, name
    with pytest.raises(SharesExhausted):
        # GPU 4 is out; GPUs 5-7 have room for 3 each but not for 4.
        rig.service.prepare(cid("x"), shares(4))


def test_update_never_mixes_shares_with_other_kinds(ts_rig: Rig) -> None:
    rig = ts_rig
    rig.service.prepare(cid("a"), shares(2))
    with pytest.raises(FailedPrecondition, match="shares are never mixed with whole GPUs or MIG devices"):
        rig.service.update(cid("a"), [Resource("gpu_shares", 2.0), Resource("gpus", 1.0)])
    rig.service.update(cid("a"), [Resource("gpu_shares", 2.0), Resource("cpus", 2.0)])  # unchanged: fine
    assert granted(rig, cid("a")) == [minor_of(rig, 4)]
    rig.service.prepare(cid("w"), gpus(1))
    with pytest.raises(FailedPrecondition, match="holds no gpu_shares; shares are placed at launch"):
        rig.service.update(cid("w"), [Resource("gpus", 1.0), Resource("gpu_shares", 1.0)])


def test_nested_containers_get_their_top_level_sharers_gpu() -> None:
    rig = fake_service("dgx-1", mode="mesos", version="v1")
    rig.settings = replace(rig.settings, shared_gpus=SHARED)
    rig.restart()
    a = cid("a")
    rig.cgroups.mesos_creates(a)  # Mesos makes the cgroup before the isolators prepare
    rig.service.prepare(a, shares(1))
    child = cid("a.b")
    rig.cgroups.mesos_creates(child)  # share_cgroups=false: a/mesos/b
    rig.service.prepare(child, ContainerConfig(share_cgroups=False))
    assert granted(rig, child) == [minor_of(rig, 4)]


def test_status_and_usage_name_the_shared_gpu(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))
    uuid = rig.service.core.gpus[minor_of(rig, 4)].uuid
    assert rig.service.status(cid("a")).gpu_uuids == (uuid,)
    assert [g.uuid for g in rig.service.usage(cid("a")).gpus] == [uuid]


# ---- the operator's choice, at start and at reload ------------------------------------------------


def test_a_restart_that_shares_a_gpu_held_whole_is_refused_naming_it() -> None:
    rig = fake_service("dgx-1")
    rig.service.prepare(cid("w"), gpus(8))
    rig.settings = replace(rig.settings, shared_gpus=SHARED)
    with pytest.raises(RoleChangeRefused, match=r"held whole by container w and cannot become shared"):
        rig.restart()


def test_a_restart_that_stops_sharing_a_gpu_with_sharers_is_refused(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("5-7:4:mps"))
    with pytest.raises(FailedPrecondition, match="which is not shared"):
        rig.restart()


def test_a_reload_may_change_gpus_nobody_holds(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))  # GPU 4
    booking = rig.service.core.booking
    rig.service.share_gpus(parse_shared_gpus("4:4:mps,5:2:time-slice,3:8"))
    assert sorted(booking.shared) == sorted(minor_of(rig, i) for i in (3, 4, 5))
    assert minor_of(rig, 6) in booking.available, "GPU 6 is whole again"
    assert minor_of(rig, 3) not in booking.available, "GPU 3 is shared now"
    rig.service.prepare(cid("w"), gpus(5))
    assert minor_of(rig, 3) not in (granted(rig, cid("w")) or [])


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("5-7:4:mps", "GPU {m4} has 1 gpu_shares held and cannot become whole"),
        ("4:4,5-7:4:mps", "cannot switch from mps to time-slice"),
        ("0-7:4:mps", "GPU {m0} is held whole and cannot become shared"),
        ("4:8:mps,5-7:4:mps", "GPU {m4} has 1 gpu_shares held and cannot be re-cut from 4 to 8 ways"),
    ],
)
def test_a_reload_that_would_switch_a_held_gpu_is_refused_and_changes_nothing(rig: Rig, spec: str, says: str) -> None:
    rig.service.prepare(cid("a"), shares(1))  # GPU 4
    rig.service.prepare(cid("w"), gpus(4))  # GPUs 0-3
    booking = rig.service.core.booking
    before = (booking.shared, booking.allocated, booking.share_specs)
    with booking.lock, pytest.raises(RoleChangeRefused) as err:
        booking.share(parse_shared_gpus(spec))
    assert says.format(m4=minor_of(rig, 4), m0=minor_of(rig, 0)) in str(err.value)
    assert (booking.shared, booking.allocated, booking.share_specs) == before


def test_store_failures_leave_no_shares_booked(rig: Rig) -> None:
    rig.store.faults.fail_at("record")
    with pytest.raises(StateError):
        rig.service.prepare(cid("a"), shares(1))
    assert sum(booked(rig).values()) == 0


# ---- the booking's methods -----------------------------------------------------------------------


def test_the_booking_places_restores_and_frees_shares_under_its_lock(ts_rig: Rig) -> None:
    rig = ts_rig
    from isolator.core.locks import LockNotHeld

    booking = rig.service.core.booking
    m4, m5 = minor_of(rig, 4), minor_of(rig, 5)
    assert set(booking.resolve_shared(parse_shared_gpus("4:2"))) == {m4}
    with pytest.raises(LockNotHeld):
        booking.place_shares("x", 1)
    with booking.lock:
        assert booking.place_shares("x", 2).minor == m4
        booking.restore_shares("y", m4, 1)
        assert booking.share_holders(m4) == {"x": 2, "y": 1}
        assert booking.free_shares("x") == (m4, False)
        assert booking.free_shares("y") == (m4, True)
        assert booking.free_shares("y") is None
        assert booking.place_shares("z", 4, near=[1]).minor == m4
        assert booking.shares_held()[m4] == 4
        assert booking.place_shares("v", 1).minor == m5


# ---- MPS (docs/sharing.md, "The two modes") --------------------------------------------------------


def test_the_first_mps_sharer_starts_the_gpus_daemon_in_exclusive_process_mode(rig: Rig) -> None:
    assert rig.mps.running() == frozenset()
    info = rig.service.prepare(cid("a"), shares(1))
    assert rig.mps.running() == {uuid_of(rig, 4)}
    assert rig.inventory.settings(4)[0] == 3, "EXCLUSIVE_PROCESS"
    assert rig.service.core.mps.state(minor_of(rig, 4)) == "running"
    memory = rig.service.core.gpus[minor_of(rig, 4)].memory_total
    assert info is not None
    assert dict(info.environment) == {
        "CUDA_MPS_PIPE_DIRECTORY": f"/fake/mps/{uuid_of(rig, 4)}/pipe",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={memory // (1 << 20) // 4}M",
    }
    rig.service.prepare(cid("b"), shares(1))  # GPU 5
    assert rig.mps.starts == {uuid_of(rig, 4): 1, uuid_of(rig, 5): 1}
    info_b = rig.service.prepare(cid("e"), shares(1))  # GPU 6: its own daemon
    assert info_b is not None and dict(info_b.environment)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_a_second_sharer_uses_the_running_daemon(rig: Rig) -> None:
    for name in "abcde":
        rig.service.prepare(cid(name), shares(1))  # a and e on GPU 4
    assert rig.mps.starts[uuid_of(rig, 4)] == 1


def test_an_image_sharer_gets_the_pipe_directory_mounted_read_only_at_cudas_default(rig: Rig) -> None:
    rig.filesystem.make_dirs("/rootfs/a")
    config = ContainerConfig(resources=(Resource("gpu_shares", 1.0),), rootfs="/rootfs/a", image_env=("A=1",))
    info = rig.service.prepare(cid("a"), config)
    assert info is not None
    pipe = f"/fake/mps/{uuid_of(rig, 4)}/pipe"
    mount = next(m for m in info.mounts if m.source == pipe)
    assert mount.target.endswith("/tmp/nvidia-mps")
    # Read-only (MS_BIND|MS_RDONLY, which the launcher applies as a remount): a root user in the image
    # can neither rewrite the daemon's files nor plant its own sockets where the sidecar's commands go.
    assert mount.flags == 4096 | 1
    env = dict(info.environment)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_a_command_task_sharer_gets_its_mps_environment_as_task_environment(rig: Rig) -> None:
    config = ContainerConfig(resources=(Resource("gpu_shares", 1.0),), command_task=True)
    info = rig.service.prepare(cid("a"), config)
    assert info is not None and "CUDA_MPS_PIPE_DIRECTORY" in dict(info.task_environment)


def test_time_sliced_sharers_get_no_mps(rig: Rig) -> None:
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4-7:4"))
    rig.restart()
    assert rig.service.prepare(cid("a"), shares(1)) is None
    assert rig.mps.running() == frozenset()
    assert rig.inventory.settings(4)[0] == 0


def test_the_daemon_stops_after_the_last_sharer_before_the_handover_check(rig: Rig) -> None:
    for name in "abcde":
        rig.service.prepare(cid(name), shares(1))  # a and e on GPU 4
    rig.service.cleanup(cid("a"))
    assert uuid_of(rig, 4) in rig.mps.running(), "e still shares it"
    rig.service.cleanup(cid("e"))
    assert uuid_of(rig, 4) not in rig.mps.running()
    assert rig.mps.commands[uuid_of(rig, 4)][-1] == "quit"
    assert rig.service.core.mps.state(minor_of(rig, 4)) == "stopped"
    assert rig.inventory.settings(4)[0] == 0, "the handover check set the compute mode back"
    assert minor_of(rig, 4) not in rig.service.core.booking.draining
    rig.service.prepare(cid("f"), shares(1))
    assert rig.mps.starts[uuid_of(rig, 4)] == 2 and rig.inventory.settings(4)[0] == 3


def test_a_daemon_that_cannot_start_refuses_the_sharer_and_leaves_nothing(rig: Rig) -> None:
    rig.mps.faults.fail_at("start")
    with pytest.raises(FailedPrecondition, match="injected fault"):
        rig.service.prepare(cid("a"), shares(1))
    assert rig.store.get(cid("a")) is None and not rig.cgroups.exists(cid("a"))
    assert sum(booked(rig).values()) == 0
    assert rig.service.core.mps.state(minor_of(rig, 4)).startswith("failed: ")
    rig.service.prepare(cid("a"), shares(1))
    assert rig.mps.running() == {uuid_of(rig, 4)}


def test_a_compute_mode_that_cannot_be_set_refuses_the_sharer(rig: Rig) -> None:
    rig.inventory.fail_gpu(4, "nvmlDeviceSetComputeMode", 4)
    with pytest.raises(FailedPrecondition, match=r"compute mode of GPU 4 .* to EXCLUSIVE_PROCESS"):
        rig.service.prepare(cid("a"), shares(1))
    assert rig.store.get(cid("a")) is None and rig.mps.running() == frozenset()


def test_a_killed_daemon_is_started_again_under_its_sharers(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))
    rig.service.prepare(cid("b"), shares(1))
    rig.mps.kill(uuid_of(rig, 4))
    rig.service.supervise_mps()
    assert rig.mps.running() == {uuid_of(rig, 4), uuid_of(rig, 5)}
    assert rig.service.core.mps.restarts[minor_of(rig, 4)] == 1
    rig.service.supervise_mps()
    assert rig.service.core.mps.restarts[minor_of(rig, 4)] == 1, "nothing to do when it runs"
    rig.mps.kill(uuid_of(rig, 4))
    rig.mps.faults.fail_at("start")
    rig.service.supervise_mps()  # logged, retried at the next pass
    assert uuid_of(rig, 4) not in rig.mps.running()
    rig.service.supervise_mps()
    assert uuid_of(rig, 4) in rig.mps.running()


def test_a_restart_adopts_live_daemons_restarts_dead_ones_and_stops_idle_ones(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))  # GPU 4
    rig.service.prepare(cid("b"), shares(1))  # GPU 5
    rig.service.prepare(cid("c"), shares(1))  # GPU 6
    rig.mps.kill(uuid_of(rig, 5))  # died while the sidecar was down
    rig.store.remove(cid("c"))  # c's record is lost (a state file restored from an old backup)
    rig.restart()
    assert granted(rig, cid("c")) == [], "a lost sharer's GPU is revoked, never rebuilt as held whole"
    assert rig.store.get(cid("c")) is None
    assert rig.mps.running() == {uuid_of(rig, 4), uuid_of(rig, 5)}
    assert rig.mps.starts == {uuid_of(rig, 4): 1, uuid_of(rig, 5): 2, uuid_of(rig, 6): 1}


def test_no_mps_edge_refuses_mps_sharers_clearly() -> None:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=SHARED)
    service = rig.without_mps()
    with pytest.raises(FailedPrecondition, match="shared in mps mode but this sidecar has no nvidia-cuda-mps-control"):
        service.prepare(cid("a"), shares(1))
    assert rig.store.get(cid("a")) is None


# ---- placement near the task's CPUs (--cpu-affinity hint/enforce) ---------------------------------


def test_shares_go_near_the_numa_node_of_the_cpus_the_task_may_run_on() -> None:
    from isolator.policy.affinity import Machine

    rig = fake_service("dgx-1", cpu_affinity="hint")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("2-5:2"))  # 2, 3 on node 0; 4, 5 on node 1
    rig.cpusets.set_machine(
        Machine(
            cpus=frozenset(range(4)), mems=frozenset({0, 1}), node_cpus={0: frozenset({0, 1}), 1: frozenset({2, 3})}
        )
    )
    rig.restart()
    rig.cpusets.parent_cpus = frozenset({2, 3})  # the agent lets the task run on node 1's CPUs only
    rig.service.prepare(cid("a"), shares(1))
    assert granted(rig, cid("a")) == [minor_of(rig, 4)], "node 1's GPU first, though GPU 2 has a lower minor"
    rig.service.prepare(cid("b"), shares(1))
    assert granted(rig, cid("b")) == [minor_of(rig, 5)]
    rig.service.prepare(cid("c"), shares(1))
    assert granted(rig, cid("c")) == [minor_of(rig, 2)], "the fewest shares held comes before the node"
    rig.cpusets.parent_cpus = None  # nothing restricts it: every node is near, the lowest minor wins
    rig.service.prepare(cid("d"), shares(1))
    assert granted(rig, cid("d")) == [minor_of(rig, 3)]


def test_without_affinity_the_tasks_cpus_do_not_matter() -> None:
    from isolator.policy.affinity import Machine

    rig = fake_service("dgx-1")  # --cpu-affinity off
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("2-5:2"))
    rig.cpusets.set_machine(
        Machine(
            cpus=frozenset(range(4)), mems=frozenset({0, 1}), node_cpus={0: frozenset({0, 1}), 1: frozenset({2, 3})}
        )
    )
    rig.restart()
    rig.cpusets.parent_cpus = frozenset({2, 3})
    rig.service.prepare(cid("a"), shares(1))
    assert granted(rig, cid("a")) == [minor_of(rig, 2)]


def test_a_daemon_of_a_gpu_no_longer_shared_in_mps_mode_is_stopped(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))  # GPU 4's daemon
    rig.service.cleanup(cid("a"))
    rig.mps.start(uuid_of(rig, 4))  # left running (a crash between the record and the stop, then a reload)
    rig.service.share_gpus(parse_shared_gpus("5-7:4:mps"))
    rig.service.supervise_mps()
    assert uuid_of(rig, 4) not in rig.mps.running()
    rig.mps.start(uuid_of(rig, 0))  # one in our directory for a GPU never shared: stopped too
    rig.service.supervise_mps()
    assert rig.mps.running() == frozenset()


def test_recover_releasing_the_last_sharer_stops_its_mps_daemon() -> None:
    from isolator.model import ContainerState

    rig = fake_service("dgx-1", mode="mesos")
    rig.settings = replace(rig.settings, shared_gpus=SHARED)
    rig.restart()
    for name in ("a", "b"):
        rig.cgroups.mesos_creates(cid(name))
        rig.service.prepare(cid(name), shares(1))  # GPUs 4 and 5
    result = rig.service.recover([ContainerState(cid("b"))], [])  # Mesos no longer knows a
    assert result.released == 1 and rig.store.get(cid("a")) is None
    assert rig.mps.running() == {uuid_of(rig, 5)}
    assert booked(rig)[minor_of(rig, 4)] == 0
