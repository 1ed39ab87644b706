"""The handover check (docs/handover.md), in-process over the fakes: a GPU something still runs on
after its container is kept out of every Prepare until it is free, and an admin sees why."""

from __future__ import annotations

from dataclasses import replace

import pytest

from isolator.errors import FailedPrecondition, GpusExhausted, NotFound
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.testing import Rig, fake_service

MIB = 1 << 20


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def gpus(n: int) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpus", float(n)),))


def with_settings(rig: Rig, **changes: object) -> Rig:
    rig.settings = replace(rig.settings, **changes)  # type: ignore[arg-type]
    rig.restart()
    return rig


@pytest.fixture
def rig() -> Rig:
    return fake_service("dgx-1")


def held(rig: Rig, name: str) -> frozenset[int]:
    rec = rig.store.get(cid(name))
    assert rec is not None
    return rec.holding.gpus


def gpu(rig: Rig, index: int):  # type: ignore[no-untyped-def]
    return rig.service.list_gpus().gpus[index]


def leave_a_process_on_gpu(rig: Rig, index: int, pid: int = 4242, memory: int = 1 << 30) -> None:
    """Prepare a container on every GPU, leave a process on GPU ``index``, clean the container up."""
    rig.service.prepare(cid("first"), gpus(8))
    rig.inventory.start_process(index, pid, memory)
    rig.service.cleanup(cid("first"))


def test_a_process_left_after_cleanup_keeps_its_gpu_out_of_every_prepare_until_it_is_gone(rig: Rig) -> None:
    leave_a_process_on_gpu(rig, 5)
    with pytest.raises(GpusExhausted, match=r"1 more are draining: \[5\]"):
        rig.service.prepare(cid("all"), gpus(8))
    for n in range(3):
        rig.service.prepare(cid(f"c{n}"), gpus(2))
    assert 5 not in held(rig, "c0") | held(rig, "c1") | held(rig, "c2")
    rig.service.prepare(cid("last"), gpus(1))
    assert 5 not in held(rig, "last")
    with pytest.raises(GpusExhausted):
        rig.service.prepare(cid("more"), gpus(1))
    rig.inventory.stop_process(5, 4242)
    rig.service.prepare(cid("more"), gpus(1))  # re-checked on the allocation attempt itself
    assert held(rig, "more") == {5}


def test_an_admin_sees_the_draining_gpu_its_pids_and_since_when(rig: Rig) -> None:
    released_at = rig.clock.time()
    leave_a_process_on_gpu(rig, 2, pid=777, memory=512 * MIB)
    view = gpu(rig, 2)
    assert (view.drain_state, view.drain_pids, view.drain_since) == ("draining", (777,), released_at)
    assert view.healthy and not view.holder
    assert "processes still run on it: 777 (compute, 512 MiB)" in view.drain_reason
    assert view.drain_memory_used_bytes == 512 * MIB
    assert all(g.drain_state == "" for g in rig.service.list_gpus().gpus if g.index != 2)
    check = {c.name: c for c in rig.service.health()}["handover"]
    assert check.ok and "GPU 2 draining since" in check.detail and "pids [777]" in check.detail


def test_memory_in_use_over_the_threshold_drains_a_gpu_without_processes(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(8))
    rig.inventory.set_usage(1, 300 * MIB, 0)
    rig.inventory.set_usage(4, 100 * MIB, 0)  # under the 256 MiB default: the driver's own
    rig.service.cleanup(cid("a"))
    assert [g.index for g in rig.service.list_gpus().gpus if g.drain_state] == [1]
    assert "300 MiB of memory in use (the threshold is 256 MiB)" in gpu(rig, 1).drain_reason
    rig.inventory.set_usage(1, 0, 0)
    rig.service.recheck_draining()
    assert gpu(rig, 1).drain_state == ""


def test_a_gpu_whose_check_fails_is_not_handed_out_and_says_why(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(8))
    rig.inventory.fail_gpu(6, "nvmlDeviceGetComputeRunningProcesses", 999)
    rig.service.cleanup(cid("a"))
    view = gpu(rig, 6)
    assert view.drain_state == "draining" and "the handover check could not be done" in view.drain_reason
    with pytest.raises(GpusExhausted):
        rig.service.prepare(cid("b"), gpus(8))
    rig.inventory.clear()
    rig.service.prepare(cid("b"), gpus(8))


def test_a_gpu_drained_past_the_timeout_is_unhealthy_then_free_once_clear(rig: Rig) -> None:
    with_settings(rig, drain_timeout_s=60.0)
    leave_a_process_on_gpu(rig, 3)
    rig.clock.advance(59)
    rig.service.recheck_draining()
    assert gpu(rig, 3).drain_state == "draining" and gpu(rig, 3).healthy
    rig.clock.advance(1)
    rig.service.recheck_draining()
    view = gpu(rig, 3)
    assert (view.drain_state, view.healthy) == ("unhealthy", False)
    assert view.health_reason.startswith("drain timed out: processes still run on it: 4242")
    assert not {c.name: c for c in rig.service.health()}["handover"].ok
    assert rig.service.core.handover.events["unhealthy"] == 1
    rig.inventory.stop_process(3)
    rig.service.recheck_draining()
    assert (gpu(rig, 3).drain_state, gpu(rig, 3).healthy) == ("", True)
    assert {c.name: c for c in rig.service.health()}["handover"].ok


def test_the_timeout_follows_the_injected_clock_not_the_wall(rig: Rig) -> None:
    with_settings(rig, drain_timeout_s=60.0)
    leave_a_process_on_gpu(rig, 3)
    for _ in range(5):
        rig.service.recheck_draining()  # real time passes, the clock does not
    assert gpu(rig, 3).drain_state == "draining"


def test_undrain_returns_a_draining_gpu_at_once_and_is_refused_for_others(rig: Rig) -> None:
    leave_a_process_on_gpu(rig, 4)
    uuid = gpu(rig, 4).uuid
    done = rig.service.undrain(uuid)
    assert (done.index, done.minor, done.was) == (4, 4, "draining")
    assert "returned to the pool by an admin" in done.detail and "4242" in done.detail
    assert gpu(rig, 4).drain_state == ""
    rig.service.prepare(cid("all"), gpus(8))  # the admin's decision: the process is still there
    with pytest.raises(FailedPrecondition, match="held by container all"):
        rig.service.undrain("4")
    rig.service.cleanup(cid("all"))  # checked again at this release: draining again
    assert gpu(rig, 4).drain_state == "draining"
    assert rig.service.undrain("minor:4").was == "draining"
    assert rig.service.undrain("4").was == "" and "was not draining" in rig.service.undrain("4").detail
    with pytest.raises(NotFound, match="no managed GPU 'GPU-nope'"):
        rig.service.undrain("GPU-nope")


def test_a_draining_gpu_stays_draining_across_a_restart_with_its_clock(rig: Rig) -> None:
    with_settings(rig, drain_timeout_s=60.0)
    since = rig.clock.time()
    leave_a_process_on_gpu(rig, 5)
    rig.clock.advance(30)
    rig.restart()
    assert (gpu(rig, 5).drain_state, gpu(rig, 5).drain_since) == ("draining", since)
    with pytest.raises(GpusExhausted):
        rig.service.prepare(cid("all"), gpus(8))
    rig.clock.advance(30)
    rig.service.recheck_draining()
    assert gpu(rig, 5).drain_state == "unhealthy", "the drain clock went on across the restart"
    rig.inventory.stop_process(5)
    rig.restart()  # checked again at start: free
    assert gpu(rig, 5).drain_state == "" and rig.store.drains() == {}


def test_a_gpu_busy_at_start_is_draining_even_without_a_record_of_it(rig: Rig) -> None:
    # A crash between a release and its check, or a process started while the sidecar was down.
    rig.inventory.start_process(7, 99)
    rig.restart()
    assert (gpu(rig, 7).drain_state, gpu(rig, 7).drain_pids) == ("draining", (99,))
    assert set(rig.store.drains()) == {7}


def test_a_grow_never_takes_a_draining_gpu(rig: Rig) -> None:
    leave_a_process_on_gpu(rig, 0)
    rig.service.prepare(cid("a"), gpus(1))
    rig.service.update(cid("a"), [Resource("gpus", 7.0)])
    assert 0 not in held(rig, "a") and len(held(rig, "a")) == 7


def test_application_clocks_and_compute_mode_are_reset_and_recorded(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(8))
    rig.inventory.set_application_clocks(2, 900, 700)
    rig.inventory.set_compute_mode(2, 3)  # EXCLUSIVE_PROCESS
    rig.service.cleanup(cid("a"))
    assert rig.inventory.settings(2) == (0, 1312, 877)
    view = gpu(rig, 2)
    assert view.drain_state == ""
    assert view.last_reset == (
        "application clocks: reset from graphics 900 MHz, memory 700 MHz to graphics 1312 MHz, memory 877 MHz",
        "compute mode: reset from EXCLUSIVE_PROCESS to DEFAULT",
    )
    assert gpu(rig, 3).last_reset == ()


def test_the_node_default_compute_mode_is_what_a_gpu_is_reset_to(rig: Rig) -> None:
    with_settings(rig, default_compute_mode=3)
    assert all(rig.inventory.settings(i)[0] == 3 for i in range(8)), "free GPUs are set at start"
    rig.service.prepare(cid("a"), gpus(1))
    (index,) = held(rig, "a")
    rig.inventory.set_compute_mode(index, 0)
    rig.service.cleanup(cid("a"))
    assert rig.inventory.settings(index)[0] == 3


def test_a_failed_clock_reset_is_reported_and_a_failed_compute_mode_reset_drains(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(8))
    rig.inventory.set_application_clocks(1, 900, 700)
    rig.inventory.fail_gpu(1, "nvmlDeviceResetApplicationsClocks", 4)
    rig.inventory.set_compute_mode(2, 2)  # PROHIBITED
    rig.inventory.fail_gpu(2, "nvmlDeviceSetComputeMode", 4)
    rig.service.cleanup(cid("a"))
    clocks = gpu(rig, 1)
    assert clocks.drain_state == "" and clocks.last_reset == (
        "application clocks: graphics 900 MHz, memory 700 MHz, failed to reset: Insufficient Permissions",
    )
    mode = gpu(rig, 2)
    assert mode.drain_state == "draining"
    assert mode.drain_reason == "its compute mode (PROHIBITED) could not be reset: Insufficient Permissions"
    assert rig.service.core.handover.events["reset-failed"] == 2


def test_drain_check_off_hands_released_gpus_out_at_once_and_forgets_old_marks(rig: Rig) -> None:
    leave_a_process_on_gpu(rig, 5)
    assert set(rig.store.drains()) == {5}
    with_settings(rig, drain_check=False)
    assert rig.store.drains() == {} and gpu(rig, 5).drain_state == ""
    rig.inventory.set_compute_mode(3, 2)
    rig.service.prepare(cid("all"), gpus(8))
    rig.service.cleanup(cid("all"))
    rig.service.prepare(cid("again"), gpus(8))
    assert rig.inventory.settings(3)[0] == 2, "off: nothing is reset either"
    assert "off" in {c.name: c for c in rig.service.health()}["handover"].detail


def test_a_forced_release_drains_like_a_cleanup(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(2))
    (first, _second) = sorted(held(rig, "a"))
    rig.inventory.start_process(first, 31337)
    rig.service.release(cid("a"), force=False)
    assert gpu(rig, first).drain_state == "draining" and gpu(rig, first).drain_pids == (31337,)


def test_a_gpu_given_back_by_a_shrinking_update_is_checked_too(rig: Rig) -> None:
    # The devices cgroup checks at open(2): a process that opened the GPU before the revocation keeps it.
    rig.service.prepare(cid("a"), gpus(8))
    rig.inventory.start_process(6, 66)
    rig.inventory.start_process(1, 11)
    rig.service.update(cid("a"), [Resource("gpus", 2.0)])
    kept = held(rig, "a")
    draining = {g.index for g in rig.service.list_gpus().gpus if g.drain_state}
    assert draining == {1, 6} - kept and draining
    assert all(gpu(rig, i).drain_state == "" for i in kept), "held GPUs are never marked"


def test_describe_shows_what_the_last_handover_reset_on_the_containers_gpus(rig: Rig) -> None:
    rig.service.prepare(cid("a"), gpus(8))
    rig.inventory.set_compute_mode(4, 2)
    rig.service.cleanup(cid("a"))
    rig.service.prepare(cid("b"), gpus(8))
    described = {g.index: g for g in rig.service.describe_container(cid("b")).gpus}
    assert described[4].last_reset == ("compute mode: reset from PROHIBITED to DEFAULT",)
    assert described[4].drain_state == "" and described[3].last_reset == ()


def test_a_check_whose_gpu_was_let_go_meanwhile_leaves_it_to_its_new_holder(rig: Rig) -> None:
    # A Prepare's recheck listed GPU 3 while it drained; before its turn, the Cleanup that released
    # it checked it, let it go, and another Prepare took it for a container that now runs on it.
    leave_a_process_on_gpu(rig, 3)
    listed = sorted(rig.service.core.handover.view())
    assert listed == [3]
    rig.inventory.stop_process(3)
    rig.service.recheck_draining()
    rig.service.prepare(cid("b"), gpus(8))
    rig.inventory.start_process(3, 5151)
    rig.service.core.handover.check(listed)  # the stale recheck's turn
    assert gpu(rig, 3).holder and gpu(rig, 3).drain_state == "", "a container's GPU is never marked draining"
    rig.service.cleanup(cid("b"))
    assert gpu(rig, 3).drain_state == "draining", "its own release is checked, and finds the process"
