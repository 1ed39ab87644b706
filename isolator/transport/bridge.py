"""The sidecar's end of the command-module bridge: one call per connection on a second Unix socket.

It decodes what a bridge executable (isolator/bridge/command.py, bridge.c) forwards (the JSON
criteo/mesos-command-modules writes) into the request messages and calls the same handlers as gRPC
(isolator/transport/handlers.py), so translation is shared; it maps their ``IsolatorError`` to its
own reply lines, once. Its calls are admitted by the gRPC server's Dispatcher
(isolator/transport/serving.py), so the in-flight limit and the Cleanup lane are shared too, and its
connection slots are counted as the gate counts its own (``peergate.ConnectionSlots``). It holds no
isolator logic and never binds sockets itself (the server does).

Wire protocol, version 2 (version 1 is still served; its names are proto/gpuisolator/v1/wire.proto's
BridgeToken). The client connects, sends one request and
shuts down its write side; the server answers and closes.

    request  b"gpu-isolator-bridge/2 <method> <timeout_ms> <deadline_ms>\\n" + <the IN file's bytes, untouched>
             b"gpu-isolator-bridge/1 <method> <timeout_ms>\\n" + <...>    a client from before deadlines
    reply    b"OK\\n" + <the bytes for OUT, possibly empty>
             b"ERROR <gRPC code name> <one-line message>\\n"            final: never retried
             b"RETRY <pause_ms> <gRPC code name> <one-line message>\\n" load shed, the call did not run

A RETRY is asked again after pause_ms, the pause doubling up to 500 ms, until the client's deadline;
then the client reports "<code>: <message>" as for an ERROR. Only load shedding answers RETRY (the
Dispatcher's limit reached, or the caller's share of connections taken); a RESOURCE_EXHAUSTED from
the isolator itself ("no GPUs left") is an ERROR, since asking again cannot help and, with the
module running one hook at a time, would stall the whole agent.

``deadline_ms`` is the client's absolute deadline: CLOCK_MONOTONIC (Python's ``time.monotonic``) in
milliseconds, by which it gives up; it is the same on every attempt of a RETRY loop. The call's
deadline is the earlier of it and arrival + ``timeout_ms``: a request read late (the sidecar was
stopped, the accept queue was long) keeps its caller's deadline, and a client whose clock reads
ahead of ours (another time namespace) is still bounded by its timeout. A version-1 request has
only its timeout, counted from when its bytes were read. A call past its deadline is answered
``ERROR DEADLINE_EXCEEDED`` without running, on arrival or when a worker would start it
(isolator/transport/handlers.py; Cleanup and Watch excepted).

The client forwards IN's bytes without parsing them and copies the reply into OUT verbatim, so it
needs no ``json`` import (measured: ``json`` alone adds about as much as the bare interpreter's start)
and every check lives here, once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from isolator.errors import (
    FailedPrecondition,
    InvalidArgument,
    IsolatorError,
    Overloaded,
    PermissionDenied,
    Unavailable,
    Unimplemented,
)
from isolator.rpc import isolator_pb2 as pb
from isolator.transport import peergate, serving
from isolator.transport.handlers import BRIDGE, CallFacts, IsolatorHandlers, observe
from isolator.transport.logcontext import hook_context
from isolator.transport.wire import BRIDGE_ERROR, BRIDGE_OK, BRIDGE_PROTOCOL_1, BRIDGE_PROTOCOL_2, BRIDGE_RETRY

LOG = logging.getLogger(__name__)

# The framing's names are the contract's (proto/gpuisolator/v1/wire.proto, through transport/wire.py).
PROTOCOL = BRIDGE_PROTOCOL_1  # <method> <timeout_ms>: clients from before deadlines
PROTOCOL_2 = BRIDGE_PROTOCOL_2  # <method> <timeout_ms> <deadline_ms>: what the bridges send
MAX_HEADER_BYTES = 256
# The deepest JSON nesting accepted; Mesos's deepest input (a nested ContainerID chain inside a
# ContainerConfig) stays far below it, and it keeps hostile input from exhausting the stack.
MAX_DEPTH = 64
MAX_MESSAGE_CHARS = 2000
MAX_DRAIN_BYTES = 64 * 1024 * 1024


# ---- outputs: proto -> the JSON stout's protobuf::parse<T> accepts --------------------------------
#
# Field names are the .proto names (preserving_proto_field_name). proto3 leaves out fields that
# hold their default value, which stout would refuse where Mesos declares them `required`
# (apache/mesos:include/mesos/mesos.proto): Resource.type (SCALAR is 0) and Value.Scalar.value,
# and ResourceStatistics.timestamp. Those are filled in below.


def _to_json(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _with_values(environment: dict[str, Any]) -> None:
    # Mesos refuses a VALUE variable without a value; proto3 drops an empty one.
    for variable in environment.get("variables", []):
        variable.setdefault("value", "")


def _mesos_resource(resource: dict[str, Any]) -> dict[str, Any]:
    # Never the deprecated `role`: the agent aborts on a limitation's resource that has one.
    resource.pop("role", None)
    resource.setdefault("type", "SCALAR")
    if resource["type"] == "SCALAR":
        resource.setdefault("scalar", {}).setdefault("value", 0.0)
    return resource


def prepare_output(response: pb.PrepareResponse) -> bytes:
    if not response.HasField("launch_info"):
        return b""  # Mesos's None(): this isolator adds nothing to the launch
    info = _to_json(response.launch_info)
    for key in ("environment", "task_environment"):
        if key in info:
            _with_values(info[key])
    return _encode(info)


def empty_output(response: Message) -> bytes:
    return b""


def watch_output(response: pb.WatchResponse) -> bytes:
    if not response.HasField("limitation"):
        return b""  # the module keeps polling
    limitation = _to_json(response.limitation)
    limitation["resources"] = [_mesos_resource(r) for r in limitation.get("resources", [])]
    return _encode(limitation)


def usage_output(response: pb.UsageResponse) -> bytes:
    # Only ResourceStatistics goes back: the module parses OUT as that message. Per-GPU figures
    # stay on the gRPC and admin routes, which have a place for them.
    statistics = _to_json(response.statistics)
    if not statistics.get("timestamp"):
        statistics["timestamp"] = time.time()
    return _encode(statistics)


@dataclass(frozen=True)
class Call:
    request_type: type[Message]
    rpc: str
    output: Callable[[Any], bytes]


# The methods criteo/mesos-command-modules forwards (reference: bridge-and-cgroup2.md §A.1.3).
# It never forwards recover, update or status, so the bridge does not serve them.
CALLS: dict[str, Call] = {
    "prepare": Call(pb.PrepareRequest, "Prepare", prepare_output),
    "isolate": Call(pb.IsolateRequest, "Isolate", empty_output),
    "watch": Call(pb.WatchRequest, "Watch", watch_output),
    "usage": Call(pb.UsageRequest, "Usage", usage_output),
    "cleanup": Call(pb.CleanupRequest, "Cleanup", empty_output),
}


# ---- inputs -----------------------------------------------------------------------------------


NUMERIC_CPP_TYPES = frozenset(
    {
        FieldDescriptor.CPPTYPE_INT32,
        FieldDescriptor.CPPTYPE_INT64,
        FieldDescriptor.CPPTYPE_UINT32,
        FieldDescriptor.CPPTYPE_UINT64,
        FieldDescriptor.CPPTYPE_DOUBLE,
        FieldDescriptor.CPPTYPE_FLOAT,
    }
)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")


def check_shape(value: Any, descriptor: Any, path: str, depth: int = 0) -> None:
    """Refuse non-objects where a message or a map is expected and non-arrays where a repeated field is.

    json_format.ParseDict iterates whatever it is given as a message, so with unknown fields
    ignored it would take ``"container_id": "abc"`` for an empty ID; this catches it first.
    """
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"input nested deeper than {MAX_DEPTH} levels at {path}")
    if not isinstance(value, dict):
        raise InvalidArgument(f"{path} must be a JSON object, not {_kind(value)}")
    for key, item in value.items():
        field = descriptor.fields_by_name.get(key)
        if field is None or item is None:
            continue  # unknown keys are ignored, as stout ignores them
        items = [item]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            # A map is a JSON object in stout's form (Docker's `Labels`); its values are checked
            # against the entry's value field.
            if not isinstance(item, dict):
                raise InvalidArgument(f"{path}.{key} must be a JSON object, not {_kind(item)}")
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                for name, sub in item.items():
                    check_shape(sub, value_field.message_type, f"{path}.{key}[{name!r}]", depth + 1)
            continue
        if field.is_repeated:
            if not isinstance(item, list):
                raise InvalidArgument(f"{path}.{key} must be a JSON array, not {_kind(item)}")
            items = item
        if field.message_type is not None:
            for i, sub in enumerate(items):
                where = f"{path}.{key}" + (f"[{i}]" if field.is_repeated else "")
                check_shape(sub, field.message_type, where, depth + 1)
        elif field.cpp_type in NUMERIC_CPP_TYPES:
            # json_format takes true for 1 (a Python bool is an int); stout never writes one for a number.
            for i, sub in enumerate(items):
                if isinstance(sub, bool):
                    where = f"{path}.{key}" + (f"[{i}]" if field.is_repeated else "")
                    raise InvalidArgument(f"{where} must be a number, not a boolean")


def decode_input(payload: bytes, request_type: type[Message]) -> Message:
    """The IN file's bytes -> a request message, or INVALID_ARGUMENT saying what is wrong."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"input is not UTF-8: {exc.reason} at byte {exc.start}") from None
    if not text.strip():
        raise InvalidArgument("input is empty; expected a JSON object")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"input is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument("input is nested too deeply to parse") from None
    check_shape(obj, request_type.DESCRIPTOR, "input")
    try:
        return json_format.ParseDict(obj, request_type(), ignore_unknown_fields=True, max_recursion_depth=MAX_DEPTH)
    except json_format.ParseError as exc:
        raise InvalidArgument(f"input does not match {request_type.DESCRIPTOR.name}: {exc}") from None


@dataclass(frozen=True)
class Frame:
    method: str
    timeout: float  # seconds, as the client counted them when it sent the request
    deadline: float | None  # the client's ``time.monotonic()`` by which it gives up (version 2); None: not sent
    payload: bytes

    def deadline_from(self, arrived: float) -> float:
        """The call's deadline on our clock, for a request whose bytes were read at ``arrived``."""
        relative = arrived + self.timeout
        return relative if self.deadline is None else min(relative, self.deadline)


def parse_frame(data: bytes) -> Frame:
    """Split a request into its header's fields and its payload."""
    header, sep, payload = data.partition(b"\n")
    if not sep or len(header) > MAX_HEADER_BYTES:
        raise InvalidArgument("malformed bridge request: no header line")
    parts = header.split(b" ")
    if parts[0] not in (PROTOCOL, PROTOCOL_2):
        version = parts[0].decode("ascii", "replace")[:40]
        raise FailedPrecondition(
            f"bridge protocol {version!r} is not spoken here (this sidecar speaks {PROTOCOL_2.decode()}"
            f" and {PROTOCOL.decode()})",
        )
    fields = 4 if parts[0] == PROTOCOL_2 else 3
    if len(parts) != fields or not all(p.isdigit() for p in parts[2:]):
        shape = "<method> <ms> <deadline_ms>" if fields == 4 else "<method> <ms>"
        raise InvalidArgument(f"malformed bridge request header; expected '<protocol> {shape}'")
    method = parts[1].decode("ascii", "replace")
    if method not in CALLS:
        raise Unimplemented(
            f"method {method[:40]!r} is not served over the bridge (only {', '.join(CALLS)})",
        )
    deadline = int(parts[3]) / 1000.0 if fields == 4 else None
    return Frame(method, int(parts[2]) / 1000.0, deadline, payload)


def error_reply(code: str, message: str, retry_ms: int | None = None) -> bytes:
    """``ERROR <CODE> <message>`` (final: the bridge never retries it), or with ``retry_ms``
    ``RETRY <pause_ms> <CODE> <message>`` (load shedding: the call did not run; the bridge may send
    it again after pause_ms, doubling up to 500 ms, until its deadline)."""
    line = " ".join(message.split())[:MAX_MESSAGE_CHARS]
    head = BRIDGE_ERROR + b" " if retry_ms is None else BRIDGE_RETRY + b" %d " % max(0, retry_ms)
    return head + code.encode() + b" " + line.encode("utf-8", "replace") + b"\n"


def refusal_reply(exc: IsolatorError) -> bytes:
    """The reply for an error: RETRY for load shedding (errors.Overloaded), ERROR for the rest."""
    return error_reply(exc.code, exc.message, exc.retry_after_ms if isinstance(exc, Overloaded) else None)


def _container_hint(payload: bytes) -> str:
    """The container ID an input names (``parent.child``), best effort, for the log line of a
    refusal that happens before the request is a message; "" when there is none to read."""
    try:
        node = json.loads(payload).get("container_id")
        chain: list[str] = []
        while isinstance(node, dict) and len(chain) <= MAX_DEPTH:
            chain.append(str(node.get("value", ""))[:256])
            node = node.get("parent")
        return ".".join(reversed(chain))
    except (ValueError, AttributeError, RecursionError):
        return ""


def answer(handlers: IsolatorHandlers, method: str, payload: bytes, deadline: float, peer: str = "") -> bytes:
    """An admitted call's input -> the reply's bytes, on a worker of the pool (``peer``: the caller
    as the gate names it, from this connection's SO_PEERCRED; ``deadline``: ``time.monotonic()`` by
    which the caller gives up). The bridge's one error mapping. Never raises."""
    call = CALLS[method]
    try:
        started = time.perf_counter()
        try:
            request = decode_input(payload, call.request_type)
        except IsolatorError as exc:
            # Refused before the handler (whose entry logs and measures every call) runs: say so
            # with the hook and the container, and count it as the handler's entry would.
            with hook_context(call.rpc, _container_hint(payload)):
                LOG.info("bridge %s refused: %s", method, exc.message)
                observe(handlers.observer, call.rpc, exc.code, time.perf_counter() - started, None)
            return refusal_reply(exc)
        response = handlers.handle(call.rpc, request, CallFacts(peer, deadline, BRIDGE))
        return BRIDGE_OK + b"\n" + call.output(response)
    except IsolatorError as exc:
        return refusal_reply(exc)
    except Exception as exc:  # a bug here must answer the caller, not kill the listener
        LOG.exception("bridge %s failed with an unexpected error", method)
        return error_reply("INTERNAL", f"internal error in bridge {method}: {exc}")  # as status_of does


# ---- the listener -------------------------------------------------------------------------------


# Callers outside the allow-list, and allowed ones over their share of connection slots, are
# answered (PERMISSION_DENIED; RETRY) at most this many at once (beyond: closed at once), each
# within REFUSAL_DEADLINE_S.
MAX_REFUSALS = 16
REFUSAL_DEADLINE_S = 2.0
# An allowed uid holds at most this share of the connection slots (the gate's rule for gRPC
# connections, counted by the same ``peergate.ConnectionSlots``), so that one caller's slow or
# stuck connections cannot lock the others out.
UID_SHARE = peergate.UID_SHARE


class BridgeListener:
    """Accepts on a bound, listening Unix socket; each connection is a coroutine on the event loop
    of the gRPC server's Dispatcher (isolator/transport/serving.py), which admits its call.

    Per connection, in this order: the caller's SO_PEERCRED (on the accept thread; a caller outside
    the allow-list is answered PERMISSION_DENIED as a refusal and never takes a connection slot); a
    connection slot (at most ``max_connections``, one uid at most UID_SHARE of them; else a RETRY as
    a refusal); the whole request, within ``io_timeout`` seconds overall (not per read); then the
    Dispatcher, the one admission of both routes: the call shares ``--max-concurrent-rpcs`` and the
    request-byte bound with gRPC calls and is answered ``RETRY`` when shed, and a Cleanup skips both
    and runs first, on the pool's Cleanup lane when every worker is stuck. The slot is given back
    once the call is admitted (the Dispatcher counts it from there), so calls in flight, however
    many, never keep a Cleanup from being read. The count of open connections is kept under a lock
    only so that ``stop`` may read it from another thread; it changes on the loop.
    """

    def __init__(
        self,
        sock: socket.socket,
        handlers: IsolatorHandlers,
        dispatcher: serving.Dispatcher,
        loop: asyncio.AbstractEventLoop,
        *,
        max_request_bytes: int,
        max_connections: int,
        allowed_uids: tuple[int, ...],
        allowed_gids: tuple[int, ...],
        io_timeout: float = 10.0,
    ) -> None:
        self._sock = sock
        self._handlers = handlers
        self._dispatcher = dispatcher
        self._loop = loop
        self._limit = MAX_HEADER_BYTES + max_request_bytes
        self._max_connections = max_connections
        # Refusals (denied callers and busy ones alike) share one cap here.
        self._slots = peergate.ConnectionSlots(max_connections, {"refused": MAX_REFUSALS}, pooled=True)
        self.set_allowed(allowed_uids, allowed_gids)
        self._io_timeout = io_timeout
        self._closing = threading.Event()
        self._idle = threading.Condition()
        self._in_flight = 0  # connections open (read, admitted or answered)
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread: threading.Thread | None = None
        self._warned = False
        self.shed = 0  # RETRY replies sent (calls turned away for load, never run)

    def set_allowed(self, allowed_uids: tuple[int, ...], allowed_gids: tuple[int, ...]) -> None:
        """Who may call, checked per connection from the next one on (set again on SIGHUP)."""
        self._allowlist = peergate.Allowlist.of(allowed_uids, allowed_gids)  # the gate's own rule

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name="bridge-accept", daemon=True)
        self._thread.start()

    def stop(self, grace: float) -> None:
        """Stop accepting, wait up to ``grace`` seconds for the connections open, then cut the rest
        (a call already running on a worker finishes there; its answer is not sent)."""
        self._closing.set()
        try:
            # Wakes the accept() blocked in the other thread (close alone does not on Linux).
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join()
        self._sock.close()
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=grace)
            if self._in_flight:
                LOG.warning("stopping with %d bridge call(s) still in flight", self._in_flight)
        if not self._loop.is_closed():
            with contextlib.suppress(RuntimeError, concurrent.futures.TimeoutError):
                asyncio.run_coroutine_threadsafe(self._cut(), self._loop).result(10)

    async def _cut(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def slots(self) -> dict[str, int]:
        """Slots taken now, by kind (tests and the load bench)."""
        taken = self._slots.taken()
        return {"connection": taken["allowed"], "refusal": taken["refused"]}

    def _accept_loop(self) -> None:
        peergate.accept_loop(self._sock, self._closing, self._admit, "bridge")

    def _admit(self, conn: socket.socket) -> None:
        """On the accept thread: who is calling, then the connection goes to the loop."""
        cred = peergate.peer_credentials(conn)  # the one SO_PEERCRED reader, shared with the gRPC gate
        allowed = self._allowlist.allows(cred)
        conn.setblocking(False)
        self._loop.call_soon_threadsafe(self._arrived, conn, cred, allowed)

    def _arrived(self, conn: socket.socket, cred: peergate.PeerCredentials, allowed: bool) -> None:
        """On the loop: a connection slot or a refusal, else the connection is closed at once."""
        if self._closing.is_set():
            conn.close()
            return
        kind, _why, got = self._slots.take(allowed, cred.uid)
        refusal: IsolatorError | None = None
        if kind == "denied":
            refusal = PermissionDenied(peergate.denial_message(cred.uid, cred.gid))
            if got:
                LOG.warning(
                    "bridge call from pid %d uid %d gid %d refused: not in allowed-uids/gids",
                    cred.pid,
                    cred.uid,
                    cred.gid,
                )
        elif kind == "busy":
            refusal = Overloaded(
                f"too many bridge connections (uid {cred.uid} holds its share, or all"
                f" {self._max_connections} are taken; --max-connections); try again"
            )
        if not got:
            if not self._warned:
                LOG.warning(
                    "bridge: refusals at their cap of %d; closing new connections (uid %d)", MAX_REFUSALS, cred.uid
                )
                self._warned = True
            conn.close()
            return
        self._warned = False
        with self._idle:
            self._in_flight += 1
        if refusal is not None:
            task = self._loop.create_task(self._refuse(conn, cred.uid, kind, refusal))
        else:
            task = self._loop.create_task(self._serve(conn, cred))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _closed(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    async def _refuse(self, conn: socket.socket, uid: int, kind: str, error: IsolatorError) -> None:
        deadline = self._loop.time() + REFUSAL_DEADLINE_S
        try:
            with conn:
                try:
                    await self._drain(conn, deadline)
                    if isinstance(error, Overloaded):
                        self.shed += 1
                    await self._send(conn, refusal_reply(error), deadline)
                except (OSError, TimeoutError) as exc:
                    LOG.debug("bridge refusal not delivered: %s", exc)
        finally:
            self._slots.give_back(kind, uid)
            self._closed()

    async def _serve(self, conn: socket.socket, cred: peergate.PeerCredentials) -> None:
        holding = True

        def admitted() -> None:
            nonlocal holding
            if holding:
                holding = False
                self._slots.give_back("allowed", cred.uid)

        try:
            with conn:
                try:
                    data = await self._receive(conn, self._loop.time() + self._io_timeout)
                    if data is None:
                        too_big = InvalidArgument(f"request larger than {self._limit - MAX_HEADER_BYTES} bytes")
                        reply = error_reply(too_big.code, too_big.message)
                    else:
                        peer = "bridge:" + peergate.peer_name(cred, "bridge")[1:]
                        reply = await self._call(data, peer, admitted)
                    admitted()
                    await self._send(conn, reply, self._loop.time() + self._io_timeout)
                except (OSError, TimeoutError) as exc:
                    # The caller gave up (its deadline, SIGTERM from the module), or trickled its
                    # request past the deadline: nothing to answer.
                    LOG.debug("bridge connection dropped: %s", exc)
        finally:
            admitted()
            self._closed()

    async def _call(self, data: bytes, peer: str, admitted: Callable[[], None]) -> bytes:
        """Parse the header, pass the Dispatcher's admission, run the call on its pool."""
        arrived = time.monotonic()
        method = "?"
        try:
            frame = parse_frame(data)
        except IsolatorError as exc:
            if isinstance(exc, InvalidArgument):
                LOG.info("bridge %s refused: %s", method, exc.message)
            return refusal_reply(exc)
        method, payload, deadline = frame.method, frame.payload, frame.deadline_from(arrived)
        rpc = CALLS[method].rpc
        facts = CallFacts(peer, deadline, BRIDGE)
        stale = facts.expired(rpc, "")
        if stale is not None:
            # Its caller gave up while the request waited to be read (the sidecar was stopped):
            # answered at once, without taking a worker or a place in the queue.
            container = _container_hint(payload)  # parsed on the loop only for a refusal
            stale = facts.expired(rpc, container) or stale
            with hook_context(rpc, container):
                LOG.warning("bridge %s refused: %s", method, stale.message)
                observe(self._handlers.observer, rpc, stale.code, 0.0, None)
            return refusal_reply(stale)
        busy = self._dispatcher.admit("bridge", rpc, len(payload))
        if busy is not None:
            self.shed += 1
            return refusal_reply(busy)
        admitted()
        try:
            return await self._dispatcher.execute(
                rpc, len(payload), answer, self._handlers, method, payload, deadline, peer
            )
        except RuntimeError as exc:  # the pool is shut down, or no thread could start
            stopping = Unavailable(f"the sidecar could not run bridge {method}: {exc}")
            return refusal_reply(stopping)

    async def _receive(self, conn: socket.socket, deadline: float) -> bytes | None:
        """The whole request, or None when it is over the size limit (the rest drained)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await self._recv(conn, deadline)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self._limit:
                await self._drain(conn, deadline)
                return None
            chunks.append(chunk)

    async def _recv(self, conn: socket.socket, deadline: float) -> bytes:
        if self._loop.time() >= deadline:
            raise TimeoutError("the request did not arrive before the connection's deadline")
        async with asyncio.timeout_at(deadline):
            return await self._loop.sock_recv(conn, 65536)

    async def _send(self, conn: socket.socket, data: bytes, deadline: float) -> None:
        async with asyncio.timeout_at(deadline):
            await self._loop.sock_sendall(conn, data)

    async def _drain(self, conn: socket.socket, deadline: float) -> None:
        # Closing a Unix socket with unread data resets the peer, which then loses the answer;
        # read and discard the rest (bounded in bytes and time) so that the caller learns why.
        for _ in range(MAX_DRAIN_BYTES // 65536):
            try:
                if not await self._recv(conn, deadline):
                    return
            except TimeoutError:
                return
