"""``FakeInventory``: the GPUs of a host without NVML (isolator.core.ports.GpuInventory).

Built from a ``Topology`` or from one of the simulated hosts shipped in isolator/simhost/hosts/
(``FakeInventory.of_host("dgx-1")``), parsed only: no fake library, no device nodes, no root.
Tests steer it as they steer the simulated host: ``xid(index, 79)`` makes a GPU unhealthy and
tells subscribers, ``set_usage`` sets what ``usage`` answers, ``lose_nvml`` makes live calls fail;
``start_process``/``stop_process``, ``set_compute_mode``/``set_application_clocks``/``settings`` and
``fail`` have the simulated host's names and meanings (what a container leaves behind on a GPU).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from isolator.errors import GpuNotFound, NvmlError
from isolator.model import (
    Gpu,
    GpuHealth,
    GpuProcess,
    GpuRecord,
    GpuUsageSample,
    HealthEvent,
    Link,
    MigDevice,
    Occupancy,
    ProcessUsage,
    ResetStep,
    Topology,
    compute_mode_name,
)

# As isolator/simhost/fakenvml.c: the application clocks every GPU boots with.
DEFAULT_APP_GRAPHICS_MHZ = 1312
DEFAULT_APP_MEMORY_MHZ = 877
_CODES = {3: "NOT_SUPPORTED", 4: "NO_PERMISSION", 9: "DRIVER_NOT_LOADED", 15: "GPU_IS_LOST", 999: "UNKNOWN"}
_ERRORS = {  # nvmlErrorString
    "NOT_SUPPORTED": "Not Supported",
    "NO_PERMISSION": "Insufficient Permissions",
    "DRIVER_NOT_LOADED": "Driver Not Loaded",
    "GPU_IS_LOST": "GPU is lost",
    "UNKNOWN": "Unknown Error",
}


@dataclass(frozen=True)
class _Process:
    """A line of the simulated host's control/processes, as the fake keeps it."""

    pid: int
    memory: int
    kind: str  # compute, graphics, mps-server, mps
    sm: int | None
    mem: int
    mig: tuple[int, int] | None


class FakeInventory:
    def __init__(
        self,
        topology: Topology,
        driver_version: str = "535.104.05",
        cuda_driver_version: str = "12.2",
        mig: dict[int, tuple[MigDevice, ...]] | None = None,
    ) -> None:
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self._topology = topology
        self._lock = threading.Lock()
        self._records = {
            g.index: GpuRecord(
                gpu=g,
                mig_capable=bool(mig and g.index in mig),
                mig_enabled=bool(mig and g.index in mig),
                mig_devices=(mig or {}).get(g.index, ()),
            )
            for g in topology.gpus
        }
        self._usage: dict[int, GpuUsageSample] = {}
        self._processes: dict[int, list[_Process]] = {}
        self._settings: dict[int, tuple[int, int, int]] = {}  # compute mode, app graphics/memory MHz
        self._fail: dict[tuple[int, str], str] = {}  # (index, NVML call) -> NVML error name
        self._callbacks: list[Callable[[HealthEvent], None]] = []
        self.nvml_lost = False
        self.closed = False

    @classmethod
    def of_host(cls, name: str) -> FakeInventory:
        """The GPUs, links and MIG devices of a shipped simulated host (``dgx-1``, ``dgx-a100``...)."""
        from isolator.simhost.host import format_cpu_list, load_host, mig_caps_minors

        spec = load_host(name)
        gpus = tuple(
            Gpu(
                index=g.index,
                minor=g.minor,
                uuid=g.uuid,
                name=g.name,
                pci_bus_id=g.pci_bus_id,
                memory_total=g.memory_mib << 20,
                numa_node=g.numa_node,
                cpu_affinity=format_cpu_list(spec.numa.get(g.numa_node, ())) if g.numa_node is not None else "",
            )
            for g in spec.gpus
        )
        switch_lanes = {g.index: sum(g.nvswitch.values()) for g in spec.gpus}
        by_index = {g.index: g for g in spec.gpus}
        links = {}
        for a in by_index:
            for b in by_index:
                if a < b:
                    lanes = min(by_index[a].nvlink.get(b, 0), by_index[b].nvlink.get(a, 0))
                    if switch_lanes[a] and switch_lanes[b]:
                        lanes += min(switch_lanes[a], switch_lanes[b])
                    links[(a, b)] = Link(pcie=spec.level(a, b), nvlink_lanes=lanes)
        mig = {
            g.index: tuple(
                MigDevice(
                    parent_uuid=g.uuid,
                    uuid=m.uuid,
                    gpu_instance_id=m.gpu_instance,
                    compute_instance_id=m.compute_instance,
                    caps_minors=mig_caps_minors(g.minor, m.gpu_instance, m.compute_instance),
                    memory_total=m.memory_mib << 20,
                    profile=m.profile,
                    parent_index=g.index,
                    parent_minor=g.minor,
                    gpu_slices=m.gpu_slices,
                    compute_slices=m.compute_slices,
                    placement=(m.placement_start, m.placement_size),
                    slot=slot,
                )
                for slot, m in enumerate(g.mig_devices)
            )
            for g in spec.gpus
            if g.mig
        }
        cuda = f"{spec.cuda_driver_version // 1000}.{spec.cuda_driver_version % 1000 // 10}"
        return cls(Topology(gpus=gpus, links=links), spec.driver_version, cuda, mig)

    # ---- GpuInventory-------------------------------------------------------------------------------

    @property
    def records(self) -> tuple[GpuRecord, ...]:
        with self._lock:
            return tuple(self._records[i] for i in sorted(self._records))

    def topology(self) -> Topology:
        return self._topology

    def healthy(self) -> frozenset[int]:
        with self._lock:
            return frozenset(i for i, r in self._records.items() if r.usable)

    def usage(self, index: int) -> GpuUsageSample:
        self._live("query utilization", index)
        with self._lock:
            if index not in self._records:
                raise GpuNotFound(op="find GPU", target=str(index), cause="not managed by this sidecar")
            total = self._records[index].gpu.memory_total
            return self._usage.get(index, GpuUsageSample(index, total, 0, 0, 0))

    def device_count(self) -> int:
        self._live("count devices", None)
        return len(self._records)

    def on_health_change(self, callback: Callable[[HealthEvent], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def occupancy(self, index: int) -> Occupancy:
        self._live("list compute processes", index)
        self._injected(index, "nvmlDeviceGetComputeRunningProcesses", "list compute processes")
        with self._lock:
            if index not in self._records:
                raise GpuNotFound(op="find GPU", target=str(index), cause="not managed by this sidecar")
            procs = list(self._processes.get(index, ()))
            total = self._records[index].gpu.memory_total
            base = self._usage[index].memory_used if index in self._usage else 0
        listed = tuple(
            GpuProcess(p.pid, self._charged(p, procs), "graphics" if p.kind == "graphics" else "compute")
            for p in procs
            if p.kind != "mps"
        )
        used = min(total, base + sum(p.memory for p in procs))
        return Occupancy(listed, used, total)

    @staticmethod
    def _charged(p: _Process, procs: list[_Process]) -> int:
        """What NVML's compute list says ``p`` uses: an MPS server carries its clients' memory."""
        if p.kind != "mps-server":
            return p.memory
        return p.memory + sum(c.memory for c in procs if c.kind == "mps" and c.mig == p.mig)

    def process_usage(self, index: int) -> tuple[ProcessUsage, ...]:
        self._live("list compute processes", index)
        self._injected(index, "nvmlDeviceGetComputeRunningProcesses", "list compute processes")
        with self._lock:
            if index not in self._records:
                raise GpuNotFound(op="find GPU", target=str(index), cause="not managed by this sidecar")
            record = self._records[index]
            procs = list(self._processes.get(index, ()))
            util_failure = self._fail.get((index, "nvmlDeviceGetProcessUtilization"))
        if util_failure and util_failure not in ("NOT_SUPPORTED",):
            raise NvmlError(op="query process utilization", target=f"GPU {index}", cause=_ERRORS[util_failure])
        reported = not record.mig_enabled and not util_failure
        out: dict[int, ProcessUsage] = {}
        for p in procs:
            mig_uuid = ""
            if record.mig_enabled:
                found = [m.uuid for m in record.mig_devices if (m.gpu_instance_id, m.compute_instance_id) == p.mig]
                if not found:
                    continue  # a MIG GPU's processes are listed by MIG device
                mig_uuid = found[0]
            if p.pid in out and p.kind != "mps":
                continue  # as the real edge: the first listing of a pid, the MPS call's over the others
            sm, mem = ((p.sm, p.mem) if p.sm is not None else (0, 0)) if reported else (None, None)
            kind = p.kind if p.kind in ("graphics", "mps") else "compute"
            out[p.pid] = ProcessUsage(p.pid, index, self._charged(p, procs), kind, mig_uuid, sm, mem)
        return tuple(sorted(out.values(), key=lambda p: p.pid))

    def reset_settings(self, index: int, compute_mode: int) -> tuple[ResetStep, ...]:
        self._live("reset settings", index)
        with self._lock:
            mode, graphics, memory = self._settings.get(index, (0, DEFAULT_APP_GRAPHICS_MHZ, DEFAULT_APP_MEMORY_MHZ))
            clocks_failure = self._fail.get((index, "nvmlDeviceResetApplicationsClocks"))
            mode_failure = self._fail.get((index, "nvmlDeviceSetComputeMode"))
        steps = []
        before = f"graphics {graphics} MHz, memory {memory} MHz"
        default = f"graphics {DEFAULT_APP_GRAPHICS_MHZ} MHz, memory {DEFAULT_APP_MEMORY_MHZ} MHz"
        if (graphics, memory) == (DEFAULT_APP_GRAPHICS_MHZ, DEFAULT_APP_MEMORY_MHZ):
            steps.append(ResetStep("application clocks", before, before, False))
        elif clocks_failure:
            steps.append(ResetStep("application clocks", before, "", False, _ERRORS[clocks_failure], clocks_failure))
        else:
            self.set_application_clocks(index, DEFAULT_APP_GRAPHICS_MHZ, DEFAULT_APP_MEMORY_MHZ)
            steps.append(ResetStep("application clocks", before, default, True))
        name = compute_mode_name(mode)
        if mode == compute_mode:
            steps.append(ResetStep("compute mode", name, name, False))
        elif mode_failure:
            steps.append(ResetStep("compute mode", name, "", False, _ERRORS[mode_failure], mode_failure))
        else:
            self.set_compute_mode(index, compute_mode)
            steps.append(ResetStep("compute mode", name, compute_mode_name(compute_mode), True))
        return tuple(steps)

    def close(self) -> None:
        self.closed = True

    # ---- steering -----------------------------------------------------------------------------------

    def xid(self, index: int, xid: int, when: float = 0.0) -> None:
        """A critical XID on GPU ``index``: it becomes unhealthy and subscribers hear of it."""
        self.mark_unhealthy(index, f"XID {xid}", xid, when)

    def mark_unhealthy(self, index: int, reason: str, xid: int = 0, when: float = 0.0, source: str = "xid") -> None:
        """As the real inventory's (isolator/gpu/health.py): GPU ``index`` unhealthy for ``source``."""
        self._set_health(index, GpuHealth(False, reason, xid, when, source))

    def reset(self, index: int) -> None:
        """GPU ``index`` was reset (unbound and bound again): healthy, and subscribers hear of it."""
        self._set_health(index, GpuHealth())

    def _set_health(self, index: int, health: GpuHealth) -> None:
        with self._lock:
            rec = self._records.get(index)
            if rec is None:
                return
            self._records[index] = replace(rec, health=health)
            callbacks = list(self._callbacks)
        for cb in callbacks:
            cb(HealthEvent(index, rec.gpu.uuid, health.healthy, health.reason, health.last_xid, health.last_xid_time))

    def set_usage(self, index: int, memory_used: int, utilization: int) -> None:
        with self._lock:
            total = self._records[index].gpu.memory_total
            self._usage[index] = GpuUsageSample(index, total, memory_used, utilization, 0)

    def lose_nvml(self) -> None:
        self.nvml_lost = True

    # ---- what a container leaves behind (the simulated host's steering, same names) ------------------

    def start_process(
        self,
        index: int,
        pid: int,
        memory_used: int = 0,
        kind: str = "compute",
        sm_util: int | None = None,
        memory_util: int = 0,
        mig: tuple[int, int] | None = None,
    ) -> None:
        if kind not in ("compute", "graphics", "mps-server", "mps"):
            raise ValueError(f"unknown process kind {kind!r}")
        with self._lock:
            self._processes.setdefault(index, []).append(_Process(pid, memory_used, kind, sm_util, memory_util, mig))

    def stop_process(self, index: int, pid: int | None = None) -> None:
        with self._lock:
            self._processes[index] = [p for p in self._processes.get(index, []) if pid is not None and p.pid != pid]

    def set_compute_mode(self, index: int, mode: int) -> None:
        with self._lock:
            _m, g, m = self._settings.get(index, (0, DEFAULT_APP_GRAPHICS_MHZ, DEFAULT_APP_MEMORY_MHZ))
            self._settings[index] = (mode, g, m)

    def set_application_clocks(self, index: int, graphics_mhz: int, memory_mhz: int) -> None:
        with self._lock:
            mode, _g, _m = self._settings.get(index, (0, DEFAULT_APP_GRAPHICS_MHZ, DEFAULT_APP_MEMORY_MHZ))
            self._settings[index] = (mode, graphics_mhz, memory_mhz)

    def settings(self, index: int) -> tuple[int, int, int]:
        with self._lock:
            return self._settings.get(index, (0, DEFAULT_APP_GRAPHICS_MHZ, DEFAULT_APP_MEMORY_MHZ))

    def fail_gpu(self, index: int | None, call: str = "*", code: int = 15) -> None:
        """As the simulated host's: ``call`` fails with nvmlReturn_t ``code`` for GPU ``index``
        (the fake knows the handover calls: nvmlDeviceGetComputeRunningProcesses,
        nvmlDeviceResetApplicationsClocks, nvmlDeviceSetComputeMode)."""
        with self._lock:
            self._fail[(-1 if index is None else index, call)] = _CODES.get(code, f"NVML error {code}")

    def clear(self) -> None:
        with self._lock:
            self._fail.clear()
            self._usage.clear()
            self._processes.clear()

    def _injected(self, index: int, call: str, op: str) -> None:
        with self._lock:
            name = self._fail.get((index, call)) or self._fail.get((index, "*"))
        if name:
            raise NvmlError(op=op, target=f"GPU {index}", cause=_ERRORS.get(name, name))

    def _live(self, op: str, index: int | None) -> None:
        if self.nvml_lost:
            raise NvmlError(op=op, target="NVML" if index is None else f"GPU {index}", cause="driver not loaded")
