"""Composition root: configuration -> real edges -> service -> server.

The one place that builds concrete classes and configures logging handlers for the daemon.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

from isolator.core.service import IsolatorService
from isolator.daemon.config import Config
from isolator.errors import ConfigError, FailedPrecondition, GpusUnavailable, NvmlNotFound
from isolator.model import AuditReport
from isolator.policy import gpuflags
from isolator.transport.server import SidecarServer

if TYPE_CHECKING:
    from isolator.gpu.nvml import Inventory
    from isolator.simhost.sim import SimulatedHost
    from volumes.manager import VolumeManager

LOG = logging.getLogger("isolator")

NO_GPUS_HINT = "if this node has no GPUs, say so with --resources gpus:0"


def configure_logging(level: str, fmt: str = "text") -> None:
    from isolator.daemon.logfmt import JsonFormatter, TextFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def simulated_host(config: Config) -> SimulatedHost:
    """The simulated GPU host of ``--simulate``, laid out under ``<work-dir>/simhost`` (idempotent)."""
    from isolator.simhost.sim import SimulatedHost

    host = SimulatedHost(config.simulate, os.path.join(config.work_dir, "simhost")).setup()
    LOG.info("simulating host '%s' under %s", host.spec.name, host.root)
    return host


def build_inventory(
    config: Config, notes: list[str] | None = None, host: SimulatedHost | None = None, watch: bool = True
) -> Inventory | None:
    """The GPUs to manage, or None when the operator said there are none (``--resources gpus:0``).

    Fails closed (GpusUnavailable) when NVML is missing or reports fewer GPUs than configured,
    including none at all under auto-discovery.

    With ``--simulate`` the simulated host's fake NVML is loaded; otherwise NVML comes from
    ``--nvml-library`` or the dynamic loader. Notes go to ``notes`` when given (logged once the
    daemon serves), so that a start that fails later still prints one line only.
    """
    notes = notes if notes is not None else []
    devices = config.nvidia_gpu_devices
    if not gpuflags.wants_nvml(config.resources, devices):
        gpuflags.decide(config.resources, devices, available=None)  # refuses gpus:0 with devices
        notes.append("GPU discovery is off ('--resources' specifies 0 GPUs)")
        return None
    from isolator.gpu.nvml import Inventory

    if config.simulate:
        host = host or simulated_host(config)
        inventory = Inventory(
            library=host.library_path,
            proc_root=host.proc_root,
            sys_root=os.path.join(host.root, "sys"),
            ignored_xids=config.ignored_xids,
            probe_s=config.gpu_probe_interval,
        )
    else:
        inventory = Inventory(
            library=config.nvml_library, ignored_xids=config.ignored_xids, probe_s=config.gpu_probe_interval
        )
    try:
        inventory.open()
    except NvmlNotFound as exc:
        # Raises "gpus requested but NVML not found" when GPUs were asked for.
        gpuflags.decide(config.resources, devices, available=None, nvml_problem=exc.message)
        # Auto-discovery: Mesos would advertise no GPUs; a GPU node whose driver is missing must
        # not look healthy while running GPU tasks without GPUs, so this fails closed too.
        raise GpusUnavailable(f"no usable NVML ({exc.message}); {NO_GPUS_HINT}") from exc
    try:
        available = inventory.device_count()
        decision = gpuflags.decide(config.resources, devices, available=available)
        if not decision.indices:
            raise GpusUnavailable(f"NVML reports no GPUs; {NO_GPUS_HINT}")
        inventory.read(decision.indices)
        if watch:
            inventory.start_health_watch()
            watch_device_events(inventory, host)
    except BaseException:
        inventory.close()
        raise
    LOG.info(
        "managing %d GPU(s) %s, driver %s, CUDA %s",
        len(decision.indices),
        list(decision.indices),
        inventory.driver_version,
        inventory.cuda_driver_version,
    )
    return inventory


def watch_device_events(inventory: Inventory, host: SimulatedHost | None) -> None:
    """Kernel device events (GPU bind/unbind, nvidia module load/unload) make the inventory read
    the GPUs again. A simulated host's events come from its control file, a real host's from the
    kernel's netlink socket (pyroute2, imported on the watch thread, off the start-up path)."""
    from isolator.gpu import uevents

    if host is not None:
        source = uevents.FileSource(host.uevents_path)  # now: what is written after start counts

        def factory() -> uevents.Source:
            return source
    else:

        def factory() -> uevents.Source:
            return uevents.NetlinkSource()

    watch = uevents.UeventWatch(factory, inventory.bus_ids, inventory.device_changed).start()
    inventory.on_close(watch.stop)


def build_service(
    config: Config, notes: list[str] | None = None, on_volume_build: Callable[[object], None] | None = None
) -> IsolatorService:
    """Real edges for the hooks: NVML (or the simulated host's), the devices cgroup of the detected
    hierarchy, the state store under the work dir, and the driver volume manager."""
    from isolator.cgroups import controller_for
    from isolator.cgroups.detect import detect
    from isolator.core.context import Settings
    from isolator.host.state import StateStore
    from isolator.host.system import EmptyInventory, LocalFilesystem, ProcProcesses, SystemClock
    from isolator.policy.devices import HostDevices

    host = simulated_host(config) if config.simulate else None
    inventory = build_inventory(config, notes, host)
    dev_root, volumes = _dev_root_and_volumes(config, host, on_volume_build)
    hierarchy = detect(override=config.cgroup_version)
    if os.path.commonpath([hierarchy.mount, config.cgroups_hierarchy]) != config.cgroups_hierarchy.rstrip("/"):
        raise ConfigError(
            f"the {hierarchy.version} devices hierarchy is mounted at '{hierarchy.mount}', "
            f"outside --cgroups-hierarchy '{config.cgroups_hierarchy}'"
        )
    host_devices = HostDevices(dev_root)
    # In mesos mode the controller writes only NVIDIA's majors; every other device is the agent's.
    controller = controller_for(
        hierarchy,
        os.path.join(config.work_dir, "devices"),
        cgroups_root=config.cgroups_root,
        mode=config.mode,
        nvidia_majors=host_devices.nvidia_majors,
    )
    if inventory is not None and host is None:
        host_devices.load_uvm()  # Mesos loads nvidia-uvm at start when it is missing
    store = StateStore(config.state_dir)
    try:
        if inventory is not None:
            keep_health_marks(inventory, store)
        return IsolatorService(
            inventory=inventory if inventory is not None else EmptyInventory(),
            cgroups=controller,
            devices=host_devices,
            store=store,
            volumes=volumes,
            processes=ProcProcesses(),
            filesystem=LocalFilesystem(),
            clock=SystemClock(),
            settings=Settings(mode=config.mode, policy=config.allocation_policy),
        )
    except BaseException:
        store.close()
        if inventory is not None:
            inventory.close()
        raise


def keep_health_marks(inventory: Inventory, store: Any) -> None:
    """XID and double-bit ECC marks outlive the sidecar: the marks recorded in the state store are
    applied to the GPUs again (before the core reads their health), and every later mark or reset
    is recorded. A GPU so marked stays out of allocation after a restart until a reset (unbind/bind,
    driver reload) makes it healthy again, as without a restart (isolator/gpu/nvml.py RESET_CLEARS).
    """
    from isolator.gpu.nvml import RESET_CLEARS
    from isolator.host.state import HealthMark

    by_uuid = {r.gpu.uuid: r.gpu.index for r in inventory.records if r.gpu.uuid}
    for mark in store.health_marks():
        index = by_uuid.get(mark.uuid)
        if index is None:
            continue  # not managed now (or not visible): the mark waits for it
        LOG.warning("GPU %d (%s) stays unhealthy: %s, recorded before this start", index, mark.uuid, mark.reason)
        inventory.mark_unhealthy(index, mark.reason, mark.xid, mark.at, mark.source)

    def follow(event: Any) -> None:
        try:
            health = inventory.record(event.index).health
            if not health.healthy and health.source in RESET_CLEARS:
                store.put_health_mark(
                    HealthMark(event.uuid, health.source, health.reason, health.last_xid, health.last_xid_time)
                )
            elif health.healthy:
                store.drop_health_mark(event.uuid)
        except Exception as exc:  # the mark stays in memory; only a restart would forget it
            LOG.error("failed to record the health of GPU %d (%s): %s", event.index, event.uuid, exc)

    inventory.on_health_change(follow)


def _dev_root_and_volumes(
    config: Config, host: SimulatedHost | None, on_build: Callable[[object], None] | None = None
) -> tuple[str, VolumeManager]:
    """The device nodes' directory and the driver volume manager (the simulated host's when simulating)."""
    from volumes.manager import VolumeManager

    dev_root, driver_root = config.dev_root, config.driver_root
    volume_kwargs: dict[str, object] = {}
    if host is not None:
        from isolator.simhost.driver import build_driver_root

        driver = build_driver_root(host.driver_root, host.spec.driver_version)
        dev_root, driver_root = host.dev_root, host.driver_root
        volume_kwargs["path"] = driver.path
    volumes = VolumeManager(
        config.volume_root,
        driver_root=driver_root,
        on_build=on_build,
        **volume_kwargs,  # type: ignore[arg-type]
    )
    return dev_root, volumes


def cdi_spec_of(inventory: Any, dev_root: str, volumes: Any, kind: str) -> dict[str, Any]:
    """The CDI spec of what ``inventory`` manages; builds the current driver's volume if needed."""
    from isolator.exporters import cdi
    from isolator.policy.devices import HostDevices
    from volumes.inject import Image, volume_env

    control = HostDevices(dev_root).control_devices()
    names = [os.path.relpath(n.path, dev_root) for n in control.numbers()]
    volume = volumes.ensure(inventory.driver_version)
    return cdi.build_spec(
        cdi.entries(inventory.records),
        dev_root=dev_root,
        control_nodes=names,
        volume_path=volume.path,
        volume_env=sorted(volume_env(Image()).items()),
        kind=kind,
    )


def generate_cdi(config: Config) -> dict[str, Any]:
    """``gpu-isolator cdi generate``: the spec, offline (NVML and the volume, no running sidecar)."""
    host = simulated_host(config) if config.simulate else None
    inventory = build_inventory(config, host=host, watch=False)
    if inventory is None:
        raise FailedPrecondition("no GPUs are managed (gpus:0, or no NVML): nothing to put in a CDI spec")
    try:
        dev_root, volumes = _dev_root_and_volumes(config, host)
        return cdi_spec_of(inventory, dev_root, volumes, config.cdi_kind)
    finally:
        inventory.close()


def agent_resources(config: Config) -> str:
    """``gpu-isolator resources``: ``gpus:N;mig-<profile>:M;...`` for the agent's ``--resources``.

    ``gpus`` counts the managed GPUs that are not in MIG mode (docs/mig.md, "Configuring the agent").
    """
    from isolator.policy import mig

    host = simulated_host(config) if config.simulate else None
    inventory = build_inventory(config, host=host, watch=False)
    if inventory is None:
        return "gpus:0"
    try:
        records = inventory.records
        whole = sum(1 for r in records if not r.mig_enabled)
        return mig.agent_resources(whole, [d for r in records if r.mig_enabled for d in r.mig_devices])
    finally:
        inventory.close()


class CdiKeeper:
    """``--cdi-dir``: keeps ``<dir>/gpu-isolator.json`` equal to what the sidecar manages.

    Rewritten at start, whenever a GPU's health changes (an unhealthy GPU leaves the spec) and every
    ``interval`` seconds (a changed volume or inventory); an unchanged spec is not rewritten. A
    failure is logged and retried at the next trigger: it never stops the sidecar.
    """

    def __init__(self, inventory: Any, dev_root: str, volumes: Any, directory: str, kind: str) -> None:
        self.inventory = inventory
        self.dev_root = dev_root
        self.volumes = volumes
        self.directory = directory
        self.kind = kind
        self._lock = threading.Lock()

    def update(self) -> str | None:
        from isolator.exporters import cdi

        with self._lock:
            try:
                spec = cdi_spec_of(self.inventory, self.dev_root, self.volumes, self.kind)
                path, changed = cdi.write_spec(spec, self.directory)
            except Exception as exc:
                LOG.error("failed to write the CDI spec into '%s': %s", self.directory, exc)
                return None
        if changed:
            LOG.info("wrote CDI spec '%s' (%d devices)", path, len(spec["devices"]))
        return path

    def start(self, stop: threading.Event, interval: float) -> None:
        self.update()
        self.inventory.on_health_change(lambda _event: self.update())
        args = (self.update, stop, interval, lambda _count: None)
        threading.Thread(target=_reap_loop, args=args, name="cdi", daemon=True).start()


def _reap_loop(
    reap: Callable[[], object], stop: threading.Event, interval: float, reaped: Callable[[int], None]
) -> None:
    while not stop.wait(interval):
        try:
            released = reap()
            reaped(len(released) if isinstance(released, (list, tuple)) else 0)
        except Exception:
            LOG.exception("periodic reconciliation failed; retrying in %s s", interval)


def _ignore(_count: int) -> None:
    pass


def _audit_loop(
    audit: Callable[[], AuditReport], stop: threading.Event, interval: float, audited: Callable[[int], None]
) -> None:
    while not stop.wait(interval):
        try:
            audited(len(audit().repaired))
        except Exception:
            LOG.exception("periodic drift audit failed; retrying in %s s", interval)


def _nvml_of(service: IsolatorService) -> Inventory | None:
    """The service's NVML inventory, or None on a node without GPUs (``--resources gpus:0``)."""
    from isolator.host.system import EmptyInventory

    inventory = service.core.inventory
    return None if isinstance(inventory, EmptyInventory) else cast("Inventory", inventory)


def serve(config: Config) -> int:
    """Run the sidecar until SIGTERM or SIGINT. Raises IsolatorError if it cannot start.

    Under systemd (``Type=notify``) it sends READY=1 once the state is restored (every recorded
    allocation booked), both sockets serve and, in mesos mode, the first reconciliation against
    Mesos's cgroups has released containers destroyed while it was down; WATCHDOG=1 from this serving loop at half the
    watchdog interval, and STOPPING=1 when told to stop.
    """
    from isolator.daemon.sdnotify import Notifier

    configure_logging(config.log_level, config.log_format)
    notifier = Notifier()
    notes: list[str] = []
    metrics = None
    if config.metrics_address:
        from isolator.exporters.metrics import Metrics, parse_address

        parse_address(config.metrics_address)  # a bad address stops the start before anything is built
        metrics = Metrics()
    service = build_service(config, notes, on_volume_build=metrics.volume_built if metrics else None)
    observers: list[Callable[[str, str, float, object], None]] = []
    jobmap = None
    extras: list[Callable[[], None]] = []  # stopped after the server
    try:
        if config.job_mapping_dir:
            from isolator.exporters.jobmap import JobMapping

            jobmap = JobMapping(config.job_mapping_dir, service, service.core.inventory)
            jobmap.sync()  # exact from the recorded state, whatever a crash left there
            observers.append(jobmap.observe)
        if metrics is not None:
            from isolator.exporters.metrics import MetricsServer

            metrics.service = service
            observers.append(metrics.observe)
            extras.append(MetricsServer(config.metrics_address, metrics).start().stop)
    except BaseException:
        service.close()
        raise

    def observe(hook: str, code: str, seconds: float, response: object) -> None:
        for observer in observers:
            observer(hook, code, seconds, response)

    def reaped(count: int) -> None:
        if metrics is not None:
            metrics.reaped(count)
        if count and jobmap is not None:
            jobmap.sync()

    # Before the sockets exist: a SIGTERM from whoever saw them (systemd, a test) stops the
    # sidecar cleanly instead of killing it with its sockets left behind.
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        LOG.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = SidecarServer(config, service, observe if observers else None)
    try:
        server.start()
    except BaseException:
        for stop_extra in extras:
            stop_extra()
        service.close()
        raise
    for note in notes:
        LOG.info("%s", note)
    core = service.core
    keeper: CdiKeeper | None = None
    if config.cdi_dir and core.volumes is not None and core.gpus:
        keeper = CdiKeeper(core.inventory, core.edges.devices.dev_root, core.volumes, config.cdi_dir, config.cdi_kind)
        keeper.start(stop, config.reap_interval)
    elif config.cdi_dir:
        LOG.error("--cdi-dir '%s': no GPUs are managed, so no CDI spec is written", config.cdi_dir)
    if config.mode == "mesos":
        threading.Thread(
            target=_reap_loop,
            args=(service.reap_vanished, stop, config.reap_interval, reaped),
            name="reaper",
            daemon=True,
        ).start()
    if config.mode == "mesos":
        # The first reconciliation against Mesos's cgroups before READY=1: containers destroyed
        # while the sidecar was down give their GPUs back before systemd starts the agent.
        try:
            reaped(len(service.reap_vanished()))
        except Exception:
            LOG.exception("the first reconciliation failed; the reaper retries in %s s", config.reap_interval)
    if config.audit_interval > 0:
        audit = (service.audit, stop, config.audit_interval, metrics.audited if metrics is not None else _ignore)
        threading.Thread(target=_audit_loop, args=audit, name="audit", daemon=True).start()
    serving = f"serving on {config.socket}"
    notifier.ready(serving)
    nvml = _nvml_of(service)
    answering = True
    rescans = nvml.rescans if nvml is not None else 0
    tick = 0.5 if notifier.watchdog_s is None else min(0.5, notifier.watchdog_s / 2)
    # Wake periodically so that signals are handled promptly whatever the platform's lock waits do,
    # and so that a wedged loop stops the watchdog pings (systemd then restarts the daemon).
    while not stop.wait(tick):
        if notifier.watchdog_s is not None:
            notifier.watchdog()
        if nvml is not None and nvml.nvml_answering != answering:
            # Health that follows NVML: grpc_health_probe says NOT_SERVING while no GPU can be handed out.
            answering = not answering
            server.set_serving(answering)
            if answering:
                LOG.warning("NVML answers again: the health service says SERVING")
            else:
                LOG.error("NVML does not answer: the health service says NOT_SERVING until it does")
            notifier.notify(f"STATUS={serving if answering else 'NVML does not answer; no GPU can be handed out'}")
        if nvml is not None and (jobmap is not None or keeper is not None) and nvml.rescans != rescans:
            # The GPUs were read again (a MIG mode change, a GPU back): the files follow the inventory.
            rescans = nvml.rescans
            if jobmap is not None:
                try:
                    jobmap.sync()
                except Exception:
                    LOG.exception("failed to update the job mapping in '%s'", config.job_mapping_dir)
            if keeper is not None:
                keeper.update()  # logs its own failures
    notifier.stopping()
    for stop_extra in extras:
        stop_extra()
    server.stop()
    return 0
