"""The inventory through the real pynvml code path, against the simulated host's fake NVML."""

from __future__ import annotations

import os
import queue

import pytest
from hostexpect import kind, lanes

from isolator.errors import GpuNotFound, NvmlNotFound
from isolator.gpu.nvml import HealthEvent, Inventory, profile_slices
from isolator.simhost.host import format_cpu_list, mig_caps_minors, shipped_hosts
from isolator.simhost.sim import NVML_ERROR_UNKNOWN, SimulatedHost


def _open(host: SimulatedHost, **kwargs) -> Inventory:
    inv = Inventory(
        library=host.library_path, proc_root=host.proc_root, sys_root=os.path.join(host.root, "sys"), **kwargs
    )
    return inv.open()


@pytest.fixture
def sim(short_tmp):
    def make(name: str) -> SimulatedHost:
        return SimulatedHost(name, os.path.join(short_tmp, name)).setup(make_devices=False)

    return make


@pytest.fixture
def inventory(sim):
    opened: list[Inventory] = []

    def make(name: str, read: bool = True, **kwargs) -> tuple[SimulatedHost, Inventory]:
        host = sim(name)
        inv = _open(host, **kwargs)
        opened.append(inv)
        if read:
            inv.read()
        return host, inv

    yield make
    for inv in opened:
        inv.close()


@pytest.mark.parametrize("name", shipped_hosts())
def test_inventory_reports_exactly_the_described_host(inventory, name):
    host, inv = inventory(name)
    spec = host.spec
    assert inv.driver_version == spec.driver_version
    assert inv.cuda_driver_version == f"{spec.cuda_driver_version // 1000}.{spec.cuda_driver_version % 1000 // 10}"
    assert [r.gpu.index for r in inv.records] == [g.index for g in spec.gpus]
    for r, g in zip(inv.records, spec.gpus, strict=True):
        assert (r.gpu.minor, r.gpu.uuid, r.gpu.name, r.gpu.pci_bus_id) == (g.minor, g.uuid, g.name, g.pci_bus_id)
        assert r.gpu.memory_total == g.memory_mib * 2**20
        assert r.gpu.numa_node == g.numa_node
        assert r.gpu.cpu_affinity == format_cpu_list(spec.numa[g.numa_node])
        assert (r.mig_capable, r.mig_enabled) == (g.mig is not None, bool(g.mig))
        assert not r.errors
    topo = inv.topology()
    for a in range(len(spec.gpus)):
        for b in range(a + 1, len(spec.gpus)):
            link = topo.link(a, b)
            assert (link.smi, link.nvlink_lanes) == (kind(spec, a, b), lanes(spec, a, b)), (a, b)
            assert link.pcie == spec.level(a, b)
    assert inv.healthy() == frozenset(range(len(spec.gpus)))


def test_dgx1_matrix_is_the_f3_hybrid_cube_mesh(inventory):
    _, inv = inventory("dgx-1")
    topo = inv.topology()
    matrix = [" ".join("X" if a == b else topo.link(a, b).smi for b in range(8)) for a in range(8)]
    assert matrix == [
        "X NV1 NV1 NV2 NV2 SYS SYS SYS",
        "NV1 X NV2 NV1 SYS NV2 SYS SYS",
        "NV1 NV2 X NV2 SYS SYS NV1 SYS",
        "NV2 NV1 NV2 X SYS SYS SYS NV1",
        "NV2 SYS SYS SYS X NV1 NV1 NV2",
        "SYS NV2 SYS SYS NV1 X NV2 NV1",
        "SYS SYS NV1 SYS NV1 NV2 X NV2",
        "SYS SYS SYS NV1 NV2 NV1 NV2 X",
    ]


@pytest.mark.parametrize(("name", "expected"), [("dgx-2", 6), ("dgx-a100", 12), ("hgx-h100", 18)])
def test_nvswitch_lanes_count_toward_every_pair_as_nvidia_smi_shows(inventory, name, expected):
    _, inv = inventory(name)
    topo = inv.topology()
    n = len(topo.gpus)
    assert {topo.link(a, b).nvlink_lanes for a in range(n) for b in range(n) if a != b} == {expected}


def test_workstation_reports_minors_that_differ_from_indices(inventory):
    _, inv = inventory("workstation-4")
    assert [(g.index, g.minor) for g in inv.topology().gpus] == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert inv.topology().link(0, 1).smi == "PIX" and inv.topology().link(0, 2).smi == "SYS"


def test_mig_devices_carry_uuids_and_the_nvidia_caps_minors_they_need(inventory):
    host, inv = inventory("dgx-a100")
    listed = 0
    for spec in host.spec.gpus:
        record = inv.record(spec.index)
        assert record.mig_enabled == bool(spec.mig) and record.mig_capable
        assert [(m.gpu_instance_id, m.compute_instance_id, m.profile) for m in record.mig_devices] == [
            (m.gpu_instance, m.compute_instance, m.profile) for m in spec.mig_devices
        ]
        for dev, want in zip(record.mig_devices, spec.mig_devices, strict=True):
            assert dev.uuid == want.uuid and dev.uuid.startswith("MIG-")
            assert (dev.parent_uuid, dev.parent_index, dev.parent_minor) == (spec.uuid, spec.index, spec.minor)
            assert dev.memory_total == want.memory_mib * 2**20
            assert dev.caps_minors == mig_caps_minors(spec.minor, want.gpu_instance, want.compute_instance)
            assert (dev.gpu_slices, dev.compute_slices) == (want.gpu_slices, want.compute_slices)
            assert dev.placement == (want.placement_start, want.placement_size)
            listed += 1
    assert listed == 15  # 3 + 7 + 2 + 3 on GPUs 0-3
    assert [m.profile for m in inv.record(3).mig_devices] == ["4g.20gb", "2g.10gb", "1g.10gb"]
    assert inv.record(4).mig_enabled and inv.record(4).mig_devices == ()
    assert not inv.record(5).mig_enabled and inv.record(5).mig_capable


def test_mig_caps_minors_follow_the_drivers_layout():
    # /proc/driver/nvidia-caps/mig-minors: config 1, monitor 2, then per GPU minor 15 GPU instances
    # of one GI access minor followed by 8 CI access minors (9 per GI, 135 per GPU).
    assert mig_caps_minors(0, 0, 0) == (3, 4)
    assert mig_caps_minors(0, 0, 7) == (3, 11)
    assert mig_caps_minors(0, 1, 0) == (12, 13)
    assert mig_caps_minors(1, 0, 0) == (138, 139)
    assert mig_caps_minors(0, 14, 7) == (129, 137)


def test_profile_names_give_their_slices():
    assert profile_slices("1g.5gb") == (1, 1)
    assert profile_slices("3g.20gb") == (3, 3)
    assert profile_slices("1c.3g.20gb") == (3, 1)
    assert profile_slices("1g.5gb+me") == (1, 1)
    assert profile_slices("") is None and profile_slices("3g") is None


def test_mig_device_without_caps_minors_has_none_rather_than_a_guess(inventory, sim):
    host = sim("dgx-a100")
    os.remove(os.path.join(host.proc_root, "driver", "nvidia-caps", "mig-minors"))
    with _open(host) as inv:
        inv.read()
        assert all(m.caps_minors == () for m in inv.record(0).mig_devices)


def _health_events(inv: Inventory) -> queue.Queue[HealthEvent]:
    events: queue.Queue[HealthEvent] = queue.Queue()
    inv.on_health_change(events.put)
    return events


def test_xid_marks_the_gpu_unhealthy_and_tells_subscribers(inventory):
    host, inv = inventory("dgx-1", poll_ms=50)
    events = _health_events(inv)
    inv.start_health_watch()
    host.inject_xid(3, 79)
    event = events.get(timeout=10)
    assert (event.index, event.uuid, event.healthy, event.xid) == (3, host.spec.gpus[3].uuid, False, 79)
    record = inv.record(3)
    assert not record.health.healthy and record.health.last_xid == 79 and record.health.last_xid_time > 0
    assert record.status == "XID 79"
    assert inv.healthy() == frozenset(range(8)) - {3}


def test_ignored_xid_leaves_the_gpu_healthy(inventory):
    host, inv = inventory("dgx-1", poll_ms=50)
    events = _health_events(inv)
    inv.start_health_watch()
    host.inject_xid(2, 13)  # graphics engine exception: the application's fault
    host.inject_xid(5, 48)  # double-bit ECC error: the GPU's
    event = events.get(timeout=10)
    assert event.index == 5  # the XID 13 before it produced no event
    assert inv.record(2).health.healthy
    assert events.empty()


def test_ignored_xid_list_is_configurable(inventory):
    host, inv = inventory("single", poll_ms=50, ignored_xids=(79,))
    events = _health_events(inv)
    inv.start_health_watch()
    host.inject_xid(0, 79)
    host.inject_xid(0, 13)
    assert events.get(timeout=10).xid == 13


def test_xid_on_a_mig_device_names_its_instances(inventory):
    host, inv = inventory("dgx-a100", poll_ms=50)
    events = _health_events(inv)
    inv.start_health_watch()
    host.inject_xid(0, 94, gpu_instance=1, compute_instance=0)
    assert events.get(timeout=10).reason == "XID 94 (GPU instance 1, compute instance 0)"


def test_gpu_whose_queries_fail_is_degraded_and_the_others_stay_usable(inventory, sim):
    host = sim("hgx-h100")
    host.fail_gpu(2, "nvmlDeviceGetMemoryInfo")
    with _open(host) as inv:
        inv.read()
        record = inv.record(2)
        assert record.degraded and not record.usable
        assert "failed to query memory of GPU 2 (nvmlDeviceGetMemoryInfo): GPU is lost" in record.status
        assert inv.healthy() == frozenset(range(8)) - {2}
        assert len(inv.records) == 8


def test_lost_gpu_is_listed_without_identity_and_left_out_of_the_topology(sim):
    host = sim("dgx-1")
    host.fail_gpu(6)  # every call about GPU 6 fails, as when the GPU has fallen off the bus
    with _open(host) as inv:
        inv.read()
        lost = inv.record(6)
        assert not lost.identified and lost.degraded
        assert [g.index for g in inv.topology().gpus] == [0, 1, 2, 3, 4, 5, 7]
        assert inv.healthy() == frozenset({0, 1, 2, 3, 4, 5, 7})
        assert inv.topology().link(0, 3).smi == "NV2"


def test_failed_pair_query_is_blamed_on_the_gpu_common_to_every_failure(sim):
    host = sim("workstation-4")
    host.fail_gpu(1, "nvmlDeviceGetTopologyCommonAncestor", NVML_ERROR_UNKNOWN)
    with _open(host) as inv:
        inv.read()
        assert inv.healthy() == frozenset({0, 2, 3})
        assert "PCIe path between GPUs 0 and 1" in inv.record(1).status


def test_clear_and_refresh_bring_a_degraded_gpu_back_keeping_health_learned_from_xids(inventory):
    host, inv = inventory("single", read=False, poll_ms=50)
    host.fail_gpu(0, "nvmlDeviceGetName")
    inv.read()
    assert inv.healthy() == frozenset()
    host.clear()
    inv.refresh()
    assert inv.healthy() == frozenset({0})
    inv.mark_unhealthy(0, "XID 79", 79, 1.0)
    inv.refresh()
    assert inv.record(0).health.last_xid == 79


def test_event_wait_failure_marks_every_gpu_unhealthy(inventory):
    host, inv = inventory("workstation-4", poll_ms=50)
    events = _health_events(inv)
    inv.start_health_watch()
    host.fail_gpu(None, "nvmlEventSetWait", NVML_ERROR_UNKNOWN)
    seen = {events.get(timeout=10).index for _ in range(4)}
    assert seen == {0, 1, 2, 3}
    assert inv.healthy() == frozenset()


def test_usage_reports_memory_used_and_utilisation(inventory):
    host, inv = inventory("dgx-1")
    host.set_usage(4, memory_used=3 * 2**30, gpu_util=87, memory_util=41)
    usage = inv.usage(4)
    assert (usage.memory_used, usage.gpu_utilization, usage.memory_utilization) == (3 * 2**30, 87, 41)
    assert usage.memory_total == 16160 * 2**20
    assert inv.usage(0).memory_used == 0
    with pytest.raises(GpuNotFound):
        inv.usage(8)


def test_reading_only_the_managed_indices(inventory):
    _, inv = inventory("dgx-1", read=False)
    inv.read([1, 5])
    assert [g.index for g in inv.topology().gpus] == [1, 5]
    assert inv.topology().link(1, 5).smi == "NV2"
    with pytest.raises(GpuNotFound, match="NVML reports 8 GPU"):
        inv.read([8])


def test_missing_library_is_a_typed_error_naming_the_path(short_tmp):
    path = os.path.join(short_tmp, "libnvidia-ml.so.1")
    with pytest.raises(NvmlNotFound, match=f"failed to load NVML '{path}'"):
        Inventory(library=path).open()


def test_nvml_init_failure_is_a_typed_error(sim):
    host = sim("single")
    host.fail_gpu(None, "nvmlInit", 9)  # NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(NvmlNotFound, match="Driver Not Loaded"):
        _open(host)


def test_fake_nvml_fills_nvml_h_process_structs_for_each_version_and_sizes_buffers_as_nvml_does(sim):
    """The per-process entry points with nvml.h's structs, called through ctypes as a C caller would:
    nvmlProcessInfo_v1_t (12+4 bytes) for the unversioned calls, the 24-byte v2 struct for _v2/_v3,
    nvmlProcessUtilizationSample_t; a too-small buffer gets INSUFFICIENT_SIZE and the count needed."""
    import ctypes
    import time

    import pynvml

    host = sim("dgx-a100")
    host.start_process(5, 900, 64 << 20, "mps-server")
    host.start_process(5, 901, 3 << 20, "mps", sm_util=44, memory_util=7)
    host.start_process(5, 902, 5 << 20, "mps")
    host.start_process(0, 903, 9 << 20, mig=(13, 0))
    lib = ctypes.CDLL(host.library_path)

    class V1(ctypes.Structure):
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

    assert ctypes.sizeof(V1) == 16 and ctypes.sizeof(pynvml.c_nvmlProcessInfo_v2_t) == 24
    assert ctypes.sizeof(pynvml.c_nvmlProcessUtilizationSample_t) == 32
    assert lib.nvmlInit_v2() == 0
    try:
        dev = ctypes.c_void_p()
        assert lib.nvmlDeviceGetHandleByIndex_v2(5, ctypes.byref(dev)) == 0
        count = ctypes.c_uint(1)
        one = (V1 * 1)()
        assert lib.nvmlDeviceGetMPSComputeRunningProcesses(dev, ctypes.byref(count), one) == 7  # INSUFFICIENT_SIZE
        assert count.value == 2
        v1 = (V1 * 2)()
        assert lib.nvmlDeviceGetMPSComputeRunningProcesses(dev, ctypes.byref(count), v1) == 0
        assert [(p.pid, p.usedGpuMemory) for p in v1] == [(901, 3 << 20), (902, 5 << 20)]
        for name in ("nvmlDeviceGetMPSComputeRunningProcesses_v2", "nvmlDeviceGetMPSComputeRunningProcesses_v3"):
            v2 = (pynvml.c_nvmlProcessInfo_v2_t * 4)()
            count = ctypes.c_uint(4)
            assert getattr(lib, name)(dev, ctypes.byref(count), v2) == 0 and count.value == 2
            assert [(p.pid, p.usedGpuMemory, p.gpuInstanceId) for p in v2[:2]] == [
                (901, 3 << 20, 0xFFFFFFFF),
                (902, 5 << 20, 0xFFFFFFFF),
            ]
        compute = (pynvml.c_nvmlProcessInfo_v2_t * 4)()
        count = ctypes.c_uint(4)
        assert lib.nvmlDeviceGetComputeRunningProcesses_v3(dev, ctypes.byref(count), compute) == 0
        assert [(p.pid, p.usedGpuMemory) for p in compute[: count.value]] == [(900, (64 + 3 + 5) << 20)]
        samples = (pynvml.c_nvmlProcessUtilizationSample_t * 4)()
        count = ctypes.c_uint(0)
        assert lib.nvmlDeviceGetProcessUtilization(dev, None, ctypes.byref(count), ctypes.c_ulonglong(0)) == 7
        assert count.value == 1
        count = ctypes.c_uint(4)
        before = int(time.time() * 1e6)
        assert lib.nvmlDeviceGetProcessUtilization(dev, samples, ctypes.byref(count), ctypes.c_ulonglong(0)) == 0
        s = samples[0]
        assert (count.value, s.pid, s.smUtil, s.memUtil) == (1, 901, 44, 7) and s.timeStamp >= before
        later = ctypes.c_ulonglong(s.timeStamp + 3_600_000_000)
        assert lib.nvmlDeviceGetProcessUtilization(dev, samples, ctypes.byref(count), later) == 6  # NOT_FOUND
        # a MIG GPU: its processes on the parent carry their GI/CI; per-process utilisation is not supported
        gpu0 = ctypes.c_void_p()
        assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(gpu0)) == 0
        count = ctypes.c_uint(4)
        assert lib.nvmlDeviceGetComputeRunningProcesses_v3(gpu0, ctypes.byref(count), compute) == 0
        assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in compute[: count.value]] == [(903, 13, 0)]
        assert lib.nvmlDeviceGetProcessUtilization(gpu0, samples, ctypes.byref(count), ctypes.c_ulonglong(0)) == 3
    finally:
        lib.nvmlShutdown()
