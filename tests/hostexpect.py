"""What a host description says NVML must report: the tests' independent reading of a HostSpec."""

from __future__ import annotations

from typing import Any

from isolator.simhost.host import HostSpec, format_cpu_list, mig_caps_minors

SMI = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def lanes(spec: HostSpec, a: int, b: int) -> int:
    ga, gb = spec.gpus[a], spec.gpus[b]
    direct = ga.nvlink.get(b, 0)
    to_a, to_b = sum(ga.nvswitch.values()), sum(gb.nvswitch.values())
    return direct + (min(to_a, to_b) if to_a and to_b else 0)


def kind(spec: HostSpec, a: int, b: int) -> str:
    n = lanes(spec, a, b)
    return f"NV{n}" if n else SMI[int(spec.level(a, b))]


def gpus_json(spec: HostSpec) -> list[dict[str, Any]]:
    """The ListGpus entries (as the CLI's --json prints them) for a host with every GPU healthy."""
    out = []
    for g in spec.gpus:
        cpus = format_cpu_list(spec.numa.get(g.numa_node, ())) if g.numa_node is not None else ""
        out.append(
            {
                "index": g.index,
                "minor": g.minor,
                "uuid": g.uuid,
                "name": g.name,
                "pci_bus_id": g.pci_bus_id,
                "memory_total_bytes": str(g.memory_mib * 2**20),  # uint64 is a string in proto JSON
                "numa_node": -1 if g.numa_node is None else g.numa_node,
                "cpu_affinity": cpus,
                "healthy": True,
                "last_xid": "0",
                "last_xid_time": None,  # a time: ISO 8601 UTC, null when unset
                "health_reason": "",
                "holder": "",
                "mig_enabled": bool(g.mig),
                "mig_devices": [
                    {
                        "uuid": m.uuid,
                        "profile": m.profile,
                        "resource": "mig-" + m.profile.replace("+", ".") if m.gpu_slices == m.compute_slices else "",
                        "gpu_instance_id": m.gpu_instance,
                        "compute_instance_id": m.compute_instance,
                        "memory_total_bytes": str(m.memory_mib * 2**20),
                        "caps_minors": list(mig_caps_minors(g.minor, m.gpu_instance, m.compute_instance)),
                        "slot": slot,
                        "holder": "",
                    }
                    for slot, m in sorted(
                        enumerate(g.mig_devices), key=lambda sm: (sm[1].gpu_instance, sm[1].compute_instance)
                    )
                ]
                if g.mig
                else [],
                # The handover check (docs/handover.md): nothing runs on a fresh host's GPUs.
                "drain_state": "",
                "drain_since": None,
                "drain_pids": [],
                "drain_reason": "",
                "drain_memory_used_bytes": "0",
                "last_reset": [],
                # An operator's maintenance drain (docs/operations.md section 7): none on a fresh host.
                "maintenance": False,
                "maintenance_reason": "",
                "maintenance_since": None,
                "maintenance_by": "",
                # Shares (docs/sharing.md): nothing is shared unless --shared-gpus says so.
                "shares_total": 0,
                "shares_held": 0,
                "share_mode": "",
                "share_holders": [],
                "mps_state": "",
            }
        )
    return out


def topology_json(spec: HostSpec) -> dict[str, Any]:
    n = len(spec.gpus)
    return {
        "indices": list(range(n)),
        "links": [
            {"a": a, "b": b, "kind": kind(spec, a, b), "nvlink_lanes": lanes(spec, a, b)}
            for a in range(n)
            for b in range(a + 1, n)
        ],
        "numa_nodes": [-1 if g.numa_node is None else g.numa_node for g in spec.gpus],
        "cpu_affinity": [
            format_cpu_list(spec.numa.get(g.numa_node, ())) if g.numa_node is not None else "" for g in spec.gpus
        ],
    }
