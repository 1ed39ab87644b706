"""What each process on a GPU uses, through NVML's per-process calls (the one NVML door,
isolator/gpu/nvmlcall.py): the compute, graphics and MPS-client lists, each MIG device's own
processes, and nvmlDeviceGetProcessUtilization's samples.

MPS clients come from the MPS call with their own memory, once: a pid the compute list also names
is taken from the MPS list; the MPS server stays a compute process (whatever the driver charges it).
"""

from __future__ import annotations

from typing import Any

from isolator.errors import NvmlError
from isolator.gpu import nvmlcall as nv
from isolator.model import GpuRecord, ProcessUsage

_LISTS = {"compute": "Compute", "graphics": "Graphics", "mps": "MPSCompute"}


def process_usage(handle: object, record: GpuRecord) -> tuple[ProcessUsage, ...]:
    """Every process on the GPU of ``record`` (``handle`` its NVML handle), on each of its MIG
    devices when MIG is on. Raises NvmlError when NVML cannot list the compute processes (callers
    that display show N/A; callers that decide fail closed)."""
    index = record.index
    if record.mig_enabled:
        out: list[ProcessUsage] = []
        for mig in record.mig_devices:
            target = f"GPU {index} MIG {mig.gpu_instance_id}/{mig.compute_instance_id}"
            mig_handle = nv.call("nvmlDeviceGetHandleByUUID", mig.uuid, op="find MIG device", target=target)
            # per-process utilisation is not reported on MIG devices (NOT_SUPPORTED)
            out += listed(mig_handle, index, target, mig.uuid, None)
        return tuple(out)
    target = f"GPU {index}"
    return listed(handle, index, target, "", utilization(handle, target))


def listed(
    handle: object, index: int, target: str, mig_uuid: str, util: dict[int, tuple[int, int]] | None
) -> tuple[ProcessUsage, ...]:
    """The processes of one handle's lists, each pid once, with its utilisation (None: not reported;
    a pid without a sample where it is reported: 0)."""
    lists = {kind: one_list(handle, kind, target) for kind in _LISTS}
    mps = {int(p.pid) for p in lists["mps"]}
    out: dict[int, ProcessUsage] = {}
    for kind, found in lists.items():
        for p in found:
            pid = int(p.pid)
            if pid in out or (kind != "mps" and pid in mps):
                continue
            sm, mem = (None, None) if util is None else util.get(pid, (0, 0))
            out[pid] = ProcessUsage(pid, index, int(p.usedGpuMemory or 0), kind, mig_uuid, sm, mem)
    return tuple(sorted(out.values(), key=lambda p: p.pid))


def one_list(handle: object, kind: str, target: str) -> list[Any]:
    """One of NVML's process lists (_v3, else _v2 on drivers before R510: the same struct). The
    graphics and MPS lists may be absent (a datacenter board, an old driver): none then."""
    name = _LISTS[kind]
    v3, v2 = f"nvmlDeviceGet{name}RunningProcesses_v3", f"nvmlDeviceGet{name}RunningProcesses_v2"
    op = f"list {kind} processes"
    try:
        try:
            return list(nv.call(v3, handle, op=op, target=target))
        except NvmlError as exc:
            if nv.code(exc) != nv.FUNCTION_NOT_FOUND:
                raise
            return list(nv.call(v2, handle, op=op, target=target))
    except NvmlError as exc:
        if kind != "compute" and nv.absent(exc):
            return []
        raise NvmlError(op=op, target=target, cause=nv.cause(exc), nvml_code=nv.code(exc), call=v3) from exc


def utilization(handle: object, target: str) -> dict[int, tuple[int, int]] | None:
    """pid -> (SM %, memory %) from each process's newest sample (nvmlDeviceGetProcessUtilization);
    {} when no process was sampled (NOT_FOUND: none used the GPU lately), None when the driver or
    the GPU does not report it. Any other failure is NvmlError."""
    try:
        op = "query process utilization"
        samples = nv.call("nvmlDeviceGetProcessUtilization", handle, 0, op=op, target=target)
    except NvmlError as exc:
        if nv.code(exc) == nv.NOT_FOUND:
            return {}
        if nv.absent(exc):
            return None
        raise
    newest: dict[int, Any] = {}
    for s in samples:
        if int(s.pid) not in newest or int(s.timeStamp) >= int(newest[int(s.pid)].timeStamp):
            newest[int(s.pid)] = s
    return {pid: (int(s.smUtil), int(s.memUtil)) for pid, s in newest.items()}
