"""gpu_shares under a real Mesos master and agent (docs/sharing.md): an agent with
``gpus:4;gpu_shares:16`` (the simulated DGX-1's GPUs 0-3 whole, 4-7 shared four ways: 4-6 time-sliced,
where a pooled task may hold all four shares, 7 under MPS, where every sharer holds one). The
master takes the custom scalar from the agent's --resources and offers it; mesos-execute asks for it
as for cpus; the sidecar places and isolates, and the tasks report what they could open.

Placement spreads (the fewest shares held first), so the scenario first fills GPUs 4, 5 and 6 with one
four-share task each: then four one-share tasks run at once on GPU 7, each opening exactly it; a
``gpus:1`` task gets one of GPUs 0-3; an XID on GPU 7 ends its four sharers and no other task; a fifth
one-share task is refused while no healthy shared GPU has room, and goes to GPU 4 once its holder ends.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator

import pytest
from conftest import PROBE, assert_sees_exactly, opened_gpus
from invariants import scrape_unix

from isolator.testing.cluster import Cluster
from isolator.testing.task import Task

# The sidecar's metrics, so that a scenario can see gpu_isolator_errors_total (issue 41).
METRICS = os.path.join(tempfile.mkdtemp(prefix="gi-shares-", dir="/tmp"), "metrics.sock")


@pytest.fixture(scope="module")
def shared(mesos_home: str) -> Iterator[Cluster]:
    with Cluster(
        mesos_home,
        gpus=4,
        resources="cpus:8;mem:4096;disk:4096;gpu_shares:16",
        sidecar_flags=("--shared-gpus", "4-6:4:time-slice,7:4:mps", "--metrics-address", f"unix:{METRICS}"),
    ) as c:
        yield c


def run(cluster: Cluster, shares: int = 0, gpus: int = 0, seconds: float = 600) -> Task:
    devdir = cluster.agents[0].sidecar.dev_root  # type: ignore[union-attr]
    task = cluster.submit(f"python3 {PROBE} {devdir} {seconds:g}", gpus=gpus, shares=shares)
    task.wait("TASK_RUNNING")
    task.wait_stdout("probed")
    return task


def env(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^env (\w+)=(.*)$", stdout, re.M))


def test_the_master_offers_gpu_shares_and_the_sidecar_places_and_isolates_them(shared: Cluster) -> None:
    agent = shared.agents[0]
    state = agent.sidecar_json("gpus")
    assert {int(g["index"]): int(g["shares_total"]) for g in state["gpus"]} == {
        0: 0,
        1: 0,
        2: 0,
        3: 0,
        4: 4,
        5: 4,
        6: 4,
        7: 4,
    }
    whole = [run(shared, shares=4) for _ in range(3)]
    for task, gpu in zip(whole, (4, 5, 6), strict=True):
        assert_sees_exactly(task.stdout(), {gpu})
        assert "CUDA_MPS_PIPE_DIRECTORY" not in env(task.stdout()), "time-sliced: no MPS"
    sharers = [run(shared, shares=1) for _ in range(4)]
    for task in sharers:
        assert_sees_exactly(task.stdout(), {7})  # four at once on GPU 7, each opening exactly it
        variables = env(task.stdout())
        assert variables["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert variables["CUDA_MPS_PIPE_DIRECTORY"].endswith("/pipe")
    gpus = {int(g["index"]): g for g in agent.sidecar_json("gpus")["gpus"]}
    assert gpus[7]["shares_held"] == 4 and gpus[7]["mps_state"] == "running"
    assert sorted(h["holder"] for h in gpus[7]["share_holders"]) == sorted(t.container_id() for t in sharers)

    exclusive = run(shared, gpus=1)
    (mine,) = opened_gpus(exclusive.stdout())
    assert mine in {0, 1, 2, 3}, "a gpus:1 task never gets a shared GPU"

    # An XID on GPU 7 ends its four sharers, each told which GPU, and no other task.
    assert agent.sidecar is not None
    agent.sidecar.sim.inject_xid(7, 79)
    for task in sharers:
        update = task.wait("TASK_FAILED", timeout=90)
        assert update.reason == "REASON_CONTAINER_LIMITATION", update
        assert "GPU 7" in update.message and "XID 79" in update.message and "gpu_shares" in update.message, update
    for task in [*whole, exclusive]:
        assert task.state == "TASK_RUNNING", task.updates()
    for task in sharers:
        task.wait_gone()

    # The master offers GPU 7's four shares again, but GPU 7 is out and 4-6 are full: the sidecar refuses
    # a one-share task at once, saying what each shared GPU has free.
    devdir = agent.sidecar.dev_root
    refused = shared.submit(f"python3 {PROBE} {devdir} 0", shares=1)
    update = refused.wait("TASK_FAILED", timeout=60)
    assert update.reason == "REASON_CONTAINER_LAUNCH_FAILED", update
    assert "RESOURCE_EXHAUSTED: Requested 1 gpu_shares but no shared GPU has that many free" in update.message
    assert "GPU 7: 4 (not usable)" in update.message, update
    # GPU 4's holder ends: the next one-share task goes there.
    whole[0].teardown()
    whole[0].wait_gone()
    fifth = shared.submit(f"python3 {PROBE} {devdir} 0", shares=1)
    fifth.wait("TASK_FINISHED", timeout=120)
    assert_sees_exactly(fifth.stdout(), {4})
    for task in [*whole[1:], exclusive]:
        task.teardown()
    assert agent.proc is not None and agent.proc.poll() is None, "the agent died"
    assert "Check failed" not in agent.log()


def _shares_held(cluster: Cluster) -> dict[int, list[str]]:
    gpus = cluster.agents[0].sidecar_json("gpus")["gpus"]
    return {int(g["index"]): sorted(h["holder"] for h in g["share_holders"]) for g in gpus if int(g["shares_total"])}


def test_the_agent_and_the_sidecar_restarted_with_sharers_live_keep_every_share(shared: Cluster) -> None:
    """After the first scenario GPU 7 is out (its XID); GPUs 4-6 are free once its tasks are gone."""
    import time

    agent = shared.agents[0]
    deadline = time.monotonic() + 120
    while any(_shares_held(shared).values()):
        assert time.monotonic() < deadline, _shares_held(shared)
        time.sleep(0.5)
    tasks = [run(shared, shares=1) for _ in range(4)]  # GPUs 4, 5, 6, then 4 again
    opened = [opened_gpus(t.stdout()) for t in tasks]
    assert opened == [{4}, {5}, {6}, {4}], opened
    before = _shares_held(shared)
    assert before[4] == sorted([tasks[0].container_id(), tasks[3].container_id()])
    rules = {t.name: t.devices_list() for t in tasks}

    agent.restart()  # the module reloads its contexts, the sidecar keeps its books
    assert _shares_held(shared) == before
    for t in tasks:
        assert t.devices_list() == rules[t.name]
        assert t.state == "TASK_RUNNING", t.updates()

    assert agent.sidecar is not None
    agent.sidecar.terminate()
    agent.start_sidecar()  # the books rebuilt from the records
    assert _shares_held(shared) == before
    gpus = {int(g["index"]): g for g in agent.sidecar_json("gpus")["gpus"]}
    assert [gpus[i]["share_mode"] for i in (4, 5, 6)] == ["time-slice"] * 3
    for t in tasks:
        assert t.devices_list() == rules[t.name]
        assert t.state == "TASK_RUNNING", t.updates()

    # Recovered sharers are still cleaned up through the module; GPU 4 keeps its second sharer.
    tasks[0].teardown()
    tasks[0].wait_gone()
    assert _shares_held(shared)[4] == [tasks[3].container_id()]
    for t in tasks[1:]:
        t.teardown()
        t.wait_gone()
    assert not any(_shares_held(shared).values())
    assert "Check failed" not in agent.log()


def _errors(path: str) -> dict[str, float]:
    return {k: v for k, v in scrape_unix(path).items() if k.startswith("gpu_isolator_errors_total")}


@pytest.fixture(scope="module")
def native_metrics() -> str:
    return os.path.join(tempfile.mkdtemp(prefix="gi-native-", dir="/tmp"), "metrics.sock")


@pytest.fixture(scope="module")
def shared_native(mesos_home: str, native_metrics: str) -> Iterator[Cluster]:
    """The same agent on the native route: our module forwards every Update (the criteo route forwards
    none), which is where issue 41's errors came from."""
    with Cluster(
        mesos_home,
        gpus=4,
        route="native",
        resources="cpus:8;mem:4096;disk:4096;gpu_shares:16",
        sidecar_flags=("--shared-gpus", "4-6:4:time-slice,7:4:mps", "--metrics-address", f"unix:{native_metrics}"),
    ) as c:
        yield c


@pytest.mark.parametrize("route", ["criteo", "native"])
def test_a_share_task_that_ends_leaves_no_isolator_error_in_the_agent_log(route: str, request) -> None:
    """Issue 41: when a task ends the agent shrinks its executor and calls update with no gpu_shares;
    the sidecar releases them, so the agent logs no failed update and no error is counted."""
    cluster: Cluster = request.getfixturevalue("shared" if route == "criteo" else "shared_native")
    metrics = METRICS if route == "criteo" else request.getfixturevalue("native_metrics")
    agent = cluster.agents[0]
    assert agent.sidecar is not None
    mark, before = len(agent.log()), _errors(metrics)
    tasks = [cluster.submit(f"python3 {PROBE} {agent.sidecar.dev_root} 0", shares=n) for n in (1, 2)]
    for task in tasks:
        task.wait("TASK_FINISHED", timeout=120)
        task.wait_gone()
    log = agent.log()[mark:]
    assert "Failed to update resources" not in log, log
    errors = [line for line in log.splitlines() if line.startswith("E") and "isolator" in line.lower()]
    assert errors == [], errors  # glog's error lines start with E
    assert _errors(metrics) == before, "an ended share task counts no sidecar error"
    assert not any(_shares_held(cluster).values()), "every share released"
