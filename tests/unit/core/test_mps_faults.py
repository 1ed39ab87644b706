"""An MPS server in FAULT (issue 41 item 4) over the fake service and FakeMps (the stand-in's model,
simhost/mpsmodel.py): the supervise pass sees it through ``get_server_status``; every sharer of that
GPU, and only those, gets a limitation that says so; a new sharer of that GPU is refused, naming the
fault, until every client of it has exited and the server is ACTIVE again; a sharer that leaves
(Cleanup, an Update to 0) has its MPS clients ended with ``terminate_client`` first."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hook_helpers import uuid_of

from isolator.errors import IsolatorError
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.shares import parse_shared_gpus
from isolator.testing import Rig, fake_service


@pytest.fixture(params=["v1", "v2"])
def rig(request) -> Rig:
    rig = fake_service("dgx-1", version=request.param)
    # GPU 4 cut four ways, GPU 5 two ways, both under MPS: a gpu-share-4 unit can go to GPU 4 only.
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps,5:2:mps"))
    rig.restart()
    return rig


def unit(size: int) -> ContainerConfig:
    return ContainerConfig(resources=(Resource(f"gpu-share-{size}", 1.0), Resource("cpus", 1.0)))


def fault(rig: Rig, index: int) -> int:
    """A fatal fault in a client of the GPU's server (the stand-in's sim_fault); the server's pid."""
    uuid = uuid_of(rig, index)
    (server,) = rig.mps.daemon(uuid).servers
    rig.mps.command(uuid, f"sim_fault {server}")
    return server


def test_a_fault_ends_exactly_that_gpus_sharers_and_keeps_new_ones_off_until_it_is_active(rig: Rig) -> None:
    svc = rig.service
    a, c, b = ContainerId("a"), ContainerId("c"), ContainerId("b")
    svc.prepare(a, unit(4))  # GPU 4
    svc.prepare(c, unit(4))  # GPU 4
    svc.prepare(b, unit(2))  # GPU 5
    clients = [rig.mps.connect(uuid_of(rig, 4), pid, 0) for pid in (3001, 3002)]
    rig.mps.connect(uuid_of(rig, 5), 3003, 0)
    for name in (a, b, c):
        assert svc.watch(name) is None
    server = fault(rig, 4)
    assert svc.watch(a) is None, "not seen before the supervise pass"
    svc.supervise_mps()

    for name in (a, c):
        limitation = svc.watch(name)
        assert limitation is not None
        assert f"MPS server {server} in FAULT" in limitation.message and "GPU 4" in limitation.message
        assert limitation.mig == (("gpu_shares", 1),) and limitation.gpus == 0
    assert svc.watch(b) is None, "a sharer of another GPU is not told"
    check = next(ch for ch in svc.health() if ch.name == "mps")
    assert not check.ok and f"MPS server {server} in FAULT" in check.detail

    with pytest.raises(IsolatorError) as refused:
        svc.prepare(ContainerId("d"), unit(4))
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert f"MPS server in FAULT: GPU 4 ({uuid_of(rig, 4)}): MPS server {server} in FAULT" in refused.value.message
    assert rig.store.get(ContainerId("d")) is None, "nothing booked"

    for client in clients:  # every client of the fault exits (the agent ended a and c)
        client.exit()
    svc.supervise_mps()
    assert rig.mps.command(uuid_of(rig, 4), f"get_server_status {server}") == "ACTIVE"
    svc.prepare(ContainerId("d"), unit(4))
    assert svc.watch(ContainerId("d")) is None, "a sharer placed after the recovery is not ended"
    assert svc.watch(a) is not None, "a sharer the fault ended stays ended until its Cleanup"
    svc.cleanup(a)
    assert next(ch for ch in svc.health() if ch.name == "mps").ok


def test_a_cleanup_and_an_update_to_zero_terminate_the_sharers_mps_clients_first(rig: Rig) -> None:
    svc = rig.service
    a, b = ContainerId("a"), ContainerId("b")
    svc.prepare(a, unit(4))
    svc.prepare(b, unit(4))
    uuid = uuid_of(rig, 4)
    rig.cgroups.add_pid(a, 4001)
    rig.cgroups.add_pid(b, 4002)
    rig.mps.connect(uuid, 4001, 0)
    rig.mps.connect(uuid, 4002, 0)
    rig.mps.connect(uuid, 4999, 0)  # someone else's client: never ended by a's or b's leaving
    (server,) = rig.mps.daemon(uuid).servers
    svc.update(a, ())  # to 0 shares
    assert f"terminate_client {server} 4001" in rig.mps.commands[uuid]
    rig.mps.commands[uuid].clear()
    try:
        svc.cleanup(b)  # standalone: refused while b still has a process, after its client was ended
    except IsolatorError:
        rig.cgroups.kill(4002)
        svc.cleanup(b)
    ended = [c for c in rig.mps.commands[uuid] if c.startswith("terminate_client")]
    assert ended[0] == f"terminate_client {server} 4002" and set(ended) == {ended[0]}


def test_a_server_state_that_cannot_be_read_keeps_the_fault(rig: Rig) -> None:
    svc = rig.service
    svc.prepare(ContainerId("a"), unit(4))
    rig.mps.connect(uuid_of(rig, 4), 3001, 0)
    fault(rig, 4)
    svc.supervise_mps()
    rig.mps.faults.fail_at("command")
    svc.supervise_mps()  # the daemon answers nothing: the fault is not cleared on a guess
    assert svc.watch(ContainerId("a")) is not None
    with pytest.raises(IsolatorError, match="MPS server in FAULT"):
        svc.prepare(ContainerId("d"), unit(4))


def test_a_daemon_killed_in_a_fault_is_started_again_and_its_ended_sharers_stay_ended(rig: Rig) -> None:
    svc = rig.service
    svc.prepare(ContainerId("a"), unit(4))
    rig.mps.connect(uuid_of(rig, 4), 3001, 0)
    fault(rig, 4)
    svc.supervise_mps()
    rig.mps.kill(uuid_of(rig, 4))  # its servers die with it: the fault with them
    svc.supervise_mps()
    assert uuid_of(rig, 4) in rig.mps.running() and svc.core.mps.faults() == {}
    assert svc.watch(ContainerId("a")) is not None, "its clients failed: still ended"
    svc.prepare(ContainerId("d"), unit(4))  # a new sharer is served by the new daemon
    assert svc.watch(ContainerId("d")) is None


def test_a_restarted_sidecar_sees_a_fault_that_lasts_and_ends_the_sharers_it_recovered(rig: Rig) -> None:
    svc = rig.service
    svc.prepare(ContainerId("a"), unit(4))
    rig.mps.connect(uuid_of(rig, 4), 3001, 0)
    server = fault(rig, 4)
    rig.restart()  # the daemon (a session of its own) outlives the sidecar, in FAULT
    svc = rig.service
    svc.supervise_mps()
    limitation = svc.watch(ContainerId("a"))
    assert limitation is not None and f"MPS server {server} in FAULT" in limitation.message


def test_a_sharer_ended_by_a_fault_stays_ended_after_a_restart_that_finds_the_server_active_again(rig: Rig) -> None:
    svc = rig.service
    svc.prepare(ContainerId("a"), unit(4))
    client = rig.mps.connect(uuid_of(rig, 4), 3001, 0)
    server = fault(rig, 4)
    svc.supervise_mps()
    rig.mps.disconnect(uuid_of(rig, 4), client.pid)  # its client exited: the server is ACTIVE again
    rig.restart()
    svc = rig.service
    svc.supervise_mps()
    assert svc.core.mps.faults() == {}
    limitation = svc.watch(ContainerId("a"))
    assert limitation is not None and f"MPS server {server} in FAULT" in limitation.message
    svc.prepare(ContainerId("d"), unit(4))  # the GPU takes new sharers again, and they are not ended
    assert svc.watch(ContainerId("d")) is None


def test_a_daemon_stopped_by_its_last_sharers_cleanup_during_a_pass_is_not_an_error(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """The pass reads the servers' state after ``ensure`` released the lock; a Cleanup of the GPU's
    last sharer in between stops the daemon (seen on the node, tests/node/test_v2.py: "cannot read its
    MPS servers' state ... Cannot find MPS control daemon process" logged as an ERROR). The daemon
    was stopped on purpose: nothing to read, nothing logged as an error, no fault."""
    svc = rig.service
    a = ContainerId("a")
    svc.prepare(a, unit(4))
    uuid = uuid_of(rig, 4)
    command = rig.mps.command
    lists = []

    def cleanup_first(gpu: str, text: str, peer_uid: int = 0) -> str:
        if text == "get_server_list":
            lists.append(text)
            if len(lists) == 2:  # the pass's read, after ensure's read-back (under its lock) was the first
                svc.cleanup(a)  # the agent's Cleanup, on another thread, between ensure and the read
        return command(gpu, text, peer_uid)

    rig.mps.command = cleanup_first  # type: ignore[method-assign]
    rig.mps.commands.clear()
    with caplog.at_level("WARNING"):
        svc.supervise_mps()
    assert len(lists) == 2 and rig.store.get(a) is None and uuid not in rig.mps.running()
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    assert svc.core.mps.faults() == {}
