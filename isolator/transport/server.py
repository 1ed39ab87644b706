"""The gRPC server: servicers that translate proto <-> model (transport.convert), and the Unix socket's lifecycle.

Servicers only translate and map typed errors to status codes; they hold no logic. The socket is
bound under a lock file so that two sidecars never share one path: a stale socket left by a crash
is replaced, a live one is never stolen.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import grp
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from isolator import __version__, model
from isolator.bridge.listener import BridgeListener
from isolator.core.api import IsolatorApi
from isolator.daemon.config import Config
from isolator.errors import ContainerGone, IsolatorError, SocketError
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.transport import peergate, serving
from isolator.transport.convert import (
    config_from_proto,
    container_id_from_proto,
    container_info_to_proto,
    description_to_proto,
    gpu_info_to_proto,
    launch_info_to_proto,
    limitation_to_proto,
    maintenance_to_proto,
    released_to_proto,
    resources_from_proto,
    topology_to_proto,
    undrained_to_proto,
    usage_to_proto,
    volume_to_proto,
)
from isolator.transport.logcontext import hook_context
from isolator.transport.reflection import Reflection
from isolator.transport.status import mark_retryable, status_of

LOG = logging.getLogger(__name__)

ISOLATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Isolator"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["Admin"].full_name
# Every RPC method served, by name: the ``hook`` label of the metrics (isolator/exporters/metrics.py).
HOOKS = tuple(m.name for s in ("Isolator", "Admin") for m in pb.DESCRIPTOR.services_by_name[s].methods)

T = TypeVar("T")


# ---- error mapping (isolator/transport/status.py is the one place typed errors become statuses) -----------


# Told of every call once it is answered: (hook, status code name, seconds, response or None).
Observer = Callable[[str, str, float, Any], None]


def _container_text(request: Any) -> str:
    """The request's container ID as ``parent.child`` for logs ("" when it has none)."""
    node = getattr(request, "container_id", None)
    chain: list[str] = []
    while node is not None and len(chain) <= model.MAX_NESTING:
        chain.append(getattr(node, "value", ""))
        node = node.parent if node.HasField("parent") else None
    return ".".join(reversed(chain)) if any(chain) else ""


def _translate_errors(method: Callable[..., T]) -> Callable[..., T]:
    """Turn typed errors into statuses; anything else is a bug, logged with its traceback.

    The one edge every call passes (gRPC and the bridge alike): it also sets the hook and container
    for the log lines of the call, and tells the servicer's observer (metrics, job mapping).
    """
    hook = method.__name__

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> T:
        observer: Observer | None = self.observer  # every servicer has one (None: not observed)
        started = time.perf_counter()
        code, response = "OK", None
        with hook_context(hook, _container_text(request)):
            try:
                response = method(self, request, context)
                return response
            except IsolatorError as exc:
                code = exc.code
                LOG.log(
                    logging.DEBUG if isinstance(exc, ContainerGone) else logging.INFO,
                    "%s failed: %s",
                    hook,
                    exc.message,
                )
                mark_retryable(context, exc)
                context.abort(*status_of(exc, hook))
            except Exception as exc:
                code = "INTERNAL"
                LOG.exception("%s failed with an unexpected error", hook)
                context.abort(*status_of(exc, hook))
            finally:
                if observer is not None:
                    try:
                        observer(hook, code, time.perf_counter() - started, response)
                    except Exception:
                        LOG.exception("observer of %s failed", hook)
        raise AssertionError("unreachable: context.abort raises")

    return wrapper


# Bytes that are not the method's request message are INVALID_ARGUMENT, not gRPC's INTERNAL
# "Exception deserializing request!": isolator/transport/serving.py parses leniently.


# ---- servicers --------------------------------------------------------------------------------


class IsolatorServicer(pb_grpc.IsolatorServicer):
    def __init__(self, service: IsolatorApi, observer: Observer | None = None) -> None:
        self._service = service
        self.observer = observer

    @_translate_errors
    def Recover(self, request: pb.RecoverRequest, context: grpc.ServicerContext) -> pb.RecoverResponse:
        states = [
            model.ContainerState(container_id_from_proto(s.container_id), pid=s.pid, directory=s.directory)
            for s in request.states
        ]
        orphans = [container_id_from_proto(o) for o in request.orphans]
        result = self._service.recover(states, orphans)
        return pb.RecoverResponse(recovered=result.recovered, released=result.released)

    @_translate_errors
    def Prepare(self, request: pb.PrepareRequest, context: grpc.ServicerContext) -> pb.PrepareResponse:
        cid = container_id_from_proto(request.container_id)
        info = self._service.prepare(cid, config_from_proto(request.container_config))
        if info is None:
            return pb.PrepareResponse()
        return pb.PrepareResponse(launch_info=launch_info_to_proto(info))

    @_translate_errors
    def Isolate(self, request: pb.IsolateRequest, context: grpc.ServicerContext) -> pb.IsolateResponse:
        caller = peergate.caller_pid(context.peer())  # the gate's SO_PEERCRED: whose pid may be moved
        self._service.isolate(container_id_from_proto(request.container_id), request.pid, caller)
        return pb.IsolateResponse()

    @_translate_errors
    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> pb.WatchResponse:
        remaining = context.time_remaining()
        # Answer "no limitation yet" a little before the caller's deadline rather than racing it.
        if remaining is not None:
            remaining = max(0.0, remaining - min(0.25, remaining / 2))
        try:
            limitation = self._service.watch(container_id_from_proto(request.container_id), remaining)
        except ContainerGone:
            if getattr(context, "module_poll", False):
                # criteo's module polls once more after each Cleanup: a gone container has no
                # limitation, and an error here would be a line in both logs per container.
                return pb.WatchResponse()
            raise
        if limitation is None:
            return pb.WatchResponse()
        return pb.WatchResponse(limitation=limitation_to_proto(limitation))

    @_translate_errors
    def Update(self, request: pb.UpdateRequest, context: grpc.ServicerContext) -> pb.UpdateResponse:
        cid = container_id_from_proto(request.container_id)
        self._service.update(cid, list(resources_from_proto(request.resource_requests)))
        return pb.UpdateResponse()

    @_translate_errors
    def Usage(self, request: pb.UsageRequest, context: grpc.ServicerContext) -> pb.UsageResponse:
        return usage_to_proto(self._service.usage(container_id_from_proto(request.container_id)))

    @_translate_errors
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        status = self._service.status(container_id_from_proto(request.container_id))
        return pb.StatusResponse(gpu_uuids=status.gpu_uuids, state=status.state)

    @_translate_errors
    def Cleanup(self, request: pb.CleanupRequest, context: grpc.ServicerContext) -> pb.CleanupResponse:
        self._service.cleanup(container_id_from_proto(request.container_id))
        return pb.CleanupResponse()


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, service: IsolatorApi, observer: Observer | None = None, mode: str = "") -> None:
        self._service = service
        self._mode = mode  # for Health: which mode the answering sidecar runs in
        self.observer = observer

    @_translate_errors
    def ListGpus(self, request: pb.ListGpusRequest, context: grpc.ServicerContext) -> pb.ListGpusResponse:
        gpus = self._service.list_gpus()
        return pb.ListGpusResponse(
            driver_version=gpus.driver_version,
            cuda_driver_version=gpus.cuda_driver_version,
            gpus=[gpu_info_to_proto(g) for g in gpus.gpus],
            sidecar_version=__version__,
        )

    @_translate_errors
    def Topology(self, request: pb.TopologyRequest, context: grpc.ServicerContext) -> pb.TopologyResponse:
        return topology_to_proto(self._service.topology())

    @_translate_errors
    def ListContainers(
        self, request: pb.ListContainersRequest, context: grpc.ServicerContext
    ) -> pb.ListContainersResponse:
        containers = self._service.list_containers()
        return pb.ListContainersResponse(containers=[container_info_to_proto(c) for c in containers])

    @_translate_errors
    def DescribeContainer(
        self, request: pb.DescribeContainerRequest, context: grpc.ServicerContext
    ) -> pb.DescribeContainerResponse:
        return description_to_proto(self._service.describe_container(container_id_from_proto(request.container_id)))

    @_translate_errors
    def Volume(self, request: pb.VolumeRequest, context: grpc.ServicerContext) -> pb.VolumeResponse:
        return volume_to_proto(self._service.volume())

    @_translate_errors
    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        checks = self._service.health()
        return pb.HealthResponse(
            checks=[pb.HealthResponse.Check(name=c.name, ok=c.ok, detail=c.detail) for c in checks],
            version=__version__,
            mode=self._mode,
            hostname=socket.gethostname(),
        )

    @_translate_errors
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        released = self._service.release(container_id_from_proto(request.container_id), request.force)
        return released_to_proto(released)

    @_translate_errors
    def Audit(self, request: pb.AuditRequest, context: grpc.ServicerContext) -> pb.AuditResponse:
        report = self._service.audit()
        return pb.AuditResponse(checked=report.checked, repaired=report.repaired, repairs_total=report.repairs_total)

    @_translate_errors
    def Undrain(self, request: pb.UndrainRequest, context: grpc.ServicerContext) -> pb.UndrainResponse:
        return undrained_to_proto(self._service.undrain(request.gpu))

    @_translate_errors
    def MaintenanceDrain(
        self, request: pb.MaintenanceDrainRequest, context: grpc.ServicerContext
    ) -> pb.MaintenanceResponse:
        caller = peergate.caller_text(context.peer())  # the gate's SO_PEERCRED: who took it out of service
        return maintenance_to_proto(self._service.maintenance_drain(request.gpu, request.reason, caller))

    @_translate_errors
    def MaintenanceUndrain(
        self, request: pb.MaintenanceUndrainRequest, context: grpc.ServicerContext
    ) -> pb.MaintenanceResponse:
        caller = peergate.caller_text(context.peer())
        return maintenance_to_proto(self._service.maintenance_undrain(request.gpu, caller))


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
    failed start can ``release`` without leaving anything half-made.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock_path = path + ".lock"
        self._lock_fd: int | None = None
        self._created_dirs: list[str] = []

    def acquire(self) -> None:
        directory = os.path.dirname(self.path)
        self._make_dirs(directory)
        try:
            # O_NOFOLLOW: a link planted in the socket's directory never makes us create or open its
            # target; O_NONBLOCK: a planted FIFO cannot hang the start (it is refused just below).
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(self.lock_path, flags, 0o600)
        except OSError as exc:
            self.release()
            if exc.errno == errno.ELOOP:
                raise SocketError(f"refusing lock file '{self.lock_path}': it is a symbolic link") from exc
            raise SocketError(f"failed to create lock file '{self.lock_path}': {exc.strerror}") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            self.release()
            raise SocketError(f"refusing lock file '{self.lock_path}': not a regular file owned by uid {os.geteuid()}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._created_dirs.clear()
            raise SocketError(f"another sidecar holds '{self.lock_path}' and serves on '{self.path}'") from None
        self._lock_fd = fd
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
        if remove_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lock_path)
            os.close(self._lock_fd)
            self._lock_fd = None
        self._remove_created()


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


class SidecarServer:
    """A gRPC server on a Unix socket serving Isolator, Admin, health and reflection.

    Beside it, unless disabled, the command-module bridge listens on ``config.bridge_path`` and
    calls the same Isolator servicer (isolator/bridge/listener.py).
    """

    def __init__(self, config: Config, service: IsolatorApi, observer: Observer | None = None) -> None:
        self.config = config
        self.service = service
        self.observer = observer
        self._guard = SocketGuard(config.socket)
        self._bridge_guard = SocketGuard(config.bridge_path) if config.bridge_path else None
        self._bridge: BridgeListener | None = None
        self._bridge_held = False
        self._server: grpc.aio.Server | None = None
        self._loop = serving.EventLoopThread()
        self._dispatcher: serving.Dispatcher | None = None
        self._health = self._loop.call(_make_health())
        self._stopped = threading.Event()
        self._private = peergate.private_dir(config.socket)
        self._private_made = False
        self._gate: peergate.PeerGate | None = None
        self._deny: grpc.Server | None = None

    @property
    def address(self) -> str:
        return "unix:" + self.config.socket

    def start(self) -> None:
        cfg = self.config
        self._guard.acquire()
        try:
            # gRPC listens only in a private 0700 directory; the public socket belongs to the gate,
            # which checks each caller's SO_PEERCRED (gRPC Python cannot see it) before splicing.
            peergate.make_private_dir(self._private)
            self._private_made = True
            isolator_servicer = IsolatorServicer(self.service, self.observer)
            server = self._serve_aio(isolator_servicer)
            allowed_path = os.path.join(self._private, peergate.ALLOWED_NAME)
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
            self._start_bridge(isolator_servicer)
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
            "serving on %s (mode %s, allowed uids %s, gids %s)",
            cfg.socket,
            oct(cfg.socket_mode),
            sorted(set(cfg.allowed_uids) | {os.geteuid()}),
            sorted(cfg.allowed_gids),
        )

    def _serve_aio(self, isolator_servicer: IsolatorServicer) -> grpc.aio.Server:
        """The aio server (isolator/transport/serving.py): Watch waits on a future, the rest runs on the pool."""
        cfg = self.config
        dispatcher = self._dispatcher = serving.Dispatcher(cfg.max_workers, cfg.max_concurrent_rpcs)
        service = self.service

        def container_of(request: pb.WatchRequest) -> model.ContainerId:
            return container_id_from_proto(request.container_id)

        watch = serving.watch_handler(isolator_servicer, service.subscribe, container_of, pb.WatchResponse, dispatcher)

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
                        isolator_servicer,
                        dispatcher,
                        {"Watch": watch},
                        self.observer,
                    ),
                    serving.unary_handlers(
                        ADMIN_SERVICE,
                        pb.DESCRIPTOR.services_by_name["Admin"],
                        AdminServicer(self.service, self.observer, self.config.mode),
                        dispatcher,
                        {},
                        self.observer,
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

    def _start_bridge(self, servicer: IsolatorServicer) -> None:
        cfg = self.config
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
            servicer,
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
        cfg = self.config
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
        LOG.info("stopped serving on %s", self.config.socket)

    def wait(self) -> None:
        self._stopped.wait()
