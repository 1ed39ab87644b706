"""``FakeMps``: MPS control daemons in memory (isolator.core.ports.MpsDaemons), with fault points.

Each GPU UUID has a daemon or not. A daemon knows and answers what the stand-in's does, from the
same model (simhost/mpsmodel.py: defaults, servers per uid, clients and their limits, users queueing,
FAULT via ``sim_fault``), with numbers for server pids. ``kill`` ends one behind the core's back (a
crash of the real daemon), ``faults`` fails a step (start, command, alive, stop) with the edge's
MpsError, ``commands`` keeps every control command sent, per GPU, as the stand-in's control.log does,
and ``connect`` plays an MPS client of a given pid and uid.
"""

from __future__ import annotations

import itertools
import threading

from isolator.host.mps import MpsError
from isolator.simhost import mpsmodel
from isolator.testing.faults import Faults

MISSING = "Cannot find MPS control daemon process"


class _Server:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.running = True

    def alive(self) -> bool:
        return self.running

    def stop(self) -> None:
        self.running = False


class FakeClient:
    """An MPS client as the model sees it; ``said`` holds what its daemon told it, line by line."""

    def __init__(self, fake: FakeMps, uuid: str, client: mpsmodel.Client, outcome: str) -> None:
        self._fake, self.uuid, self.client, self.outcome = fake, uuid, client, outcome
        self.said: list[str] = []

    @property
    def pid(self) -> int:
        return self.client.pid

    @property
    def server(self) -> int:
        return self.client.server

    @property
    def threads(self) -> float:
        return self.client.threads

    @property
    def pinned(self) -> int | None:
        return self.client.pinned

    def exit(self) -> None:
        self._fake.disconnect(self.uuid, self.pid)


class FakeMps:
    def __init__(self, root: str = "/fake/mps") -> None:
        self.root = root
        self._lock = threading.RLock()
        self._daemons: dict[str, mpsmodel.Daemon] = {}
        self._pids: dict[str, int] = {}
        self._next = itertools.count(5000)
        self.starts: dict[str, int] = {}
        self.multiuser_of: dict[str, bool] = {}  # how each GPU's daemon was last started
        self.commands: dict[str, list[str]] = {}
        self.logs: dict[str, list[str]] = {}
        # Settings a broken daemon answers but does not take (a command's first word): a percentage is
        # echoed as the value in force, a pinned limit answered with nothing, as the real one answers.
        self.ignored: set[str] = set()
        self.faults = Faults(lambda step, cid: MpsError(op=step, gpu="?", path="fake", cause="injected fault"))

    def pipe_dir(self, uuid: str) -> str:
        return f"{self.root}/{uuid}/pipe"

    def start(self, uuid: str, multiuser: bool = False) -> int:
        self.faults.check("start")
        with self._lock:
            if uuid in self._pids:
                raise MpsError(op="start", gpu=uuid, path="fake", cause="An instance of this daemon is already running")
            pid = self._pids[uuid] = next(self._next)
            self._daemons[uuid] = mpsmodel.Daemon(
                uuid,
                lambda uid: _Server(next(self._next)),
                lambda name, line: self.logs.setdefault(uuid, []).append(f"{name}: {line}"),
                multiuser=multiuser,
            )
            self.starts[uuid] = self.starts.get(uuid, 0) + 1
            self.multiuser_of[uuid] = multiuser
            return pid

    def command(self, uuid: str, text: str, peer_uid: int = 0) -> str:
        self.faults.check("command")
        with self._lock:
            daemon = self._daemons.get(uuid)
            if daemon is None:
                raise MpsError(op=f"send '{text}' to", gpu=uuid, path="fake", cause=MISSING)
            self.commands.setdefault(uuid, []).append(text)
            words = text.split()
            if words and words[0] in self.ignored:
                return daemon.threads if "percentage" in words[0] else ""
            reply = daemon.command(text, peer_uid=peer_uid)
            self._reap(uuid)
            return reply

    def alive(self, uuid: str) -> bool:
        self.faults.check("alive")
        with self._lock:
            return uuid in self._pids

    def pid(self, uuid: str) -> int | None:
        with self._lock:
            return self._pids.get(uuid)

    def multiuser(self, uuid: str) -> bool | None:
        with self._lock:
            return self.multiuser_of.get(uuid) if uuid in self._pids else None

    def stop(self, uuid: str) -> None:
        """``quit``, then the kill the edge does when clients keep it waiting."""
        self.faults.check("stop")
        with self._lock:
            if uuid in self._pids:
                self.commands.setdefault(uuid, []).append("quit")
                self._daemons[uuid].stop_all()
                self._forget(uuid)

    def _reap(self, uuid: str) -> None:
        daemon = self._daemons.get(uuid)
        if daemon is not None and daemon.quitting and not daemon.clients():
            daemon.stop_all()
            self._forget(uuid)

    def _forget(self, uuid: str) -> None:
        del self._pids[uuid]
        del self._daemons[uuid]

    # ---- for tests ----------------------------------------------------------------------------------

    def running(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._pids)

    def kill(self, uuid: str) -> None:
        """The daemon dies behind the core's back (its servers with it)."""
        with self._lock:
            if uuid in self._pids:
                self._daemons[uuid].stop_all()
                self._forget(uuid)

    def daemon(self, uuid: str) -> mpsmodel.Daemon:
        """The model of the GPU's running daemon (servers, clients) for a test to look at."""
        with self._lock:
            return self._daemons[uuid]

    def connect(self, uuid: str, pid: int, uid: int, env: dict[str, str] | None = None) -> FakeClient:
        """An MPS client of ``pid`` running as ``uid`` connects with ``env`` (its CUDA_MPS_* variables);
        its ``outcome``: ready, pending (another uid's server holds the GPU) or refused (FAULT)."""
        with self._lock:
            daemon = self._daemons.get(uuid)
            if daemon is None:
                raise MpsError(op="connect to", gpu=uuid, path="fake", cause=MISSING)
            said: list[str] = []
            client = mpsmodel.Client(pid, uid, dict(env or {}), said.append, command="fake", namespace="0")
            outcome = daemon.connect(client)
            fake = FakeClient(self, uuid, client, outcome)
            fake.said = said
            if outcome == "ready":
                said.append(daemon.ready_line(client))
            elif outcome == "pending":
                daemon.tick()
            return fake

    def disconnect(self, uuid: str, pid: int) -> None:
        """A client exits (or is killed)."""
        with self._lock:
            daemon = self._daemons.get(uuid)
            if daemon is not None:
                daemon.disconnect(pid)
                self._reap(uuid)
