"""The isolator hooks and the admin queries, as plain methods on plain data.

This module orchestrates; it never imports grpc or generated code (the server translates), and it
reaches the machine only through the edges it is given. Hooks that are not built yet raise
``Unimplemented`` so that the caller sees UNIMPLEMENTED, never a fake success.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from isolator import mig
from isolator.errors import Unimplemented
from isolator.model import ContainerConfig, ContainerId, ContainerState, LaunchInfo, RecoverResult, Resource

if TYPE_CHECKING:
    from isolator.nvml import Inventory

LOG = logging.getLogger(__name__)


class Service:
    def __init__(self, inventory: Inventory | None = None) -> None:
        # None: the sidecar manages no GPUs (gpus:0, or no NVML with auto-discovery).
        self.inventory = inventory

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
        """The ListGpusResponse shape (docs/inventory.md)."""
        inv = self.inventory
        if inv is None:
            return {"driver_version": "", "cuda_driver_version": "", "gpus": []}
        gpus = []
        for r in inv.records:
            g = r.gpu
            gpus.append(
                {
                    "index": g.index,
                    # A GPU whose identity could not be read has no minor; its empty UUID says so.
                    "minor": max(g.minor, 0),
                    "uuid": g.uuid,
                    "name": g.name,
                    "pci_bus_id": g.pci_bus_id,
                    "memory_total_bytes": g.memory_total,
                    "numa_node": -1 if g.numa_node is None else g.numa_node,
                    "cpu_affinity": g.cpu_affinity,
                    "healthy": r.usable,
                    "last_xid": r.health.last_xid,
                    "last_xid_time": r.health.last_xid_time,
                    "health_reason": r.status,
                    "holder": "",
                    "mig_enabled": r.mig_enabled,
                    "mig_devices": mig.device_views(r.mig_devices, {}) if r.mig_enabled else [],
                }
            )
        return {"driver_version": inv.driver_version, "cuda_driver_version": inv.cuda_driver_version, "gpus": gpus}

    def topology(self) -> dict[str, Any]:
        """The TopologyResponse shape: every pair once (a < b) in nvidia-smi topo -m notation."""
        if self.inventory is None:
            return {"indices": [], "links": [], "numa_nodes": [], "cpu_affinity": []}
        topo = self.inventory.topology()
        indices = [g.index for g in topo.gpus]
        links = []
        for i, a in enumerate(indices):
            for b in indices[i + 1 :]:
                link = topo.link(a, b)
                links.append({"a": a, "b": b, "kind": link.smi, "nvlink_lanes": link.nvlink_lanes})
        return {
            "indices": indices,
            "links": links,
            "numa_nodes": [-1 if g.numa_node is None else g.numa_node for g in topo.gpus],
            "cpu_affinity": [g.cpu_affinity for g in topo.gpus],
        }

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
        if self.inventory is not None:
            self.inventory.close()
