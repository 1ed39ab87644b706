"""Failures under a real agent: GPU health events, requests beyond the free GPUs, restarts.

On the shared agent, which advertises one GPU more than the simulated DGX-1 has (as an agent does
whose GPU the sidecar took out of service). The GPUs marked unhealthy here stay so: this module runs
last (files run in name order).
"""

from __future__ import annotations

import time

import pytest
from conftest import assert_sees_exactly, opened_gpus, probe

from isolator.testing.cluster import Cluster


@pytest.fixture
def sick(cluster: Cluster) -> Cluster:
    """The shared agent, which advertises one GPU more than the simulated DGX-1 has (conftest)."""
    return cluster


def test_more_gpus_than_free_fails_fast_with_a_message_an_operator_understands(sick: Cluster) -> None:
    agent = sick.agents[0]
    started = time.monotonic()
    task = probe(sick, gpus=9)
    update = task.wait("TASK_FAILED", timeout=60)
    elapsed = time.monotonic() - started
    # "No GPU left" is final: the bridge does not retry it until its 25 s deadline.
    assert elapsed < 15, (elapsed, update)
    assert update.reason == "REASON_CONTAINER_LAUNCH_FAILED", update
    assert "RESOURCE_EXHAUSTED: Requested 9 gpus but only 8 available" in update.message, update
    assert all(h == "" for h in agent.holders().values())
    # The agent is not stalled behind it: the next task runs at once.
    ok = probe(sick, gpus=8)
    ok.wait("TASK_FINISHED")
    ok.wait_gone()  # its GPUs are re-offered before the agent cleans up (docs)
    assert_sees_exactly(ok.stdout(), set(range(8)))


def test_a_gpu_health_event_fails_the_task_naming_the_gpu_and_the_agent_stays_up(sick: Cluster) -> None:
    agent = sick.agents[0]
    task = probe(sick, gpus=1, seconds=300)
    task.wait("TASK_RUNNING")
    task.wait_stdout("probed")
    cid = task.container_id()
    (index,) = [i for i, h in agent.holders().items() if h == cid]
    assert agent.sidecar is not None
    agent.sidecar.sim.inject_xid(index, 79)  # GPU has fallen off the bus
    update = task.wait("TASK_FAILED", timeout=60)
    assert update.reason == "REASON_CONTAINER_LIMITATION", update
    assert f"GPU {index}" in update.message and "XID 79" in update.message, update
    task.wait_gone()
    assert agent.proc is not None and agent.proc.poll() is None, "the agent died"
    assert "Check failed" not in agent.log()
    gpus = {int(g["index"]): g for g in agent.sidecar_json("gpus")["gpus"]}
    assert not gpus[index]["healthy"] and gpus[index]["holder"] == ""
    # The agent still launches: the sick GPU is never handed out again.
    after = probe(sick, gpus=7)
    after.wait("TASK_FINISHED")
    after.wait_gone()  # its GPUs are re-offered before the agent cleans up (docs)
    assert opened_gpus(after.stdout()) == set(range(8)) - {index}


def test_an_unhealthy_gpu_stays_out_of_service_after_a_sidecar_restart(sick: Cluster) -> None:
    agent = sick.agents[0]
    assert agent.sidecar is not None
    gpus = {int(g["index"]): g for g in agent.sidecar_json("gpus")["gpus"]}
    healthy = {i for i, g in gpus.items() if g["healthy"]}
    index = min(healthy)
    agent.sidecar.sim.inject_xid(index, 48)  # double-bit ECC error
    deadline = time.monotonic() + 30
    while {int(g["index"]) for g in agent.sidecar_json("gpus")["gpus"] if g["healthy"]} != healthy - {index}:
        assert time.monotonic() < deadline, agent.sidecar_json("gpus")
        time.sleep(0.1)
    agent.sidecar.terminate()
    agent.start_sidecar()
    after = {int(g["index"]): g for g in agent.sidecar_json("gpus")["gpus"]}
    assert {i for i, g in after.items() if g["healthy"]} == healthy - {index}, after
    task = probe(sick, gpus=len(healthy) - 1)
    task.wait("TASK_FINISHED")
    task.wait_gone()  # its GPUs are re-offered before the agent cleans up (docs)
    assert opened_gpus(task.stdout()) == healthy - {index}
