"""Which container a GPU process belongs to, and what each container uses (isolator/policy/usage.py)."""

from __future__ import annotations

from isolator.model import ProcessUsage
from isolator.policy.usage import HeldDevice, attribute, owner, share_slice

MIB = 1 << 20


def test_owner_is_the_top_level_container_below_our_root_on_either_layout() -> None:
    root = "/sys/fs/cgroup/devices/gpu-isolator"
    assert owner(f"{root}/c1", root) == "c1"  # v1
    assert owner(f"{root}/c1/mesos/child", root) == "c1"  # a nested container counts for its top
    assert owner("/sys/fs/cgroup/mesos/c2/leaf", "/sys/fs/cgroup/mesos/") == "c2"  # v2 leaf
    assert owner(f"{root}", root) is None, "our root itself is nobody's"
    assert owner(f"{root}-other/c1", root) is None, "a sibling that merely starts with our root's name"
    assert owner("/sys/fs/cgroup/system.slice/nvidia-mps.service", root) is None
    assert owner(None, root) is None, "gone"


def test_a_share_may_use_its_part_of_the_gpus_memory() -> None:
    assert share_slice(16 << 30, 1, 4) == 4 << 30
    assert share_slice(16 << 30, 3, 4) == 12 << 30


def proc(pid: int, memory: int, gpu: int = 0, mig: str = "", sm: int | None = 0, kind: str = "compute") -> ProcessUsage:
    return ProcessUsage(pid, gpu, memory, kind, mig, sm, None if sm is None else 0)


def test_only_the_containers_own_processes_count_on_each_device_it_holds() -> None:
    held = [HeldDevice("GPU-a", 0, 0, "gpu", 16 << 30), HeldDevice("GPU-b", 1, 1, "gpu", 16 << 30)]
    listed = {0: (proc(10, 100 * MIB, sm=30), proc(11, 50 * MIB, sm=25), proc(99, 900 * MIB, sm=40)), 1: ()}
    a, b = attribute(held, listed, {}, mine=[10, 11])
    assert (a.memory_used, a.sm_utilization, a.pids, a.over) == (150 * MIB, 55, (10, 11), False)
    assert (b.memory_used, b.sm_utilization, b.pids) == (0, 0, ())


def test_utilization_is_capped_and_unknown_when_any_process_lacks_it() -> None:
    held = [HeldDevice("GPU-a", 0, 0, "gpu", 16 << 30)]
    (capped,) = attribute(held, {0: (proc(1, 0, sm=80), proc(2, 0, sm=70))}, {}, mine=[1, 2])
    assert capped.sm_utilization == 100
    (unknown,) = attribute(held, {0: (proc(1, 0, sm=None), proc(2, 0, sm=70))}, {}, mine=[1, 2])
    assert unknown.sm_utilization is None


def test_a_share_over_its_slice_is_over_and_one_within_is_not() -> None:
    held = [HeldDevice("GPU-s", 4, 4, "share", 4 << 30)]
    (within,) = attribute(held, {4: (proc(7, 4 << 30, gpu=4, kind="mps"),)}, {}, mine=[7])
    assert within.over is False
    (over,) = attribute(held, {4: (proc(7, (4 << 30) + 1, gpu=4, kind="mps"),)}, {}, mine=[7])
    assert over.over is True
    whole = [HeldDevice("GPU-w", 0, 0, "gpu", 4 << 30)]
    (gpu,) = attribute(whole, {0: (proc(7, 5 << 30),)}, {}, mine=[7])
    assert gpu.over is False, "only a share has a slice to be over"


def test_a_mig_device_counts_only_the_processes_on_it() -> None:
    held = [HeldDevice("MIG-1", 0, 0, "mig", 5 << 30)]
    listed = {0: (proc(1, 100 * MIB, mig="MIG-1", sm=None), proc(2, 200 * MIB, mig="MIG-2", sm=None))}
    (dev,) = attribute(held, listed, {}, mine=[1, 2])
    assert (dev.memory_used, dev.pids, dev.sm_utilization) == (100 * MIB, (1,), None)


def test_a_gpu_nvml_could_not_list_carries_the_error_and_no_figures() -> None:
    held = [HeldDevice("GPU-a", 0, 0, "gpu", 16 << 30)]
    (dev,) = attribute(held, {}, {0: "failed to list compute processes 'GPU 0': Unknown Error"}, mine=[1])
    assert (dev.memory_used, dev.sm_utilization, dev.pids) == (0, None, ())
    assert "Unknown Error" in dev.error and dev.over is False
