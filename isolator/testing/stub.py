"""``StubService``: a base for test doubles of the whole service that answers UNIMPLEMENTED.

Subclass it and override the methods a test needs (tests/test_bridge.py records what arrives).
Every other hook answers ``Unimplemented`` so the caller sees UNIMPLEMENTED, never a fake success.
"""

from __future__ import annotations

from collections.abc import Callable

from isolator.errors import Unimplemented
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


class StubService:
    def recover(self, states: list[ContainerState], orphans: list[ContainerId]) -> RecoverResult:
        raise Unimplemented(hook="Recover")

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        raise Unimplemented(hook="Prepare")

    def isolate(self, container_id: ContainerId, pid: int) -> None:
        raise Unimplemented(hook="Isolate")

    def watch(self, container_id: ContainerId, timeout: float | None) -> Limitation | None:
        raise Unimplemented(hook="Watch")

    def subscribe(self, callback: Callable[[], None], container: ContainerId | None = None) -> Callable[[], None]:
        return lambda: None  # nothing here ever changes

    def update(self, container_id: ContainerId, resources: list[Resource]) -> None:
        raise Unimplemented(hook="Update")

    def usage(self, container_id: ContainerId) -> Usage:
        raise Unimplemented(hook="Usage")

    def status(self, container_id: ContainerId) -> ContainerStatus:
        raise Unimplemented(hook="Status")

    def cleanup(self, container_id: ContainerId) -> None:
        raise Unimplemented(hook="Cleanup")

    def list_gpus(self) -> GpuList:
        return GpuList(driver_version="", cuda_driver_version="")

    def topology(self) -> TopologyView:
        return TopologyView()

    def list_containers(self) -> list[ContainerInfo]:
        raise Unimplemented(hook="ListContainers")

    def describe_container(self, container_id: ContainerId) -> Description:
        raise Unimplemented(hook="DescribeContainer")

    def release(self, container_id: ContainerId, force: bool) -> Released:
        raise Unimplemented(hook="Release")

    def volume(self) -> VolumeReport:
        raise Unimplemented(hook="Volume")

    def health(self) -> list[HealthCheck]:
        raise Unimplemented(hook="Health")

    def audit(self) -> AuditReport:
        raise Unimplemented(hook="Audit")

    def undrain(self, gpu: str) -> Undrained:
        raise Unimplemented(hook="Undrain")

    def close(self) -> None:
        pass
