"""Issue 41 item 1 under a real Mesos agent, on every route and cgroup layout: a task holding a share
unit (``gpu-share-<N>``, docs/sharing.md) or a MIG unit (``mig-<profile>``, docs/mig.md) that ends by
itself is followed by the agent's shrink of its executor (an Update without the unit) and then its
Cleanup. Each must pass without an isolator error: nothing in the agent's log, nothing counted in
``gpu_isolator_errors_total``, every unit back in the sidecar's books, and each task having opened
exactly its GPU while it ran.
"""

from __future__ import annotations

import os
import tempfile
import uuid

from conftest import PROBE, assert_sees_exactly
from invariants import scrape_unix

from isolator.testing.cluster import Cluster
from isolator.testing.task import Task

BASE = "cpus:8;mem:4096;disk:4096"


def _errors(path: str) -> dict[str, float]:
    return {k: v for k, v in scrape_unix(path).items() if k.startswith("gpu_isolator_errors_total")}


def _metrics_socket() -> str:
    return os.path.join(tempfile.mkdtemp(prefix="gi-ends-", dir="/tmp"), "metrics.sock")


def _launch(cluster: Cluster, resources: str) -> Task:
    devdir = cluster.agents[0].sidecar.dev_root  # type: ignore[union-attr]
    name = f"t-{uuid.uuid4().hex[:8]}"
    args = [f"--name={name}", f"--command=python3 {PROBE} {devdir} 0", f"--resources={resources}"]
    return cluster._execute(name, args, (name,))


def _assert_ended_clean(cluster: Cluster, tasks: list[Task], mark: int, metrics: str, before: dict) -> None:
    for task in tasks:
        task.wait("TASK_FINISHED", timeout=120)
        task.wait_gone()
    log = cluster.agents[0].log()[mark:]
    assert "Failed to update resources" not in log, log
    errors = [line for line in log.splitlines() if line.startswith("E") and "isolator" in line.lower()]
    assert errors == [], errors  # glog's error lines start with E
    assert _errors(metrics) == before, "a task that ended counts no sidecar error"
    assert cluster.agents[0].sidecar_json("containers")["containers"] == [], "every unit released"


def test_share_unit_tasks_that_end_leave_no_isolator_error(mesos_home: str, route, cgroups) -> None:
    metrics = _metrics_socket()
    flags = ("--shared-gpus", "4:4:mps,5:2:time-slice", "--metrics-address", f"unix:{metrics}")
    units = f"{BASE};gpu-share-2:2;gpu-share-4:4"
    with Cluster(mesos_home, gpus=6, resources=units, route=route, cgroups=cgroups, sidecar_flags=flags) as cluster:
        agent = cluster.agents[0]
        mark, before = len(agent.log()), _errors(metrics)
        quarters = [_launch(cluster, "cpus:0.1;mem:32;gpu-share-4:1") for _ in range(2)]
        half = _launch(cluster, "cpus:0.1;mem:32;gpu-share-2:1")
        _assert_ended_clean(cluster, [*quarters, half], mark, metrics, before)
        for task in quarters:
            assert_sees_exactly(task.stdout(), {4})
            assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in task.stdout()
        assert_sees_exactly(half.stdout(), {5})
        gpus = {int(g["index"]): g for g in agent.sidecar_json("gpus")["gpus"]}
        assert [int(gpus[i].get("shares_held", 0)) for i in (4, 5)] == [0, 0]


def test_a_mig_task_that_ends_leaves_no_isolator_error(mesos_home: str, route, cgroups) -> None:
    metrics = _metrics_socket()
    resources = f"{BASE};mig-1g.5gb:8"
    with Cluster(
        mesos_home,
        host="dgx-a100",
        gpus=3,
        resources=resources,
        route=route,
        cgroups=cgroups,
        sidecar_flags=("--metrics-address", f"unix:{metrics}"),
    ) as cluster:
        agent = cluster.agents[0]
        mark, before = len(agent.log()), _errors(metrics)
        tasks = [_launch(cluster, "cpus:0.1;mem:32;mig-1g.5gb:1") for _ in range(2)]
        _assert_ended_clean(cluster, tasks, mark, metrics, before)
        for task in tasks:
            assert "probed" in task.stdout(), task.stdout()
