"""The serving lifecycle: configuration -> the service and the edges (compose.py) -> both sockets serve,
the periodic jobs run (jobs.py) -> SIGTERM. It also reloads on SIGHUP, and configures the daemon's log
handlers; it decides nothing about containers or GPUs.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

from isolator.daemon.compose import (
    Exporters,
    agent_flags,
    agent_resources,
    build_service,
    generate_cdi,
)
from isolator.daemon.config import Config
from isolator.daemon.jobs import CdiKeeper, Jobs, NvmlHealth, RescanFollower, periodic_jobs
from isolator.errors import ConfigError
from isolator.model import Mode

if TYPE_CHECKING:
    from isolator.core.service import IsolatorService
    from isolator.daemon.ownership import Claims
    from isolator.gpu.nvml import Inventory
    from isolator.transport.server import SidecarServer

# The cli (``serve``, ``resources``, ``attributes``, ``cdi generate``) and the benchmarks reach the
# composition through this module.
__all__ = ["CdiKeeper", "agent_flags", "agent_resources", "build_service", "generate_cdi", "serve"]

LOG = logging.getLogger("isolator")


def configure_logging(level: str, fmt: str = "text") -> None:
    from isolator.daemon.logfmt import JsonFormatter, TextFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class Reloader:
    """SIGHUP: read the configuration again (same flags, same file) and take over what can change
    while serving (isolator/daemon/reload.py); log what changed and what needs a restart. A file
    that fails to load leaves every setting as it was."""

    def __init__(
        self,
        config: Config,
        read: Callable[[], Config],
        server: SidecarServer,
        nvml: Inventory | None,
        jobs: Jobs,
        share: Callable[[tuple[Any, ...]], None] | None = None,
    ) -> None:
        self.config = config
        self._read = read
        self._server = server
        self._nvml = nvml
        self._jobs = jobs
        self._share = share  # the service's share_gpus (docs/sharing.md)

    def reload_on(self, hup: threading.Event) -> None:
        """Reload once if a SIGHUP came since the last look."""
        if hup.is_set():
            hup.clear()
            self.reload()

    def reload(self) -> bool:
        """True when the file loaded (whether or not anything changed)."""
        from isolator.daemon import reload as policy
        from isolator.errors import IsolatorError

        source = f"config file '{self.config.config_file}'" if self.config.config_file else "flags (no --config)"
        try:
            new = self._read()
        except IsolatorError as exc:
            LOG.error("SIGHUP: failed to reload: %s; keeping every current setting", exc.message)
            return False
        changed, restart = policy.difference(self.config, new)
        if "shared_gpus" in changed:
            # Taken over by the books first, under their lock: refused as a whole when it would switch a
            # held GPU between whole and shared, and then the old value stays (never both at once).
            try:
                if self._share is None:
                    raise ConfigError("no GPUs are managed here")
                self._share(new.shared_gpus)
            except IsolatorError as exc:
                old = policy.describe(self.config.shared_gpus)
                LOG.error("SIGHUP: shared-gpus not changed (still %s): %s", old, exc.message)
                del changed["shared_gpus"]
        # The whole new state first: allowed uids and gids go to the gate together.
        self.config = replace(self.config, **{name: value for name, (_, value) in changed.items()})
        for name in changed:
            self._apply(name)
        if changed:
            what = "; ".join(
                f"{name} {policy.describe(old)} -> {policy.describe(value)}" for name, (old, value) in changed.items()
            )
            LOG.warning("SIGHUP: reloaded %s: %s", source, what)
        else:
            LOG.info("SIGHUP: reloaded %s: no reloadable setting changed", source)
        if restart:
            LOG.warning(
                "SIGHUP: %s changed but cannot change while serving; still running with the old values until a"
                " restart (reloadable: %s)",
                ", ".join(restart),
                ", ".join(policy.RELOADABLE),
            )
        return True

    def _apply(self, name: str) -> None:
        config = self.config
        if name == "log_level":
            logging.getLogger().setLevel(config.log_level.upper())
        elif name == "audit_interval":
            self._jobs.restart("audit", config.audit_interval)
        elif name == "gpu_probe_interval" and self._nvml is not None:
            self._nvml.probe_s = config.gpu_probe_interval  # from the probe after the next
        elif name == "ignored_xids" and self._nvml is not None:
            self._nvml.ignored_xids = frozenset(config.ignored_xids)
        elif name in ("allowed_uids", "allowed_gids"):
            self._server.set_allowed(config.allowed_uids, config.allowed_gids)


def _nvml_of(service: IsolatorService) -> Inventory | None:
    """The service's NVML inventory, or None on a node without GPUs (``--resources gpus:0``)."""
    from isolator.host.system import EmptyInventory

    inventory = service.core.inventory
    return None if isinstance(inventory, EmptyInventory) else cast("Inventory", inventory)


def serve(config: Config, reread: Callable[[], Config] | None = None) -> int:
    """Run the sidecar until SIGTERM or SIGINT. Raises IsolatorError if it cannot start.

    Under systemd (``Type=notify``) it sends READY=1 once the state is restored (every recorded
    allocation booked), both sockets serve and, in mesos mode, the first reconciliation against
    Mesos's cgroups has released containers destroyed while it was down; WATCHDOG=1 from this serving loop at half the
    watchdog interval, and STOPPING=1 when told to stop.
    """
    from isolator.daemon.crashpoints import arm_from_environment
    from isolator.daemon.workdir import WorkDirLock

    arm_from_environment()

    # SIGHUP from the first moment: its default action kills the daemon (exit 129) and leaves its
    # sockets and lock files behind. Before serving it is remembered, then handled as a reload.
    hup = threading.Event()
    signal.signal(signal.SIGHUP, lambda _signum, _frame: hup.set())
    configure_logging(config.log_level, config.log_format)
    # First of all: one daemon per state directory (two would run two reapers and auditors over
    # one SQLite state and book each other's GPUs). Held until this process ends.
    lock = WorkDirLock.acquire(config.work_dir)
    try:
        # The sockets and the cgroups root are claimed later (build_service), once the GPUs and the
        # flags were checked and before the state is read or a cgroup recovered.
        owned: list[Claims] = []
        try:
            return _serve(config, hup, reread or (lambda: config), owned)
        finally:
            for claims in owned:
                claims.release()
    finally:
        lock.release()


def startup_line(config: Config, core: Any) -> str:
    """The one line that says which sidecar this is: version, host, mode, devices cgroup and GPUs."""
    import socket

    from isolator import __version__

    gpus = sorted(core.gpus.values(), key=lambda g: g.index)
    indices = ",".join(str(g.index) for g in gpus)
    return (
        f"gpu-isolator {__version__} started on host {socket.gethostname()}: mode {config.mode},"
        f" cgroup {core.cgroups.version}, {len(gpus)} GPU(s)"
        + (f" [{indices}]" if gpus else "")
        + f", work dir {config.work_dir}"
    )


def _serve(config: Config, hup: threading.Event, reread: Callable[[], Config], owned: list[Claims]) -> int:
    from isolator.daemon.sdnotify import Notifier
    from isolator.transport.server import SidecarServer

    notifier = Notifier()
    notes: list[str] = []
    exporters = Exporters.before_service(config)
    service = build_service(config, notes, on_volume_build=exporters.on_volume_build, owned=owned)
    exporters.start(config, service)
    # Before the sockets exist: a SIGTERM from whoever saw them (systemd, a test) stops the
    # sidecar cleanly instead of killing it with its sockets left behind.
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        LOG.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = SidecarServer(config.server_settings(), service, exporters.observe, owned[0].sockets if owned else None)
    try:
        server.start()
    except BaseException:
        exporters.stop()
        service.close()
        raise
    for note in notes:
        LOG.info("%s", note)
    core = service.core
    keeper = _cdi_keeper(config, core)
    jobs = Jobs(periodic_jobs(config, service, keeper, exporters.reaped, exporters.audited)).start()
    if config.mode is Mode.MESOS:
        # The first reconciliation against Mesos's cgroups before READY=1: containers destroyed
        # while the sidecar was down give their GPUs back before systemd starts the agent.
        try:
            exporters.reaped(len(service.reap_vanished()))
        except Exception:
            LOG.exception("the first reconciliation failed; the reaper retries in %s s", config.reap_interval)
    serving = f"serving on {config.socket}"
    LOG.info("%s", startup_line(config, core))
    notifier.ready(serving)
    nvml = _nvml_of(service)
    reloader = Reloader(config, reread, server, nvml, jobs, service.share_gpus if core.gpus else None)
    ticks: list[Callable[[], object]] = []
    if notifier.watchdog_s is not None:
        ticks.append(notifier.watchdog)
    ticks.append(lambda: reloader.reload_on(hup))
    if nvml is not None:
        ticks.append(NvmlHealth(nvml, server, notifier, serving))
        if exporters.jobmap is not None or keeper is not None:
            ticks.append(RescanFollower(nvml, exporters.jobmap, keeper, config.job_mapping_dir))
    tick = 0.5 if notifier.watchdog_s is None else min(0.5, notifier.watchdog_s / 2)
    # Wake periodically so that signals are handled promptly whatever the platform's lock waits do,
    # and so that a wedged loop stops the watchdog pings (systemd then restarts the daemon).
    while not stop.wait(tick):
        for check in ticks:
            check()
    notifier.stopping()
    jobs.stop()
    exporters.stop()
    server.stop()
    return 0


def _cdi_keeper(config: Config, core: Any) -> CdiKeeper | None:
    """``--cdi-dir``: the spec written now and kept (jobs.py); none without GPUs to put in it."""
    if config.cdi_dir and core.gpus:
        keeper = CdiKeeper(core.inventory, core.edges.devices.dev_root, core.volumes, config.cdi_dir, config.cdi_kind)
        return keeper.start()
    if config.cdi_dir:
        LOG.error("--cdi-dir '%s': no GPUs are managed, so no CDI spec is written", config.cdi_dir)
    return None
