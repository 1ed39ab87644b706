"""Issue 42 item 3 under the real agent: a task group whose short task ended keeps the GPU its
remaining task uses. The agent shrinks the executor's container by one GPU when the short task ends
and our module forwards that Update; the sidecar keeps the GPU on which NVML (the simulated host's,
told the remaining task's real pid) lists the remaining task's process, where the rule that ignores
use would keep the other one (and Mesos's own isolator drops an arbitrary one)."""

from __future__ import annotations

import os
import time

from conftest import probe_command

from isolator.policy.allocator import plan_update
from isolator.policy.fabric import Fabric
from isolator.testing import FakeInventory
from isolator.testing.cluster import Cluster
from isolator.testing.mesoshome import Route
from isolator.testing.scheduler import Framework
from isolator.testing.scheduler import task as task_info

NO_REAPER = ("--reap-interval", "1000000")


def _pid_of_task(task_dir: str) -> int:
    """The probe's process of the task whose sandbox is ``task_dir``, found in /proc by its cwd."""
    want = os.path.realpath(task_dir)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            if not any(a.endswith(b"probe.py") for a in argv):
                continue
            if os.path.realpath(os.readlink(f"/proc/{entry}/cwd")) == want:
                return int(entry)
        except OSError:
            continue
    raise AssertionError(f"no probe process runs in {task_dir}")


def test_a_task_group_whose_short_task_ended_keeps_the_gpu_its_remaining_task_uses(mesos_home: str) -> None:
    with Cluster(mesos_home, gpus=8, route=Route.NATIVE, sidecar_flags=NO_REAPER) as cluster:
        agent = cluster.agents[0]
        assert agent.sidecar is not None

        def held(cid: str) -> set[int]:
            return {i for i, h in agent.holders().items() if h == cid}

        def wait_held(cid: str, count: int, timeout: float = 60) -> set[int]:
            deadline = time.monotonic() + timeout
            while len(held(cid)) != count:
                assert time.monotonic() < deadline, (count, agent.holders())
                time.sleep(0.2)
            return held(cid)

        with Framework(cluster.master_address) as fw:
            fw.launch_group(
                "gi-usage",
                [
                    task_info("long", probe_command(cluster, seconds=300), "cpus:0.1;mem:32;gpus:1"),
                    task_info("short", probe_command(cluster, seconds=20), "cpus:0.1;mem:32;gpus:1"),
                ],
            )
            fw.wait("long", "TASK_RUNNING")
            fw.wait("short", "TASK_RUNNING")
            executor = cluster.find_executor("long")
            assert executor is not None
            cid = executor["container"]
            two = wait_held(cid, 2)
            # What the rule that ignores use keeps; the remaining task runs on the other GPU.
            fabric = Fabric.of(FakeInventory.of_host("dgx-1").topology())
            ignoring_use = plan_update(fabric, two, set(), 1)
            kept_today = set(two) - set(ignoring_use.release)
            (used,) = set(two) - kept_today
            pid = _pid_of_task(os.path.join(executor["directory"], "tasks", "long"))
            agent.sidecar.sim.start_process(used, pid, 512 << 20, sm_util=60)
            fw.wait("short", "TASK_FINISHED", timeout=90)
            assert wait_held(cid, 1) == {used}, f"kept {held(cid)}; the rule that ignores use keeps {kept_today}"
            assert f"drops GPUs [{min(kept_today)}], keeps [{used}]" in agent.sidecar.log()
            agent.sidecar.sim.stop_process(used)
