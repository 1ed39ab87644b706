"""Composition root: configuration -> real edges -> service -> server.

The one place that builds concrete classes and configures logging handlers for the daemon.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

from isolator.daemon.config import Config
from isolator.errors import ConfigError, FailedPrecondition, GpusUnavailable, NvmlNotFound
from isolator.policy import gpuflags

# The core and the gRPC server are imported where they are built, after the GPUs, the flags and the
# host were checked: a start that must stop (exit 4, 78) says so without loading them first.
if TYPE_CHECKING:
    from isolator.cgroups.cpuset import CpusetController
    from isolator.core.service import IsolatorService
    from isolator.daemon.ownership import Claims
    from isolator.gpu.nvml import Inventory
    from isolator.host.cpus import SysCpus
    from isolator.model import AuditReport
    from isolator.simhost.sim import SimulatedHost
    from isolator.transport.server import SidecarServer
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
    config: Config,
    notes: list[str] | None = None,
    on_volume_build: Callable[[object], None] | None = None,
    owned: list[Claims] | None = None,
) -> IsolatorService:
    """Real edges for the hooks: NVML (or the simulated host's), the devices cgroup of the detected
    hierarchy, the state store under the work dir, and the driver volume manager.

    With ``owned``, the (hierarchy, cgroups root) and the sockets are claimed (appended there) once
    the GPUs and the hierarchy are known and before any cgroup or the state is touched: a second
    daemon on them exits 75, after a bad flag (78) or missing GPUs (4) have had their say."""
    from isolator.cgroups import controller_for
    from isolator.cgroups.detect import detect
    from isolator.core.context import Settings
    from isolator.host.devices import HostDevices
    from isolator.host.state import StateStore
    from isolator.host.system import EmptyInventory, LocalFilesystem, ProcProcesses, SystemClock

    host = simulated_host(config) if config.simulate else None
    inventory = build_inventory(config, notes, host)
    dev_root, volumes = _dev_root_and_volumes(config, host, on_volume_build)
    hierarchy = detect(override=config.cgroup_version)
    if os.path.commonpath([hierarchy.mount, config.cgroups_hierarchy]) != config.cgroups_hierarchy.rstrip("/"):
        raise ConfigError(
            f"the {hierarchy.version} devices hierarchy is mounted at '{hierarchy.mount}', "
            f"outside --cgroups-hierarchy '{config.cgroups_hierarchy}'"
        )
    if owned is not None:
        from isolator.daemon.ownership import claim

        try:
            owned.append(claim(config, hierarchy))
        except BaseException:
            if inventory is not None:
                inventory.close()
            raise
    host_devices = HostDevices(dev_root)
    # In mesos mode the controller writes only NVIDIA's majors; every other device is the agent's.
    controller = controller_for(
        hierarchy,
        os.path.join(config.work_dir, "devices"),
        cgroups_root=config.cgroups_root,
        mode=config.mode,
        nvidia_majors=host_devices.nvidia_majors,
        device_path=host_devices.node_path,
    )
    if inventory is not None and host is None:
        host_devices.load_uvm()  # Mesos loads nvidia-uvm at start when it is missing
    cpus, cpusets = cpu_edges(config)
    store = StateStore(config.state_dir)
    try:
        from isolator.core.service import IsolatorService
        from isolator.model import COMPUTE_MODES

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
            settings=Settings(
                mode=config.mode,
                policy=config.allocation_policy,
                cpu_affinity=config.cpu_affinity,
                drain_check=config.drain_check == "on",
                drain_memory_bytes=config.drain_memory_mib << 20,
                drain_timeout_s=config.drain_timeout,
                default_compute_mode=COMPUTE_MODES[config.default_compute_mode],
                shared_gpus=config.shared_gpus,
            ),
            cpus=cpus,
            cpusets=cpusets,
            mps=mps_control(config, host),
        )
    except BaseException:
        store.close()
        if inventory is not None:
            inventory.close()
        raise


def mps_control(config: Config, host: SimulatedHost | None) -> Any:
    """The MPS control edge (docs/sharing.md): the simulated host's stand-in, or the driver's
    ``nvidia-cuda-mps-control`` (under --driver-root, else on PATH); None when nothing is shared in
    mps mode. Daemons live in ``<work-dir>/mps/<GPU UUID>/{pipe,log}``."""
    import shutil

    from isolator.host.mps import MpsControl

    if not any(s.mode == "mps" for s in config.shared_gpus):
        return None
    if host is not None:
        executable = host.mps_control
    else:
        bundled = os.path.join(config.driver_root, "usr/bin/nvidia-cuda-mps-control")
        executable = bundled if os.path.exists(bundled) else shutil.which("nvidia-cuda-mps-control") or ""
    if not executable:
        raise ConfigError("--shared-gpus names GPUs in mps mode but nvidia-cuda-mps-control is not installed")
    return MpsControl(executable, os.path.join(config.work_dir, "mps"))


def cpu_edges(config: Config) -> tuple[SysCpus | None, CpusetController | None]:
    """What the machine's CPUs are, and the cpuset hierarchy (docs/affinity.md).

    The cpuset edge is built whenever a cpuset hierarchy is bound, whatever ``--cpu-affinity``
    says, so that containers held to a cpuset under ``enforce`` keep it, and lose it at Cleanup,
    after a restart with another mode. ``enforce`` without a usable one stops the start.
    """
    from isolator.cgroups.cpuset import MESOS_CPUSET_SUFFIX, CpusetController, find_cpuset
    from isolator.host.cpus import SysCpus

    cpus = SysCpus() if config.cpu_affinity != "off" else None
    found = find_cpuset()
    problem = ""
    if found is None:
        problem = "no cpuset controller is bound (neither a cgroup v1 'cpuset' hierarchy nor cgroup2's 'cpuset')"
    elif found[0] == "v2" and config.mode == "mesos":
        # One cgroup per process on v2, and the container's is Mesos's: none of our own can hold it.
        problem = (
            "in mesos mode it needs a cgroup v1 'cpuset' hierarchy (on cgroup v2 the container's cgroup is Mesos's)"
        )
        found = None
    if found is None:
        if config.cpu_affinity == "enforce":
            raise ConfigError(f"--cpu-affinity enforce: {problem}; use hint or off")
        return cpus, None
    version, mount = found
    root = config.cgroups_root if config.mode == "standalone" else config.cgroups_root.rstrip("/") + MESOS_CPUSET_SUFFIX
    return cpus, CpusetController(mount, root, version)


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


def cdi_spec_of(
    inventory: Any, dev_root: str, volumes: Any, kind: str, strategies: Sequence[str] = ("index", "uuid")
) -> dict[str, Any]:
    """The CDI spec of what ``inventory`` manages; builds the current driver's volume if needed."""
    from isolator.exporters import cdi
    from isolator.host.devices import HostDevices
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
        names=strategies,
    )


def generate_cdi(config: Config, names: Sequence[str] = ("index", "uuid")) -> dict[str, Any]:
    """``gpu-isolator cdi generate``: the spec, offline (NVML and the volume, no running sidecar);
    ``names``: the device name strategies (isolator.exporters.cdi.NAME_STRATEGIES)."""
    host = simulated_host(config) if config.simulate else None
    inventory = build_inventory(config, host=host, watch=False)
    if inventory is None:
        raise FailedPrecondition("no GPUs are managed (gpus:0, or no NVML): nothing to put in a CDI spec")
    try:
        dev_root, volumes = _dev_root_and_volumes(config, host)
        return cdi_spec_of(inventory, dev_root, volumes, config.cdi_kind, names)
    finally:
        inventory.close()


def agent_resources(config: Config) -> str:
    """``gpu-isolator resources``: ``gpus:N;gpu_shares:S;mig-<profile>:M;...`` for the agent's ``--resources``.

    ``gpus`` counts the managed GPUs that are neither in MIG mode (docs/mig.md, "Configuring the
    agent") nor shared; ``gpu_shares`` the shares of the shared ones (docs/sharing.md).
    """
    return agent_flags(config)[0]


def agent_flags(config: Config) -> tuple[str, list[tuple[str, str]]]:
    """The agent's ``--resources`` string and its ``--attributes`` pairs (isolator/policy/attributes.py),
    from one reading of NVML (offline, as ``gpu-isolator resources`` and ``attributes``)."""
    from isolator.policy import attributes, mig, shares

    host = simulated_host(config) if config.simulate else None
    inventory = build_inventory(config, host=host, watch=False)
    if inventory is None:
        if config.shared_gpus:
            raise ConfigError("--shared-gpus names GPUs but GPU discovery is off ('--resources' specifies 0 GPUs)")
        return "gpus:0", attributes.attributes([], "", "")
    try:
        records = inventory.records
        shared = shares.resolve(config.shared_gpus, [(r.gpu.index, r.gpu.minor, r.mig_enabled) for r in records])
        whole = sum(1 for r in records if not r.mig_enabled and r.gpu.minor not in shared)
        line = mig.agent_resources(whole, [d for r in records if r.mig_enabled for d in r.mig_devices])
        head, sep, rest = line.partition(";")
        resources = shares.agent_resources(int(head.removeprefix("gpus:")), shared) + sep + rest
        pairs = attributes.attributes(records, inventory.driver_version, inventory.cuda_driver_version)
        return resources, pairs
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
        every(interval, stop, self.update, "cdi", "periodic reconciliation failed")


def every(interval: float, stop: threading.Event, work: Callable[[], object], name: str, failure: str) -> None:
    """The daemon's one periodic loop: ``work`` every ``interval`` seconds on a daemon thread
    ``name`` until ``stop`` is set (at once while it waits; after a run in progress). A failure is
    logged (``failure``, with its traceback) and the next period tries again: it never stops the sidecar."""

    def loop() -> None:
        while not stop.wait(interval):
            try:
                work()
            except Exception:
                LOG.exception("%s; retrying in %s s", failure, interval)

    threading.Thread(target=loop, name=name, daemon=True).start()


def _ignore(_count: int) -> None:
    pass


class AuditLoop:
    """The periodic drift audit, restartable with another period (SIGHUP); 0 turns it off."""

    def __init__(self, audit: Callable[[], AuditReport], audited: Callable[[int], None]) -> None:
        self._audit = audit
        self._audited = audited
        self._cancel: threading.Event | None = None

    def start(self, interval: float) -> None:
        self.cancel()
        if interval > 0:
            cancel = self._cancel = threading.Event()
            audit, audited = self._audit, self._audited
            every(interval, cancel, lambda: audited(len(audit().repaired)), "audit", "periodic drift audit failed")

    def cancel(self) -> None:
        """The running loop ends at its next wake-up (at once while it waits; after an audit in progress)."""
        if self._cancel is not None:
            self._cancel.set()
            self._cancel = None


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
        audit: AuditLoop,
        share: Callable[[tuple[Any, ...]], None] | None = None,
    ) -> None:
        self.config = config
        self._read = read
        self._server = server
        self._nvml = nvml
        self._audit = audit
        self._share = share  # the service's share_gpus (docs/sharing.md)

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
            self._audit.start(config.audit_interval)
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

    notifier = Notifier()
    notes: list[str] = []
    metrics = None
    if config.metrics_address:
        from isolator.exporters.metrics import Metrics, parse_address
        from isolator.transport.server import HOOKS

        parse_address(config.metrics_address)  # a bad address stops the start before anything is built
        metrics = Metrics(hooks=HOOKS)
    service = build_service(config, notes, on_volume_build=metrics.volume_built if metrics else None, owned=owned)
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
    from isolator.transport.server import SidecarServer

    server = SidecarServer(
        config.server_settings(), service, observe if observers else None, owned[0].sockets if owned else None
    )
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
    if config.cdi_dir and core.gpus:
        keeper = CdiKeeper(core.inventory, core.edges.devices.dev_root, core.volumes, config.cdi_dir, config.cdi_kind)
        keeper.start(stop, config.reap_interval)
    elif config.cdi_dir:
        LOG.error("--cdi-dir '%s': no GPUs are managed, so no CDI spec is written", config.cdi_dir)
    if config.mode == "mesos":
        reap = service.reap_vanished
        every(config.reap_interval, stop, lambda: reaped(len(reap())), "reaper", "periodic reconciliation failed")
    if config.mode == "mesos":
        # The first reconciliation against Mesos's cgroups before READY=1: containers destroyed
        # while the sidecar was down give their GPUs back before systemd starts the agent.
        try:
            reaped(len(service.reap_vanished()))
        except Exception:
            LOG.exception("the first reconciliation failed; the reaper retries in %s s", config.reap_interval)
    if core.gpus and config.shared_gpus:
        # MPS control daemons found dead are started again, as often as the GPUs are probed (docs/sharing.md).
        interval, failure = config.gpu_probe_interval, "supervising the MPS control daemons failed"
        every(interval, stop, service.supervise_mps, "mps", failure)
    if core.gpus and config.drain_check == "on":
        # Draining GPUs are looked at again as often as the GPUs are probed (docs/handover.md).
        interval, failure = config.gpu_probe_interval, "re-checking the draining GPUs failed"
        every(interval, stop, service.recheck_draining, "drain", failure)
    audit = AuditLoop(service.audit, metrics.audited if metrics is not None else _ignore)
    audit.start(config.audit_interval)
    serving = f"serving on {config.socket}"
    LOG.info("%s", startup_line(config, core))
    notifier.ready(serving)
    nvml = _nvml_of(service)
    reloader = Reloader(config, reread, server, nvml, audit, service.share_gpus if core.gpus else None)
    answering = True
    rescans = nvml.rescans if nvml is not None else 0
    tick = 0.5 if notifier.watchdog_s is None else min(0.5, notifier.watchdog_s / 2)
    # Wake periodically so that signals are handled promptly whatever the platform's lock waits do,
    # and so that a wedged loop stops the watchdog pings (systemd then restarts the daemon).
    while not stop.wait(tick):
        if notifier.watchdog_s is not None:
            notifier.watchdog()
        if hup.is_set():
            hup.clear()
            reloader.reload()
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
    audit.cancel()
    for stop_extra in extras:
        stop_extra()
    server.stop()
    return 0
