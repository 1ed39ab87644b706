"""Issue 33's stale prepare under the real agent: the sidecar stopped past the caller's deadline.

The agent's prepare gives up while the sidecar is stopped; the agent fails the task and runs cleanup,
which waits for the sidecar; the sidecar is continued. Before, it ran that cleanup first and then the
stale prepare, booking two GPUs for a container that no longer existed, so the next task asking for
every GPU failed. Through each route: criteo's command module running our bridge (which sends its
absolute deadline in the bridge protocol) and our own module (which sends it as gRPC metadata,
``gpu-isolator-deadline-ms``, beside gRPC's relative one that a stopped server would count afresh).
On our module's route the stale Prepare never reaches a handler (seen in the sidecar's debug log): the
module cancels the call at its deadline, and the continued sidecar reads the cancellation with the
call. The absolute deadline is for a call read before the stop and queued behind others, which
tests/system/test_stale_hooks.py makes happen; here what is asserted is what the agent and the next
task see.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable

import pytest
from conftest import probe

from isolator.bridge.command import TIMEOUT_ENV
from isolator.testing.cluster import Cluster
from isolator.testing.mesoshome import Route


def running(command: str) -> bool:
    """Whether a process whose command line names ``command`` runs now (the agent's hook child)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if command.encode() in argv:
            return True
    return False


def until(predicate: Callable[[], bool], what: str, budget: float = 120.0) -> None:
    deadline = time.monotonic() + budget
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def test_a_prepare_that_gave_up_while_the_sidecar_was_stopped_books_nothing(
    mesos_home: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bridge gives up after 8 s instead of 25 (the agent's environment is its commands').
    monkeypatch.setenv(TIMEOUT_ENV, "8")
    with Cluster(mesos_home) as cluster:
        agent = cluster.agents[0]
        sidecar = agent.sidecar
        assert sidecar is not None and sidecar.proc is not None
        cleanup = os.path.join(agent.bin_dir, "gpu-isolator-cleanup")
        with sidecar.frozen():
            task = probe(cluster, gpus=2)
            # The prepare gives up (exit 4), the agent destroys the container: its cleanup waits for us.
            until(lambda: running(cleanup), "the agent's cleanup after the failed prepare")
        update = task.wait("TASK_FAILED", timeout=120)
        assert "no answer from the sidecar" in update.message, update
        task.wait_gone()

        def settled() -> str:
            with open(sidecar.log_path) as fh:
                lines = [ln for ln in fh if "bridge prepare refused" in ln or "prepared container" in ln]
            return lines[0] if lines else ""

        until(lambda: bool(settled()), "the sidecar answered the stale prepare")
        assert "not run: its caller's deadline passed" in settled(), settled()
        assert all(holder == "" for holder in agent.holders().values()), agent.holders()
        # Every GPU is free for the next task (the gpus:7 failed here).
        big = probe(cluster, gpus=8)
        big.wait("TASK_FINISHED", timeout=120)


def test_a_prepare_our_module_gave_up_on_while_the_sidecar_was_stopped_books_nothing(mesos_home: str) -> None:
    cluster = Cluster(mesos_home, route=Route.NATIVE)
    cluster.module_params = {"prepare_timeout": "8secs"}
    with cluster:
        agent = cluster.agents[0]
        sidecar = agent.sidecar
        assert sidecar is not None
        mark = len(agent.log())
        with sidecar.frozen():
            task = probe(cluster, gpus=2)
            # The module gives up after 8 s and says so; the agent then destroys the container, whose
            # cleanup (forwarded after the failed prepare, in order) waits for the sidecar.
            until(
                lambda: "gpu-isolator Prepare: DEADLINE_EXCEEDED" in agent.log()[mark:], "the module's prepare gave up"
            )
            until(lambda: "from PREPARING to DESTROYING" in agent.log()[mark:], "the agent destroying the container")
        update = task.wait("TASK_FAILED", timeout=120)
        assert "gpu-isolator Prepare: DEADLINE_EXCEEDED: no answer from the sidecar" in update.message, update
        assert "within 8secs" in update.message, update
        task.wait_gone()
        started = re.search(r"Starting container (\S+)", agent.log()[mark:])
        assert started is not None
        with open(sidecar.log_path) as fh:  # the whole log (Sidecar.log() is its tail)
            assert f"prepared container {started.group(1)}" not in fh.read()
        assert all(holder == "" for holder in agent.holders().values()), agent.holders()
        # Every GPU is free for the next task.
        big = probe(cluster, gpus=8)
        big.wait("TASK_FINISHED", timeout=120)
