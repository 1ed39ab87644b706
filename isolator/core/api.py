"""What the edge servers (gRPC servicers, the command-module bridge) may call on the core.

``isolator.core.service.IsolatorService`` implements it; so does ``isolator.testing.StubService``,
a base for test doubles of the whole service. Only domain types (isolator.model) cross it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

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


class IsolatorApi(Protocol):
    # Isolator hooks (include/mesos/slave/isolator.hpp)
    def recover(self, states: list[ContainerState], orphans: list[ContainerId]) -> RecoverResult: ...

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None: ...

    def isolate(self, container_id: ContainerId, pid: int) -> None: ...

    def watch(self, container_id: ContainerId, timeout: float | None) -> Limitation | None: ...

    # Without a thread: ``callback`` (which must not block) runs on each change that may end a
    # Watch of ``container``; the returned function unsubscribes. Re-check with watch(cid, 0).
    def subscribe(self, callback: Callable[[], None], container: ContainerId | None = None) -> Callable[[], None]: ...

    def update(self, container_id: ContainerId, resources: list[Resource]) -> None: ...

    def usage(self, container_id: ContainerId) -> Usage: ...

    def status(self, container_id: ContainerId) -> ContainerStatus: ...

    def cleanup(self, container_id: ContainerId) -> None: ...

    # Admin views (docs/cli.md)
    def list_gpus(self) -> GpuList: ...

    def topology(self) -> TopologyView: ...

    def list_containers(self) -> list[ContainerInfo]: ...

    def describe_container(self, container_id: ContainerId) -> Description: ...

    def release(self, container_id: ContainerId, force: bool) -> Released: ...

    def volume(self) -> VolumeReport: ...

    def health(self) -> list[HealthCheck]: ...

    def audit(self) -> AuditReport: ...

    def undrain(self, gpu: str) -> Undrained: ...

    def close(self) -> None: ...
