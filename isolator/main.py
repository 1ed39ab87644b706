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
from typing import TYPE_CHECKING

from isolator import gpuflags
from isolator.config import Config
from isolator.core.service import IsolatorService
from isolator.errors import ConfigError, NvmlNotFound
from isolator.server import SidecarServer

if TYPE_CHECKING:
    from isolator.nvml import Inventory
    from isolator.simhost.sim import SimulatedHost

LOG = logging.getLogger("isolator")


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
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
    config: Config, notes: list[str] | None = None, host: SimulatedHost | None = None
) -> Inventory | None:
    """The GPUs to manage, or None when there are none (gpus:0, or no NVML and nothing requested).

    With ``--simulate`` the simulated host's fake NVML is loaded; otherwise NVML comes from
    ``--nvml-library`` or the dynamic loader. Warnings go to ``notes`` when given, so that a start
    that fails later still prints one line only.
    """
    notes = notes if notes is not None else []
    devices = config.nvidia_gpu_devices
    if not gpuflags.wants_nvml(config.resources, devices):
        gpuflags.decide(config.resources, devices, available=None)  # refuses gpus:0 with devices
        LOG.info("GPU discovery is off ('--resources' specifies 0 GPUs)")
        return None
    from isolator.nvml import Inventory

    if config.simulate:
        host = host or simulated_host(config)
        inventory = Inventory(
            library=host.library_path,
            proc_root=host.proc_root,
            sys_root=os.path.join(host.root, "sys"),
            ignored_xids=config.ignored_xids,
        )
    else:
        inventory = Inventory(library=config.nvml_library, ignored_xids=config.ignored_xids)
    try:
        inventory.open()
    except NvmlNotFound as exc:
        # Raises "gpus requested but NVML not found" when GPUs were asked for; else none to manage.
        gpuflags.decide(config.resources, devices, available=None, nvml_problem=exc.message)
        notes.append(f"{exc.message}; managing no GPUs")
        return None
    try:
        decision = gpuflags.decide(config.resources, devices, available=inventory.device_count())
        inventory.read(decision.indices)
        inventory.start_health_watch()
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


def build_service(config: Config, notes: list[str] | None = None) -> IsolatorService:
    """Real edges for the hooks: NVML (or the simulated host's), the devices cgroup of the detected
    hierarchy, the state store under the work dir, and the driver volume manager."""
    from isolator.cgroups import controller_for
    from isolator.cgroups.detect import detect
    from isolator.core.context import Settings
    from isolator.devices import HostDevices
    from isolator.state import StateStore
    from isolator.system import EmptyInventory, LocalFilesystem, ProcProcesses, SystemClock
    from volumes.manager import VolumeManager

    host = simulated_host(config) if config.simulate else None
    inventory = build_inventory(config, notes, host)
    dev_root, driver_root = config.dev_root, config.driver_root
    volume_kwargs: dict[str, object] = {}
    if host is not None:
        from isolator.simhost.driver import build_driver_root

        driver = build_driver_root(host.driver_root, host.spec.driver_version)
        dev_root, driver_root = host.dev_root, host.driver_root
        volume_kwargs["path"] = driver.path
    hierarchy = detect(override=config.cgroup_version)
    if os.path.commonpath([hierarchy.mount, config.cgroups_hierarchy]) != config.cgroups_hierarchy.rstrip("/"):
        raise ConfigError(
            f"the {hierarchy.version} devices hierarchy is mounted at '{hierarchy.mount}', "
            f"outside --cgroups-hierarchy '{config.cgroups_hierarchy}'"
        )
    controller = controller_for(
        hierarchy, os.path.join(config.work_dir, "devices"), cgroups_root=config.cgroups_root, mode=config.mode
    )
    host_devices = HostDevices(dev_root)
    if inventory is not None and host is None:
        host_devices.load_uvm()  # Mesos loads nvidia-uvm at start when it is missing
    store = StateStore(config.state_dir)
    try:
        volumes = VolumeManager(config.volume_root, driver_root=driver_root, **volume_kwargs)  # type: ignore[arg-type]
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


def _periodic(task: Callable[[], object], stop: threading.Event, interval: float, what: str) -> None:
    while not stop.wait(interval):
        try:
            task()
        except Exception:
            LOG.exception("periodic %s failed; retrying in %s s", what, interval)


def serve(config: Config) -> int:
    """Run the sidecar until SIGTERM or SIGINT. Raises IsolatorError if it cannot start."""
    configure_logging(config.log_level)
    notes: list[str] = []
    service = build_service(config, notes)
    server = SidecarServer(config, service)
    try:
        server.start()
    except BaseException:
        service.close()
        raise
    for note in notes:
        LOG.warning("%s", note)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        LOG.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if config.mode == "mesos":
        reap = (service.reap_vanished, stop, config.reap_interval, "reaping")
        threading.Thread(target=_periodic, args=reap, name="reaper", daemon=True).start()
    if config.audit_interval > 0:
        audit = (service.audit, stop, config.audit_interval, "drift audit")
        threading.Thread(target=_periodic, args=audit, name="audit", daemon=True).start()
    # Wake periodically so that signals are handled promptly whatever the platform's lock waits do.
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0
