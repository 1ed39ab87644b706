"""The per-container usage series (isolator/exporters/metrics.py) over the in-process fake service."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import generate_latest

from isolator.exporters.metrics import Metrics
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.shares import parse_shared_gpus
from isolator.testing import fake_service

MIB = 1 << 20


def lines(rig, prefix: str) -> list[str]:
    text = generate_latest(Metrics(rig.service).registry).decode()
    return sorted(line for line in text.splitlines() if line.startswith(prefix))


def values(rig, prefix: str) -> dict[str, float]:
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in lines(rig, prefix))}


def test_each_live_container_has_one_series_per_device_it_holds_and_none_after_cleanup() -> None:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps"))
    rig.restart()
    a, s = ContainerId("a"), ContainerId("s")
    rig.service.prepare(a, ContainerConfig(resources=(Resource("gpus", 1.0),)))
    rig.service.prepare(s, ContainerConfig(resources=(Resource("gpu_shares", 1.0),)))
    (held,) = rig.service.core.store.get(a).holding.gpus
    gpu = rig.service.core.gpus[held]
    shared = rig.service.core.gpus[rig.service.core.store.get(s).holding.share.gpu]
    rig.cgroups.add_pid(a, 1001)
    rig.cgroups.add_pid(s, 2001)
    rig.inventory.start_process(gpu.index, 1001, 300 * MIB, sm_util=35)
    rig.inventory.start_process(shared.index, 2001, shared.memory_total // 4 + 1, "mps", sm_util=5)
    used = values(rig, "gpu_isolator_container_gpu_memory_used_bytes{")
    assert used == {
        f'gpu_isolator_container_gpu_memory_used_bytes{{UUID="{gpu.uuid}",container_id="a",kind="gpu"}}': 300 * MIB,
        f'gpu_isolator_container_gpu_memory_used_bytes{{UUID="{shared.uuid}",container_id="s",kind="share"}}': (
            shared.memory_total // 4 + 1
        ),
    }
    assert values(rig, "gpu_isolator_container_gpu_share_over{") == {
        f'gpu_isolator_container_gpu_share_over{{UUID="{shared.uuid}",container_id="s"}}': 1
    }, "only a share has a slice to be over"
    sm = values(rig, "gpu_isolator_container_gpu_sm_utilization_percent{")
    assert (
        sm[f'gpu_isolator_container_gpu_sm_utilization_percent{{UUID="{gpu.uuid}",container_id="a",kind="gpu"}}'] == 35
    )
    for pid, index in ((1001, gpu.index), (2001, shared.index)):
        rig.cgroups.kill(pid)
        rig.inventory.stop_process(index, pid)
    rig.service.cleanup(a)
    rig.service.cleanup(s)
    for family in ("memory_used_bytes", "memory_limit_bytes", "sm_utilization_percent", "share_over"):
        assert lines(rig, f"gpu_isolator_container_gpu_{family}{{") == [], "gone with the container"


def test_a_gpu_nvml_cannot_list_has_no_usage_series_rather_than_a_zero() -> None:
    rig = fake_service("dgx-1")
    a = ContainerId("a")
    rig.service.prepare(a, ContainerConfig(resources=(Resource("gpus", 1.0),)))
    (held,) = rig.service.core.store.get(a).holding.gpus
    rig.inventory.fail_gpu(rig.service.core.gpus[held].index, "nvmlDeviceGetComputeRunningProcesses", 999)
    assert lines(rig, "gpu_isolator_container_gpu_memory_used_bytes{") == []
    assert lines(rig, "gpu_isolator_container_gpus{") == ['gpu_isolator_container_gpus{container_id="a"} 1.0']
