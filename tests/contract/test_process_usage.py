"""The per-process view of a GPU (GpuInventory.process_usage): the fake inventory, the real NVML
edge on the simulated host's library, and (marked gpu) the real edge on a real GPU give the same
answers to the same steering.

The exact numbers (MPS clients charged to their server, MIG devices' processes, utilisation
samples) are checked on the fake and the simulated host, which can be steered to them; a real GPU
is steered by a real CUDA process, and checked for what holds on any driver: its pid, its memory,
utilisation that is either a percentage or not reported, and nothing left once it ends.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from isolator.errors import NvmlError
from isolator.testing import FakeInventory

MIB = 1 << 20

# A CUDA client through the driver API only (no toolkit): a context on the one visible GPU, N MiB
# allocated, "ready" on stdout, then it waits for stdin to close.
CUDA_CLIENT = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
def check(rc, what):
    if rc != 0:
        sys.exit(f"{what}: CUDA error {rc}")
check(cuda.cuInit(0), "cuInit")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
check(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[1]) << 20)), "cuMemAlloc")
print("ready", flush=True)
sys.stdin.read()
"""


class RealGpu:
    """Steers a real GPU the way the tests steer the simulated one: real CUDA processes."""

    def __init__(self, inventory: Any) -> None:
        self.inventory = inventory
        self.clients: dict[int, subprocess.Popen[str]] = {}

    def spawn(self, index: int, memory_mib: int) -> int:
        uuid = self.inventory.record(index).gpu.uuid
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=uuid)
        proc = subprocess.Popen(
            [sys.executable, "-c", CUDA_CLIENT, str(memory_mib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "the CUDA client did not start"
        self.clients[proc.pid] = proc
        return proc.pid

    def end(self, index: int, pid: int) -> None:
        proc = self.clients.pop(pid)
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)

    def close(self) -> None:
        for pid in list(self.clients):
            self.end(0, pid)


class Steered:
    """The fake's and the simulated host's steering, as ``spawn``/``end`` of a made-up pid."""

    def __init__(self, steer: Any) -> None:
        self.steer = steer
        self.next_pid = 40000

    def spawn(self, index: int, memory_mib: int) -> int:
        self.next_pid += 1
        self.steer.start_process(index, self.next_pid, memory_mib * MIB, sm_util=37, memory_util=12)
        return self.next_pid

    def end(self, index: int, pid: int) -> None:
        self.steer.stop_process(index, pid)

    def close(self) -> None:
        pass


@contextlib.contextmanager
def inventory_of(kind: str, host: str, tmp: str) -> Iterator[tuple[Any, Any]]:
    """(inventory, steering): the fake steers itself; the real edge on the simulated host is steered
    through its control files; on a real GPU the steering is ``RealGpu``."""
    if kind == "fake":
        fake = FakeInventory.of_host(host)
        yield fake, fake
        return
    from isolator.gpu.nvml import Inventory

    if kind == "gpu":
        real = Inventory().open()
        real.read()
        steer = RealGpu(real)
        try:
            yield real, steer
        finally:
            steer.close()
            real.close()
        return
    from isolator.simhost.sim import SimulatedHost

    sim = SimulatedHost(host, os.path.join(tmp, host)).setup(make_devices=False)
    real = Inventory(library=sim.library_path, proc_root=sim.proc_root, sys_root=os.path.join(sim.root, "sys"))
    real.open()
    try:
        real.read()
        yield real, sim
    finally:
        real.close()


def _cuda_present() -> bool:
    return ctypes.util.find_library("cuda") is not None


@pytest.mark.parametrize("kind", ["fake", "nvml", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.root])])
def test_a_process_is_listed_with_its_memory_and_gone_when_it_ends(kind: str, short_tmp: str) -> None:
    if kind == "gpu" and not _cuda_present():
        pytest.skip("[gpu] libcuda.so.1 is not on this machine: no CUDA process can be started")
    with inventory_of(kind, "dgx-1", short_tmp) as (inv, steer):
        index = next(r.index for r in inv.records if r.usable and not r.mig_enabled)
        before = {p.pid for p in inv.process_usage(index)}
        driver = steer if kind == "gpu" else Steered(steer)
        pid = driver.spawn(index, 256)
        try:
            mine = [p for p in inv.process_usage(index) if p.pid == pid]
            assert len(mine) == 1, f"pid {pid} is listed once on GPU {index}"
            (p,) = mine
            assert (p.gpu, p.kind, p.mig_uuid) == (index, "compute", "")
            assert p.used_memory >= 256 * MIB
            if kind == "gpu":
                assert p.used_memory < 2048 * MIB, "a context and 256 MiB, not the whole GPU's used memory"
            assert (p.sm_utilization is None) == (p.memory_utilization is None)
            if p.sm_utilization is not None:
                assert 0 <= p.sm_utilization <= 100 and 0 <= p.memory_utilization <= 100
            if kind != "gpu":
                assert (p.sm_utilization, p.memory_utilization) == (37, 12)
        finally:
            driver.end(index, pid)
        assert {p.pid for p in inv.process_usage(index)} == before


@pytest.mark.parametrize("kind", ["fake", "nvml"])
def test_mps_clients_are_listed_with_their_own_memory_and_charged_to_the_server_in_the_compute_list(
    kind: str, short_tmp: str
) -> None:
    with inventory_of(kind, "dgx-1", short_tmp) as (inv, steer):
        steer.start_process(2, 700, 66 * MIB, "mps-server")
        steer.start_process(2, 701, 208 * MIB, "mps", sm_util=40, memory_util=5)
        steer.start_process(2, 702, 1024 * MIB, "mps", sm_util=25, memory_util=9)
        steer.start_process(2, 703, 512 * MIB, "compute", sm_util=10, memory_util=1)
        usage = {p.pid: (p.kind, p.used_memory, p.sm_utilization, p.memory_utilization) for p in inv.process_usage(2)}
        assert usage == {
            700: ("compute", (66 + 208 + 1024) * MIB, 0, 0),  # NVML's compute list: the server carries its clients
            701: ("mps", 208 * MIB, 40, 5),
            702: ("mps", 1024 * MIB, 25, 9),
            703: ("compute", 512 * MIB, 10, 1),
        }
        occupancy = inv.occupancy(2)
        assert sorted((p.pid, p.used_memory) for p in occupancy.processes) == [
            (700, (66 + 208 + 1024) * MIB),
            (703, 512 * MIB),
        ], "the normal list has the server, not its clients"
        assert occupancy.memory_used == (66 + 208 + 1024 + 512) * MIB, "each byte once"
        steer.stop_process(2, 701)
        assert {p.pid: p.used_memory for p in inv.process_usage(2)}[700] == (66 + 1024) * MIB


@pytest.mark.parametrize("kind", ["fake", "nvml"])
def test_utilization_is_zero_without_a_sample_and_absent_where_the_driver_does_not_report_it(
    kind: str, short_tmp: str
) -> None:
    with inventory_of(kind, "dgx-1", short_tmp) as (inv, steer):
        steer.start_process(1, 501, 10 * MIB)
        steer.start_process(1, 502, 20 * MIB, sm_util=90, memory_util=30)
        assert {p.pid: p.sm_utilization for p in inv.process_usage(1)} == {501: 0, 502: 90}
        steer.stop_process(1, 502)
        assert {p.pid: p.sm_utilization for p in inv.process_usage(1)} == {501: 0}, "no sample at all: all idle"
        steer.fail_gpu(1, "nvmlDeviceGetProcessUtilization", 3)  # NOT_SUPPORTED
        assert [(p.pid, p.used_memory, p.sm_utilization, p.memory_utilization) for p in inv.process_usage(1)] == [
            (501, 10 * MIB, None, None)
        ]
        steer.start_process(4, 504, 10 * MIB)
        steer.fail_gpu(4, "nvmlDeviceGetProcessUtilization", 999)
        with pytest.raises(NvmlError, match="GPU 4"):
            inv.process_usage(4)


@pytest.mark.parametrize("kind", ["fake", "nvml"])
def test_a_failing_compute_list_is_an_error_not_an_empty_gpu(kind: str, short_tmp: str) -> None:
    with inventory_of(kind, "dgx-1", short_tmp) as (inv, steer):
        steer.start_process(3, 601, 10 * MIB)
        steer.fail_gpu(3, "nvmlDeviceGetComputeRunningProcesses", 999)
        with pytest.raises(NvmlError, match="GPU 3"):
            inv.process_usage(3)
        assert [p.pid for p in inv.process_usage(2)] == [], "only the GPU that fails"


@pytest.mark.parametrize("kind", ["fake", "nvml"])
def test_a_mig_gpu_lists_each_process_on_its_mig_device_without_utilization(kind: str, short_tmp: str) -> None:
    with inventory_of(kind, "dgx-a100", short_tmp) as (inv, steer):
        record = inv.record(0) if kind == "nvml" else next(r for r in inv.records if r.index == 0)
        by_ids = {(m.gpu_instance_id, m.compute_instance_id): m.uuid for m in record.mig_devices}
        steer.start_process(0, 801, 300 * MIB, mig=(1, 0))
        steer.start_process(0, 802, 100 * MIB, mig=(13, 0), sm_util=50)
        steer.start_process(0, 803, 50 * MIB, "mps", mig=(13, 0))
        got = sorted((p.pid, p.mig_uuid, p.kind, p.used_memory, p.sm_utilization) for p in inv.process_usage(0))
        assert got == [
            (801, by_ids[(1, 0)], "compute", 300 * MIB, None),
            (802, by_ids[(13, 0)], "compute", 100 * MIB, None),
            (803, by_ids[(13, 0)], "mps", 50 * MIB, None),
        ]
