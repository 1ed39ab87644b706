"""The server side of both routes: the gRPC server (Isolator, Admin, health, reflection) behind the
peer-credential gate, and the command-module bridge's listener beside it, on their Unix sockets.

Both routes call the same handlers (isolator/transport/handlers.py) through one admission
(isolator/transport/serving.py). The sockets are bound under a lock file so that two sidecars
never share one path: a stale socket left by a crash is replaced, a live one is never stolen.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import socket
import stat
import threading
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from isolator import model
from isolator.core.api import IsolatorApi
from isolator.errors import SocketError, SocketHeld, StateError
from isolator.host.pidlock import PidLock
from isolator.rpc import isolator_pb2 as pb
from isolator.transport import peergate, serving
from isolator.transport.bridge import BridgeListener
from isolator.transport.convert import container_id_from_proto
from isolator.transport.handlers import AdminHandlers, IsolatorHandlers, Observer
from isolator.transport.reflection import Reflection
from isolator.transport.settings import ServerSettings

LOG = logging.getLogger(__name__)

ISOLATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Isolator"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["Admin"].full_name
# Every RPC method served, by name: the ``hook`` label of the metrics (isolator/exporters/metrics.py).
HOOKS = tuple(m.name for s in ("Isolator", "Admin") for m in pb.DESCRIPTOR.services_by_name[s].methods)

# Bytes that are not the method's request message are INVALID_ARGUMENT, not gRPC's INTERNAL
# "Exception deserializing request!": isolator/transport/serving.py parses leniently.


# ---- the Unix socket ----------------------------------------------------------------------------


async def _make_health() -> health.aio.HealthServicer:
    return health.aio.HealthServicer()  # made on the loop it serves from


def socket_is_live(path: str) -> bool:
    """True when something accepts connections on ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise
    finally:
        probe.close()
    return True


class SocketGuard:
    """Holds ``<socket>.lock`` for the server's life and clears a stale socket under it.

    ``acquire`` creates the socket's directory if needed and remembers what it created, so a
    failed start can ``release`` without leaving anything half-made. The lock file holds its
    holder's pid (isolator/host/pidlock.py): a second sidecar on the path refuses with exit 75
    naming it, and only the holder ever removes the socket. ``flag`` names the option that chose
    the path, for that refusal.
    """

    def __init__(self, path: str, flag: str = "--socket") -> None:
        self.path = path
        self.flag = flag
        self.lock_path = path + ".lock"
        self._lock: PidLock | None = None
        self._created_dirs: list[str] = []

    @property
    def held(self) -> bool:
        return self._lock is not None

    def acquire(self) -> None:
        """Take the path (a no-op when already held: the daemon claims its sockets first of all)."""
        if self._lock is not None:
            return
        directory = os.path.dirname(self.path)
        self._make_dirs(directory)
        if os.path.islink(self.lock_path):
            self.release()
            raise SocketError(f"refusing lock file '{self.lock_path}': it is a symbolic link")
        try:
            self._lock = PidLock.acquire(
                self.lock_path, f"socket '{self.path}'", removable=True, held=SocketHeld, path=self.path, flag=self.flag
            )
        except SocketHeld:
            self._created_dirs.clear()  # the holder's directories
            raise
        except StateError as exc:
            self.release()
            if "not a regular file" in exc.message:
                raise SocketError(
                    f"refusing lock file '{self.lock_path}': not a regular file owned by uid {os.geteuid()}"
                ) from exc
            raise SocketError(f"failed to create lock file '{self.lock_path}': {exc.fields.get('cause')}") from exc
        try:
            self._clear_stale()
        except SocketError:
            self.release()
            raise

    def _make_dirs(self, directory: str) -> None:
        missing = []
        d = directory
        while d and not os.path.lexists(d):
            missing.append(d)
            d = os.path.dirname(d)
        if d and not os.path.isdir(d):
            raise SocketError(f"failed to create socket directory '{directory}': '{d}' is not a directory")
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o755)
            except OSError as exc:
                self._remove_created()
                raise SocketError(f"failed to create socket directory '{d}': {exc.strerror}") from exc
            self._created_dirs.append(d)
        if not os.access(directory, os.W_OK | os.X_OK):
            why = "is not writable"
            try:
                if os.statvfs(directory).f_flag & os.ST_RDONLY:
                    why = "is on a read-only file system"
            except OSError:
                pass
            raise SocketError(f"failed to bind '{self.path}': directory '{directory}' {why}")

    def _clear_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise SocketError(
                f"'{self.path}' is a directory; the socket option takes the socket's own path,"
                f" e.g. '{os.path.join(self.path, 'isolator.sock')}'"
            )
        if not stat.S_ISSOCK(st.st_mode):
            kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a socket"
            raise SocketError(
                f"refusing to replace '{self.path}': it exists and is {kind}; remove it or choose another path"
            )
        if socket_is_live(self.path):
            raise SocketError(f"refusing to replace '{self.path}': a live server answers on it")
        LOG.warning("removing stale socket '%s' left by an earlier run", self.path)
        os.unlink(self.path)

    def _remove_created(self) -> None:
        for d in reversed(self._created_dirs):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        self._created_dirs.clear()

    def release(self, remove_socket: bool = False) -> None:
        """Let the path go; ``remove_socket`` removes the socket too, only ever when held."""
        if remove_socket and self._lock is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._lock is not None:
            self._lock.release()  # unlinks the lock file while still holding it
            self._lock = None
        self._remove_created()


def socket_guards(settings: ServerSettings) -> tuple[SocketGuard, SocketGuard | None]:
    """The guards of the gRPC socket and of the bridge's (None when the bridge is off)."""
    bridge = SocketGuard(settings.bridge_path, "--bridge-socket") if settings.bridge_path else None
    return SocketGuard(settings.socket, "--socket"), bridge


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


class SidecarServer:
    """A gRPC server on a Unix socket serving Isolator, Admin, health and reflection.

    Beside it, unless disabled, the command-module bridge listens on ``settings.bridge_path`` and
    calls the same Isolator handlers (isolator/transport/bridge.py).
    """

    def __init__(
        self,
        settings: ServerSettings,
        service: IsolatorApi,
        observer: Observer | None = None,
        guards: tuple[SocketGuard, SocketGuard | None] | None = None,
    ) -> None:
        """``guards``: the gRPC and bridge sockets' guards when the daemon claimed them already
        (isolator/daemon/ownership.py); otherwise ``start`` takes them."""
        self.settings = settings
        self.service = service
        self.observer = observer
        self._guard, self._bridge_guard = guards if guards is not None else socket_guards(settings)
        self._bridge: BridgeListener | None = None
        self._bridge_held = False
        self._server: grpc.aio.Server | None = None
        self._loop = serving.EventLoopThread()
        self._dispatcher: serving.Dispatcher | None = None
        self._health = self._loop.call(_make_health())
        self._stopped = threading.Event()
        self._private = peergate.private_dir(settings.socket)
        self._private_made = False
        self._gate: peergate.PeerGate | None = None
        self._deny: grpc.Server | None = None

    @property
    def address(self) -> str:
        return "unix:" + self.settings.socket

    def start(self) -> None:
        cfg = self.settings
        self._guard.acquire()
        try:
            # gRPC listens only in a private 0700 directory; the public socket belongs to the gate,
            # which checks each caller's SO_PEERCRED (gRPC Python cannot see it) before splicing.
            peergate.make_private_dir(self._private)
            self._private_made = True
            isolator_handlers = IsolatorHandlers(self.service, self.observer)
            server = self._serve_aio(isolator_handlers)
            allowed_path = peergate.direct_path(cfg.socket)
            denied_path = os.path.join(self._private, peergate.DENIED_NAME)
            try:
                port = self._loop.call(self._add_port(server, "unix:" + allowed_path))
            except RuntimeError as exc:
                raise SocketError(f"failed to bind '{allowed_path}': {exc}") from exc
            if port == 0:
                raise SocketError(f"failed to bind '{allowed_path}'")
            self._deny = peergate.deny_server(denied_path)
            self._gate = peergate.PeerGate(
                self._bind_public(cfg.socket),
                allowed_path,
                denied_path,
                peergate.Allowlist.of(cfg.allowed_uids, cfg.allowed_gids),
                max_connections=cfg.max_connections,
            )
            self._start_bridge(isolator_handlers)
            self._loop.call(server.start())
            self._deny.start()
            self._gate.start()
        except BaseException:
            self._stop_bridge(grace=0)
            self._stop_gate(grace=0)
            self._stop_aio(grace=0)
            self._guard.release(remove_socket=True)
            raise
        self._server = server
        for name in ("", ISOLATOR_SERVICE, ADMIN_SERVICE):
            self._loop.call(self._health.set(name, health_pb2.HealthCheckResponse.SERVING))
        LOG.info(
            "serving on %s (mode %s, allowed uids %s, gids %s; direct for uid %d at %s)",
            cfg.socket,
            oct(cfg.socket_mode),
            sorted(set(cfg.allowed_uids) | {os.geteuid()}),
            sorted(cfg.allowed_gids),
            os.geteuid(),
            peergate.direct_path(cfg.socket),
        )

    def _serve_aio(self, isolator_handlers: IsolatorHandlers) -> grpc.aio.Server:
        """The aio server (isolator/transport/serving.py): Watch waits on a future, the rest runs on the pool."""
        cfg = self.settings
        dispatcher = self._dispatcher = serving.Dispatcher(cfg.max_workers, cfg.max_concurrent_rpcs)
        service = self.service

        def container_of(request: pb.WatchRequest) -> model.ContainerId:
            return container_id_from_proto(request.container_id)

        watch = serving.watch_handler(isolator_handlers, service.subscribe, container_of, pb.WatchResponse, dispatcher)

        async def build() -> grpc.aio.Server:
            server = grpc.aio.server(
                # Watches are bounded by serving.MAX_WATCHES, other calls by the dispatcher.
                maximum_concurrent_rpcs=serving.MAX_WATCHES + cfg.max_concurrent_rpcs + 64,
                options=serving.server_options(cfg.max_message_bytes),
            )
            server.add_generic_rpc_handlers(
                (
                    serving.unary_handlers(
                        ISOLATOR_SERVICE,
                        pb.DESCRIPTOR.services_by_name["Isolator"],
                        isolator_handlers,
                        dispatcher,
                        {"Watch": watch},
                    ),
                    serving.unary_handlers(
                        ADMIN_SERVICE,
                        pb.DESCRIPTOR.services_by_name["Admin"],
                        AdminHandlers(self.service, self.observer, cfg.mode),
                        dispatcher,
                        {},
                    ),
                )
            )
            health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
            serving.add_reflection(Reflection((ISOLATOR_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME)), server)
            return server

        return self._loop.call(build())

    @staticmethod
    async def _add_port(server: grpc.aio.Server, address: str) -> int:
        return server.add_insecure_port(address)

    def _stop_aio(self, grace: float) -> None:
        server, self._server = self._server, None
        dispatcher = self._dispatcher
        if server is not None:

            async def stop() -> None:
                if dispatcher is not None:
                    dispatcher.close_watches()  # open Watches answer UNAVAILABLE now, not after the grace
                await server.stop(grace)

            self._loop.call(stop())
        if dispatcher is not None:
            dispatcher.shutdown()
            self._dispatcher = None
        self._loop.close()

    def set_allowed(self, uids: tuple[int, ...], gids: tuple[int, ...]) -> None:
        """Who may call both sockets, from each one's next connection on (a reload on SIGHUP)."""
        if self._gate is not None:
            self._gate.set_allowlist(peergate.Allowlist.of(uids, gids))
        if self._bridge is not None:
            self._bridge.set_allowed(uids, gids)

    def set_serving(self, serving: bool) -> None:
        """The standard health service's answer for the whole server and the Isolator service
        (NOT_SERVING while no GPU can be handed out); Admin stays SERVING, to say why."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if self._server is not None and not self._stopped.is_set():
            for name in ("", ISOLATOR_SERVICE):
                self._loop.call(self._health.set(name, status))

    def _bind_public(self, path: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            # Born 0600 so there is no window in which another user could connect; the configured
            # mode and group are applied right after.
            with _umask(0o177):
                sock.bind(path)
            self._apply_socket_permissions(path)
            sock.listen(1024)  # bursts of connections wait here, not in a refusal
        except OSError as exc:
            sock.close()
            raise SocketError(f"failed to bind '{path}': {exc.strerror}") from exc
        except BaseException:
            sock.close()
            raise
        return sock

    def _stop_gate(self, grace: float) -> None:
        if self._gate is not None:
            self._gate.stop()
            self._gate = None
        if self._deny is not None:
            self._deny.stop(grace).wait()
            self._deny = None
        if self._private_made:
            peergate.remove_private_dir(self._private)
            self._private_made = False

    def _start_bridge(self, handlers: IsolatorHandlers) -> None:
        cfg = self.settings
        if self._bridge_guard is None:
            return
        path = self._bridge_guard.path
        self._bridge_guard.acquire()
        self._bridge_held = True
        sock = self._bind_public(path)  # born 0600, as the gRPC socket
        assert self._dispatcher is not None, "the aio server (and its Dispatcher) is built first"
        # The bridge's calls pass the gRPC calls' Dispatcher: one in-flight limit, one Cleanup lane.
        self._bridge = BridgeListener(
            sock,
            handlers,
            self._dispatcher,
            self._loop.loop,
            max_request_bytes=cfg.max_message_bytes,
            max_connections=cfg.max_connections,
            allowed_uids=cfg.allowed_uids,
            allowed_gids=cfg.allowed_gids,
        )
        self._bridge.start()
        LOG.info("command-module bridge listening on %s", path)

    def _stop_bridge(self, grace: float) -> None:
        if self._bridge is not None:
            self._bridge.stop(grace)
            self._bridge = None
        if self._bridge_guard is not None and self._bridge_held:
            self._bridge_guard.release(remove_socket=True)
            self._bridge_held = False

    def _apply_socket_permissions(self, path: str) -> None:
        cfg = self.settings
        gid = -1
        if cfg.socket_group:
            try:
                gid = grp.getgrnam(cfg.socket_group).gr_gid
            except KeyError:
                raise SocketError(f"failed to set group of '{path}': no group '{cfg.socket_group}'") from None
        try:
            if gid != -1:
                os.chown(path, -1, gid)
            os.chmod(path, cfg.socket_mode)
        except OSError as exc:
            raise SocketError(f"failed to set permissions of '{path}': {exc.strerror}") from exc

    def stop(self, grace: float = 5.0) -> None:
        if self._server is None or self._stopped.is_set():
            return
        self._stopped.set()
        self._loop.call(self._health.enter_graceful_shutdown())
        self._stop_bridge(grace)
        if self._gate is not None:
            self._gate.stop_accepting()
        # Calls in flight finish through their spliced connections, then the gate cuts them.
        self._stop_aio(grace)
        self._stop_gate(grace=0)
        self._guard.release(remove_socket=True)
        self.service.close()
        LOG.info("stopped serving on %s", self.settings.socket)

    def wait(self) -> None:
        self._stopped.wait()
