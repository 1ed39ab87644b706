"""Composition: configuration -> the real edges -> the service. The one place that builds concrete
classes (NVML or the simulated host's, the devices cgroup of the detected hierarchy, the state store,
the driver volumes, the CPU and MPS edges); it serves nothing and runs no job (main.py, jobs.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from isolator.daemon.config import Config
from isolator.errors import ConfigError, FailedPrecondition, GpusUnavailable, NvmlNotFound
from isolator.model import CgroupVersion, Mode, ShareMode
from isolator.policy import gpuflags

# The core and the gRPC server are imported where they are built, after the GPUs, the flags and the
# host were checked: a start that must stop (exit 4, 78) says so without loading them first.
if TYPE_CHECKING:
    from isolator.cgroups.cpuset import CpusetController
    from isolator.core.service import IsolatorService
    from isolator.daemon.ownership import Claims
    from isolator.gpu.nvml import Inventory
    from isolator.host.cpus import SysCpus
    from isolator.simhost.sim import SimulatedHost
    from volumes.manager import VolumeManager

LOG = logging.getLogger("isolator")

NO_GPUS_HINT = "if this node has no GPUs, say so with --resources gpus:0"


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
    from isolator.host.system import EmptyInventory, LocalFilesystem, PasswdUsers, ProcProcesses, SystemClock

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
        from isolator.core.healthmarks import HealthMarks
        from isolator.core.service import IsolatorService
        from isolator.gpu.nvml import RESET_CLEARS
        from isolator.model import COMPUTE_MODES

        if inventory is not None:
            # XID and ECC marks outlive the sidecar (before the core reads the GPUs' health).
            HealthMarks(inventory, store, RESET_CLEARS).start()
        return IsolatorService(
            inventory=inventory if inventory is not None else EmptyInventory(),
            cgroups=controller,
            devices=host_devices,
            store=store,
            volumes=volumes,
            processes=ProcProcesses(),
            filesystem=LocalFilesystem(),
            clock=SystemClock(),
            users=PasswdUsers(),
            settings=Settings(
                mode=config.mode,
                policy=config.allocation_policy,
                cpu_affinity=config.cpu_affinity,
                drain_check=config.drain_check == "on",
                drain_memory_bytes=config.drain_memory_mib << 20,
                drain_timeout_s=config.drain_timeout,
                default_compute_mode=COMPUTE_MODES[config.default_compute_mode],
                shared_gpus=config.shared_gpus,
                share_placement=config.share_placement,
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
    import contextlib
    import shutil

    from isolator.host.mps import MpsControl, MpsError

    if not any(s.mode == ShareMode.MPS for s in config.shared_gpus):
        return None
    if host is not None:
        executable = host.mps_control
    else:
        bundled = os.path.join(config.driver_root, "usr/bin/nvidia-cuda-mps-control")
        executable = bundled if os.path.exists(bundled) else shutil.which("nvidia-cuda-mps-control") or ""
    if not executable:
        raise ConfigError("--shared-gpus names GPUs in mps mode but nvidia-cuda-mps-control is not installed")
    control = MpsControl(executable, os.path.join(config.work_dir, "mps"))
    with contextlib.suppress(MpsError):  # a work directory not there yet: the first daemon's start opens it
        control.open_root()
    return control


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
    elif found[0] is CgroupVersion.V2 and config.mode is Mode.MESOS:
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
    root = (
        config.cgroups_root if config.mode is Mode.STANDALONE else config.cgroups_root.rstrip("/") + MESOS_CPUSET_SUFFIX
    )
    return cpus, CpusetController(mount, root, version)


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
    from isolator.policy import attributes, shares

    host = simulated_host(config) if config.simulate else None
    inventory = build_inventory(config, host=host, watch=False)
    if inventory is None:
        if config.shared_gpus:
            raise ConfigError("--shared-gpus names GPUs but GPU discovery is off ('--resources' specifies 0 GPUs)")
        return "gpus:0", attributes.attributes([], "", "")
    try:
        records = inventory.records
        shared = shares.resolve(config.shared_gpus, [(r.gpu.index, r.gpu.minor, r.mig_enabled) for r in records])
        return attributes.agent_flags(records, shared, inventory.driver_version, inventory.cuda_driver_version)
    finally:
        inventory.close()


class Exporters:
    """What the hooks' outcomes feed besides the answer (docs/metrics.md): the Prometheus metrics
    (``--metrics-address``) and dcgm-exporter's job mapping (``--job-mapping-dir``), built around the service."""

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics
        self.jobmap: Any = None
        self._observers: list[Callable[[str, str, float, object], None]] = []
        self._stops: list[Callable[[], None]] = []  # after the server

    @classmethod
    def before_service(cls, config: Config) -> Exporters:
        """The metrics exist before the service (they count the volume builds of its start); a bad
        address stops the start before anything is built."""
        if not config.metrics_address:
            return cls()
        from isolator.exporters.metrics import Metrics, parse_address
        from isolator.transport.server import HOOKS

        parse_address(config.metrics_address)
        return cls(Metrics(hooks=HOOKS))

    @property
    def on_volume_build(self) -> Callable[[object], None] | None:
        return self.metrics.volume_built if self.metrics is not None else None

    def start(self, config: Config, service: IsolatorService) -> Exporters:
        """The job mapping, exact from the recorded state (whatever a crash left there), and the metrics
        server. The service is closed if either fails."""
        try:
            if config.job_mapping_dir:
                from isolator.exporters.jobmap import JobMapping

                self.jobmap = JobMapping(config.job_mapping_dir, service, service.core.inventory)
                self.jobmap.sync()
                self._observers.append(self.jobmap.observe)
            if self.metrics is not None:
                from isolator.exporters.metrics import MetricsServer

                self.metrics.service = service
                self._observers.append(self.metrics.observe)
                self._stops.append(MetricsServer(config.metrics_address, self.metrics).start().stop)
        except BaseException:
            service.close()
            raise
        return self

    @property
    def observe(self) -> Callable[[str, str, float, object], None] | None:
        """What the server calls after each hook; None when nothing listens."""
        if not self._observers:
            return None
        observers = tuple(self._observers)

        def observe(hook: str, code: str, seconds: float, response: object) -> None:
            for observer in observers:
                observer(hook, code, seconds, response)

        return observe

    def reaped(self, count: int) -> None:
        if self.metrics is not None:
            self.metrics.reaped(count)
        if count and self.jobmap is not None:
            self.jobmap.sync()

    def audited(self, count: int) -> None:
        if self.metrics is not None:
            self.metrics.audited(count)

    def stop(self) -> None:
        for stop in self._stops:
            stop()
