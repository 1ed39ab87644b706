"""``FakeMps``: MPS control daemons in memory (isolator.core.ports.MpsDaemons), with fault points.

Each GPU UUID has a daemon or not; ``kill`` ends one behind the core's back (a crash of the real
daemon), ``faults`` fails a step (start, command, alive, stop) with the edge's MpsError, and
``commands`` keeps every control command sent, per GPU, as the stand-in's control.log does.
"""

from __future__ import annotations

import itertools
import threading

from isolator.host.mps import MpsError
from isolator.testing.faults import Faults


class FakeMps:
    def __init__(self, root: str = "/fake/mps") -> None:
        self.root = root
        self._lock = threading.Lock()
        self._pids: dict[str, int] = {}
        self._next = itertools.count(5000)
        self.starts: dict[str, int] = {}
        self.commands: dict[str, list[str]] = {}
        self.faults = Faults(lambda step, cid: MpsError(op=step, gpu="?", path="fake", cause="injected fault"))

    def pipe_dir(self, uuid: str) -> str:
        return f"{self.root}/{uuid}/pipe"

    def start(self, uuid: str) -> int:
        self.faults.check("start")
        with self._lock:
            if uuid in self._pids:
                raise MpsError(op="start", gpu=uuid, path="fake", cause="An instance of this daemon is already running")
            pid = self._pids[uuid] = next(self._next)
            self.starts[uuid] = self.starts.get(uuid, 0) + 1
            return pid

    def command(self, uuid: str, text: str) -> str:
        self.faults.check("command")
        with self._lock:
            if uuid not in self._pids:
                raise MpsError(op=f"send '{text}' to", gpu=uuid, path="fake", cause="Cannot find MPS control daemon")
            self.commands.setdefault(uuid, []).append(text)
            if text == "quit":
                del self._pids[uuid]
            return ""

    def alive(self, uuid: str) -> bool:
        self.faults.check("alive")
        with self._lock:
            return uuid in self._pids

    def stop(self, uuid: str) -> None:
        self.faults.check("stop")
        with self._lock:
            if uuid in self._pids:
                self.commands.setdefault(uuid, []).append("quit")
                del self._pids[uuid]

    # ---- for tests ----------------------------------------------------------------------------------

    def running(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._pids)

    def kill(self, uuid: str) -> None:
        """The daemon dies behind the core's back."""
        with self._lock:
            self._pids.pop(uuid, None)
