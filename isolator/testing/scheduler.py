"""A minimal Mesos framework on the v1 scheduler HTTP API, for what mesos-execute cannot do.

mesos-execute launches one task (or one task group) per framework; sending a second task group to
an executor that already runs, which is what makes the agent call the isolators' ``update``, needs a
framework of its own. This one subscribes with ``GPU_RESOURCES``, launches task groups on the
default executor when asked (each on an offer that fits), acknowledges every status update and
records them. JSON over HTTP, RecordIO events (docs: mesos scheduler-http-api).

    with Framework(master) as fw:
        fw.launch_group("ex", [task("t1", "sleep 60", "cpus:0.1;mem:32;gpus:1")])
        fw.wait("t1", "TASK_RUNNING")
        fw.kill("t1")
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

__all__ = ["Framework", "task"]


def _resources(text: str) -> list[dict[str, Any]]:
    out = []
    for part in text.split(";"):
        name, _, value = part.partition(":")
        out.append({"name": name, "type": "SCALAR", "scalar": {"value": float(value)}})
    return out


def task(name: str, command: str, resources: str) -> dict[str, Any]:
    """A TaskInfo (without its agent, set at launch)."""
    return {"name": name, "task_id": {"value": name}, "resources": _resources(resources), "command": {"value": command}}


def _scalar(resources: list[dict[str, Any]], name: str) -> float:
    return sum(r.get("scalar", {}).get("value", 0.0) for r in resources if r["name"] == name)


class Framework:
    def __init__(self, master: str, name: str = "gi-test-framework") -> None:
        self.master = master  # host:port
        self.name = name
        self.framework_id = ""
        self.stream_id = ""
        self.agent_id = ""
        self.statuses: dict[str, list[dict[str, Any]]] = {}
        self._cond = threading.Condition()
        self._pending: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []  # (executor, tasks)
        self._conn: http.client.HTTPConnection | None = None
        self._thread: threading.Thread | None = None
        self._closing = False

    # ---- life cycle ----

    def __enter__(self) -> Framework:
        host, _, port = self.master.partition(":")
        self._conn = http.client.HTTPConnection(host, int(port), timeout=None)
        body = {
            "type": "SUBSCRIBE",
            "subscribe": {
                "framework_info": {
                    "user": "root",
                    "name": self.name,
                    "checkpoint": True,
                    "capabilities": [{"type": "GPU_RESOURCES"}],
                }
            },
        }
        self._conn.request(
            "POST",
            "/api/v1/scheduler",
            json.dumps(body),
            {"Content-Type": "application/json", "Accept": "application/json"},
        )
        resp = self._conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"SUBSCRIBE: HTTP {resp.status}: {resp.read()[:500]!r}")
        self.stream_id = resp.getheader("Mesos-Stream-Id") or ""
        self._thread = threading.Thread(target=self._events, args=(resp,), daemon=True)
        self._thread.start()
        with self._cond:
            self._cond.wait_for(lambda: bool(self.framework_id), timeout=60)
        if not self.framework_id:
            raise RuntimeError("no SUBSCRIBED event within 60 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing = True
        if self.framework_id:
            try:
                self._call({"type": "TEARDOWN"})
            except OSError:
                pass
        if self._conn is not None:
            self._conn.close()

    # ---- calls ----

    def _call(self, body: dict[str, Any]) -> None:
        host, _, port = self.master.partition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            body = {"framework_id": {"value": self.framework_id}, **body}
            headers = {"Content-Type": "application/json", "Mesos-Stream-Id": self.stream_id}
            conn.request("POST", "/api/v1/scheduler", json.dumps(body), headers)
            resp = conn.getresponse()
            data = resp.read()
            if resp.status not in (200, 202):
                raise RuntimeError(f"{body['type']}: HTTP {resp.status}: {data[:500]!r}")
        finally:
            conn.close()

    def launch_group(
        self, executor_id: str, tasks: list[dict[str, Any]], executor_resources: str = "cpus:0.1;mem:32;disk:32"
    ) -> None:
        """Launch ``tasks`` as one group on the default executor ``executor_id`` at the next offer
        that fits them (the executor's resources count only at its first launch)."""
        executor = {
            "type": "DEFAULT",
            "executor_id": {"value": executor_id},
            "framework_id": {"value": self.framework_id},
            "resources": _resources(executor_resources),
        }
        with self._cond:
            self._pending.append((executor, tasks))
        self._call({"type": "REVIVE"})

    def kill(self, task_id: str) -> None:
        self._call({"type": "KILL", "kill": {"task_id": {"value": task_id}, "agent_id": {"value": self.agent_id}}})

    def wait(self, task_id: str, state: str, timeout: float = 90) -> dict[str, Any]:
        """The first status of ``task_id`` in ``state``; AssertionError on another terminal state."""

        def seen() -> dict[str, Any] | None:
            for status in self.statuses.get(task_id, []):
                if status["state"] == state:
                    return status
                if status["state"] in ("TASK_FAILED", "TASK_ERROR", "TASK_LOST", "TASK_DROPPED", "TASK_KILLED"):
                    raise AssertionError(f"task {task_id} ended {status} waiting for {state}")
            return None

        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = seen()
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout:g} s waiting for {task_id} to reach {state}")
                self._cond.wait(left)

    # ---- events ----

    def _events(self, resp: http.client.HTTPResponse) -> None:
        try:
            while not self._closing:
                line = resp.readline()
                if not line:
                    return
                size = int(line.strip())
                event = json.loads(resp.read(size))
                self._handle(event)
        except (OSError, ValueError, RuntimeError):
            return  # the master closed the stream (teardown) or refused a call: no more events
        except AttributeError:
            # http.client's reader, when close() took its file from under it (teardown).
            if not self._closing:
                raise

    def _handle(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "SUBSCRIBED":
            with self._cond:
                self.framework_id = event["subscribed"]["framework_id"]["value"]
                self._cond.notify_all()
        elif kind == "OFFERS":
            for offer in event["offers"].get("offers", []):
                self._offer(offer)
        elif kind == "UPDATE":
            status = event["update"]["status"]
            with self._cond:
                self.statuses.setdefault(status["task_id"]["value"], []).append(status)
                self._cond.notify_all()
            if "uuid" in status:
                self._call(
                    {
                        "type": "ACKNOWLEDGE",
                        "acknowledge": {
                            "agent_id": status["agent_id"],
                            "task_id": status["task_id"],
                            "uuid": status["uuid"],
                        },
                    }
                )

    def _offer(self, offer: dict[str, Any]) -> None:
        with self._cond:
            pending = self._pending.pop(0) if self._pending else None
        offer_id = {"value": offer["id"]["value"]}
        if pending is None:
            self._call({"type": "DECLINE", "decline": {"offer_ids": [offer_id], "filters": {"refuse_seconds": 1}}})
            return
        executor, tasks = pending
        self.agent_id = offer["agent_id"]["value"]
        need = {n: sum(_scalar(t["resources"], n) for t in tasks) for n in ("cpus", "mem", "disk", "gpus")}
        have = {n: _scalar(offer["resources"], n) for n in need}
        if any(have[n] < need[n] for n in need):
            with self._cond:
                self._pending.insert(0, pending)
            self._call({"type": "DECLINE", "decline": {"offer_ids": [offer_id], "filters": {"refuse_seconds": 0.2}}})
            return
        group = [dict(t, agent_id={"value": self.agent_id}) for t in tasks]
        operation = {"type": "LAUNCH_GROUP", "launch_group": {"executor": executor, "task_group": {"tasks": group}}}
        self._call(
            {
                "type": "ACCEPT",
                "accept": {"offer_ids": [offer_id], "operations": [operation], "filters": {"refuse_seconds": 1}},
            }
        )
