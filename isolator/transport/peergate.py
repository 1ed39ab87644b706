"""Who may call: the public socket's gate, which checks each caller's SO_PEERCRED before gRPC sees a byte.

gRPC Python does not expose a connection's peer credentials, so gRPC listens only in a private 0700
directory and this gate owns the public socket: per connection it reads the caller's uid, gid and
pid from the kernel and splices the bytes either to the real gRPC server (allowed) or to a gRPC
server whose every method answers PERMISSION_DENIED without reading the request (denied).
It decides nothing about requests and never parses them. One thread moves every connection's bytes
(epoll); gRPC Python has no way to take an accepted connection's fd instead (grpcio 1.85: the core's
``grpc_server_add_channel_from_fd`` is not exposed, and ``context.peer()`` of a Unix socket is
``unix:``, no credentials), so the gate still copies.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass

import grpc

from isolator.errors import Overloaded, PermissionDenied, SocketError
from isolator.transport.status import mark_retryable, status_of

LOG = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;} (socket(7), SO_PEERCRED)
# Connections of callers outside the allow-list are few and short; capping them apart keeps a
# local user who may open the socket from starving allowed callers of connection slots.
MAX_DENIED_CONNECTIONS = 16
# Connections turned away for load: spliced to the refusing server, which answers each call on them
# RESOURCE_EXHAUSTED (never a silent close), at most this many at once; beyond, closed at once.
MAX_BUSY_CONNECTIONS = 16
# An allowed uid may hold at most this share of ``max_connections``, so that one caller (its idle
# connections included) cannot lock the others out.
UID_SHARE = 0.5
# Bytes the splicer moves per recv/send: HTTP/2 frames are 16 KiB by default, so 64 KiB rarely
# splits one. One buffer serves every connection (the splicer is one thread); a connection keeps
# only what its receiving side did not take yet.
SPLICE_BUFFER = 64 * 1024
ALLOWED_NAME = "grpc"
DENIED_NAME = "deny"
PRIVATE_SUFFIX = ".d"
# The longest name inside the private directory, for the config's path-length check.
PRIVATE_EXTRA = len(PRIVATE_SUFFIX) + 1 + max(len(ALLOWED_NAME), len(DENIED_NAME))


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(conn: socket.socket) -> PeerCredentials:
    """The connecting process's credentials as the kernel recorded them at connect(2)."""
    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return PeerCredentials(pid, uid, gid)


def accept_loop(
    listener: socket.socket, closing: threading.Event, admit: Callable[[socket.socket], None], name: str
) -> None:
    """Accept connections on ``listener`` and hand each to ``admit`` until ``closing`` is set: the one
    accept loop of both sockets (this gate's and the bridge's). A failed accept (EMFILE and friends)
    is logged and retried after a pause, never spun on; a connection ``admit`` fails on is closed,
    and the loop goes on."""
    while not closing.is_set():
        try:
            conn, _ = listener.accept()
        except OSError as exc:
            if closing.is_set():
                return
            LOG.warning("%s: accept failed: %s", name, exc.strerror)
            time.sleep(0.05)
            continue
        try:
            admit(conn)
        except Exception:  # one bad connection must not stop the loop
            LOG.exception("%s: failed to admit a connection", name)
            conn.close()


@dataclass(frozen=True)
class Allowlist:
    """Callers allowed to steer the sidecar: by uid, or by primary gid. The sidecar's own euid is
    always in (it is root in production; in tests it lets the daemon talk to itself)."""

    uids: frozenset[int]
    gids: frozenset[int]

    @classmethod
    def of(cls, uids: Iterable[int], gids: Iterable[int]) -> Allowlist:
        return cls(frozenset(uids) | {os.geteuid()}, frozenset(gids))

    def allows(self, cred: PeerCredentials) -> bool:
        return cred.uid in self.uids or cred.gid in self.gids


class ConnectionSlots:
    """The one connection-slot accounting of both sockets (this gate's and the bridge's).

    A new connection takes a slot of one kind: ``allowed`` (at most ``max_connections``, one uid at
    most UID_SHARE of them), else ``busy`` (an allowed caller over its share, ``why`` "share", or
    with every slot taken, ``why`` "full"), or ``denied`` (a caller outside the allow-list). Busy
    and denied connections are answered with a refusal and are capped apart (``refusal_caps``, by
    kind, or one cap for both under the same name), so that refused callers never starve allowed
    ones; a connection over its kind's cap gets no slot at all and is closed at once.
    """

    def __init__(self, max_connections: int, refusal_caps: dict[str, int], pooled: bool = False) -> None:
        # ``pooled``: busy and denied connections share one cap (``refusal_caps["refused"]``).
        self._caps = {"allowed": max_connections, **refusal_caps}
        self._pooled = pooled
        self.share = max(1, int(max_connections * UID_SHARE))
        self._count = dict.fromkeys(self._caps, 0)
        self._per_uid: dict[int, int] = {}
        self._lock = threading.Lock()

    def _bucket(self, kind: str) -> str:
        return "refused" if self._pooled and kind != "allowed" else kind

    def take(self, allowed: bool, uid: int) -> tuple[str, str, bool]:
        """A slot for a new connection of ``uid``: (kind, why, got one). Without one (its kind's cap
        reached) the connection is to be closed at once."""
        why = ""
        with self._lock:
            if not allowed:
                kind = "denied"
            elif self._per_uid.get(uid, 0) >= self.share:
                kind, why = "busy", "share"
            elif self._count["allowed"] >= self._caps["allowed"]:
                kind, why = "busy", "full"
            else:
                kind = "allowed"
            bucket = self._bucket(kind)
            if self._count[bucket] >= self._caps[bucket]:
                return kind, why, False
            self._count[bucket] += 1
            if kind == "allowed":
                self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        return kind, why, True

    def give_back(self, kind: str, uid: int) -> None:
        with self._lock:
            self._count[self._bucket(kind)] -= 1
            if kind == "allowed":
                left = self._per_uid.get(uid, 1) - 1
                if left:
                    self._per_uid[uid] = left
                else:
                    self._per_uid.pop(uid, None)

    def taken(self) -> dict[str, int]:
        """Slots taken now, by kind (``allowed``, and each refusal cap's name)."""
        with self._lock:
            return dict(self._count)


def denial_message(uid: int, gid: int) -> str:
    return f"uid {uid} (gid {gid}) is not allowed to call the sidecar; see --allowed-uids and --allowed-gids"


def private_dir(public_socket: str) -> str:
    return public_socket + PRIVATE_SUFFIX


def direct_path(public_socket: str) -> str:
    """Where gRPC itself listens: the direct door for callers of the sidecar's own uid (root), which
    only they can reach (the private directory is 0700), so every caller there is one the
    allow-list admits (it always holds the sidecar's euid) and no gate copies its bytes. The Mesos
    module calls it (mesos/settings.cpp, parameter ``route``). A call there has no caller the gate
    named: Isolate's pid checks that need the caller's pid and the admin records' pid do not apply
    (``caller_pid`` is 0), which is why the public socket keeps its gate for everyone else."""
    return os.path.join(private_dir(public_socket), ALLOWED_NAME)


def make_private_dir(path: str) -> None:
    """Create ``path`` 0700 and ours, or take over one left by a crash after checking it is ours.

    Refuses a symlink or a directory someone else owns: whoever controls it could put their own
    socket where the gate connects allowed callers.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise SocketError(
                f"failed to create private socket directory '{path}': it exists and is not a directory owned by us"
            ) from None
        os.chmod(path, 0o700)
        for name in os.listdir(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))
    except OSError as exc:
        raise SocketError(f"failed to create private socket directory '{path}': {exc.strerror}") from exc


def remove_private_dir(path: str) -> None:
    for name in (ALLOWED_NAME, DENIED_NAME):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, name))
    with contextlib.suppress(OSError):
        os.rmdir(path)


class _DenyEverything(grpc.GenericRpcHandler):
    """Answers every method PERMISSION_DENIED (or RESOURCE_EXHAUSTED on a connection the gate turned
    away for load). The handler is stream-unary so that gRPC calls it as soon as the headers
    arrive, before any request message is read or parsed."""

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return grpc.stream_unary_rpc_method_handler(self._deny)

    @staticmethod
    def _deny(request_iterator: object, context: grpc.ServicerContext) -> None:
        uid, gid, busy = _credentials_from_peer(context.peer())
        if busy:
            error: Exception = Overloaded(busy_message(uid, busy))
        else:
            error = PermissionDenied(denial_message(uid, gid))
        mark_retryable(context, error)
        context.abort(*status_of(error, "the peer-credential gate"))


def busy_message(uid: int, why: str) -> str:
    if why == "share":
        return f"uid {uid} holds its share of the sidecar's connections (--max-connections); close some and retry"
    return "the sidecar holds --max-connections connections; retry shortly"


PEER_PREFIX = "gpu-isolator-peer/"


def peer_name(cred: PeerCredentials, serial: str, why: str = "") -> str:
    """The abstract address the gate binds its side of each connection to, so that the server it
    splices to learns the caller from ``context.peer()``: NUL + "gpu-isolator-peer/<uid>/<gid>/<n>/<pid>[/<why>]";
    gRPC reports it as "unix-abstract:gpu-isolator-peer/...". Only the gate (root, in the private
    0700 directory) connects there, so the name is the gate's word, not the caller's."""
    return f"\0{PEER_PREFIX}{cred.uid}/{cred.gid}/{serial}/{cred.pid}" + (f"/{why}" if why else "")


def _credentials_from_peer(peer: str) -> tuple[int, int, str]:
    try:
        _, _, rest = peer.partition(PEER_PREFIX)
        uid, gid, _n, _pid, *why = rest.split("/")
        return int(uid), int(gid), why[0] if why else ""
    except ValueError:
        return -1, -1, ""


def caller_pid(peer: str) -> int:
    """The calling process's pid (SO_PEERCRED at connect) from a peer the gate named; 0 (the
    model's UNKNOWN_CALLER) for any other peer, e.g. a connection made straight to the private socket."""
    if PEER_PREFIX not in peer:
        return 0
    try:
        return int(peer.partition(PEER_PREFIX)[2].split("/")[3])
    except (IndexError, ValueError):
        return 0


def caller_text(peer: str) -> str:
    """Who called, for the record of an admin decision: ``uid 0, pid 4242`` from the gate's
    SO_PEERCRED; "unknown caller" for a peer the gate did not name."""
    if PEER_PREFIX not in peer:
        return "unknown caller"
    uid, _gid, _why = _credentials_from_peer(peer)
    pid = caller_pid(peer)
    return f"uid {uid}, pid {pid}" if uid >= 0 else "unknown caller"


def deny_server(path: str) -> grpc.Server:
    """A gRPC server on ``path`` that refuses everything; two workers and a small inbox."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="deny"),
        maximum_concurrent_rpcs=MAX_DENIED_CONNECTIONS + MAX_BUSY_CONNECTIONS,
        options=[
            ("grpc.max_receive_message_length", 1024),
            ("grpc.so_reuseport", 0),
            # Refused callers get their answer at once; their connections do not linger.
            ("grpc.server_handshake_timeout_ms", 2000),
            ("grpc.max_connection_idle_ms", 2000),
        ],
    )
    server.add_generic_rpc_handlers((_DenyEverything(),))
    if server.add_insecure_port("unix:" + path) == 0:
        raise SocketError(f"failed to bind '{path}'")
    return server


class _Connection:
    """One caller's connection spliced to one upstream; the splicer's thread moves its bytes."""

    def __init__(self, client: socket.socket, upstream: socket.socket, kind: str, uid: int) -> None:
        self.client = client
        self.upstream = upstream
        self.kind = kind
        self.uid = uid
        # Bytes read from one side that the other did not take yet, by the side they go to; a
        # side with some waiting is not read from again until they are gone (back-pressure).
        self.waiting: dict[socket.socket, bytes] = {client: b"", upstream: b""}
        self.ended: set[socket.socket] = set()  # sides that sent EOF
        self.shut: set[socket.socket] = set()  # sides we passed a half-close to (once their bytes were delivered)
        self.closed = False

    def peer_of(self, sock: socket.socket) -> socket.socket:
        return self.upstream if sock is self.client else self.client


class _Splicer:
    """Every spliced connection's bytes, both ways, moved by one thread over epoll: no thread per
    connection or per direction, and one SPLICE_BUFFER for all of them (a side whose peer does not
    take what was read keeps only that remainder). Connections are handed over from the accept
    thread through ``add``; ``forget`` is called (on this thread) when one has ended both ways."""

    def __init__(self, forget: Callable[[_Connection], None]) -> None:
        self._forget = forget
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._incoming: list[_Connection] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._owner: dict[socket.socket, _Connection] = {}
        self._buf = bytearray(SPLICE_BUFFER)
        self._thread = threading.Thread(target=self._run, name="gate-splice", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, conn: _Connection) -> None:
        with self._lock:
            self._incoming.append(conn)
        self._wake()

    def stop(self) -> None:
        """Close every connection and end the thread. Idempotent."""
        with self._lock:
            self._stopping = True
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        try:
            while True:
                for key, events in self._selector.select():
                    if key.data is None:
                        self._drain_wakeups()
                        continue
                    conn: _Connection = key.data
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock not in self._owner:
                        continue  # ended earlier in this round
                    if events & selectors.EVENT_WRITE:
                        self._flush(conn, sock)
                    if events & selectors.EVENT_READ and sock in self._owner:
                        self._read(conn, sock)
                    if sock in self._owner:
                        self._settle(conn)
                if self._take_incoming():
                    return
        finally:
            for conn in set(self._owner.values()):
                self._end(conn)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass

    def _take_incoming(self) -> bool:
        """Register the connections handed over; True when stopping."""
        with self._lock:
            incoming, self._incoming = self._incoming, []
            stopping = self._stopping
        for conn in incoming:
            for sock in (conn.client, conn.upstream):
                sock.setblocking(False)
                self._owner[sock] = conn
                self._selector.register(sock, selectors.EVENT_READ, conn)
            if stopping:
                self._end(conn)
        return stopping

    def _read(self, conn: _Connection, sock: socket.socket) -> None:
        dst = conn.peer_of(sock)
        try:
            n = sock.recv_into(self._buf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._end(conn)  # a reset on one side ends both
            return
        if n == 0:
            conn.ended.add(sock)
            return
        view = memoryview(self._buf)[:n]
        try:
            sent = dst.send(view)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._end(conn)
            return
        if sent < n:
            conn.waiting[dst] = bytes(view[sent:])

    def _flush(self, conn: _Connection, dst: socket.socket) -> None:
        data = conn.waiting[dst]
        if not data:
            return
        try:
            sent = dst.send(data)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._end(conn)
            return
        conn.waiting[dst] = data[sent:]

    def _settle(self, conn: _Connection) -> None:
        """Pass on half-closes whose bytes are all delivered, end a connection closed both ways, and
        set what each side is waited on for: read while its peer has nothing waiting, write while it has."""
        for src in (conn.client, conn.upstream):
            dst = conn.peer_of(src)
            if src in conn.ended and not conn.waiting[dst] and dst not in conn.shut:
                conn.shut.add(dst)
                try:
                    dst.shutdown(socket.SHUT_WR)  # pass the half-close on, as the caller meant it
                except OSError:
                    self._end(conn)
                    return
        if len(conn.shut) == 2:
            self._end(conn)
            return
        for sock in (conn.client, conn.upstream):
            events = 0
            if sock not in conn.ended and not conn.waiting[conn.peer_of(sock)]:
                events |= selectors.EVENT_READ
            if conn.waiting[sock]:
                events |= selectors.EVENT_WRITE
            self._watch(sock, events, conn)

    def _watch(self, sock: socket.socket, events: int, conn: _Connection) -> None:
        """Wait on ``sock`` for ``events``; for none, not at all (epoll takes no empty mask)."""
        try:
            current = self._selector.get_key(sock).events
        except KeyError:
            current = 0
        if events == current:
            return
        if not events:
            self._selector.unregister(sock)
        elif not current:
            self._selector.register(sock, events, conn)
        else:
            self._selector.modify(sock, events, conn)

    def _end(self, conn: _Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        for sock in (conn.client, conn.upstream):
            self._owner.pop(sock, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()
        self._forget(conn)


class PeerGate:
    """Accepts on the bound, listening public socket and splices each connection by its caller.

    ``max_connections`` bounds allowed callers' connections (one thread splices them all), and one uid
    holds at most UID_SHARE of them. A connection over a cap is spliced to the refusing server,
    which answers RESOURCE_EXHAUSTED (MAX_BUSY_CONNECTIONS at once; beyond, closed). Denied
    callers get at most MAX_DENIED_CONNECTIONS. The gRPC server closes connections that stay
    idle or never finish their handshake (isolator/transport/serving.py), which frees their slots here.
    """

    def __init__(
        self,
        listener: socket.socket,
        allowed_path: str,
        denied_path: str,
        allowlist: Allowlist,
        max_connections: int,
    ) -> None:
        self._listener = listener
        self._allowed_path = allowed_path
        self._denied_path = denied_path
        self._allowlist = allowlist
        self._slots = ConnectionSlots(max_connections, {"denied": MAX_DENIED_CONNECTIONS, "busy": MAX_BUSY_CONNECTIONS})
        self._splicer = _Splicer(self._forget)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._serial = itertools.count()
        self._warned_full = False

    def start(self) -> None:
        self._splicer.start()
        self._thread = threading.Thread(target=self._accept_loop, name="gate-accept", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        """Close the public socket; connections already spliced go on. Idempotent."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() in the other thread
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._listener.close()

    def stop(self) -> None:
        """Stop accepting and cut every spliced connection."""
        self.stop_accepting()
        self._splicer.stop()

    def set_allowlist(self, allowlist: Allowlist) -> None:
        """Callers allowed from the next connection on (SIGHUP); connections already admitted keep
        their verdict until they close, as a file descriptor keeps the permission it was opened with."""
        self._allowlist = allowlist

    def connections(self) -> tuple[int, int]:
        """(allowed, denied) connections open now."""
        taken = self._slots.taken()
        return taken["allowed"], taken["denied"]

    def _accept_loop(self) -> None:
        accept_loop(self._listener, self._closing, self._admit, "gate")

    def _admit(self, client: socket.socket) -> None:
        cred = peer_credentials(client)
        kind, why, got = self._slots.take(self._allowlist.allows(cred), cred.uid)
        full = not got
        if kind != "allowed" or full:
            self._warn_refusal(kind, why, full, cred)
        else:
            self._warned_full = False
        if full:
            client.close()
            return
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            # Every connection, allowed ones too: Isolate needs the caller's pid (docs/security.md).
            upstream.bind(peer_name(cred, f"{os.getpid()}.{next(self._serial)}", why if kind != "allowed" else ""))
            upstream.connect(self._allowed_path if kind == "allowed" else self._denied_path)
        except OSError:
            upstream.close()
            client.close()
            self._release(kind, cred.uid)
            raise
        self._splicer.add(_Connection(client, upstream, kind, cred.uid))

    def _warn_refusal(self, kind: str, why: str, full: bool, cred: PeerCredentials) -> None:
        if kind == "denied" and not full:
            LOG.warning(
                "gate: call from pid %d uid %d gid %d refused: not in allowed-uids/gids", cred.pid, cred.uid, cred.gid
            )
            return
        if self._warned_full:
            return
        self._warned_full = True
        if kind == "busy" and why == "share":
            LOG.warning(
                "gate: uid %d holds its share of %d connections; refusing its new ones", cred.uid, self._slots.share
            )
        else:
            LOG.warning(
                "gate: %s connections at their cap; refusing new ones (pid %d uid %d)",
                "denied" if kind == "denied" else "allowed",
                cred.pid,
                cred.uid,
            )

    def _release(self, kind: str, uid: int) -> None:
        self._slots.give_back(kind, uid)

    def _forget(self, conn: _Connection) -> None:
        self._release(conn.kind, conn.uid)
