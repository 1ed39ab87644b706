"""The GPU inventory: the GPUs NVML reports, their topology, MIG devices, usage and what runs on
them, read through the one NVML door (isolator/gpu/nvmlcall.py); their health is watched by the
part in isolator/gpu/health.py, which ``Inventory`` extends.

It reports what NVML says as plain model data and decides nothing about allocation. NVML errors
become typed errors; a GPU whose queries fail is recorded as degraded and the others stay usable.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from isolator.errors import GpuNotFound, NvmlError
from isolator.gpu import nvmlcall as nv
from isolator.gpu import processes
from isolator.gpu.health import (
    HEALTH_ABSENT,
    HEALTH_ECC,
    HEALTH_NVML,
    HEALTH_REGISTER,
    HEALTH_XID,
    RESET_CLEARS,
    HealthWatch,
)
from isolator.gpu.nvmlcall import DEFAULT_LIBRARY, load_library
from isolator.gpu.xids import DEFAULT_IGNORED_XIDS
from isolator.model import (
    Gpu,
    GpuProcess,
    GpuRecord,
    GpuUsageSample,
    HealthEvent,
    Link,
    MigDevice,
    Occupancy,
    PcieLevel,
    ProcessUsage,
    ResetStep,
    Topology,
    compute_mode_name,
)
from isolator.policy import affinity

LOG = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_LIBRARY",
    "HEALTH_ABSENT",
    "HEALTH_ECC",
    "HEALTH_NVML",
    "HEALTH_REGISTER",
    "HEALTH_XID",
    "RESET_CLEARS",
    "HealthEvent",
    "Inventory",
    "load_library",
    "profile_slices",
]

# nvmlDeviceGetCpuAffinity fills an array of 64-bit words; 64 words cover 4096 CPUs.
CPU_SET_WORDS = 64


def _normalise_bus_id(raw: bytes | str) -> str:
    """NVML's ``00000000:1A:00.0`` -> sysfs's ``0000:1a:00.0`` (go-gpuallocator's PciInfo.BusID)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    text = text.split("\0", 1)[0].strip().lower()
    if len(text) > 12 and text.startswith("0000"):
        text = text[4:]
    return text


def _cpu_list(words: Iterable[int]) -> str:
    """NVML's CPU affinity bit mask (64-bit words) in cpulist syntax, as ``nvidia-smi topo -m`` prints it."""
    return affinity.format_list(w * 64 + bit for w, word in enumerate(words) for bit in range(64) if word >> bit & 1)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


_PROFILE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.\d+gb(?:\+\w+)*$")


def profile_slices(profile: str) -> tuple[int, int] | None:
    """``1g.5gb`` -> (1, 1), ``1c.3g.20gb`` -> (3, 1): GPU-instance and compute-instance slices."""
    m = _PROFILE.fullmatch(profile)
    if m is None:
        return None
    gpu = int(m.group(2))
    return gpu, int(m.group(1) or gpu)


def _mig_minors(proc_root: str) -> dict[str, int]:
    """/proc/driver/nvidia-caps/mig-minors: ``gpu<minor>/gi<g>[/ci<c>]/access <cap minor>``."""
    path = os.path.join(proc_root, "driver", "nvidia-caps", "mig-minors")
    out: dict[str, int] = {}
    try:
        with open(path) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 2 and parts[1].isdigit():
                    out[parts[0]] = int(parts[1])
    except FileNotFoundError:
        pass
    return out


# ---- the inventory --------------------------------------------------------------------------


class Inventory(HealthWatch):
    """The GPUs NVML reports, read once by ``read()`` and again by ``refresh()``.

    Life cycle: ``open()`` (load + nvmlInit), ``read(indices)``, optionally ``start_health_watch()``,
    and ``close()``. Queries are thread-safe; health callbacks run on the event thread.
    """

    def __init__(
        self,
        library: str = "",
        proc_root: str = "/proc",
        sys_root: str = "/sys",
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        poll_ms: int = 500,
        probe_s: float = 30.0,
        retry_s: float = 2.0,
    ) -> None:
        super().__init__(ignored_xids=ignored_xids, poll_ms=poll_ms, probe_s=probe_s, retry_s=retry_s)
        self.library = library
        self.proc_root = proc_root
        self.sys_root = sys_root
        self.driver_version = ""
        self.cuda_driver_version = ""
        self._links: dict[tuple[int, int], Link] = {}
        self._indices: tuple[int, ...] | None = None
        self._closers: list[Callable[[], None]] = []

    # ---- life cycle ------------------------------------------------------------------------

    def open(self) -> Inventory:
        """Load NVML and initialise it. Raises NvmlNotFound when there is no usable NVML."""
        load_library(self.library)
        nv.init(self.library or DEFAULT_LIBRARY)
        self._open = True
        try:
            # nvidia-smi --query-gpu=driver_version
            self.driver_version = _text(nv.call("nvmlSystemGetDriverVersion", op="query driver version"))
            # nvidia-smi's header "CUDA Version: 12.2" (NVML encodes it as 12020)
            cuda = nv.call("nvmlSystemGetCudaDriverVersion", op="query CUDA driver version")
            self.cuda_driver_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except NvmlError:
            self.close()
            raise
        return self

    def on_close(self, closer: Callable[[], None]) -> None:
        """Call ``closer`` first when the inventory closes (the uevent watch that feeds it)."""
        self._closers.append(closer)

    def close(self) -> None:
        for closer in self._closers:
            closer()
        self._closers.clear()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_ms / 1000 + 5)
            self._thread = None
        if self._open:
            self._free_event_set()
            try:
                nv.call("nvmlShutdown")
            except NvmlError as exc:
                LOG.warning("failed to shut NVML down: %s", nv.cause(exc))
            self._open = False

    def __enter__(self) -> Inventory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def device_count(self) -> int:
        """``nvidia-smi --query-gpu=count``."""
        return int(nv.call("nvmlDeviceGetCount", op="count GPUs"))

    # ---- reading ---------------------------------------------------------------------------

    def read(self, indices: Iterable[int] | None = None) -> None:
        """Read the GPUs at these NVML indices (all when None), their links and MIG devices."""
        count = self.device_count()
        wanted = tuple(range(count)) if indices is None else tuple(sorted(set(indices)))
        for i in wanted:
            if not 0 <= i < count:
                raise GpuNotFound(op="find GPU", target=str(i), cause=f"NVML reports {count} GPU(s)")
        mig_minors = _mig_minors(self.proc_root)
        records: dict[int, GpuRecord] = {}
        handles: dict[int, object] = {}
        for i in wanted:
            record, handle = self._read_gpu(i, mig_minors)
            records[i] = record
            if handle is not None:
                handles[i] = handle
        links, pair_errors = self._read_links(records, handles)
        for i, errs in pair_errors.items():
            records[i] = replace(records[i], errors=records[i].errors + tuple(errs))
        with self._lock:
            old = {r.gpu.uuid: r.health for r in self._records.values() if r.gpu.uuid}
            self._records = {
                i: replace(r, health=old.get(r.gpu.uuid, r.health)) if r.gpu.uuid else r for i, r in records.items()
            }
            self._links = links
            self._handles = handles
            self._indices = wanted
        for r in records.values():
            if r.errors:
                LOG.error("GPU %d is degraded: %s", r.index, "; ".join(r.errors))

    def refresh(self) -> None:
        """Read the same GPUs again; health learned from events is kept (by UUID)."""
        self.read(self._indices)

    def _read_gpu(self, index: int, mig_minors: dict[str, int]) -> tuple[GpuRecord, object | None]:
        errors: list[str] = []

        def query(what: str, function: str, *args: object) -> Any:
            try:
                return nv.call(function, *args)
            except NvmlError as exc:
                errors.append(f"failed to query {what} of GPU {index} ({function}): {nv.cause(exc)}")
                return None

        handle = query("handle", "nvmlDeviceGetHandleByIndex", index)
        if handle is None:
            return GpuRecord(gpu=Gpu(index=index, minor=-1, uuid=""), errors=tuple(errors)), None
        # nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total; the minor is the N of
        # /dev/nvidiaN (nvidia-smi -q: "Minor Number").
        minor = query("minor number", "nvmlDeviceGetMinorNumber", handle)
        uuid = query("UUID", "nvmlDeviceGetUUID", handle)
        name = query("name", "nvmlDeviceGetName", handle)
        pci = query("PCI info", "nvmlDeviceGetPciInfo", handle)
        memory = query("memory", "nvmlDeviceGetMemoryInfo", handle)
        bus = _normalise_bus_id(pci.busId) if pci is not None else ""
        # nvidia-smi topo -m, column "CPU Affinity"
        words = query("CPU affinity", "nvmlDeviceGetCpuAffinity", handle, CPU_SET_WORDS)
        numa = self._numa_node(handle, bus, index, errors)
        gpu = Gpu(
            index=index,
            minor=int(minor) if minor is not None else -1,
            uuid=_text(uuid) if uuid is not None else "",
            name=_text(name) if name is not None else "",
            pci_bus_id=bus,
            memory_total=int(memory.total) if memory is not None else 0,
            numa_node=numa,
            cpu_affinity=_cpu_list(words) if words is not None else "",
        )
        capable, enabled, migs = self._read_mig(handle, gpu, mig_minors, errors)
        return GpuRecord(gpu, capable, enabled, migs, tuple(errors)), handle

    def _numa_node(self, handle: object, bus: str, index: int, errors: list[str]) -> int | None:
        # nvidia-smi topo -m, column "NUMA Affinity". nvmlDeviceGetNumaNodeId is recent (R525+);
        # older drivers: the PCI device's numa_node in sysfs, as go-gpuallocator reads it.
        try:
            return int(nv.call("nvmlDeviceGetNumaNodeId", handle))
        except NvmlError as exc:
            if not nv.absent(exc):
                errors.append(f"failed to query NUMA node of GPU {index} (nvmlDeviceGetNumaNodeId): {nv.cause(exc)}")
                return None
        if not bus:
            return None
        try:
            with open(os.path.join(self.sys_root, "bus", "pci", "devices", bus, "numa_node")) as fh:
                node = int(fh.read().strip())
        except (OSError, ValueError):
            return None
        return node if node >= 0 else None

    def _read_mig(
        self, handle: object, gpu: Gpu, mig_minors: dict[str, int], errors: list[str]
    ) -> tuple[bool, bool, tuple[MigDevice, ...]]:
        # nvidia-smi --query-gpu=mig.mode.current; devices: nvidia-smi -L
        try:
            current, _pending = nv.call("nvmlDeviceGetMigMode", handle)
        except NvmlError as exc:
            if not nv.absent(exc):
                errors.append(f"failed to query MIG mode of GPU {gpu.index} (nvmlDeviceGetMigMode): {nv.cause(exc)}")
            return False, False, ()
        if current != nv.DEVICE_MIG_ENABLE:
            return True, False, ()
        out: list[MigDevice] = []
        try:
            count = nv.call("nvmlDeviceGetMaxMigDeviceCount", handle)
            for slot in range(count):
                try:
                    mig = nv.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
                except NvmlError as exc:
                    if nv.code(exc) == nv.NOT_FOUND:
                        continue
                    raise
                gi = nv.call("nvmlDeviceGetGpuInstanceId", mig)
                ci = nv.call("nvmlDeviceGetComputeInstanceId", mig)
                # nvidia-smi -L: "MIG 1g.5gb Device 0: (UUID: MIG-...)"; NVML names a MIG device
                # "<GPU name> MIG <profile>".
                name = _text(nv.call("nvmlDeviceGetName", mig))
                profile = name.rsplit(" MIG ", 1)[1].strip() if " MIG " in name else ""
                gslices, cslices = self._mig_slices(mig, gpu.index, gi, ci, profile, errors)
                caps = tuple(
                    mig_minors[key]
                    for key in (f"gpu{gpu.minor}/gi{gi}/access", f"gpu{gpu.minor}/gi{gi}/ci{ci}/access")
                    if key in mig_minors
                )
                if len(caps) != 2:
                    # Without both access capabilities a container cannot use the device; an empty
                    # tuple tells the allocator to refuse it rather than whitelist too little.
                    LOG.warning("no nvidia-caps minors for GPU %d GI %d CI %d in mig-minors", gpu.index, gi, ci)
                    caps = ()
                out.append(
                    MigDevice(
                        parent_uuid=gpu.uuid,
                        uuid=_text(nv.call("nvmlDeviceGetUUID", mig)),
                        gpu_instance_id=gi,
                        compute_instance_id=ci,
                        caps_minors=caps,
                        memory_total=int(nv.call("nvmlDeviceGetMemoryInfo", mig).total),
                        profile=profile,
                        parent_index=gpu.index,
                        parent_minor=gpu.minor,
                        gpu_slices=gslices,
                        compute_slices=cslices,
                        placement=self._gi_placement(handle, gi),
                        slot=slot,
                    )
                )
        except NvmlError as exc:
            errors.append(f"failed to query MIG devices of GPU {gpu.index}: {nv.cause(exc)}")
        return True, True, tuple(out)

    @staticmethod
    def _mig_slices(mig: object, index: int, gi: int, ci: int, profile: str, errors: list[str]) -> tuple[int, int]:
        """GPU-instance and compute-instance slices (nvidia-smi mig -lgi / -lci), checked against the name.

        A profile name that disagrees with NVML's slice counts is an error (the GPU is then
        degraded): handing out a device whose size we cannot trust is worse than not handing it out.
        """
        named = profile_slices(profile)
        try:
            attrs = nv.call("nvmlDeviceGetAttributes_v2", mig)
        except NvmlError as exc:
            if nv.absent(exc):
                return named if named is not None else (0, 0)
            raise
        counted = (int(attrs.gpuInstanceSliceCount), int(attrs.computeInstanceSliceCount))
        if named is not None and named != counted:
            errors.append(
                f"MIG device GI {gi} CI {ci} of GPU {index} is named {profile!r} but NVML counts "
                f"{counted[0]} GPU-instance and {counted[1]} compute-instance slices"
            )
        return counted

    @staticmethod
    def _gi_placement(handle: object, gi: int) -> tuple[int, int] | None:
        """Where the GPU instance sits in the GPU's memory slices (nvidia-smi mig -lgi "Placement")."""
        try:
            info = nv.call("nvmlGpuInstanceGetInfo", nv.call("nvmlDeviceGetGpuInstanceById", handle, gi))
        except NvmlError as exc:
            # Placement only steers which device is chosen; without it the choice ignores contiguity.
            LOG.info("no placement for GPU instance %d: %s", gi, nv.cause(exc))
            return None
        return (int(info.placement.start), int(info.placement.size))

    def _read_links(
        self, records: dict[int, GpuRecord], handles: dict[int, object]
    ) -> tuple[dict[tuple[int, int], Link], dict[int, list[str]]]:
        """Pairwise PCIe levels and NVLink lanes (nvidia-smi topo -m)."""
        ok = sorted(i for i, r in records.items() if i in handles and not r.errors)
        by_bus = {records[i].gpu.pci_bus_id: i for i in ok}
        direct: dict[tuple[int, int], int] = {}
        switch_lanes: dict[int, int] = {}
        pair_errors: dict[int, list[str]] = {}
        for i in ok:
            for peer, lanes in self._nvlinks(i, handles[i], by_bus, switch_lanes, pair_errors).items():
                direct[(i, peer)] = lanes
        links: dict[tuple[int, int], Link] = {}
        failed: dict[tuple[int, int], str] = {}
        for a in ok:
            for b in ok:
                if a >= b:
                    continue
                try:
                    level = PcieLevel(nv.call("nvmlDeviceGetTopologyCommonAncestor", handles[a], handles[b]))
                except NvmlError as exc:
                    failed[(a, b)] = f"nvmlDeviceGetTopologyCommonAncestor: {nv.cause(exc)}"
                    continue
                except ValueError:
                    level = PcieLevel.SYSTEM
                # Lanes both ends see; on NVSwitch systems every GPU on the node's switch fabric
                # reaches every other through its switch lanes (see switch_lanes below).
                lanes = min(direct.get((a, b), 0), direct.get((b, a), 0))
                if switch_lanes.get(a) and switch_lanes.get(b):
                    lanes += min(switch_lanes[a], switch_lanes[b])
                links[(a, b)] = Link(pcie=level, nvlink_lanes=lanes)
        # A lost GPU fails every pair it is in; blame it alone when it is the common member,
        # otherwise both ends of each failed pair.
        for (a, b), why in failed.items():
            culprits = [g for g in (a, b) if all((min(g, o), max(g, o)) in failed for o in ok if o != g)]
            for g in culprits or [a, b]:
                msg = f"failed to query the PCIe path between GPUs {a} and {b} ({why})"
                if msg not in pair_errors.setdefault(g, []):
                    pair_errors[g].append(msg)
        return links, pair_errors

    def _nvlinks(
        self,
        index: int,
        handle: object,
        by_bus: dict[str, int],
        switch_lanes: dict[int, int],
        pair_errors: dict[int, list[str]],
    ) -> dict[int, int]:
        """Active lanes of GPU ``index`` per peer GPU; lanes to NVSwitches go to ``switch_lanes``.

        nvidia-smi nvlink -s / -R show the same lanes. On NVSwitch systems the remote end is a
        switch, not the peer (go-gpuallocator counts nothing there); every GPU reaches every other
        through the node's switches, which nvidia-smi topo -m shows as NV<lanes to switches>. We
        assume one switch fabric per node (DGX-2, DGX A100, HGX H100: the switches are trunked).
        """
        peers: dict[int, int] = {}
        for link in range(nv.NVLINK_MAX_LINKS):
            try:
                if nv.call("nvmlDeviceGetNvLinkState", handle, link) != nv.FEATURE_ENABLED:
                    continue
                remote = _normalise_bus_id(nv.call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link).busId)
                try:
                    kind = nv.call("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
                except NvmlError as exc:
                    if not nv.absent(exc):
                        raise
                    # Older drivers: a remote end that is not one of our GPUs is a switch.
                    kind = nv.NVLINK_DEVICE_TYPE_GPU if remote in by_bus else nv.NVLINK_DEVICE_TYPE_SWITCH
            except NvmlError as exc:
                if nv.code(exc) == nv.NOT_SUPPORTED:
                    break  # no NVLink on this GPU
                if nv.code(exc) == nv.INVALID_ARGUMENT:
                    continue  # no such link on this GPU (go-gpuallocator skips these too)
                pair_errors.setdefault(index, []).append(
                    f"failed to query NVLink {link} of GPU {index} (nvmlDeviceGetNvLink*): {nv.cause(exc)}"
                )
                break
            if kind == nv.NVLINK_DEVICE_TYPE_SWITCH:
                switch_lanes[index] = switch_lanes.get(index, 0) + 1
            elif kind == nv.NVLINK_DEVICE_TYPE_GPU and remote in by_bus:
                peers[by_bus[remote]] = peers.get(by_bus[remote], 0) + 1
        return peers

    # ---- queries ---------------------------------------------------------------------------

    @property
    def records(self) -> tuple[GpuRecord, ...]:
        with self._lock:
            return tuple(self._records[i] for i in sorted(self._records))

    def record(self, index: int) -> GpuRecord:
        with self._lock:
            if index not in self._records:
                raise GpuNotFound(op="find GPU", target=str(index), cause="not managed by this sidecar")
            return self._records[index]

    def topology(self) -> Topology:
        """The identified GPUs and the link of every pair, for the allocator."""
        with self._lock:
            gpus = tuple(r.gpu for i, r in sorted(self._records.items()) if r.identified)
            return Topology(gpus=gpus, links=dict(self._links))

    def healthy(self) -> frozenset[int]:
        """NVML indices the allocator may hand out: healthy, fully read and identified."""
        with self._lock:
            return frozenset(i for i, r in self._records.items() if r.usable)

    def usage(self, index: int) -> GpuUsageSample:
        """nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu,utilization.memory."""
        with self._lock:
            handle = self._handles.get(index)
        if handle is None:
            raise GpuNotFound(op="find GPU", target=str(index), cause="not managed by this sidecar or lost")
        target = f"GPU {index}"
        memory = nv.call("nvmlDeviceGetMemoryInfo", handle, op="query memory", target=target)
        util = nv.call("nvmlDeviceGetUtilizationRates", handle, op="query utilization", target=target)
        return GpuUsageSample(
            index=index,
            memory_total=int(memory.total),
            memory_used=int(memory.used),
            gpu_utilization=int(util.gpu),
            memory_utilization=int(util.memory),
        )

    # ---- handover: what runs on a GPU, and resetting what a container changed --------------------

    def _live_handle(self, index: int) -> object:
        with self._lock:
            handle = self._handles.get(index)
        if handle is None:
            raise GpuNotFound(op="find GPU", target=str(index), cause="not managed by this sidecar or lost")
        return handle

    def occupancy(self, index: int) -> Occupancy:
        """nvidia-smi's "Processes" table and memory.used for GPU ``index``. Raises NvmlError when
        NVML cannot say (the caller fails closed)."""
        handle = self._live_handle(index)
        target = f"GPU {index}"
        procs: list[GpuProcess] = []
        for kind, v3, v2 in (
            ("compute", "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
            ("graphics", "nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
        ):
            op = f"list {kind} processes"
            try:
                try:
                    found = nv.call(v3, handle, op=op, target=target)
                except NvmlError as exc:
                    if nv.code(exc) != nv.FUNCTION_NOT_FOUND:
                        raise
                    found = nv.call(v2, handle, op=op, target=target)  # drivers before R510 have no _v3 (same struct)
            except NvmlError as exc:
                if nv.code(exc) != nv.NOT_SUPPORTED:
                    raise NvmlError(op=op, target=target, cause=nv.cause(exc), nvml_code=nv.code(exc), call=v3) from exc
                if kind == "compute":
                    raise NvmlError(op=op, target=target, cause="not supported", call=v3) from None
                found = []  # a GPU without graphics (some datacenter boards) runs no graphics process
            procs += [GpuProcess(int(p.pid), int(p.usedGpuMemory or 0), kind) for p in found]
        try:
            # v2 reports memory the driver reserves apart from "used" (nvidia-smi shows v2's used);
            # v1's used includes it, hundreds of MiB on recent GPUs with nothing running.
            memory = nv.call("nvmlDeviceGetMemoryInfo", handle, op="query memory", target=target, version=nv.MEMORY_V2)
        except NvmlError as exc:
            if nv.code(exc) != nv.FUNCTION_NOT_FOUND:
                raise NvmlError(
                    op="query memory",
                    target=target,
                    cause=nv.cause(exc),
                    nvml_code=nv.code(exc),
                    call="nvmlDeviceGetMemoryInfo_v2",
                ) from exc
            memory = nv.call("nvmlDeviceGetMemoryInfo", handle, op="query memory", target=target)
        return Occupancy(tuple(procs), int(memory.used), int(memory.total))

    # ---- per process: what each process uses (isolator/gpu/processes.py) ----------------------

    def process_usage(self, index: int) -> tuple[ProcessUsage, ...]:
        """Every process on GPU ``index`` with its memory and, where the driver reports it, its
        utilisation (isolator/gpu/processes.py). Raises NvmlError when NVML cannot list them."""
        return processes.process_usage(self._live_handle(index), self.record(index))

    def reset_settings(self, index: int, compute_mode: int) -> tuple[ResetStep, ...]:
        """Set GPU ``index``'s application clocks back to their defaults and its compute mode to
        ``compute_mode`` where they differ (nvidia-smi -rac, nvidia-smi -c). Each step says what it
        found and did; an NVML failure is reported in its step (GpuNotFound only for a GPU without a
        handle: lost, or not managed)."""
        handle = self._live_handle(index)
        return (self._reset_clocks(handle), self._reset_compute_mode(handle, compute_mode))

    @staticmethod
    def _reset_clocks(handle: object) -> ResetStep:
        what = "application clocks"
        try:
            now = (
                nv.call("nvmlDeviceGetApplicationsClock", handle, nv.CLOCK_GRAPHICS),
                nv.call("nvmlDeviceGetApplicationsClock", handle, nv.CLOCK_MEM),
            )
            default = (
                nv.call("nvmlDeviceGetDefaultApplicationsClock", handle, nv.CLOCK_GRAPHICS),
                nv.call("nvmlDeviceGetDefaultApplicationsClock", handle, nv.CLOCK_MEM),
            )
        except NvmlError as exc:
            if nv.absent(exc):
                # No application clocks on this GPU: nothing a container could have changed.
                return ResetStep(what, "not supported", "not supported", False)
            return ResetStep(what, "unknown", "", False, f"failed to read them: {nv.cause(exc)}", nv.error_name(exc))
        before = f"graphics {now[0]} MHz, memory {now[1]} MHz"
        if now == default:
            return ResetStep(what, before, before, False)
        try:
            nv.call("nvmlDeviceResetApplicationsClocks", handle)
        except NvmlError as exc:
            return ResetStep(what, before, "", False, nv.cause(exc), nv.error_name(exc))
        return ResetStep(what, before, f"graphics {default[0]} MHz, memory {default[1]} MHz", True)

    @staticmethod
    def _reset_compute_mode(handle: object, mode: int) -> ResetStep:
        what = "compute mode"
        try:
            now = int(nv.call("nvmlDeviceGetComputeMode", handle))
        except NvmlError as exc:
            if nv.absent(exc):
                return ResetStep(what, "not supported", "not supported", False)
            return ResetStep(what, "unknown", "", False, f"failed to read it: {nv.cause(exc)}", nv.error_name(exc))
        if now == mode:
            return ResetStep(what, compute_mode_name(now), compute_mode_name(now), False)
        try:
            nv.call("nvmlDeviceSetComputeMode", handle, mode)
        except NvmlError as exc:
            return ResetStep(what, compute_mode_name(now), "", False, nv.cause(exc), nv.error_name(exc))
        return ResetStep(what, compute_mode_name(now), compute_mode_name(mode), True)

    # ---- what the health watch reads again (isolator/gpu/health.py) ---------------------------

    def _mig_minors(self) -> dict[str, int]:
        return _mig_minors(self.proc_root)
