"""MPS limits a task cannot lift (docs/sharing.md, "Limits a task cannot lift"; issue 41 item 2) under a
real Mesos master and agent, both routes: a quarter-GPU task whose command unsets (or raises) its
CUDA_MPS_* limits runs the simulated host's stand-in MPS client, which connects to the GPU's stand-in
control daemon as a CUDA process would and prints what it was given: still a quarter."""

from __future__ import annotations

import json
import os
import sys
import uuid

from isolator.testing.cluster import Cluster
from isolator.testing.task import Task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = "cpus:8;mem:4096;disk:4096"


def launch(cluster: Cluster, env_prefix: str) -> Task:
    name = f"t-{uuid.uuid4().hex[:8]}"
    client = f"{sys.executable} -m isolator.simhost.mpsclient --seconds 0"
    command = f"cd {ROOT} && env | grep ^CUDA_MPS_ ; {env_prefix} {client}"
    args = [f"--name={name}", f"--command={command}", "--resources=cpus:0.1;mem:32;gpu-share-4:1"]
    return cluster._execute(name, args, (name,))


def test_a_quarter_task_that_unsets_or_raises_its_limits_still_gets_a_quarter(mesos_home: str, route) -> None:
    with Cluster(
        mesos_home, gpus=4, resources=f"{BASE};gpu-share-4:4", route=route, sidecar_flags=("--shared-gpus", "4:4:mps")
    ) as cluster:
        unset = launch(cluster, "env -u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -u CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        raised = launch(
            cluster, "env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1000000M"
        )
        for task in (unset, raised):
            task.wait("TASK_FINISHED", timeout=120)
            out = task.stdout()
            told = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("CUDA_MPS_"))
            assert told["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25", out
            mib = int(told["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].removeprefix("0=").removesuffix("M"))
            got = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
            assert (got["mps"], got["active_thread_percentage"], got["pinned_mem_limit_mib"]) == (True, 25.0, mib), out
            task.wait_gone()
        assert cluster.agents[0].proc is not None and cluster.agents[0].proc.poll() is None, "the agent died"
