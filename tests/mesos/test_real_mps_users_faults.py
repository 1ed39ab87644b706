"""MPS users and faults under a real Mesos master and agent, on every route and cgroup layout (issue 41
items 3 and 4; docs/sharing.md, "Users" and "Faults").

Each sharer runs the simulated host's stand-in MPS client, which connects to its GPU's stand-in
control daemon as a CUDA process does and prints the server it was given. A task's Unix user is the
``user`` of its CommandInfo, which the agent hands to the isolator in the container's config.

- Users: on a single-user MPS GPU a sharer of another user is refused while the GPU has sharers (the
  agent's message says why), a sharer of the same user joins the same server, and once the GPU is
  empty the other user gets a server of its own, run as that user. With ``:multiuser`` both users'
  sharers are served at once by one server.
- Faults: a fatal fault in one GPU's MPS server ends exactly that GPU's sharers with a limitation
  naming it; the sharer of the other MPS GPU keeps running, never told of a fault.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

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


def test_one_user_per_mps_server_and_another_user_waits_for_an_empty_gpu(mesos_home: str, route, cgroups) -> None:
    flags = ("--shared-gpus", "4:4:mps")
    with Cluster(
        mesos_home, gpus=5, resources=f"{BASE};gpu-share-4:4", route=route, cgroups=cgroups, sidecar_flags=flags
    ) as cluster:
        mark = len(cluster.agents[0].log())
        first = _sharer(cluster, "root")
        got = _connected(first)
        server = got["server"]
        assert _uid_of(server) == 0

        refused = _sharer(cluster, "nobody")
        update = refused.wait("TASK_FAILED", "TASK_ERROR", timeout=90)
        assert "serves one user at a time" in update.message and "uid 0" in update.message, update
        refused.wait_gone()

        same = _connected(_sharer(cluster, "root"))
        assert (same["server"], same["pipe"]) == (server, got["pipe"]), "the same user's sharer joins its server"
        listed = _control(got["pipe"], "get_server_list").split()
        assert listed == [str(server)], listed

        # Only the refusal above may have been logged as an error.
        errors = _isolator_errors(cluster, mark)
        assert all("one user at a time" in line for line in errors), errors

        for task in list(cluster.tasks):
            task.teardown()
        for task in (first,):
            task.wait_gone()
        # The GPU is empty: nobody's sharer gets a server of its own, run as nobody.
        later = _sharer(cluster, "nobody")
        theirs = _connected(later)
        assert theirs["uid"] == NOBODY and _uid_of(theirs["server"]) == NOBODY, theirs
        assert theirs["server"] != server


def test_multiuser_gpu_serves_two_users_sharers_at_once(mesos_home: str, route, cgroups) -> None:
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


def test_a_fault_ends_exactly_that_gpus_sharers(mesos_home: str, route, cgroups) -> None:
    flags = ("--shared-gpus", "4:4:mps,5:4:mps", "--share-placement", "spread")
    with Cluster(
        mesos_home, gpus=6, resources=f"{BASE};gpu-share-4:8", route=route, cgroups=cgroups, sidecar_flags=flags
    ) as cluster:
        tasks = [_sharer(cluster, "root") for _ in range(3)]
        got = {task.name: _connected(task) for task in tasks}
        pipes = sorted({g["pipe"] for g in got.values()})
        assert len(pipes) == 2, f"spread puts the first two sharers on different GPUs: {got}"
        faulted = got[tasks[0].name]["pipe"]
        victims = [t for t in tasks if got[t.name]["pipe"] == faulted]
        bystanders = [t for t in tasks if got[t.name]["pipe"] != faulted]
        assert victims and bystanders

        server = got[tasks[0].name]["server"]
        assert _control(faulted, f"sim_fault {server}") == ""
        for task in victims:
            update = task.wait("TASK_FAILED", "TASK_KILLED", timeout=90)
            assert update.reason == "REASON_CONTAINER_LIMITATION", update
            assert "FAULT" in update.message, update
        for task in bystanders:
            assert task.state() == "TASK_RUNNING", task.updates()
            assert '"event"' not in task.stdout(), "the other GPU's sharer was told of no fault"
        assert cluster.agents[0].proc is not None and cluster.agents[0].proc.poll() is None, "the agent died"
