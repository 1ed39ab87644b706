"""What each container uses on the devices it holds: NVML's processes attributed to containers by
their cgroups. Pure: the caller reads the processes (GpuInventory.process_usage) and each one's
cgroup (CgroupBackend.cgroup_of) and passes them in; the figures come out.

A process belongs to the top-level container whose cgroup under our root holds its cgroup, at any
depth: the container's own (v1 ``<root>/<id>``, v2 ``<root>/<id>/leaf``) and its nested containers'
(``<root>/<id>/mesos/<child>``...). A process outside our root (the MPS server, the host's own) or
in a cgroup of a container we have no record of is nobody's. Its memory counts on the device NVML
lists it on: the GPU, or the MIG device it runs on; an MPS client's own memory (the MPS call) counts
for its container, never the server's total.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from isolator.model import DeviceUse, ProcessUsage


@dataclass(frozen=True)
class HeldDevice:
    """One device a container holds, as the core describes it to ``attribute``."""

    uuid: str  # the GPU's, or the MIG device's
    minor: int  # the GPU's (a MIG device's parent's)
    index: int  # the GPU's NVML index (a MIG device's parent's)
    kind: str  # "gpu", "mig" or "share"
    memory_limit: int  # bytes: the device's memory, a share's slice


def owner(where: str | None, root: str) -> str | None:
    """The top-level container name (the first component below ``root``) of the cgroup ``where``;
    None for a cgroup outside our root, or when the process is gone (``where`` None)."""
    top = root.rstrip("/") + "/"
    if where is None or not where.startswith(top):
        return None
    name = where[len(top) :].split("/", 1)[0]
    return name or None


def share_slice(memory_total: int, shares: int, total: int) -> int:
    """The memory ``shares`` of ``total`` shares may use of a GPU of ``memory_total`` bytes."""
    return memory_total * shares // total if total > 0 else memory_total


def attribute(
    held: Iterable[HeldDevice],
    processes: Mapping[int, tuple[ProcessUsage, ...]],
    errors: Mapping[int, str],
    mine: Iterable[int],
) -> tuple[DeviceUse, ...]:
    """One container's use of each device it ``held``, from each GPU's ``processes`` (by NVML
    index; a GPU whose listing failed is in ``errors`` instead) and the pids that are ``mine`` (the
    listed processes whose cgroup is the container's). SM utilisation is the sum of its processes'
    (at most 100), None when the driver reports none for any of them; a device NVML could not list
    carries the error and zeros, never a made-up figure."""
    pids = frozenset(mine)
    out = []
    for dev in held:
        if dev.index in errors:
            out.append(DeviceUse(dev.uuid, dev.minor, dev.kind, 0, dev.memory_limit, None, (), errors[dev.index]))
            continue
        on = [
            p
            for p in processes.get(dev.index, ())
            if p.pid in pids and (p.mig_uuid == dev.uuid if dev.kind == "mig" else not p.mig_uuid)
        ]
        sm: int | None = None
        if on and all(p.sm_utilization is not None for p in on):
            sm = min(100, sum(p.sm_utilization or 0 for p in on))
        elif not on and dev.kind != "mig":
            sm = 0  # no process of its there: it uses none, whatever the driver reports
        out.append(
            DeviceUse(
                dev.uuid,
                dev.minor,
                dev.kind,
                sum(p.used_memory for p in on),
                dev.memory_limit,
                sm,
                tuple(sorted(p.pid for p in on)),
            )
        )
    return tuple(out)
