"""The only module that imports pynvml: GPU inventory, topology, MIG devices and health.

Health follows the hardware both ways: XID and double-bit ECC events mark a GPU unhealthy; a
rescan (``request_rescan``: kernel device events from isolator/gpu/uevents.py, a failed event wait, or
the periodic probe noticing a lost GPU or a MIG mode change) re-initialises NVML, reads the GPUs
again by UUID and marks them unhealthy (gone) or healthy again (back, or reset since their XID).

It reports what NVML says as plain model data and decides nothing about allocation. NVML errors
become typed errors; a GPU whose queries fail is recorded as degraded and the others stay usable.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import pynvml

from isolator.errors import GpuNotFound, NvmlError, NvmlNotFound
from isolator.gpu.xids import DEFAULT_IGNORED_XIDS
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
    PcieLevel,
    ResetStep,
    Topology,
    compute_mode_name,
)
from isolator.policy import affinity

LOG = logging.getLogger(__name__)

DEFAULT_LIBRARY = "libnvidia-ml.so.1"
# nvmlDeviceGetCpuAffinity fills an array of 64-bit words; 64 words cover 4096 CPUs.
CPU_SET_WORDS = 64
# The event types k8s-device-plugin registers (k8s-topology.md section 2.4). XIDs outside the
# ignored list and double-bit ECC errors mark a GPU unhealthy; single-bit errors are corrected by
# the hardware and only logged.
WATCHED_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError | pynvml.nvmlEventTypeSingleBitEccError
)


# Why a GPU is unhealthy, which decides what makes it healthy again (``Inventory._rescan``).
HEALTH_XID = "xid"  # an XID: healthy again only after the GPU was reset (unbound, driver reloaded)
HEALTH_ECC = "ecc"  # a double-bit ECC error: likewise
HEALTH_ABSENT = "absent"  # NVML no longer enumerates it: healthy when it is back
HEALTH_NVML = "nvml"  # NVML failed (event wait, init): unknown until an event wait works again
HEALTH_REGISTER = "register"  # could not be registered for events: retried by the next rescan
RESET_CLEARS = (HEALTH_XID, HEALTH_ECC)


# ---- loading --------------------------------------------------------------------------------

_load_lock = threading.Lock()
_loaded_path: str | None = None


def load_library(path: str = "") -> None:
    """Make pynvml use NVML from ``path`` (or, when empty, wherever the dynamic loader finds it).

    pynvml keeps one module-wide library handle (``pynvml.nvmlLib``) that nvmlInit fills with
    ``CDLL("libnvidia-ml.so.1")`` when it is None; assigning our own CDLL first is how a library in
    an odd place (or the simulated host's) is used. Its function-pointer cache must go with it.
    """
    global _loaded_path
    with _load_lock:
        if path:
            if _loaded_path == path and pynvml.nvmlLib is not None:
                return
            try:
                lib = ctypes.CDLL(path)
            except OSError as exc:
                raise NvmlNotFound(target=path, cause=str(exc)) from exc
            with pynvml.libLoadLock:
                pynvml.nvmlLib = lib
                pynvml._nvmlGetFunctionPointer_cache.clear()
            _loaded_path = path
        elif _loaded_path is not None:
            with pynvml.libLoadLock:
                pynvml.nvmlLib = None
                pynvml._nvmlGetFunctionPointer_cache.clear()
            _loaded_path = None


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


class Inventory:
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
        self.library = library
        self.proc_root = proc_root
        self.sys_root = sys_root
        self.ignored_xids = frozenset(ignored_xids)
        self.poll_ms = poll_ms
        self.probe_s = probe_s  # how often the GPUs are probed for loss or a MIG mode change (0: never)
        self.retry_s = retry_s  # pause before re-initialising NVML after it failed
        self.driver_version = ""
        self.cuda_driver_version = ""
        self._lock = threading.RLock()
        self._records: dict[int, GpuRecord] = {}
        self._links: dict[tuple[int, int], Link] = {}
        self._handles: dict[int, object] = {}
        self._indices: tuple[int, ...] | None = None
        self._callbacks: list[Callable[[HealthEvent], None]] = []
        self._open = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: object | None = None
        self._rescan = threading.Event()
        self._rescan_reasons: list[str] = []
        self._reset: set[str] = set()  # UUIDs reset (gone, or the driver went away) since marked
        self._answering = True  # False from a failed event wait or re-initialisation until a wait works
        self.rescans = 0  # completed rescans, for callers that wait on one
        self._closers: list[Callable[[], None]] = []

    # ---- life cycle ------------------------------------------------------------------------

    def open(self) -> Inventory:
        """Load NVML and initialise it. Raises NvmlNotFound when there is no usable NVML."""
        target = self.library or DEFAULT_LIBRARY
        load_library(self.library)
        try:
            pynvml.nvmlInit()  # nvidia-smi fails the same way when this does
        except pynvml.NVMLError_LibraryNotFound as exc:
            raise NvmlNotFound(target=target, cause="not found by the dynamic loader") from exc
        except pynvml.NVMLError as exc:
            raise NvmlNotFound(target=target, cause=str(exc)) from exc
        self._open = True
        try:
            # nvidia-smi --query-gpu=driver_version
            self.driver_version = _text(self._call("query driver version", "NVML", pynvml.nvmlSystemGetDriverVersion))
            # nvidia-smi's header "CUDA Version: 12.2" (NVML encodes it as 12020)
            cuda = self._call("query CUDA driver version", "NVML", pynvml.nvmlSystemGetCudaDriverVersion)
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
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                LOG.warning("failed to shut NVML down: %s", exc)
            self._open = False

    def __enter__(self) -> Inventory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, target: str, fn: Callable[..., Any], *args: object) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            raise NvmlError(op=op, target=target, cause=str(exc), nvml_code=exc.value, call=fn.__name__) from exc

    def device_count(self) -> int:
        """``nvidia-smi --query-gpu=count``."""
        return int(self._call("count GPUs", "NVML", pynvml.nvmlDeviceGetCount))

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

        def query(what: str, fn: Callable[..., Any], *args: object) -> Any:
            try:
                return fn(*args)
            except pynvml.NVMLError as exc:
                errors.append(f"failed to query {what} of GPU {index} ({fn.__name__}): {exc}")
                return None

        handle = query("handle", pynvml.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            return GpuRecord(gpu=Gpu(index=index, minor=-1, uuid=""), errors=tuple(errors)), None
        # nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total; the minor is the N of
        # /dev/nvidiaN (nvidia-smi -q: "Minor Number").
        minor = query("minor number", pynvml.nvmlDeviceGetMinorNumber, handle)
        uuid = query("UUID", pynvml.nvmlDeviceGetUUID, handle)
        name = query("name", pynvml.nvmlDeviceGetName, handle)
        pci = query("PCI info", pynvml.nvmlDeviceGetPciInfo, handle)
        memory = query("memory", pynvml.nvmlDeviceGetMemoryInfo, handle)
        bus = _normalise_bus_id(pci.busId) if pci is not None else ""
        # nvidia-smi topo -m, column "CPU Affinity"
        words = query("CPU affinity", pynvml.nvmlDeviceGetCpuAffinity, handle, CPU_SET_WORDS)
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
            return int(pynvml.nvmlDeviceGetNumaNodeId(handle))
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            pass
        except pynvml.NVMLError as exc:
            errors.append(f"failed to query NUMA node of GPU {index} (nvmlDeviceGetNumaNodeId): {exc}")
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
            current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            return False, False, ()
        except pynvml.NVMLError as exc:
            errors.append(f"failed to query MIG mode of GPU {gpu.index} (nvmlDeviceGetMigMode): {exc}")
            return False, False, ()
        if current != pynvml.NVML_DEVICE_MIG_ENABLE:
            return True, False, ()
        out: list[MigDevice] = []
        try:
            count = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
            for slot in range(count):
                try:
                    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except pynvml.NVMLError_NotFound:
                    continue
                gi = pynvml.nvmlDeviceGetGpuInstanceId(mig)
                ci = pynvml.nvmlDeviceGetComputeInstanceId(mig)
                # nvidia-smi -L: "MIG 1g.5gb Device 0: (UUID: MIG-...)"; NVML names a MIG device
                # "<GPU name> MIG <profile>".
                name = _text(pynvml.nvmlDeviceGetName(mig))
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
                        uuid=_text(pynvml.nvmlDeviceGetUUID(mig)),
                        gpu_instance_id=gi,
                        compute_instance_id=ci,
                        caps_minors=caps,
                        memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(mig).total),
                        profile=profile,
                        parent_index=gpu.index,
                        parent_minor=gpu.minor,
                        gpu_slices=gslices,
                        compute_slices=cslices,
                        placement=self._gi_placement(handle, gi),
                        slot=slot,
                    )
                )
        except pynvml.NVMLError as exc:
            errors.append(f"failed to query MIG devices of GPU {gpu.index}: {exc}")
        return True, True, tuple(out)

    @staticmethod
    def _mig_slices(mig: object, index: int, gi: int, ci: int, profile: str, errors: list[str]) -> tuple[int, int]:
        """GPU-instance and compute-instance slices (nvidia-smi mig -lgi / -lci), checked against the name.

        A profile name that disagrees with NVML's slice counts is an error (the GPU is then
        degraded): handing out a device whose size we cannot trust is worse than not handing it out.
        """
        named = profile_slices(profile)
        try:
            attrs = pynvml.nvmlDeviceGetAttributes_v2(mig)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            return named if named is not None else (0, 0)
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
            info = pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(handle, gi))
        except pynvml.NVMLError as exc:
            # Placement only steers which device is chosen; without it the choice ignores contiguity.
            LOG.info("no placement for GPU instance %d: %s", gi, exc)
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
                    level = PcieLevel(pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
                except pynvml.NVMLError as exc:
                    failed[(a, b)] = f"nvmlDeviceGetTopologyCommonAncestor: {exc}"
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
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _normalise_bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
                try:
                    kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
                except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
                    # Older drivers: a remote end that is not one of our GPUs is a switch.
                    kind = (
                        pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
                        if remote in by_bus
                        else pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
                    )
            except pynvml.NVMLError_NotSupported:
                break  # no NVLink on this GPU
            except pynvml.NVMLError_InvalidArgument:
                continue  # no such link on this GPU (go-gpuallocator skips these too)
            except pynvml.NVMLError as exc:
                pair_errors.setdefault(index, []).append(
                    f"failed to query NVLink {link} of GPU {index} (nvmlDeviceGetNvLink*): {exc}"
                )
                break
            if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                switch_lanes[index] = switch_lanes.get(index, 0) + 1
            elif kind == pynvml.NVML_NVLINK_DEVICE_TYPE_GPU and remote in by_bus:
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
        memory = self._call("query memory", target, pynvml.nvmlDeviceGetMemoryInfo, handle)
        util = self._call("query utilization", target, pynvml.nvmlDeviceGetUtilizationRates, handle)
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
            ("compute", pynvml.nvmlDeviceGetComputeRunningProcesses_v3, pynvml.nvmlDeviceGetComputeRunningProcesses_v2),
            (
                "graphics",
                pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3,
                pynvml.nvmlDeviceGetGraphicsRunningProcesses_v2,
            ),
        ):
            try:
                try:
                    found = v3(handle)
                except pynvml.NVMLError_FunctionNotFound:
                    found = v2(handle)  # drivers before R510 have no _v3 (same struct)
            except pynvml.NVMLError_NotSupported:
                if kind == "compute":
                    raise NvmlError(
                        op="list compute processes", target=target, cause="not supported", call=v3.__name__
                    ) from None
                found = []  # a GPU without graphics (some datacenter boards) runs no graphics process
            except pynvml.NVMLError as exc:
                raise NvmlError(
                    op=f"list {kind} processes", target=target, cause=str(exc), nvml_code=exc.value, call=v3.__name__
                ) from exc
            procs += [GpuProcess(int(p.pid), int(p.usedGpuMemory or 0), kind) for p in found]
        try:
            # v2 reports memory the driver reserves apart from "used" (nvidia-smi shows v2's used);
            # v1's used includes it, hundreds of MiB on recent GPUs with nothing running.
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        except pynvml.NVMLError_FunctionNotFound:
            memory = self._call("query memory", target, pynvml.nvmlDeviceGetMemoryInfo, handle)
        except pynvml.NVMLError as exc:
            raise NvmlError(
                op="query memory", target=target, cause=str(exc), nvml_code=exc.value, call="nvmlDeviceGetMemoryInfo_v2"
            ) from exc
        return Occupancy(tuple(procs), int(memory.used), int(memory.total))

    def reset_settings(self, index: int, compute_mode: int) -> tuple[ResetStep, ...]:
        """Set GPU ``index``'s application clocks back to their defaults and its compute mode to
        ``compute_mode`` where they differ (nvidia-smi -rac, nvidia-smi -c). Each step says what it
        found and did; an NVML failure is reported in its step (GpuNotFound only for a GPU without a
        handle: lost, or not managed)."""
        handle = self._live_handle(index)
        return (self._reset_clocks(handle), self._reset_compute_mode(handle, compute_mode))

    @staticmethod
    def _error_name(exc: pynvml.NVMLError) -> str:
        return {
            pynvml.NVML_ERROR_NO_PERMISSION: "NO_PERMISSION",
            pynvml.NVML_ERROR_NOT_SUPPORTED: "NOT_SUPPORTED",
            pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: "FUNCTION_NOT_FOUND",
            pynvml.NVML_ERROR_GPU_IS_LOST: "GPU_IS_LOST",
        }.get(exc.value, f"NVML error {exc.value}")

    def _reset_clocks(self, handle: object) -> ResetStep:
        what = "application clocks"
        try:
            now = (
                pynvml.nvmlDeviceGetApplicationsClock(handle, pynvml.NVML_CLOCK_GRAPHICS),
                pynvml.nvmlDeviceGetApplicationsClock(handle, pynvml.NVML_CLOCK_MEM),
            )
            default = (
                pynvml.nvmlDeviceGetDefaultApplicationsClock(handle, pynvml.NVML_CLOCK_GRAPHICS),
                pynvml.nvmlDeviceGetDefaultApplicationsClock(handle, pynvml.NVML_CLOCK_MEM),
            )
        except pynvml.NVMLError as exc:
            if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                # No application clocks on this GPU: nothing a container could have changed.
                return ResetStep(what, "not supported", "not supported", False)
            return ResetStep(what, "unknown", "", False, f"failed to read them: {exc}", self._error_name(exc))
        before = f"graphics {now[0]} MHz, memory {now[1]} MHz"
        if now == default:
            return ResetStep(what, before, before, False)
        try:
            pynvml.nvmlDeviceResetApplicationsClocks(handle)
        except pynvml.NVMLError as exc:
            return ResetStep(what, before, "", False, str(exc), self._error_name(exc))
        return ResetStep(what, before, f"graphics {default[0]} MHz, memory {default[1]} MHz", True)

    def _reset_compute_mode(self, handle: object, mode: int) -> ResetStep:
        what = "compute mode"
        try:
            now = int(pynvml.nvmlDeviceGetComputeMode(handle))
        except pynvml.NVMLError as exc:
            if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                return ResetStep(what, "not supported", "not supported", False)
            return ResetStep(what, "unknown", "", False, f"failed to read it: {exc}", self._error_name(exc))
        if now == mode:
            return ResetStep(what, compute_mode_name(now), compute_mode_name(now), False)
        try:
            pynvml.nvmlDeviceSetComputeMode(handle, mode)
        except pynvml.NVMLError as exc:
            return ResetStep(what, compute_mode_name(now), "", False, str(exc), self._error_name(exc))
        return ResetStep(what, compute_mode_name(now), compute_mode_name(mode), True)

    # ---- health ----------------------------------------------------------------------------

    def on_health_change(self, callback: Callable[[HealthEvent], None]) -> None:
        """Call ``callback(HealthEvent)`` (on the event thread) whenever a GPU's health changes."""
        with self._lock:
            self._callbacks.append(callback)

    @property
    def nvml_answering(self) -> bool:
        """False while NVML does not answer (driver unloaded, event wait failing): from the failure
        until an event wait works again. The daemon's gRPC health follows it."""
        return self._answering

    def bus_ids(self) -> frozenset[str]:
        """The managed GPUs' PCI addresses (sysfs form), for matching kernel device events."""
        with self._lock:
            return frozenset(r.gpu.pci_bus_id for r in self._records.values() if r.gpu.pci_bus_id)

    def _set_health(self, index: int, health: GpuHealth) -> None:
        """Record ``health`` for GPU ``index`` and tell subscribers when its usability changed."""
        with self._lock:
            record = self._records.get(index)
            if record is None:
                return
            self._records[index] = replace(record, health=health)
        self._announce({index: record})

    def _announce(self, before: dict[int, GpuRecord]) -> None:
        """Call the callbacks for every GPU of ``before`` whose usability differs now."""
        events = []
        with self._lock:
            callbacks = list(self._callbacks)
            for index, old in sorted(before.items()):
                new = self._records.get(index)
                if new is None or (new.usable == old.usable and new.status == old.status):
                    continue
                if new.usable:
                    LOG.warning("GPU %d (%s) is healthy again", index, new.gpu.uuid)
                else:
                    LOG.error("GPU %d (%s) is unhealthy: %s", index, new.gpu.uuid, new.status)
                h = new.health
                events.append(HealthEvent(index, new.gpu.uuid, new.usable, new.status, h.last_xid, h.last_xid_time))
        for event in events:
            for cb in callbacks:
                try:
                    cb(event)
                except Exception:
                    LOG.exception("health callback %r failed", cb)

    def mark_unhealthy(
        self, index: int, reason: str, xid: int = 0, when: float = 0.0, source: str = HEALTH_XID
    ) -> None:
        with self._lock:
            record = self._records.get(index)
            if record is None:
                return
            health = GpuHealth(
                healthy=False,
                reason=reason,
                last_xid=xid or record.health.last_xid,
                last_xid_time=when or record.health.last_xid_time,
                source=source,
            )
        self._set_health(index, health)

    def _lose_sight(self, reason: str) -> None:
        """NVML failed: every healthy GPU's health is unknown until a rescan succeeds."""
        self._answering = False
        with self._lock:
            indices = [i for i, r in self._records.items() if r.health.healthy]
        for index in indices:
            self.mark_unhealthy(index, reason, source=HEALTH_NVML)

    def request_rescan(self, reason: str, reset_bus: str = "", reset_all: bool = False) -> None:
        """Read the GPUs again on the health thread, soon. ``reset_bus`` names a GPU (PCI address)
        that was reset, ``reset_all`` says the driver was: their XID and ECC marks are history."""
        with self._lock:
            self._rescan_reasons.append(reason)
            for r in self._records.values():
                if r.gpu.uuid and (reset_all or (reset_bus and r.gpu.pci_bus_id == reset_bus)):
                    self._reset.add(r.gpu.uuid)
        self._rescan.set()

    def device_changed(self, change: Any) -> None:
        """An isolator.gpu.uevents.Change: the uevent watch's callback."""
        self.request_rescan(change.reason, change.reset_bus, change.reset_all)

    def start_health_watch(self) -> None:
        """Register for XID and ECC events on every GPU read and watch them on a background thread.

        As k8s-device-plugin does: a GPU that cannot be registered is unhealthy at once, except
        when NVML says events are not supported (too old to health-check: warn and go on).
        """
        if self._thread is not None:
            return
        self._event_set = self._register_events()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="nvml-events", daemon=True)
        self._thread.start()

    def _register_events(self) -> object:
        event_set = self._call("create event set", "NVML", pynvml.nvmlEventSetCreate)
        with self._lock:
            handles = dict(self._handles)
        for index, handle in handles.items():
            try:
                supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
                pynvml.nvmlDeviceRegisterEvents(handle, WATCHED_EVENTS & supported, event_set)
            except pynvml.NVMLError_NotSupported:
                LOG.warning("GPU %d is too old to support health checking", index)
            except pynvml.NVMLError as exc:
                self.mark_unhealthy(index, f"cannot watch for XID events: {exc}", source=HEALTH_REGISTER)
        return event_set

    def _free_event_set(self) -> None:
        if self._event_set is not None:
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError as exc:
                LOG.warning("failed to free the NVML event set: %s", exc)
            self._event_set = None

    def _watch(self) -> None:
        next_probe = time.monotonic() + self.probe_s
        while not self._stop.is_set():
            if self._rescan.is_set():
                self._rescan.clear()
                self._rescan_now()
            if self.probe_s and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self.probe_s
                self._probe()
            if self._event_set is None:
                # NVML is down (driver unloaded?): try again after a pause, or sooner on a uevent.
                if self._rescan.wait(self.retry_s):
                    continue
                self.request_rescan("retrying NVML")
                continue
            try:
                data = pynvml.nvmlEventSetWait(self._event_set, self.poll_ms)
            except pynvml.NVMLError_Timeout:
                self._sight_regained()
                continue
            except pynvml.NVMLError as exc:
                if self._stop.is_set():
                    break
                # Blind to XIDs, nothing handed out is known to be sound (k8s-device-plugin marks
                # every device unhealthy here too); unlike it, re-initialise NVML and recover.
                self._lose_sight(f"health unknown: NVML event wait failed: {exc}")
                self._stop.wait(self.retry_s)
                self.request_rescan(f"event wait failed: {exc}")
                continue
            self._sight_regained()
            self._handle_event(data)

    def _sight_regained(self) -> None:
        """An event wait worked: GPUs whose health was unknown only for NVML's sake are healthy."""
        self._answering = True
        with self._lock:
            blind = [i for i, r in self._records.items() if r.health.source == HEALTH_NVML and i in self._handles]
            if not blind:
                return
            before = {i: self._records[i] for i in blind}
            for i in blind:
                old = self._records[i].health
                self._records[i] = replace(
                    self._records[i], health=GpuHealth(last_xid=old.last_xid, last_xid_time=old.last_xid_time)
                )
        self._announce(before)

    def _probe(self) -> None:
        """A cheap look for what no event announces: a lost GPU or a changed MIG mode."""
        with self._lock:
            items = [(i, self._handles.get(i), r) for i, r in self._records.items() if r.gpu.uuid]
        for index, handle, record in items:
            if handle is None:
                if record.health.source == HEALTH_ABSENT:
                    continue  # still gone; a uevent or the next rescan brings it back
                self.request_rescan(f"GPU {index} has no NVML handle")
                return
            try:
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                mode = self._mig_mode(handle)
            except pynvml.NVMLError as exc:
                self.request_rescan(f"GPU {index} does not answer: {exc}")
                return
            if uuid != record.gpu.uuid or (mode is not None and mode != record.mig_enabled):
                self.request_rescan(f"GPU {index} changed (MIG mode or identity)")
                return

    @staticmethod
    def _mig_mode(handle: object) -> bool | None:
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            return None
        return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)

    def rescan(self) -> bool:
        """Re-initialise NVML and read the managed GPUs again, matched by UUID (their NVML index
        may have changed); True when NVML answered. Runs on the caller's thread: the health thread
        does it for ``request_rescan``; without that thread, callers may call it directly."""
        return self._rescan_now()

    def _rescan_now(self) -> bool:
        with self._lock:
            reasons, self._rescan_reasons = self._rescan_reasons, []
            before = dict(self._records)
        LOG.info("reading the GPUs again: %s", "; ".join(dict.fromkeys(reasons)) or "requested")
        self._free_event_set()
        if self._open:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                LOG.debug("nvmlShutdown before re-initialising: %s", exc)
            self._open = False
        try:
            pynvml.nvmlInit()
            self._open = True
            self.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
            present: dict[str, tuple[int, object]] = {}
            for i in range(int(pynvml.nvmlDeviceGetCount())):
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                    present[_text(pynvml.nvmlDeviceGetUUID(handle))] = (i, handle)
                except pynvml.NVMLError as exc:
                    LOG.warning("GPU at NVML index %d does not answer: %s", i, exc)
        except pynvml.NVMLError as exc:
            with self._lock:
                self._reset.update(r.gpu.uuid for r in self._records.values())
                self._handles = {}
            self._lose_sight(f"health unknown: NVML unavailable: {exc}")
            self.rescans += 1
            return False
        mig_minors = _mig_minors(self.proc_root)
        with self._lock:
            handles: dict[int, object] = {}
            for index, old in before.items():
                uuid = old.gpu.uuid
                if not uuid:
                    continue
                if uuid not in present:
                    self._reset.add(uuid)
                    gone = "not visible to NVML: unbound from the driver, removed or lost"
                    health = old.health if not old.health.healthy and old.health.source in RESET_CLEARS else None
                    self._records[index] = replace(
                        old, health=health or replace(old.health, healthy=False, reason=gone, source=HEALTH_ABSENT)
                    )
                    continue
                now_index, handle = present[uuid]
                fresh, _ = self._read_gpu(now_index, mig_minors)
                fresh = replace(fresh, gpu=replace(fresh.gpu, index=index))
                if fresh.gpu.minor != old.gpu.minor:
                    fresh = replace(fresh, errors=(*fresh.errors, f"minor changed from {old.gpu.minor}"))
                if fresh.mig_enabled != old.mig_enabled:
                    LOG.warning("GPU %d: MIG mode is now %s", index, "enabled" if fresh.mig_enabled else "disabled")
                health = old.health
                # Back, or reset since its XID/ECC error. "Health unknown" (HEALTH_NVML) waits for an
                # event wait that works (``_watch``): NVML answering nvmlInit is not enough.
                if not health.healthy and (
                    health.source in (HEALTH_ABSENT, HEALTH_REGISTER)
                    or (health.source in RESET_CLEARS and uuid in self._reset)
                ):
                    health = GpuHealth(last_xid=health.last_xid, last_xid_time=health.last_xid_time)
                self._reset.discard(uuid)
                self._records[index] = replace(fresh, health=health)
                handles[index] = handle
            self._handles = handles
        try:
            self._event_set = self._register_events()
        except NvmlError as exc:
            self._lose_sight(f"health unknown: {exc.message}")
        self.rescans += 1
        self._announce(before)
        return True

    def _handle_event(self, data: Any) -> None:
        kind = data.eventType
        if kind == pynvml.nvmlEventTypeSingleBitEccError:
            LOG.info("single-bit ECC error corrected on a GPU; it stays healthy")
            return
        if kind not in (pynvml.nvmlEventTypeXidCriticalError, pynvml.nvmlEventTypeDoubleBitEccError):
            LOG.info("skipping NVML event type %#x", kind)
            return
        ecc = kind == pynvml.nvmlEventTypeDoubleBitEccError
        xid = 0 if ecc else int(data.eventData)
        what = "double-bit ECC error" if ecc else f"XID {xid}"
        source = HEALTH_ECC if ecc else HEALTH_XID
        try:
            uuid = _text(pynvml.nvmlDeviceGetUUID(data.device))
        except pynvml.NVMLError as exc:
            why = f"{what} on a GPU whose UUID cannot be read: {exc}"
            for index in self.healthy():
                self.mark_unhealthy(index, why, xid, time.time(), source)
            return
        with self._lock:
            found = next((i for i, r in self._records.items() if r.gpu.uuid == uuid), None)
        if found is None:
            LOG.info("%s on GPU %s, which this sidecar does not manage", what, uuid)
            return
        if not ecc and xid in self.ignored_xids:
            LOG.info("GPU %d: XID %d is an application error; it stays healthy", found, xid)
            return
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        where = f" (GPU instance {gi}, compute instance {ci})" if gi != 0xFFFFFFFF and not ecc else ""
        self.mark_unhealthy(found, f"{what}{where}", xid, time.time(), source)
