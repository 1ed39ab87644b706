"""MPS users and faults under a real Mesos master and agent, on every route and cgroup layout (issue 41
items 3 and 4; docs/sharing.md, "Users" and "Faults").

Each sharer runs the simulated host's stand-in MPS client, which connects to its GPU's stand-in
control daemon as a CUDA process does and prints the server it was given. A task's Unix user is the
``user`` of its CommandInfo, which the agent hands to the isolator in the container's config.

- Users: on single-user MPS GPUs, root's and nobody's sharers each get a GPU and a server run as
  their own user, a sharer of a user already served joins its server, and a third user is refused
  while each GPU serves another (the agent's message says why). With ``:multiuser`` two users'
  sharers are served at once by one server.
- Faults: a fatal fault in one GPU's MPS server ends exactly that GPU's sharers with a limitation
  naming it; the sharers of the other MPS GPU keep running, never told of a fault.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest

from isolator.testing.cluster import Cluster, _task_info
from isolator.testing.task import Task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = "cpus:8;mem:4096;disk:4096"
NOBODY = 65534
# /usr/bin/python3, not the venv's: the venv's interpreter lives under root's 0700 home, which a
# task run as nobody cannot reach; the stand-in client needs the standard library only.
CLIENT = f"cd {ROOT} && env | grep ^CUDA_MPS_PIPE ; exec /usr/bin/python3 -m isolator.simhost.mpsclient --seconds 600"


def _sharer(cluster: Cluster, user: str) -> Task:
    name = f"t-{uuid.uuid4().hex[:8]}"
    info = _task_info({"name": name, "command": CLIENT, "resources": "cpus:0.1;mem:32;gpu-share-4:1"})
    info["command"]["user"] = user
    path = os.path.join(cluster.work, f"task-{name}.json")
    with open(path, "w") as fh:
        json.dump(info, fh)
    return cluster._execute(name, [f"--task=file://{path}"], (name,))


def _connected(task: Task) -> dict[str, Any]:
    """What the stand-in client got (its first JSON line), with the pipe directory it was told."""
    out = task.wait_stdout(r'(?m)^\{"active_thread_percentage"', timeout=90)
    got = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    pipe = next(line for line in out.splitlines() if line.startswith("CUDA_MPS_PIPE_DIRECTORY="))
    got["pipe"] = pipe.split("=", 1)[1]
    assert got["mps"] is True, out
    return got


def _control(pipe: str, command: str) -> str:
    """One control command to the stand-in daemon behind ``pipe`` (as ``echo CMD | nvidia-cuda-mps-control``)."""
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe)
    done = subprocess.run(
        [sys.executable, "-m", "isolator.simhost.mpscontrol"],
        input=command + "\n",
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=30,
        check=True,
    )
    return done.stdout.strip()


def _uid_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(line for line in fh if line.startswith("Uid:")).split()[1])


def _isolator_errors(cluster: Cluster, mark: int) -> list[str]:
    log = cluster.agents[0].log()[mark:]
    return [line for line in log.splitlines() if line.startswith("E") and "isolator" in line.lower()]


def test_sharers_are_placed_by_user_and_a_fault_ends_exactly_its_gpus_sharers(mesos_home: str, route, cgroups) -> None:
    """One cluster per route and layout (its start is most of a scenario's time): two single-user MPS
    GPUs; root's and nobody's sharers each get a GPU and a server of their own user, a third user is
    refused, then a fault in root's server ends root's sharers and not nobody's."""
    flags = ("--shared-gpus", "4:4:mps,5:4:mps")
    with Cluster(
        mesos_home, gpus=6, resources=f"{BASE};gpu-share-4:8", route=route, cgroups=cgroups, sidecar_flags=flags
    ) as cluster:
        mark = len(cluster.agents[0].log())
        r1 = _sharer(cluster, "root")
        root = _connected(r1)
        n1 = _sharer(cluster, "nobody")
        nobody = _connected(n1)
        assert root["pipe"] != nobody["pipe"], "another user's sharer goes to the other GPU"
        assert (_uid_of(root["server"]), _uid_of(nobody["server"])) == (0, NOBODY)
        r2, n2 = _sharer(cluster, "root"), _sharer(cluster, "nobody")
        assert (_connected(r2)["server"], _connected(n2)["server"]) == (root["server"], nobody["server"])
        for pipe, server in ((root["pipe"], root["server"]), (nobody["pipe"], nobody["server"])):
            assert _control(pipe, "get_server_list").split() == [str(server)], "one server per GPU"

        refused = _sharer(cluster, "daemon")  # uid 1: each MPS GPU serves another user
        update = refused.wait("TASK_FAILED", "TASK_ERROR", timeout=90)
        assert "serves one user at a time" in update.message, update
        # The refusal is the one isolator error: the agent's line says why; criteo's command module
        # adds one of its own for the same prepare (its command's exit), naming no cause.
        errors = [line for line in _isolator_errors(cluster, mark) if "one user at a time" not in line]
        assert len(errors) <= 1 and all("METHOD=prepare] Failed to successfully run" in e for e in errors), errors

        assert _control(root["pipe"], f"sim_fault {root['server']}") == ""
        for task in (r1, r2):
            update = task.wait("TASK_FAILED", "TASK_KILLED", timeout=90)
            assert update.reason == "REASON_CONTAINER_LIMITATION", update
            assert "FAULT" in update.message, update
        for task in (n1, n2):
            assert task.state == "TASK_RUNNING", task.updates()
            assert '"event"' not in task.stdout(), "the other GPU's sharer was told of no fault"
        assert cluster.agents[0].proc is not None and cluster.agents[0].proc.poll() is None, "the agent died"


def test_multiuser_gpu_serves_two_users_sharers_at_once(mesos_home: str, route, cgroups) -> None:
    if (str(route), str(cgroups)) != ("native", "v1"):
        pytest.skip("the multi-user flag is the daemon's, not the route's or the layout's: once, native on v1")
    flags = ("--shared-gpus", "4:4:mps:multiuser")
    with Cluster(
        mesos_home, gpus=5, resources=f"{BASE};gpu-share-4:4", route=route, cgroups=cgroups, sidecar_flags=flags
    ) as cluster:
        mark = len(cluster.agents[0].log())
        root = _connected(_sharer(cluster, "root"))
        nobody = _connected(_sharer(cluster, "nobody"))
        assert root["server"] == nobody["server"], (root, nobody)
        assert (root["uid"], nobody["uid"]) == (0, NOBODY)
        assert _isolator_errors(cluster, mark) == []
