"""A task (or task group) launched through mesos-execute, and what the agent shows of it.

Its status updates (mesos-execute's own output), sandbox, container ID, cgroups and devices (the
agent's ``/state`` and the kernel), and a DEBUG container below its executor. Launches nothing itself
(``Cluster.submit`` does).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from isolator.testing.agent import Agent
from isolator.testing.mesoshome import TERMINAL, get_json, read_lines, wait_for

__all__ = ["Task", "TaskCluster", "Update"]


class TaskCluster(Protocol):
    """What a task reads of its cluster (``Cluster`` is the one; this module does not import it)."""

    @property
    def master_address(self) -> str: ...

    def check_agents(self) -> None: ...

    def find_executor(self, task: str) -> dict[str, Any] | None: ...

    def agent_of(self, agent_id: str) -> Agent: ...


@dataclass
class Update:
    """One status update as mesos-execute printed it."""

    state: str
    message: str = ""
    reason: str = ""
    source: str = ""


@dataclass
class Task:
    """A task (or a task group: ``name`` is the group's first task) submitted through mesos-execute."""

    cluster: TaskCluster
    name: str
    proc: subprocess.Popen[str]
    log_path: str
    names: tuple[str, ...] = ()
    submitted_at: float = 0.0  # time.time() when mesos-execute was started

    def status_times(self) -> dict[str, float]:
        """State -> the agent's timestamp (time.time() seconds) of this task's first update in that
        state, from the master's /master/tasks: finer than polling mesos-execute's output."""
        data = get_json(f"http://{self.cluster.master_address}/master/tasks?limit=100000", 10)
        out: dict[str, float] = {}
        for task in data.get("tasks", []):
            if task.get("id") == self.name:
                for status in task.get("statuses", []):
                    out.setdefault(str(status["state"]), float(status["timestamp"]))
        return out

    def updates(self) -> list[Update]:
        """Every status update so far, in order, for this task (its first one for a group)."""
        with open(self.log_path, errors="replace") as fh:
            text = fh.read()
        out: list[Update] = []
        for line in text.splitlines():
            m = re.match(r"Received status update (TASK_\w+) for task '([^']*)'", line.strip())
            if m:
                if m.group(2) == self.name:
                    out.append(Update(m.group(1)))
                continue
            if not out:
                continue
            m = re.match(r"(message|reason|source): '?(.*?)'?$", line.strip())
            if m and not getattr(out[-1], m.group(1)):
                setattr(out[-1], m.group(1), m.group(2))
        return out

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()

    @property
    def state(self) -> str | None:
        updates = self.updates()
        return updates[-1].state if updates else None

    def wait(self, *states: str, timeout: float = 90) -> Update:
        """The first update in ``states``; AssertionError when a different terminal state comes first."""

        def seen() -> Update | None:
            self.cluster.check_agents()
            for update in self.updates():
                if update.state in states:
                    return update
                if update.state in TERMINAL:
                    raise AssertionError(f"task {self.name} ended {update} waiting for {states}; log:\n{self.log()}")
            return None

        try:
            found = wait_for(f"{self.name} to reach {states}", seen, timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; mesos-execute said:\n{self.log()[-3000:]}") from None
        return self._settled(found)

    def _settled(self, found: Update, quiet: float = 0.1, longest: float = 2.0) -> Update:
        """``found`` whole: mesos-execute prints an update's state, message, source and reason on lines
        of their own, each flushed, so a read between them saw the state and message without the
        reason (make test-mesos under load: a TASK_FAILED with its limitation's message and reason '').
        An update followed by another is whole; the last one is read again once the log has not grown
        for ``quiet`` seconds (at most ``longest``)."""
        updates = self.updates()
        index = next((i for i, u in enumerate(updates) if u.state == found.state), None)
        if index is None or index < len(updates) - 1:
            return found if index is None else updates[index]
        deadline = time.monotonic() + longest
        size = os.path.getsize(self.log_path)
        while time.monotonic() < deadline:
            time.sleep(quiet)
            grown = os.path.getsize(self.log_path)
            if grown == size:
                break
            size = grown
        return self.updates()[index]

    def teardown(self) -> None:
        """Tear down the task's framework (one per mesos-execute) at the master: the agent kills its
        executor; mesos-execute exits without a last update (use ``kill_after`` for TASK_KILLED)."""
        framework = self.executor()["framework_id"]
        req = urllib.request.Request(
            f"http://{self.cluster.master_address}/master/teardown",
            data=f"frameworkId={framework}".encode(),
            method="POST",
        )
        urllib.request.urlopen(req, timeout=10).close()

    def wait_gone(self, timeout: float = 60) -> dict[str, Any]:
        """Wait until the agent lists the task's executor as completed (its container destroyed)."""

        def gone() -> dict[str, Any] | None:
            ex = self.cluster.find_executor(self.name)
            return ex if ex is not None and ex.get("completed") else None

        return wait_for(f"the executor of {self.name} to complete", gone, timeout)

    def executor(self) -> dict[str, Any]:
        """The agent's record of this task's executor: ``container`` (ID), ``directory``, ``framework_id``."""
        return wait_for(f"the executor of {self.name}", lambda: self.cluster.find_executor(self.name), 60)

    def agent(self) -> Agent:
        return self.cluster.agent_of(self.executor()["agent_id"])

    def container_id(self) -> str:
        return str(self.executor()["container"])

    def sandbox(self, task: str | None = None) -> str:
        """The executor's sandbox; a nested task's (``task`` of a group) below it under tasks/."""
        directory = str(self.executor()["directory"])
        return os.path.join(directory, "tasks", task) if task else directory

    def stdout(self, task: str | None = None) -> str:
        path = os.path.join(self.sandbox(task), "stdout")
        with open(path, errors="replace") as fh:
            return fh.read()

    def wait_stdout(self, pattern: str, task: str | None = None, timeout: float = 60) -> str:
        def found() -> str | None:
            with contextlib.suppress(OSError):
                text = self.stdout(task)
                if re.search(pattern, text):
                    return text
            return None

        return wait_for(f"{pattern!r} in the stdout of {task or self.name}", found, timeout)

    def cgroup(self, *nested: str) -> str:
        """The task's container cgroup in the devices hierarchy (``nested``: child container IDs);
        on v2 the container's non-leaf cgroup ``<root>/<id>``, the device manager's."""
        parts = [self.container_id()]
        for child in nested:
            parts += ["mesos", child]
        return os.path.join(self.agent().cgroups_mount(), self.agent().cgroups_root, *parts)

    def leaf(self, *nested: str) -> str:
        """v2: ``<root>/<id>/leaf`` (``.../mesos/<child>/leaf``), where the processes are (and ours)."""
        return os.path.join(self.cgroup(*nested), "leaf")

    def debug(self, command: str, timeout: float = 120) -> tuple[str, str]:
        """Run ``command`` in a DEBUG container below the task's executor (the agent's
        LAUNCH_NESTED_CONTAINER_SESSION, what ``mesos task exec`` does) and return its
        ``(container ID, stdout)``: the session streams its output as RecordIO and ends with it."""
        child = str(uuid.uuid4())
        call = {
            "type": "LAUNCH_NESTED_CONTAINER_SESSION",
            "launch_nested_container_session": {
                "container_id": {"parent": {"value": self.container_id()}, "value": child},
                "command": {"shell": True, "value": command},
            },
        }
        req = urllib.request.Request(
            f"http://{self.agent().address}/api/v1",
            data=json.dumps(call).encode(),
            headers={
                "Content-Type": "application/json",
                "Accept": "application/recordio",
                "Message-Accept": "application/json",
            },
            method="POST",
        )
        out = []
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            stream = resp.read()
        while stream:
            size, _, rest = stream.partition(b"\n")
            record, stream = rest[: int(size)], rest[int(size) :]
            message = json.loads(record)
            data = message.get("data", {})
            if message.get("type") == "DATA" and data.get("type") == "STDOUT":
                out.append(base64.b64decode(data.get("data", "")).decode(errors="replace"))
        return child, "".join(out)

    def devices_list(self, *nested: str) -> list[str]:
        """The kernel's devices.list of the task's cgroup, one rule per entry."""
        return read_lines(os.path.join(self.cgroup(*nested), "devices.list"))
