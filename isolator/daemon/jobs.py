"""The daemon's periodic jobs, one table (``periodic_jobs``: name, interval, work), the loop that runs
each, and the checks the serving loop makes on every tick. What a job does is the service's or an
exporter's; this module only decides when, and keeps a failure from stopping the sidecar.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from isolator.daemon.compose import cdi_spec_of
from isolator.daemon.config import Config
from isolator.model import Mode

if TYPE_CHECKING:
    from isolator.core.service import IsolatorService
    from isolator.daemon.sdnotify import Notifier
    from isolator.exporters.jobmap import JobMapping
    from isolator.gpu.nvml import Inventory
    from isolator.transport.server import SidecarServer

LOG = logging.getLogger("isolator")


@dataclass(frozen=True)
class Job:
    """Run ``work`` every ``interval`` seconds (0: not at all) on a daemon thread ``name``; a run that
    fails is logged as ``failure`` with its traceback, and the next period tries again."""

    name: str
    interval: float
    work: Callable[[], object]
    failure: str


def periodic_jobs(
    config: Config,
    service: IsolatorService,
    keeper: CdiKeeper | None,
    reaped: Callable[[int], None],
    audited: Callable[[int], None],
) -> tuple[Job, ...]:
    """Every periodic job of a serving daemon, in the order they start. ``reaped`` and ``audited`` hear how
    many containers a reap released and an audit repaired (the metrics, the job mapping)."""
    gpus, mesos = bool(service.core.gpus), config.mode is Mode.MESOS
    reap, audit = service.reap_vanished, service.audit
    rows: tuple[tuple[Job, bool], ...] = (
        # The CDI spec follows a changed volume or inventory (--cdi-dir).
        (
            Job("cdi", config.reap_interval, keeper.update if keeper else _nothing, "periodic reconciliation failed"),
            keeper is not None,
        ),
        # Containers whose Mesos cgroup vanished give their GPUs back (mesos mode).
        (Job("reaper", config.reap_interval, lambda: reaped(len(reap())), "periodic reconciliation failed"), mesos),
        # MPS control daemons found dead are started again, as often as the GPUs are probed (docs/sharing.md).
        (
            Job("mps", config.gpu_probe_interval, service.supervise_mps, "supervising the MPS control daemons failed"),
            gpus and bool(config.shared_gpus),
        ),
        # Draining GPUs are looked at again as often as the GPUs are probed (docs/handover.md).
        (
            Job("drain", config.gpu_probe_interval, service.recheck_draining, "re-checking the draining GPUs failed"),
            gpus and config.drain_check == "on",
        ),
        # Every container's kernel rules against its record; SIGHUP may change its period (0: off).
        (
            Job("audit", config.audit_interval, lambda: audited(len(audit().repaired)), "periodic drift audit failed"),
            True,
        ),
    )
    return tuple(job for job, wanted in rows if wanted)


def _nothing() -> None:
    pass


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


class Jobs:
    """The table's jobs, running. One can be restarted with another interval (SIGHUP's audit_interval);
    a stopped job ends at its next wake-up (at once while it waits; after a run in progress)."""

    def __init__(self, jobs: tuple[Job, ...]) -> None:
        self._jobs = {job.name: job for job in jobs}
        self._cancel: dict[str, threading.Event] = {}

    def start(self) -> Jobs:
        for job in self._jobs.values():
            self._start(job)
        return self

    def restart(self, name: str, interval: float) -> None:
        if name in self._jobs:
            self._stop(name)
            self._jobs[name] = replace(self._jobs[name], interval=interval)
            self._start(self._jobs[name])

    def stop(self) -> None:
        for name in list(self._cancel):
            self._stop(name)

    def _start(self, job: Job) -> None:
        if job.interval > 0:
            cancel = self._cancel[job.name] = threading.Event()
            every(job.interval, cancel, job.work, job.name, job.failure)

    def _stop(self, name: str) -> None:
        cancel = self._cancel.pop(name, None)
        if cancel is not None:
            cancel.set()


# ---- what the serving loop checks on every tick ---------------------------------------------------


class NvmlHealth:
    """Health that follows NVML: grpc_health_probe says NOT_SERVING while NVML does not answer (no GPU
    can be handed out), SERVING again once it does; systemd's STATUS= says the same."""

    def __init__(self, nvml: Inventory, server: SidecarServer, notifier: Notifier, serving: str) -> None:
        self.nvml = nvml
        self.server = server
        self.notifier = notifier
        self.serving = serving
        self.answering = True

    def __call__(self) -> None:
        if self.nvml.nvml_answering == self.answering:
            return
        self.answering = not self.answering
        self.server.set_serving(self.answering)
        if self.answering:
            LOG.warning("NVML answers again: the health service says SERVING")
        else:
            LOG.error("NVML does not answer: the health service says NOT_SERVING until it does")
        status = self.serving if self.answering else "NVML does not answer; no GPU can be handed out"
        self.notifier.notify(f"STATUS={status}")


class RescanFollower:
    """The GPUs were read again (a MIG mode change, a GPU back): the job mapping and the CDI spec follow
    the inventory."""

    def __init__(self, nvml: Inventory, jobmap: JobMapping | None, keeper: CdiKeeper | None, directory: str) -> None:
        self.nvml = nvml
        self.jobmap = jobmap
        self.keeper = keeper
        self.directory = directory
        self.rescans = nvml.rescans

    def __call__(self) -> None:
        if self.nvml.rescans == self.rescans:
            return
        self.rescans = self.nvml.rescans
        if self.jobmap is not None:
            try:
                self.jobmap.sync()
            except Exception:
                LOG.exception("failed to update the job mapping in '%s'", self.directory)
        if self.keeper is not None:
            self.keeper.update()  # logs its own failures


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

    def start(self) -> CdiKeeper:
        """Written now and whenever a GPU's health changes; the periodic rewrite is a job (``periodic_jobs``)."""
        self.update()
        self.inventory.on_health_change(lambda _event: self.update())
        return self
