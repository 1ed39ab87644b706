"""The isolator service: the hooks, recovery and the admin views over one set of edges.

This is the object the gRPC servicers and the bridge call (``isolator.core.api.IsolatorApi``). It
composes three parts that share one ``Core`` (isolator/core/context.py):

    hooks.Hooks        prepare, isolate, update, watch, usage, status, cleanup
    recovery.Recovery  start-up reconciliation, recover, reap_vanished, the drift audit
    admin.Admin        list_gpus, topology, list_containers, describe_container, release, volume, health

It speaks the domain model (isolator.model) only: no grpc, no proto, no dicts shaped like messages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from isolator.core.admin import Admin
from isolator.core.context import Core, Edges, Settings
from isolator.core.hooks import Hooks
from isolator.core.ports import (
    CgroupBackend,
    Clock,
    DeviceNodes,
    Filesystem,
    Inventory,
    Processes,
    StateStore,
    VolumeBuilder,
)
from isolator.core.recovery import Recovery
from isolator.model import (
    AuditReport,
    ContainerConfig,
    ContainerId,
    ContainerInfo,
    ContainerState,
    ContainerStatus,
    Description,
    GpuList,
    HealthCheck,
    LaunchInfo,
    Limitation,
    RecoverResult,
    Released,
    Resource,
    TopologyView,
    Undrained,
    Usage,
    VolumeReport,
)


class IsolatorService:
    def __init__(
        self,
        *,
        inventory: Inventory,
        cgroups: CgroupBackend,
        devices: DeviceNodes,
        store: StateStore,
        volumes: VolumeBuilder | None,
        processes: Processes,
        filesystem: Filesystem,
        clock: Clock,
        settings: Settings | None = None,
    ) -> None:
        edges = Edges(inventory, cgroups, devices, store, volumes, processes, filesystem, clock)
        self.core = Core(edges, settings or Settings())
        self.hooks = Hooks(self.core)
        self.recovery = Recovery(self.core)
        self.admin = Admin(self.core)
        self.recovery.start()

    # ---- Isolator hooks (include/mesos/slave/isolator.hpp) ----------------------------------------

    def recover(self, states: list[ContainerState], orphans: list[ContainerId]) -> RecoverResult:
        return self.recovery.recover(states, orphans)

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        return self.hooks.prepare(container_id, config)

    def isolate(self, container_id: ContainerId, pid: int) -> None:
        self.hooks.isolate(container_id, pid)

    def watch(self, container_id: ContainerId, timeout: float | None) -> Limitation | None:
        return self.hooks.watch(container_id, timeout)

    def subscribe(self, callback: Callable[[], None], container: ContainerId | None = None) -> Callable[[], None]:
        """Call ``callback`` on each change that may end a Watch of ``container``; returns the
        unsubscribe function. A Watch re-checks with ``watch(cid, 0)`` when called back."""
        return self.core.subscribe(callback, container)

    def update(self, container_id: ContainerId, resources: list[Resource]) -> None:
        self.hooks.update(container_id, resources)

    def usage(self, container_id: ContainerId) -> Usage:
        return self.hooks.usage(container_id)

    def status(self, container_id: ContainerId) -> ContainerStatus:
        return self.hooks.status(container_id)

    def cleanup(self, container_id: ContainerId) -> None:
        self.hooks.cleanup(container_id)

    # ---- maintenance --------------------------------------------------------------------------------

    def reap_vanished(self) -> list[ContainerId]:
        return self.recovery.reap_vanished()

    def audit(self) -> AuditReport:
        return self.recovery.audit()

    # ---- admin views --------------------------------------------------------------------------------

    def list_gpus(self) -> GpuList:
        return self.admin.list_gpus()

    def topology(self) -> TopologyView:
        return self.admin.topology()

    def list_containers(self) -> list[ContainerInfo]:
        return self.admin.list_containers()

    def describe_container(self, container_id: ContainerId) -> Description:
        return self.admin.describe_container(container_id)

    def release(self, container_id: ContainerId, force: bool) -> Released:
        return self.admin.release(container_id, force)

    def volume(self) -> VolumeReport:
        return self.admin.volume()

    def health(self) -> list[HealthCheck]:
        return self.admin.health()

    def undrain(self, gpu: str) -> Undrained:
        return self.admin.undrain(gpu)

    def recheck_draining(self) -> None:
        """Check the draining GPUs again (the daemon's probe loop, docs/handover.md)."""
        self.core.handover.recheck()

    def close(self) -> None:
        """Stop the inventory's event thread and close the state store."""
        with contextlib.suppress(Exception):
            self.core.inventory.close()
        with contextlib.suppress(Exception):
            self.core.store.close()
