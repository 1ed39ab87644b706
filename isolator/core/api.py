"""What the transport (isolator/transport/handlers.py, for gRPC and the command-module bridge alike)
may call on the core: the one declaration of the hook API.

``isolator.core.service.IsolatorService`` implements it (each method in its part: hooks, recovery,
admin). A method's body here is what a service that does not implement it answers: UNIMPLEMENTED,
never a fake success; ``isolator.testing.StubService`` inherits exactly that. Only domain types
(isolator.model) cross it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from isolator.errors import Unimplemented
from isolator.model import (
    AuditReport,
    ContainerConfig,
    ContainerId,
    ContainerInfo,
    ContainerState,
    ContainerStatus,
    Description,
    EndedDrain,
    GpuList,
    HealthCheck,
    LaunchInfo,
    Limitation,
    MaintenanceChange,
    RecoverResult,
    Released,
    Resource,
    TopologyView,
    Undrained,
    Usage,
    VolumeReport,
)
from isolator.policy.request import UPDATE_READS as UPDATE_READS  # said on Prepare's answer by the transport


class IsolatorApi(Protocol):
    # Isolator hooks (include/mesos/slave/isolator.hpp)
    def recover(self, states: list[ContainerState], orphans: list[ContainerId]) -> RecoverResult:
        raise Unimplemented(hook="Recover")

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        raise Unimplemented(hook="Prepare")

    # Prepare for a caller that waits for the container's Isolate: ``answer(info)`` may be called
    # (at most once, before this returns) as soon as the launch info is decided, before the grant
    # is durable and in force; Isolate answers only once it is. The info is returned either way.
    # Here: never early.
    def prepare_early(
        self, container_id: ContainerId, config: ContainerConfig, answer: Callable[[LaunchInfo | None], None]
    ) -> LaunchInfo | None:
        return self.prepare(container_id, config)

    # ``caller``: the calling process's pid as the kernel gave it (SO_PEERCRED), UNKNOWN_CALLER
    # when a remote caller's pid cannot be told, None for an in-process call (no peer to check).
    def isolate(self, container_id: ContainerId, pid: int, caller: int | None = None) -> None:
        raise Unimplemented(hook="Isolate")

    # Whether the launch must wait for this container's Isolate (said on Prepare's answer by the
    # transport; docs/mesos-agent.md, "a launch waits for Isolate only when"). Unknown here: it
    # must (fail closed).
    def isolate_awaited(self, container_id: ContainerId) -> bool:
        return True

    # Is there a limitation now? Never waits: the transport waits, subscribed below.
    def watch(self, container_id: ContainerId) -> Limitation | None:
        raise Unimplemented(hook="Watch")

    # Without a thread: ``callback`` (which must not block) runs on each change that may end a
    # Watch of ``container``; the returned function unsubscribes. Ask again with watch(cid).
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

    # Admin views (docs/cli.md)
    def list_gpus(self) -> GpuList:
        raise Unimplemented(hook="ListGpus")

    def topology(self) -> TopologyView:
        raise Unimplemented(hook="Topology")

    def list_containers(self, usage: bool = True) -> list[ContainerInfo]:
        """``usage``: with what each container's processes use (NVML asked per GPU held)."""
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

    # An operator's maintenance drain (docs/operations.md); ``caller``: who asked, as the peer gate saw it.
    def maintenance_drain(self, gpu: str, reason: str, caller: str) -> MaintenanceChange:
        raise Unimplemented(hook="MaintenanceDrain")

    def maintenance_undrain(self, gpu: str, caller: str, reason: str = "") -> MaintenanceChange:
        raise Unimplemented(hook="MaintenanceUndrain")

    # The ended drains, oldest first: who took each GPU out, why, and who returned it (the audit trail).
    def maintenance_history(self) -> list[EndedDrain]:
        raise Unimplemented(hook="MaintenanceHistory")

    # What the managed GPUs offer an agent: its --resources string and --attributes pairs (docs/cli.md).
    def agent_flags(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        raise Unimplemented(hook="AgentFlags")

    def close(self) -> None:
        return None
