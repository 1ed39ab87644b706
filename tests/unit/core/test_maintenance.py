"""An operator's maintenance drain in the core, over the shipped fakes (issue 33 item 7,
docs/operations.md section 7): no new grant of a drained GPU, whole, grown into or as a MIG device on
it, a refusal that names it, its holders keep it, undrain ends it (and only it: the handover check is
another state), a reason required, the store written before the drain counts, a restart keeps it, and
an operator's decision logged at INFO."""

from __future__ import annotations

import logging

import pytest

from isolator.errors import FailedPrecondition, GpusExhausted, InvalidArgument, NotFound
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.mig import MigExhausted
from isolator.testing import fake_service

OPERATOR = "uid 0, pid 4242"


def _gpus(n: float) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpus", n),))


def _holders(service) -> dict[int, str]:
    return {g.index: g.holder for g in service.list_gpus().gpus if g.holder}


def test_a_drained_gpu_is_never_granted_and_a_request_that_needs_it_is_refused_naming_it():
    rig = fake_service("dgx-1")
    svc = rig.service
    uuid3 = svc.list_gpus().gpus[3].uuid
    done = svc.maintenance_drain("3", "  board swap, ticket OPS-12  ", OPERATOR)
    assert (done.index, done.drained, done.was_drained, done.reason, done.by) == (
        3,
        True,
        False,
        "board swap, ticket OPS-12",
        OPERATOR,
    )
    with pytest.raises(GpusExhausted) as refused:
        svc.prepare(ContainerId("all"), _gpus(8))
    assert "only 7 available" in refused.value.message
    assert f"drained for maintenance: GPU 3 ({uuid3})" in refused.value.message
    assert svc.list_containers() == [], "a refused Prepare books nothing"
    svc.prepare(ContainerId("seven"), _gpus(7))
    assert sorted(_holders(svc)) == [0, 1, 2, 4, 5, 6, 7]


def test_running_containers_keep_a_drained_gpu_and_it_stays_out_after_they_end():
    rig = fake_service("dgx-1")
    svc = rig.service
    svc.prepare(ContainerId("holder"), _gpus(8))
    done = svc.maintenance_drain("minor:5", "fan noise", OPERATOR)
    assert done.holders == ("container holder",) and "container holder keeps it until it ends" in done.detail
    assert _holders(svc)[5] == "holder"
    assert svc.status(ContainerId("holder")).gpu_uuids == tuple(g.uuid for g in svc.list_gpus().gpus)
    svc.cleanup(ContainerId("holder"))
    with pytest.raises(GpusExhausted, match=r"drained for maintenance: GPU 5"):
        svc.prepare(ContainerId("next"), _gpus(8))


def test_a_grow_that_needs_a_drained_gpu_is_refused_naming_it():
    rig = fake_service("dgx-1")
    svc = rig.service
    svc.prepare(ContainerId("a"), _gpus(4))
    free = sorted(set(range(8)) - set(_holders(svc)))
    svc.maintenance_drain(str(free[0]), "memory errors under test", OPERATOR)
    with pytest.raises(GpusExhausted, match=rf"drained for maintenance: GPU {free[0]} "):
        svc.update(ContainerId("a"), [Resource("gpus", 8.0)])
    svc.update(ContainerId("a"), [Resource("gpus", 7.0)])
    assert free[0] not in _holders(svc)


def test_no_mig_device_of_a_drained_gpu_is_granted():
    rig = fake_service("dgx-a100")
    svc = rig.service
    gpu3 = svc.list_gpus().gpus[3]  # the only GPU with a 4g.20gb device
    assert [m.resource for m in gpu3.mig_devices].count("mig-4g.20gb") == 1
    svc.maintenance_drain(gpu3.uuid, "MIG reconfiguration", OPERATOR)
    mig = ContainerConfig(resources=(Resource("mig-4g.20gb", 1.0),))
    with pytest.raises(MigExhausted, match=rf"drained for maintenance: GPU 3 \({gpu3.uuid}\)"):
        svc.prepare(ContainerId("m"), mig)
    svc.prepare(ContainerId("small"), ContainerConfig(resources=(Resource("mig-1g.5gb", 1.0),)))
    assert all(not m.holder for m in svc.list_gpus().gpus[3].mig_devices)
    svc.maintenance_undrain("3", OPERATOR)
    svc.prepare(ContainerId("m"), mig)


def test_undrain_puts_it_back_and_is_idempotent():
    rig = fake_service("dgx-1")
    svc = rig.service
    svc.maintenance_drain("2", "cable reseat", OPERATOR)
    again = svc.maintenance_drain("2", "cable reseat, part 2", "uid 1000, pid 7")
    assert again.was_drained and "reason now: cable reseat, part 2" in again.detail
    assert svc.list_gpus().gpus[2].maintenance_reason == "cable reseat, part 2"
    ended = svc.maintenance_undrain("2", OPERATOR)
    assert (ended.drained, ended.was_drained, ended.reason) == (False, True, "cable reseat, part 2")
    assert "back in service" in ended.detail
    svc.prepare(ContainerId("all"), _gpus(8))
    nothing = svc.maintenance_undrain("2", OPERATOR)
    assert not nothing.was_drained and "nothing to do" in nothing.detail


def test_undrain_does_not_override_the_handover_check_and_says_how():
    rig = fake_service("dgx-1")
    svc = rig.service
    svc.prepare(ContainerId("a"), _gpus(8))
    rig.inventory.start_process(4, 44)
    svc.cleanup(ContainerId("a"))
    assert svc.list_gpus().gpus[4].drain_state == "draining"
    with pytest.raises(FailedPrecondition) as refused:
        svc.maintenance_undrain("4", OPERATOR)
    assert "not drained for maintenance; the handover check keeps it out" in refused.value.message
    assert "gpu-isolator undrain --handover 4" in refused.value.message
    assert svc.list_gpus().gpus[4].drain_state == "draining", "refused: nothing changed"
    # A GPU both drained and kept out by the handover check: undrain ends the drain only, and says so.
    svc.maintenance_drain("4", "and its board", OPERATOR)
    ended = svc.maintenance_undrain("4", OPERATOR)
    assert "still not handed out: the handover check (draining" in ended.detail
    assert svc.list_gpus().gpus[4].drain_state == "draining"
    # And the other way round: the handover override does not end a maintenance drain.
    svc.maintenance_drain("4", "still its board", OPERATOR)
    overridden = svc.undrain("4")
    assert overridden.was == "draining" and "it stays drained for maintenance" in overridden.detail
    with pytest.raises(GpusExhausted, match="drained for maintenance: GPU 4"):
        svc.prepare(ContainerId("all"), _gpus(8))


@pytest.mark.parametrize(
    ("reason", "why"),
    [("", "needs a reason"), ("   ", "needs a reason"), ("two\nlines", "one line"), ("x" * 513, "at most 512")],
)
def test_a_drain_without_a_usable_reason_is_refused_and_changes_nothing(reason, why):
    rig = fake_service("dgx-1")
    with pytest.raises(InvalidArgument, match=why):
        rig.service.maintenance_drain("1", reason, OPERATOR)
    assert not rig.service.list_gpus().gpus[1].maintenance and rig.store.maintenance() == {}


def test_an_unknown_gpu_is_not_found():
    rig = fake_service("dgx-1")
    with pytest.raises(NotFound, match="no managed GPU 'GPU-nope'"):
        rig.service.maintenance_drain("GPU-nope", "x", OPERATOR)
    with pytest.raises(NotFound):
        rig.service.maintenance_undrain("9", OPERATOR)


def test_a_drain_the_store_refuses_changes_nothing():
    rig = fake_service("dgx-1")
    rig.store.faults.fail_at("set_maintenance")
    with pytest.raises(Exception, match="injected fault"):
        rig.service.maintenance_drain("1", "x", OPERATOR)
    assert not rig.service.list_gpus().gpus[1].maintenance
    rig.service.prepare(ContainerId("all"), _gpus(8))


def test_a_drain_outlives_a_restart_and_is_shown_in_gpus_describe_and_health():
    rig = fake_service("dgx-1")
    rig.clock.advance(1_800_000_000.0 - rig.clock.time())
    rig.service.maintenance_drain("6", "PSU swap", OPERATOR)
    svc = rig.restart()
    g6 = svc.list_gpus().gpus[6]
    assert (g6.maintenance, g6.maintenance_reason, g6.maintenance_by) == (True, "PSU swap", OPERATOR)
    assert g6.maintenance_since == 1_800_000_000.0 and g6.healthy, "drained is not unhealthy"
    with pytest.raises(GpusExhausted, match="GPU 6"):
        svc.prepare(ContainerId("all"), _gpus(8))
    check = {c.name: c for c in svc.health()}["maintenance"]
    assert (
        check.ok
        and "GPU 6 drained for maintenance since 2027-01-15T08:00:00Z (uid 0, pid 4242): PSU swap" in check.detail
    )
    svc.maintenance_undrain("6", OPERATOR)
    svc.prepare(ContainerId("held"), _gpus(8))
    svc.maintenance_drain("6", "after all", OPERATOR)
    described = svc.describe_container(ContainerId("held"))
    assert [g.index for g in described.gpus if g.maintenance] == [6]
    assert {c.name: c for c in svc.health()}["maintenance"].ok


def test_a_drain_is_logged_at_info_never_as_an_error(caplog):
    rig = fake_service("dgx-1")
    caplog.set_level(logging.DEBUG)
    rig.service.maintenance_drain("1", "scheduled maintenance", OPERATOR)
    rig.service.maintenance_undrain("1", OPERATOR)
    mine = [r for r in caplog.records if r.name == "isolator.core.maintenance"]
    assert len(mine) == 2 and all(r.levelno == logging.INFO for r in mine)
    assert "drained for maintenance" in mine[0].getMessage() and OPERATOR in mine[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_ended_drain_stays_in_the_history_with_who_ended_it_when_and_why():
    rig = fake_service("dgx-1")
    svc = rig.service
    uuid2 = svc.list_gpus().gpus[2].uuid
    assert svc.maintenance_history() == []
    svc.maintenance_drain("2", "cable reseat", OPERATOR)
    since = svc.list_gpus().gpus[2].maintenance_since
    rig.clock.advance(3600.0)
    ended = svc.maintenance_undrain("2", "uid 1000, pid 7", "  reseated, link at x16  ")
    assert ended.detail.endswith("; ended: reseated, link at x16")
    (entry,) = svc.maintenance_history()
    assert (entry.uuid, entry.reason, entry.since, entry.by) == (uuid2, "cable reseat", since, OPERATOR)
    assert (entry.ended, entry.ended_by) == (since + 3600.0, "uid 1000, pid 7")
    assert entry.end_reason == "reseated, link at x16"
    # Without a reason it is kept all the same; an undrain of an undrained GPU adds nothing.
    svc.maintenance_drain("2", "again", OPERATOR)
    svc.maintenance_undrain("2", OPERATOR)
    svc.maintenance_undrain("2", OPERATOR)
    assert [(e.reason, e.end_reason) for e in svc.maintenance_history()] == [
        ("cable reseat", "reseated, link at x16"),
        ("again", ""),
    ]
    assert rig.restart().maintenance_history() == svc.maintenance_history(), "the store keeps it"


def test_an_undrain_reason_must_be_one_printable_line_and_a_refused_one_ends_nothing():
    rig = fake_service("dgx-1")
    svc = rig.service
    svc.maintenance_drain("2", "cable reseat", OPERATOR)
    with pytest.raises(InvalidArgument, match="one line of printable text"):
        svc.maintenance_undrain("2", OPERATOR, "done\nrm -rf")
    assert svc.list_gpus().gpus[2].maintenance and svc.maintenance_history() == []


def test_agent_flags_are_the_managed_gpus_whole_shared_and_mig():
    rig = fake_service("dgx-a100")
    resources, pairs = rig.service.agent_flags()
    assert resources.startswith("gpus:3;mig-")
    assert dict(pairs)["gpu_count"] == "8"
