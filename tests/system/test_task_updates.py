"""The harness's reading of mesos-execute's status updates (isolator/testing/task.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

from isolator.testing.task import Task


class _QuietCluster:
    """What ``Task.wait`` asks of its cluster: only that its agents still run."""

    def check_agents(self) -> None:
        return None


def test_wait_returns_an_update_whole_though_mesos_execute_printed_its_lines_apart(tmp_path: Any) -> None:
    # Seen in make test-mesos under load: a TASK_FAILED read between its lines, with the limitation's
    # message and source but reason '' (mesos-execute flushes each line of an update on its own).
    log = tmp_path / "execute.log"
    log.write_text(
        "Received status update TASK_RUNNING for task 't'\n  source: SOURCE_EXECUTOR\n"
        "Received status update TASK_FAILED for task 't'\n"
        "  message: 'container c holds a GPU that became unhealthy'\n  source: SOURCE_AGENT\n"
    )

    def rest() -> None:
        time.sleep(0.05)
        with open(log, "a") as fh:
            fh.write("  reason: REASON_CONTAINER_LIMITATION\n")

    writer = threading.Thread(target=rest)
    writer.start()
    try:
        task = Task(_QuietCluster(), "t", None, str(log))  # type: ignore[arg-type]
        update = task.wait("TASK_FAILED", timeout=5)
    finally:
        writer.join()
    assert (update.state, update.source) == ("TASK_FAILED", "SOURCE_AGENT")
    assert update.reason == "REASON_CONTAINER_LIMITATION"
    assert update.message == "container c holds a GPU that became unhealthy"
    # An update with another after it is whole already: no wait.
    started = time.monotonic()
    assert task.wait("TASK_RUNNING").source == "SOURCE_EXECUTOR"
    assert time.monotonic() - started < 0.1
