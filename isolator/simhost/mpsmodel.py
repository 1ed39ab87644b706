"""What an MPS control daemon knows and answers, as the real one of driver 580 does
(docs/gpu-host-results.md, "MPS control daemon on driver 580"): defaults, servers (one per Unix uid
at a time, or one for all with ``-multiuser-server``), their clients and limits, users queueing, FAULT.

Pure state, no sockets and no processes: the stand-in daemon (simhost/mpscontrol.py) drives it over
its control socket with real server processes, ``FakeMps`` (testing/mps.py) drives it in memory.
Replies the real run did not show are marked "not measured" where they are made.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

ACTIVE = "ACTIVE"
FAULT = "FAULT"

# CUDA driver API results a client sees (cuda.h): a sticky fault of its server, refused while the
# server tears down after one, and terminated by ``terminate_client``.
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_MPS_SERVER_NOT_READY = 807
CUDA_ERROR_MPS_CLIENT_TERMINATED = 809

ENV_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_PINNED = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"

# Messages to a connected client (one line each): its server faulted, it was terminated, its server
# is gone (quit, killed).
TO_CLIENT_FAULT = f"FAULT {CUDA_ERROR_ILLEGAL_ADDRESS}"
TO_CLIENT_TERMINATED = f"TERMINATED {CUDA_ERROR_MPS_CLIENT_TERMINATED}"
TO_CLIENT_EXIT = "EXIT"

NO_SERVER = "Server not found"  # measured for ``ps`` with no server; also said for an unknown server pid
PID_REQUIRED = "A server PID is required"  # measured for ``get_server_status`` without a pid
PRIVILEGES = (
    "Insufficient privileges for UID {uid}. Control deamon settings can only be modified by the user"
    " who started it or by the root user."
)  # the binary's string (spelling as in it); which commands it guards was not measured

_UNITS = {"": 1 << 20, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_LIMIT = re.compile(r"^(\d+)([KMGT]?)$", re.IGNORECASE)


def percentage(text: str, current: str) -> str:
    """``text`` as the daemon keeps a thread percentage (``25.0``), or ``current`` when it is not one:
    outside (0, 100] or not a number is no error, the value in force is echoed (measured)."""
    try:
        value = float(text)
    except ValueError:
        return current
    return f"{value:.1f}" if 0 < value <= 100 else current


def limit_text(text: str) -> str | None:
    """A pinned memory limit as the daemon answers it back (``2G``; a bare number is MiB: ``2`` ->
    ``2M``, measured), None when it is not one (not measured: the stand-in refuses it)."""
    match = _LIMIT.match(text)
    if not match:
        return None
    return f"{int(match.group(1))}{(match.group(2) or 'M').upper()}"


def limit_bytes(text: str) -> int:
    match = _LIMIT.match(text)
    if not match:
        raise ValueError(f"not a pinned memory limit: {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def env_pinned(text: str | None, device: str = "0") -> int | None:
    """The bytes ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``0=1G,1=512M``) asks for ``device``; None when
    it says nothing valid about it (then it does not constrain)."""
    for item in (text or "").split(","):
        dev, sep, value = item.strip().partition("=")
        if sep and dev.strip() == device and _LIMIT.match(value.strip()):
            return limit_bytes(value.strip())
    return None


def env_threads(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return value if 0 < value <= 100 else None


class ServerProcess(Protocol):
    """One ``nvidia-cuda-mps-server``: a real process in the stand-in, a number in FakeMps."""

    pid: int

    def alive(self) -> bool: ...

    def stop(self) -> None: ...


@dataclass
class Client:
    pid: int
    uid: int
    env: dict[str, str]
    notify: Callable[[str], None]  # one line to the client's connection
    id: int = 0
    server: int = 0  # its server's pid, 0 while pending
    threads: float = 100.0  # what it got: min(server, its own environment)
    pinned: int | None = None  # bytes on device 0, None = no limit
    command: str = ""
    namespace: str = ""


@dataclass
class Server:
    process: ServerProcess
    uid: int
    threads: str
    pinned: dict[str, str]
    status: str = ACTIVE
    clients: dict[int, Client] = field(default_factory=dict)  # by client pid

    @property
    def pid(self) -> int:
        return self.process.pid


class Daemon:
    """One control daemon's state. ``spawn(uid)`` starts a server process for ``uid``; ``log(file,
    line)`` writes to ``control.log``/``server.log``. Call ``tick()`` after anything changes (a
    client gone, a server's last client gone): it starts queued users' servers and recovers faults."""

    def __init__(
        self,
        device: str,
        spawn: Callable[[int], ServerProcess],
        log: Callable[[str, str], None],
        owner_uid: int = 0,
        multiuser: bool = False,
    ) -> None:
        self.device = device  # CUDA_VISIBLE_DEVICES of the daemon: its one GPU's UUID
        self.spawn = spawn
        self.log = log
        self.owner_uid = owner_uid
        self.multiuser = multiuser
        self.threads = "100.0"
        self.pinned: dict[str, str] = {}
        self.priority = "0"
        self.servers: dict[int, Server] = {}  # by server pid
        self.pending: list[Client] = []  # clients of a uid whose server cannot start yet
        self.wanted: list[int] = []  # uids asked by start_server while another uid's server runs
        self.quitting = False
        self._ids = itertools.count(1)

    # ---- clients ---------------------------------------------------------------------------------

    def _server_for(self, uid: int) -> Server | None:
        for server in self.servers.values():
            if self.multiuser or server.uid == uid:
                return server
        return None

    def connect(self, client: Client) -> str:
        """A client connects: ``ready`` (attached to its server, its limits set), ``pending`` (another
        uid's server holds the GPU: it waits, as measured, without a word, until ``tick`` attaches it
        and tells it ``ready_line``) or ``refused`` (its server is in FAULT: 807 at once, measured)."""
        if self.quitting:
            return "refused"
        server = self._server_for(client.uid)
        if server is not None and server.status == FAULT:
            self.log(
                "server.log",
                f"Server teardown in progress. Refusing to accept new client {{PID: {client.pid}, Context ID: 0}}",
            )
            self.log(
                "server.log",
                f"Failed to accept client {{PID: {client.pid}, Context ID: 0}} with status "
                f"{CUDA_ERROR_MPS_SERVER_NOT_READY}",
            )
            return "refused"
        if server is None and not self.servers:
            server = self._start(0 if self.multiuser else client.uid)
        if server is None:
            self.log(
                "control.log",
                f"NEW CLIENT {client.pid} from user {client.uid}: Server is not ready, push client to pending list",
            )
            self.pending.append(client)
            return "pending"
        self.log("control.log", f"NEW CLIENT {client.pid} from user {client.uid}: Server already exists")
        self._attach(server, client)
        return "ready"

    @staticmethod
    def ready_line(client: Client) -> str:
        """What a client is told once attached: READY and its limits (JSON)."""
        return "READY " + json.dumps(
            {"server": client.server, "threads": client.threads, "pinned": client.pinned, "id": client.id}
        )

    def _attach(self, server: Server, client: Client) -> None:
        client.id = next(self._ids)
        client.server = server.pid
        threads = float(server.threads)
        own = env_threads(client.env.get(ENV_THREADS))
        client.threads = min(threads, own) if own is not None else threads
        limits = [
            v for v in (self._bytes(server.pinned.get("0")), env_pinned(client.env.get(ENV_PINNED))) if v is not None
        ]
        client.pinned = min(limits) if limits else None
        server.clients[client.pid] = client

    @staticmethod
    def _bytes(text: str | None) -> int | None:
        return limit_bytes(text) if text else None

    def disconnect(self, pid: int) -> None:
        """A client's connection closed (it exited, was killed)."""
        self.pending = [c for c in self.pending if c.pid != pid]
        for server in self.servers.values():
            if server.clients.pop(pid, None) is not None:
                self.log(
                    "server.log",
                    f"Client {{PID: {pid}, Context ID: 1}} exiting."
                    f" Number of active client contexts is {len(server.clients)}.",
                )
        self.tick()

    def tick(self) -> None:
        """Servers found dead are dropped, a FAULT server without clients is ACTIVE again, and a queued
        uid gets the GPU once the current uid's clients are gone (its idle server quits at once,
        measured: 0.1 s)."""
        for server in list(self.servers.values()):
            if not server.process.alive():
                self.log("control.log", f"Server {server.pid} exited unexpectedly")
                self._drop(server)
            elif server.status == FAULT and not server.clients:
                server.status = ACTIVE  # the same server, measured: back to ACTIVE once its clients exited
                self.log("server.log", "Destroy server context on device 0")
        waiting = [c.uid for c in self.pending] + self.wanted
        if self.quitting or not waiting:
            return
        current = next(iter(self.servers.values()), None)
        if self.multiuser:
            server = current or self._start(0)
        else:
            if current is not None:
                if current.clients or current.status == FAULT:
                    return
                self.log("control.log", f"Try shutting down server {current.pid}, backoff is disabled")
                current.process.stop()
                self.log("control.log", f"Server {current.pid} exited with status 0")
                self._drop(current)
            server = self._start(waiting[0])  # first come, first served (deterministic)
        self.wanted = [u for u in self.wanted if not (self.multiuser or u == server.uid)]
        for client in [c for c in self.pending if self.multiuser or c.uid == server.uid]:
            self._attach(server, client)
            client.notify(self.ready_line(client))
        self.pending = [c for c in self.pending if not c.server]

    def _start(self, uid: int) -> Server:
        process = self.spawn(uid)
        server = Server(process, uid, self.threads, dict(self.pinned))
        self.servers[server.pid] = server
        self.log("control.log", f"Starting new server {server.pid} for user {uid}")
        self.log("server.log", f"Active Threads Percentage set to {server.threads}")
        for dev, value in sorted(server.pinned.items()):
            self.log("server.log", f"Device pinned memory limit for device {dev} set to {limit_bytes(value):#x} bytes")
        self.log("control.log", f"NEW SERVER {server.pid}: Ready")
        return server

    def _drop(self, server: Server) -> None:
        del self.servers[server.pid]
        for client in server.clients.values():
            client.notify(TO_CLIENT_EXIT)
        server.clients.clear()

    def stop_all(self) -> None:
        for server in list(self.servers.values()):
            server.process.stop()
            self._drop(server)
        for client in self.pending:
            client.notify(TO_CLIENT_EXIT)
        self.pending = []

    def clients(self) -> int:
        return sum(len(s.clients) for s in self.servers.values()) + len(self.pending)

    # ---- control commands ------------------------------------------------------------------------

    def command(self, text: str, peer_uid: int = 0) -> str:
        """One control command's answer (empty: nothing printed). Sets ``quitting`` on ``quit``."""
        words = text.split()
        self.log("control.log", f"Control: {' '.join(words)}")
        if not words:
            return ""
        name, args = words[0], words[1:]
        guarded = name.startswith("set_") or name in ("quit", "start_server", "terminate_client", "sim_fault")
        if guarded and peer_uid not in (0, self.owner_uid):
            return PRIVILEGES.format(uid=peer_uid)
        handler = _COMMANDS.get(name)
        if handler is None:
            return f'Unknown command "{" ".join(words)}"'
        try:
            reply = handler(self, args)
        except _Usage as exc:
            return str(exc)
        self.tick()
        return reply

    def _server(self, args: list[str]) -> Server:
        if not args:
            raise _Usage(PID_REQUIRED)
        try:
            server = self.servers.get(int(args[0]))
        except ValueError:
            server = None
        if server is None:
            raise _Usage(NO_SERVER)  # not measured for an unknown pid
        return server

    def _start_server(self, args: list[str]) -> str:
        if len(args) != 2 or args[0] != "-uid" or not args[1].isdigit():
            raise _Usage("start_server -uid <user id>")
        uid = int(args[1])
        if self._server_for(uid) is not None:
            return ""
        if not self.servers:
            self._start(0 if self.multiuser else uid)
        elif uid not in self.wanted:
            self.wanted.append(uid)  # as a client of that uid would: after the current uid's clients
        return ""

    def _quit(self, args: list[str]) -> str:
        self.quitting = True  # the real one waits for its clients ("Waiting for current clients to finish")
        return ""

    def _server_list(self, args: list[str]) -> str:
        return "\n".join(str(pid) for pid in sorted(self.servers))

    def _server_status(self, args: list[str]) -> str:
        return self._server(args).status

    def _client_list(self, args: list[str]) -> str:
        return "\n".join(str(pid) for pid in sorted(self._server(args).clients))

    def _ps(self, args: list[str]) -> str:
        if not self.servers:
            return NO_SERVER
        only = int(args[1]) if len(args) == 2 and args[0] == "-p" and args[1].isdigit() else None
        lines = [f"{'PID':<10}{'ID':<10}{'SERVER':<15}{'DEVICE':<26}{'NAMESPACE':<15}COMMAND"]
        for server in sorted(self.servers.values(), key=lambda s: s.pid):
            for client in sorted(server.clients.values(), key=lambda c: c.pid):
                if only is None or only == client.pid:
                    lines.append(
                        f"{client.pid:<10}{client.id:<10}{server.pid:<15}{self.device[:22]:<26}"
                        f"{client.namespace:<15}{client.command}"
                    )
        return "\n".join(lines)

    def _get_default_threads(self, args: list[str]) -> str:
        return self.threads

    def _set_default_threads(self, args: list[str]) -> str:
        if len(args) == 1:
            self.threads = percentage(args[0], self.threads)
        return self.threads

    def _get_threads(self, args: list[str]) -> str:
        return self._server(args).threads

    def _set_threads(self, args: list[str]) -> str:
        server = self._server(args)
        if len(args) == 2:
            server.threads = percentage(args[1], server.threads)
        return server.threads

    def _get_default_pinned(self, args: list[str]) -> str:
        if len(args) != 1:
            return ""
        if args[0] not in self.pinned:
            self.log("control.log", "No default pinned memory limit set for the device!")
        return self.pinned.get(args[0], "")

    def _set_default_pinned(self, args: list[str]) -> str:
        value = limit_text(args[1]) if len(args) == 2 else None
        if value is None:
            self.log("control.log", "Invalid pinned memory limit")  # not measured
            return ""
        self.pinned[args[0]] = value  # any device key is taken (measured: 7 on a one-GPU host, a UUID)
        return ""

    def _get_pinned(self, args: list[str]) -> str:
        server = self._server(args)
        return server.pinned.get(args[1], "") if len(args) == 2 else ""

    def _set_pinned(self, args: list[str]) -> str:
        server = self._server(args)
        value = limit_text(args[2]) if len(args) == 3 else None
        if value is None:
            self.log("control.log", "Invalid pinned memory limit")
            return ""
        server.pinned[args[1]] = value
        return ""

    def _get_priority(self, args: list[str]) -> str:
        return self.priority

    def _set_priority(self, args: list[str]) -> str:
        if len(args) == 1 and args[0] in ("0", "1"):
            self.priority = args[0]
        return ""

    def _terminate_client(self, args: list[str]) -> str:
        server = self._server(args)
        if len(args) != 2 or not args[1].isdigit() or int(args[1]) not in server.clients:
            return ""  # not measured
        client = server.clients.pop(int(args[1]))
        client.notify(TO_CLIENT_TERMINATED)
        return ""

    def _sim_fault(self, args: list[str]) -> str:
        """Stand-in only (no such command in the real daemon): a fatal GPU fault in a client of this
        server, as the measured illegal address: every client of it fails (sticky, 700), the server
        is in FAULT, refuses new clients (807) until every one of them has exited, then is ACTIVE."""
        server = self._server(args)
        server.status = FAULT
        self.log("server.log", "Server is handling a fatal GPU error.")
        for client in server.clients.values():
            self.log("server.log", f"Client {{PID: {client.pid}, Context ID: 1}} on device 0 to be torn down")
            client.notify(TO_CLIENT_FAULT)
        return ""


class _Usage(Exception):
    pass


_COMMANDS: dict[str, Callable[[Daemon, list[str]], str]] = {
    "start_server": Daemon._start_server,
    "quit": Daemon._quit,
    "get_server_list": Daemon._server_list,
    "get_server_status": Daemon._server_status,
    "get_client_list": Daemon._client_list,
    "ps": Daemon._ps,
    "get_default_active_thread_percentage": Daemon._get_default_threads,
    "set_default_active_thread_percentage": Daemon._set_default_threads,
    "get_active_thread_percentage": Daemon._get_threads,
    "set_active_thread_percentage": Daemon._set_threads,
    "get_default_device_pinned_mem_limit": Daemon._get_default_pinned,
    "set_default_device_pinned_mem_limit": Daemon._set_default_pinned,
    "get_device_pinned_mem_limit": Daemon._get_pinned,
    "set_device_pinned_mem_limit": Daemon._set_pinned,
    "get_default_client_priority": Daemon._get_priority,
    "set_default_client_priority": Daemon._set_priority,
    "terminate_client": Daemon._terminate_client,
    "sim_fault": Daemon._sim_fault,
}
