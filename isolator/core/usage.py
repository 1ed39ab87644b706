"""What each container's own processes use on the devices it holds: NVML's per-process view
(GpuInventory.process_usage) attributed by cgroup (CgroupBackend.cgroup_of), decided in
policy/usage.py. Used by the Usage hook, the admin views, the metrics and Update's whole-GPU shrink.

NVML is asked once per GPU and outside every lock. The pids are those NVML reports; they name the
container's processes as long as the sidecar shares the host's pid namespace (the unit runs it so);
a pid whose /proc entry is gone, or whose cgroup cannot be read, is nobody's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from isolator.core.context import Core
from isolator.errors import CgroupError, GpuNotFound, NvmlError
from isolator.model import ContainerId, ContainerRecord, DeviceUse, ProcessUsage
from isolator.policy import usage as attribution
from isolator.policy.usage import HeldDevice

LOG = logging.getLogger(__name__)


def held_devices(core: Core, rec: ContainerRecord) -> tuple[HeldDevice, ...]:
    """The devices ``rec`` holds, with what it may use of each: whole GPUs (by minor), its share's
    slice of a shared GPU, its MIG devices."""
    gpus = core.gpus
    out = [
        HeldDevice(gpus[m].uuid, m, gpus[m].index, "gpu", gpus[m].memory_total)
        for m in sorted(rec.holding.gpus)
        if m in gpus
    ]
    share = rec.holding.share
    if share is not None and share.gpu in gpus:
        gpu = gpus[share.gpu]
        with core.booking.lock:
            shared = core.booking.shared.get(share.gpu)
        total = shared.shares if shared is not None else share.count
        out.append(
            HeldDevice(
                gpu.uuid, gpu.minor, gpu.index, "share", attribution.share_slice(gpu.memory_total, share.count, total)
            )
        )
    for dev in sorted(core.grants.mig_of(rec), key=lambda d: (d.parent_minor, d.uuid)):
        out.append(HeldDevice(dev.uuid, dev.parent_minor, dev.parent_index, "mig", dev.memory_total))
    return tuple(out)


def read_processes(core: Core, indices: Iterable[int]) -> tuple[dict[int, tuple[ProcessUsage, ...]], dict[int, str]]:
    """Each GPU's processes (by NVML index), and for a GPU NVML could not list, why."""
    listed: dict[int, tuple[ProcessUsage, ...]] = {}
    errors: dict[int, str] = {}
    for index in sorted(set(indices)):
        try:
            listed[index] = core.inventory.process_usage(index)
        except (NvmlError, GpuNotFound) as exc:
            errors[index] = str(exc)
    return listed, errors


def owners(core: Core, processes: dict[int, tuple[ProcessUsage, ...]]) -> dict[int, str]:
    """pid -> the top-level container name whose cgroup holds it, for the listed processes that
    are in a container's cgroup under our root."""
    root = core.cgroups.root_path()
    out: dict[int, str] = {}
    for procs in processes.values():
        for p in procs:
            if p.pid in out:
                continue
            try:
                name = attribution.owner(core.cgroups.cgroup_of(p.pid), root)
            except CgroupError as exc:
                LOG.debug("pid %d on GPU %d: its cgroup cannot be read (%s); counted for nobody", p.pid, p.gpu, exc)
                continue
            if name is not None:
                out[p.pid] = name
    return out


def container_use(core: Core, records: Iterable[ContainerRecord]) -> dict[ContainerId, tuple[DeviceUse, ...]]:
    """What each of these (top-level) containers' processes use on each device it holds."""
    recs = [r for r in records if not r.container_id.nested]
    held = {r.container_id: held_devices(core, r) for r in recs}
    processes, errors = read_processes(core, (d.index for devs in held.values() for d in devs))
    owner_of = owners(core, processes)
    out = {}
    for cid, devices in held.items():
        mine = [pid for pid, name in owner_of.items() if name == cid.value]
        out[cid] = attribution.attribute(devices, processes, errors, mine)
    return out
