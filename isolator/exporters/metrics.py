"""Prometheus metrics (prometheus-client) on an opt-in listen address, and the server-edge observer
that feeds them.

Names follow Prometheus conventions and the Mesos agent's GPU metrics (``slave/gpus_total``,
``slave/gpus_used``): gauges read from the service at scrape time (nothing to keep in step), and
counters/histograms updated by ``observe`` (called once per hook by the server's error mapping) and
by the daemon loop (reconciliation repairs) and the volume manager (builds). docs/metrics.md lists
them. The registry is this object's own, not prometheus-client's global one; it also carries
prometheus-client's standard ``process_*`` metrics (a restart shows as a new ``process_start_time_seconds``)
and ``gpu_isolator_build_info``. The GPU UUID label is ``UUID``, as dcgm-exporter names it, so that
PromQL joins the two exporters' series without ``label_replace``.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import socketserver
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from isolator import __version__
from isolator.errors import ConfigError, SocketError
from isolator.model import ShareMode

LOG = logging.getLogger(__name__)

PREFIX = "gpu_isolator"
# Hook latencies: a cycle is milliseconds (docs/bench.md); Watch may wait up to its deadline.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Anyone who can connect is answered (on TCP, any local user): a connection silent for this long is
# dropped, and at most this many are answered at once (more are closed as they are accepted).
IO_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 16
# The (hook, code) pairs of gpu_isolator_errors_total that the shipped alert rules select
# (isolator/data/prometheus-rules.yml): exported at 0 from the start, so that the first error is an
# increase from 0 that `increase()` sees, not a new series born at 1 that it cannot (issue 33 item 3).
# The sidecar's own failures, on any hook; refusals, on the hooks the agent calls to place a container.
FAILURE_CODES = ("INTERNAL", "UNKNOWN", "DATA_LOSS", "UNAVAILABLE", "DEADLINE_EXCEEDED")
REFUSAL_HOOKS = ("Prepare", "Isolate", "Update")
REFUSAL_CODES = ("RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "ALREADY_EXISTS", "PERMISSION_DENIED")


class Metrics:
    """What the daemon measures. ``observe`` has the server's observer signature."""

    def __init__(self, service: Any = None, hooks: Iterable[str] = ()) -> None:
        """``hooks``: every RPC method the daemon serves (``isolator.transport.server.HOOKS``), so
        that the error series the alert rules select exist at 0 before the first call."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.service = service
        self.hook_seconds = Histogram(
            f"{PREFIX}_hook_duration_seconds",
            "Time to answer an isolator or admin call, by hook (RPC method) and outcome (ok or error)",
            ("hook", "outcome"),
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            f"{PREFIX}_errors",
            "Calls answered with an error, by hook and gRPC status code",
            ("hook", "code"),
            registry=self.registry,
        )
        for hook in hooks:
            for code in FAILURE_CODES + (REFUSAL_CODES if hook in REFUSAL_HOOKS else ()):
                self.errors.labels(hook, code)
        self.repairs = Counter(
            f"{PREFIX}_reconciliation_repairs",
            "Allocations released by reconciliation: 'recover' (Recover's orphans and unknowns),"
            " 'reap' (containers whose Mesos cgroup vanished); 'audit': kernel rules re-applied by the drift audit",
            ("kind",),
            registry=self.registry,
        )
        for kind in ("recover", "reap", "audit"):
            self.repairs.labels(kind)  # exported as 0 from the start, not from the first repair
        self.volume_builds = Counter(
            f"{PREFIX}_volume_builds", "Driver volumes built (not reused)", registry=self.registry
        )
        ProcessCollector(registry=self.registry)  # process_*: CPU, memory, fds, start time (Linux /proc)
        self.registry.register(_ServiceCollector(self))

    def observe(self, hook: str, code: str, seconds: float, response: Any = None) -> None:
        self.hook_seconds.labels(hook, "ok" if code == "OK" else "error").observe(seconds)
        if code != "OK":
            self.errors.labels(hook, code).inc()
        elif hook == "Recover" and response is not None:
            self.repairs.labels("recover").inc(int(getattr(response, "released", 0)))
        elif hook == "Audit" and response is not None:
            self.audited(len(getattr(response, "repaired", ())))

    def reaped(self, count: int) -> None:
        self.repairs.labels("reap").inc(count)

    def audited(self, count: int) -> None:
        self.repairs.labels("audit").inc(count)

    def volume_built(self, _result: object = None) -> None:
        self.volume_builds.inc()


# Per-GPU series carry dcgm-exporter's identity labels beside ours (gpu, minor), spelled and formatted
# as dcgm-exporter writes them (``UUID``, ``modelName`` = NVML's name, ``pci_bus_id`` = NVML's
# ``00000000:07:00.0``), so that PromQL joins the two exporters on any of them without label_replace.
GPU_LABELS = ("gpu", "UUID", "minor", "modelName", "pci_bus_id")


def dcgm_bus_id(sysfs: str) -> str:
    """sysfs's ``0000:1a:00.0`` (the inventory's form) -> NVML's and dcgm-exporter's ``00000000:1A:00.0``."""
    domain, sep, rest = sysfs.partition(":")
    if not sep or not rest:
        return sysfs
    try:
        return f"{int(domain, 16):08X}:{rest.upper()}"
    except ValueError:
        return sysfs


def gpu_labels(g: Any) -> list[str]:
    """GPU_LABELS' values for one ``GpuInfo``."""
    return [str(g.index), g.uuid, str(g.minor), g.name, dcgm_bus_id(g.pci_bus_id)]


class _ServiceCollector(Collector):
    """Gauges read from the service when scraped."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily(f"{PREFIX}_build_info", "Always 1; the running daemon's version", labels=("version",))
        build.add_metric([__version__], 1)
        yield build
        service = self._metrics.service
        if service is None:
            return
        gpus = service.list_gpus().gpus
        containers = [c for c in service.list_containers() if not c.nested]
        # As the agent counts its ``gpus`` resource (`gpu-isolator resources`): a shared GPU is offered as
        # gpu-share-<N> units and a MIG-mode GPU as mig-<profile> units, neither as gpus (docs/metrics.md).
        whole = [g for g in gpus if not g.shares_total and not g.mig_enabled]
        total = GaugeMetricFamily(
            f"{PREFIX}_gpus", "GPUs offered whole, neither shared nor in MIG mode (Mesos: slave/gpus_total)"
        )
        total.add_metric([], len(whole))
        used = GaugeMetricFamily(f"{PREFIX}_gpus_used", "Whole GPUs allocated to containers (Mesos: slave/gpus_used)")
        used.add_metric([], sum(1 for g in whole if g.holder))
        healthy = GaugeMetricFamily(f"{PREFIX}_gpus_healthy", "GPUs healthy and usable")
        healthy.add_metric([], sum(1 for g in gpus if g.healthy))
        per_gpu = GaugeMetricFamily(
            f"{PREFIX}_gpu_healthy", "1 when the GPU is healthy and usable, else 0", labels=GPU_LABELS
        )
        for g in gpus:
            per_gpu.add_metric(gpu_labels(g), 1 if g.healthy else 0)
        held = GaugeMetricFamily(f"{PREFIX}_container_gpus", "GPUs each container holds", labels=("container_id",))
        for c in containers:
            held.add_metric([str(c.container_id)], len(c.gpu_minors))
        yield from (total, used, healthy, per_gpu, held)
        # The handover check (docs/handover.md): free GPUs kept out because something still runs on them.
        handover = GaugeMetricFamily(
            f"{PREFIX}_gpus_held_for_handover",
            "Free GPUs the handover check holds out (draining, or unhealthy past --drain-timeout)",
        )
        handover.add_metric([], sum(1 for g in gpus if g.drain_state))
        per_handover = GaugeMetricFamily(
            f"{PREFIX}_gpu_held_for_handover",
            "1 while the handover check holds the GPU out; state: draining, or unhealthy past --drain-timeout",
            labels=(*GPU_LABELS, "state"),
        )
        handover_age = GaugeMetricFamily(
            f"{PREFIX}_gpu_held_for_handover_seconds",
            "How long the handover check has held the GPU out (only GPUs it holds)",
            labels=GPU_LABELS,
        )
        now = time.time()
        for g in gpus:
            per_handover.add_metric([*gpu_labels(g), g.drain_state or "free"], 1 if g.drain_state else 0)
            if g.drain_state:
                handover_age.add_metric(gpu_labels(g), max(0.0, now - g.drain_since))
        yield from (handover, per_handover, handover_age)
        # An operator's drains (gpu-isolator drain, docs/operations.md): every GPU has a series, 0 or 1,
        # from the start, so that an alert on a drain sees it begin. Named as the command: drained.
        out = GaugeMetricFamily(f"{PREFIX}_gpus_drained", "GPUs an operator drained (gpu-isolator drain)")
        out.add_metric([], sum(1 for g in gpus if g.maintenance))
        per_out = GaugeMetricFamily(
            f"{PREFIX}_gpu_drained",
            "1 while an operator keeps the GPU out of service (gpu-isolator drain; gpus says why and who)",
            labels=GPU_LABELS,
        )
        out_age = GaugeMetricFamily(
            f"{PREFIX}_gpu_drained_seconds",
            "How long the GPU has been drained by an operator (only GPUs that are)",
            labels=GPU_LABELS,
        )
        for g in gpus:
            per_out.add_metric(gpu_labels(g), 1 if g.maintenance else 0)
            if g.maintenance:
                out_age.add_metric(gpu_labels(g), max(0.0, now - g.maintenance_since))
        yield from (out, per_out, out_age)
        # MIG devices as units (docs/mig.md), per Mesos resource name (mig-<profile>).
        offered: dict[str, list[int]] = {}
        for g in gpus:
            for m in g.mig_devices:
                if m.resource:
                    counts = offered.setdefault(m.resource, [0, 0])
                    counts[0] += 1
                    counts[1] += 1 if m.holder else 0
        mig_total = GaugeMetricFamily(
            f"{PREFIX}_mig_devices", "MIG devices offered, per resource", labels=("resource",)
        )
        mig_used = GaugeMetricFamily(
            f"{PREFIX}_mig_devices_used", "MIG devices allocated to containers, per resource", labels=("resource",)
        )
        for name, (count, in_use) in sorted(offered.items()):
            mig_total.add_metric([name], count)
            mig_used.add_metric([name], in_use)
        mig_held = GaugeMetricFamily(
            f"{PREFIX}_container_mig_devices", "MIG devices each container holds", labels=("container_id",)
        )
        for c in containers:
            mig_held.add_metric([str(c.container_id)], len(c.mig_uuids))
        yield from (mig_total, mig_used, mig_held)
        yield from self._shares(gpus, containers)
        yield from self._container_use(containers)
        yield self._health_checks(service)

    @staticmethod
    def _container_use(containers: list[Any]) -> Iterator[Metric]:
        """What each container's processes use on each device it holds (core/usage.py): one series per
        live container and device, gone with the container; none for a device NVML could not list."""
        labels = ("container_id", "UUID", "kind")
        used = GaugeMetricFamily(
            f"{PREFIX}_container_gpu_memory_used_bytes",
            "GPU memory a container's processes use on a device it holds (NVML per process, by cgroup)",
            labels=labels,
        )
        limit = GaugeMetricFamily(
            f"{PREFIX}_container_gpu_memory_limit_bytes",
            "GPU memory a container may use on a device it holds: the device's, or a share's slice",
            labels=labels,
        )
        sm = GaugeMetricFamily(
            f"{PREFIX}_container_gpu_sm_utilization_percent",
            "SM utilisation of a container's processes on a device it holds (where the driver reports it)",
            labels=labels,
        )
        over = GaugeMetricFamily(
            f"{PREFIX}_container_gpu_share_over",
            "1 while a holder of gpu_shares uses more GPU memory than its slice, else 0",
            labels=("container_id", "UUID"),
        )
        for c in containers:
            for d in c.usage:
                if d.error:
                    continue
                values = [str(c.container_id), d.uuid, d.kind]
                used.add_metric(values, d.memory_used)
                limit.add_metric(values, d.memory_limit)
                if d.sm_utilization is not None:
                    sm.add_metric(values, d.sm_utilization)
                if d.kind == "share":
                    over.add_metric([str(c.container_id), d.uuid], 1 if d.over else 0)
        yield from (used, limit, sm, over)

    def _shares(self, gpus: list[Any], containers: list[Any]) -> Iterator[Metric]:
        """Shares of the shared GPUs (docs/sharing.md): what each is cut into, what is held, its MPS daemon."""
        labels = ("gpu", "UUID", "minor", "mode")
        total = GaugeMetricFamily(f"{PREFIX}_gpu_shares", "Shares a shared GPU is cut into (gpu_shares)", labels=labels)
        held = GaugeMetricFamily(
            f"{PREFIX}_gpu_shares_held", "Shares of a shared GPU held by containers", labels=labels
        )
        mps = GaugeMetricFamily(
            f"{PREFIX}_mps_daemon_up",
            "1 while the MPS control daemon of a shared GPU in mps mode runs, else 0; state: running, stopped,"
            " failed, or none before its first sharer",
            labels=("gpu", "UUID", "minor", "state"),
        )
        # Every GPU in mps mode has a series from the start, at 0, so that the first restart is an
        # increase that the shipped alert (GpuIsolatorMpsDaemonRestarted) sees.
        restarts = CounterMetricFamily(
            f"{PREFIX}_mps_daemon_restarts",
            "MPS control daemons of a shared GPU in mps mode found dead (killed, crashed) and started again"
            " since the sidecar started",
            labels=("gpu", "UUID", "minor"),
        )
        for g in gpus:
            if not g.shares_total:
                continue
            key = [str(g.index), g.uuid, str(g.minor), g.share_mode]
            total.add_metric(key, g.shares_total)
            held.add_metric(key, g.shares_held)
            if g.share_mode == ShareMode.MPS:
                state = g.mps_state.split(":", 1)[0] or "none"
                mps.add_metric([str(g.index), g.uuid, str(g.minor), state], 1 if state == "running" else 0)
                restarts.add_metric([str(g.index), g.uuid, str(g.minor)], g.mps_restarts)
        per_container = GaugeMetricFamily(
            f"{PREFIX}_container_gpu_shares", "gpu_shares each container holds", labels=("container_id",)
        )
        for c in containers:
            if c.shares:
                per_container.add_metric([str(c.container_id)], c.shares)
        yield from (total, held, mps, restarts, per_container)

    def _health_checks(self, service: Any) -> Metric:
        """`gpu-isolator health`'s checks (nvml, cgroups, state, consistency): 1 passing, 0 failing."""
        family = GaugeMetricFamily(
            f"{PREFIX}_health_check",
            "1 when the sidecar's health check passes, else 0 (gpu-isolator health says why)",
            labels=("check",),
        )
        try:
            checks = [(c.name, c.ok) for c in service.health()]
        except Exception:
            LOG.exception("metrics: the health checks failed")
            checks = [("health", False)]
        for name, ok in checks:
            family.add_metric([name], 1 if ok else 0)
        return family


# ---- serving ----------------------------------------------------------------------------------------


# The port docs/metrics.md suggests: not dcgm-exporter's 9400, which runs beside the sidecar on the same
# GPU nodes (nor node_exporter's 9100, the Mesos exporter's 9105, nvidia_gpu_exporter's 9835).
SUGGESTED_PORT = 9416
ALL_INTERFACES = ""  # ``:PORT``, as Go exporters read it (net.Listen): every interface, IPv6 and IPv4


def parse_address(value: str) -> tuple[str, Any]:
    """``unix:/path`` -> ("unix", path); ``HOST:PORT``, ``:PORT`` or ``PORT`` -> ("tcp", (host, port)).

    ``:PORT`` means every interface, as for Go exporters (dcgm-exporter's ``:9400``, node_exporter's
    ``:9100``): an operator who copies that form means the network. A bare ``PORT`` binds localhost:
    metrics name containers, so they are not published to the network unless an address says so.
    """
    text = value.strip()
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if not path.startswith("/"):
            raise ConfigError(f"--metrics-address '{value}': a unix socket path must be absolute")
        return "unix", path
    host, sep, port = text.rpartition(":")
    if not sep:
        host = "127.0.0.1"
    elif host == "":
        host = ALL_INTERFACES
    else:
        host = host.strip("[]")
        if not host:
            raise ConfigError(f"--metrics-address '{value}': an empty host; ':PORT' means every interface")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--metrics-address '{value}': expected HOST:PORT, :PORT or unix:/path")
    return "tcp", (host, int(port))


class _Quiet(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = IO_TIMEOUT_S  # type: ignore[misc]  # StreamRequestHandler.setup applies it
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        LOG.debug("metrics: " + format, *args)

    def address_string(self) -> str:
        return "unix" if isinstance(self.client_address, (str, bytes)) else super().address_string()


class _Bounded(socketserver.ThreadingMixIn):
    """A thread per connection, at most MAX_CONNECTIONS at once; errors (a timed-out or dropped
    connection) go to the debug log, not to stderr as socketserver's tracebacks."""

    daemon_threads = True
    _slots: threading.BoundedSemaphore | None = None

    def process_request(self, request: Any, client_address: Any) -> None:
        if self._slots is None:
            self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        if not self._slots.acquire(blocking=False):
            LOG.debug("metrics: %d connections already open; closing a new one", MAX_CONNECTIONS)
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            assert self._slots is not None
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        LOG.debug("metrics: a connection failed", exc_info=True)


class _TcpServer(_Bounded, WSGIServer):
    pass


class _TcpServer6(_TcpServer):
    address_family = socket.AF_INET6


class _TcpServerAny(_TcpServer6):
    """``[::]`` with IPV6_V6ONLY off: IPv6 and IPv4 (as ``::ffff:a.b.c.d``) on one socket, as Go's ``:PORT``."""

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class _UnixServer(_Bounded, WSGIServer):
    address_family = socket.AF_UNIX

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "localhost", 0
        self.setup_environ()

    def get_request(self) -> tuple[Any, Any]:
        conn, _ = self.socket.accept()
        return conn, ("unix", 0)


class MetricsServer:
    """Serves ``/metrics`` (and ``/``) over HTTP on TCP or a unix socket, on a daemon thread."""

    def __init__(self, address: str, metrics: Metrics, socket_mode: int = 0o660) -> None:
        self.kind, self.target = parse_address(address)
        self.metrics = metrics
        self.socket_mode = socket_mode
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        app = make_wsgi_app(self.metrics.registry)
        try:
            if self.kind == "unix":
                path = self.target
                if os.path.lexists(path):
                    if not os.path.isdir(path) and not os.path.islink(path) and _is_socket(path):
                        if _is_live(path):  # another daemon's (the daemon claims the path first)
                            raise SocketError(f"refusing to replace '{path}' for metrics: a live server answers on it")
                        os.unlink(path)  # a stale metrics socket of an earlier run
                    else:
                        raise SocketError(f"refusing to replace '{path}' for metrics: it exists and is not a socket")
                server: WSGIServer = _UnixServer(path, _Quiet)
                os.chmod(path, self.socket_mode)
            elif self.target[0] == ALL_INTERFACES:
                server = _any_interface(self.target[1])
            else:
                cls = _TcpServer6 if ":" in self.target[0] else _TcpServer
                server = cls(self.target, _Quiet)
        except OSError as exc:
            raise SocketError(f"failed to bind metrics address '{self.address}': {exc.strerror}") from exc
        server.set_app(app)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        if self.kind == "tcp" and self.target[0] == ALL_INTERFACES:
            LOG.info("metrics on every interface (%s): published to the network", self.address)
        else:
            LOG.info("metrics on %s", self.address)
        return self

    @property
    def address(self) -> str:
        if self.kind == "unix":
            return "unix:" + str(self.target)
        if self._server is not None:
            bound: Any = self._server.server_address
            host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
            return f"{host}:{bound[1]}"
        return f"{self.target[0]}:{self.target[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            if self.kind == "unix":
                try:
                    os.unlink(self.target)
                except FileNotFoundError:
                    pass


def _any_interface(port: int) -> WSGIServer:
    """Every interface: dual-stack ``[::]``, or ``0.0.0.0`` where the kernel has no IPv6."""
    try:
        return _TcpServerAny(("::", port), _Quiet)
    except OSError as exc:
        if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            raise
        return _TcpServer(("0.0.0.0", port), _Quiet)


def _is_socket(path: str) -> bool:
    return stat.S_ISSOCK(os.lstat(path).st_mode)


def _is_live(path: str) -> bool:
    """Whether something accepts connections on the socket ``path`` (refused: a stale one)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True
