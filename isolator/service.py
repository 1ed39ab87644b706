"""The isolator hooks and the admin queries, as plain methods on plain data.

This module orchestrates; it never imports grpc or generated code (the server translates), and it
reaches the machine only through the edges it is given. Hooks that are not built yet raise
``Unimplemented`` so that the caller sees UNIMPLEMENTED, never a fake success.
"""

from __future__ import annotations

import logging
from typing import Any

from isolator.errors import Unimplemented
from isolator.model import ContainerConfig, ContainerId, ContainerState, LaunchInfo, RecoverResult, Resource

LOG = logging.getLogger(__name__)


class Service:
    # ---- Isolator hooks (include/mesos/slave/isolator.hpp) ------------------------------------

    def recover(self, states: list[ContainerState], orphans: list[ContainerId]) -> RecoverResult:
        raise Unimplemented(hook="Recover")

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        raise Unimplemented(hook="Prepare")

    def isolate(self, container_id: ContainerId, pid: int) -> None:
        raise Unimplemented(hook="Isolate")

    def watch(self, container_id: ContainerId, timeout: float | None) -> dict[str, Any] | None:
        raise Unimplemented(hook="Watch")

    def update(self, container_id: ContainerId, resources: list[Resource]) -> None:
        raise Unimplemented(hook="Update")

    def usage(self, container_id: ContainerId) -> dict[str, Any]:
        raise Unimplemented(hook="Usage")

    def status(self, container_id: ContainerId) -> dict[str, Any]:
        raise Unimplemented(hook="Status")

    def cleanup(self, container_id: ContainerId) -> None:
        raise Unimplemented(hook="Cleanup")

    # ---- Admin queries -------------------------------------------------------------------------

    def list_gpus(self) -> dict[str, Any]:
        raise Unimplemented(hook="ListGpus")

    def topology(self) -> dict[str, Any]:
        raise Unimplemented(hook="Topology")

    def list_containers(self) -> list[dict[str, Any]]:
        raise Unimplemented(hook="ListContainers")

    def describe_container(self, container_id: ContainerId) -> dict[str, Any]:
        raise Unimplemented(hook="DescribeContainer")

    def volume(self) -> dict[str, Any]:
        raise Unimplemented(hook="Volume")

    def health(self) -> list[tuple[str, bool, str]]:
        raise Unimplemented(hook="Health")

    def release(self, container_id: ContainerId, force: bool) -> dict[str, Any]:
        raise Unimplemented(hook="Release")

    def close(self) -> None:
        """Release what the service holds (event threads, the state store)."""
