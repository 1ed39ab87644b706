"""Beyond the one shared agent: the agent's own devices isolator in both orders, and three agents."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest
from conftest import assert_sees_exactly, granted, kernel_allows, opened_gpus, probe

from isolator.model import CgroupVersion
from isolator.testing.cluster import Cluster
from isolator.testing.mesoshome import MODULE, Route

# Mesos's default devices whitelist (cgroups/devices): /dev/null, zero, full, tty, urandom, random,
# console, ptmx, pts/*, net/tun. None of it may be lost to our rules.
AGENT_DEFAULTS = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 5:0 rwm", "c 1:9 rwm", "c 1:8 rwm", "c 136:* rwm")


@pytest.fixture(scope="module")
def module_first(mesos_home: str, cgroups: CgroupVersion, route: Route) -> Iterator[Cluster]:
    with Cluster(mesos_home, isolation=(MODULE, "cgroups/devices"), cgroups=cgroups, route=route) as c:
        yield c


@pytest.mark.parametrize("which", ["cluster", "module_first"], ids=["devices-first", "module-first"])
def test_both_orders_of_isolation_keep_the_agents_devices_and_leak_no_gpu(
    request: pytest.FixtureRequest, which: str, cgroups: CgroupVersion, route: Route
) -> None:
    # `route` is named so that the fixtures fetched by name below are parametrized by it.
    ordered: Cluster = request.getfixturevalue(which)  # on the layout of ``cgroups``
    agent = ordered.agents[0]
    assert agent.isolation.index(MODULE) == (1 if which == "cluster" else 0)
    task = probe(ordered, gpus=2, seconds=60)
    task.wait("TASK_RUNNING")
    out = task.wait_stdout("probed")
    cid = task.container_id()
    held = {i for i, h in agent.holders().items() if h == cid}
    assert len(held) == 2
    assert_sees_exactly(out, held)
    assert granted(task) == held
    assert all(kernel_allows(task, rule) for rule in AGENT_DEFAULTS)
    task.teardown()
    task.wait_gone()
    assert all(h == "" for h in agent.holders().values())
    assert not os.path.exists(os.path.join(agent.cgroups_mount(), agent.cgroups_root, cid))


def test_three_agents_a_burst_larger_than_the_cluster_every_gpu_used_none_twice(
    mesos_home: str, cgroups: CgroupVersion, route: Route
) -> None:
    """Three agents, each with its own sidecar, simulated 4-GPU host and cgroups root; eight
    gpus:2 tasks for six pairs: six run at once, two wait for a pair to be freed.

    The agents' resources are exactly two tasks' worth: mesos-execute declines an offer that does not
    fit and then suppresses offers for good (it never revives), so a leftover without GPUs offered to
    a waiting framework would strand it; with whole slots only, every offer fits."""
    with Cluster(
        mesos_home, agents=3, host="workstation-4", resources="cpus:2;mem:256", cgroups=cgroups, route=route
    ) as cluster:
        pending = [probe(cluster, gpus=2, seconds=3, cpus=1, mem=128) for _ in range(8)]
        runs, raced, finished = [], [], []
        while pending:
            task = pending.pop(0)
            update = task.wait("TASK_FINISHED", "TASK_FAILED", timeout=180)
            if update.state == "TASK_FAILED":
                # The master re-offers a command task's GPUs on its terminal update, before the agent
                # has destroyed the container (and run our cleanup, one hook at a time): a task placed
                # in that window fails at once, in Mesos's own words; a framework retries it.
                assert re.search(r"RESOURCE_EXHAUSTED: Requested 2 gpus but only [01] available", update.message), (
                    update
                )
                raced.append(update)
                assert len(raced) < 10
                pending.append(probe(cluster, gpus=2, seconds=3, cpus=1, mem=128))
                continue
            out = task.stdout()
            agent = task.agent()
            start, end = (float(re.search(rf"^{k} (\S+)$", out, re.M).group(1)) for k in ("start", "end"))  # type: ignore[union-attr]
            runs.append((agent.index, opened_gpus(out), start, end))
            finished.append(task)
        # TASK_FINISHED reaches the master before the agent has destroyed the container (and run our
        # cleanup, one hook at a time): what is released at the end is read once every one is gone.
        for task in finished:
            task.wait_gone(timeout=120)
        minors = {int(g["minor"]) for g in cluster.agents[0].sidecar_json("gpus")["gpus"]}
        for index, agent in enumerate(cluster.agents):
            mine = [r for r in runs if r[0] == index]
            # every GPU of every agent was used
            assert set().union(*(r[1] for r in mine)) == minors, (index, mine)
            # never one GPU in two tasks at once
            for i, a in enumerate(mine):
                assert len(a[1]) == 2, a
                for b in mine[i + 1 :]:
                    if a[2] < b[3] and b[2] < a[3]:
                        assert not a[1] & b[1], (a, b)
            assert all(h == "" for h in agent.holders().values())
            root = os.path.join(agent.cgroups_mount(), agent.cgroups_root)
            assert not os.path.isdir(root) or not [d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))]
        # more tasks than pairs: some waited for a pair to be freed
        assert len(runs) == 8
