"""What each container's processes use (isolator/core/usage.py) through Usage, the admin views and
their errors, in-process over the shipped fakes on both cgroup versions and both modes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.shares import parse_shared_gpus
from isolator.testing import Rig, fake_service

MIB = 1 << 20


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def ask(**resources: float) -> ContainerConfig:
    def name(k: str) -> str:  # mig_1g_5gb is mig-1g.5gb
        return "mig-" + k[4:].replace("_", ".") if k.startswith("mig_") else k

    return ContainerConfig(resources=tuple(Resource(name(k), v) for k, v in resources.items()))


@pytest.fixture(params=[("v1", "standalone"), ("v2", "standalone"), ("v1", "mesos"), ("v2", "mesos")])
def rig(request) -> Rig:
    version, mode = request.param
    rig = fake_service("dgx-1", version=version, mode=mode)
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4-7:4:mps"))
    rig.restart()
    return rig


def index_of(rig: Rig, c: ContainerId) -> int:
    rec = rig.service.core.store.get(c)
    assert rec is not None
    minor = next(iter(rec.holding.granted))
    return rig.service.core.gpus[minor].index


def prepared(rig: Rig, name: str, **resources: float) -> ContainerId:
    c = cid(name)
    if rig.cgroups.mode.value == "mesos":
        rig.cgroups.mesos_creates(c)
    rig.service.prepare(c, ask(**resources))
    return c


def test_usage_counts_the_containers_own_processes_not_its_neighbours(rig: Rig) -> None:
    a, b = prepared(rig, "a", gpus=1), prepared(rig, "b", gpus=1)
    ia, ib = index_of(rig, a), index_of(rig, b)
    rig.cgroups.add_pid(a, 1001)
    rig.cgroups.add_pid(b, 2001)
    rig.inventory.start_process(ia, 1001, 300 * MIB, sm_util=35)
    rig.inventory.start_process(ia, 3001, 999 * MIB, sm_util=50)  # a stranger's, outside every container
    rig.inventory.start_process(ib, 2001, 700 * MIB, sm_util=10)
    (dev,) = rig.service.usage(a).devices
    assert (dev.kind, dev.memory_used, dev.sm_utilization, dev.pids) == ("gpu", 300 * MIB, 35, (1001,))
    assert dev.memory_limit == rig.service.core.gpus[dev.minor].memory_total
    (other,) = rig.service.usage(b).devices
    assert (other.memory_used, other.pids) == (700 * MIB, (2001,))


def test_a_sharer_over_its_slice_shows_as_over_in_usage_and_in_containers(rig: Rig) -> None:
    a, b = prepared(rig, "a", gpu_shares=1), prepared(rig, "b", gpu_shares=1)
    rig.cgroups.add_pid(a, 1001)
    rig.cgroups.add_pid(b, 2001)
    ia, ib = index_of(rig, a), index_of(rig, b)
    total = next(g.memory_total for g in rig.inventory.topology().gpus if g.index == ia)
    rig.inventory.start_process(ia, 500, 64 * MIB, "mps-server")
    rig.inventory.start_process(ia, 1001, total // 4 + MIB, "mps", sm_util=20)
    rig.inventory.start_process(ib, 2001, total // 8, "mps", sm_util=20)
    (dev,) = rig.service.usage(a).devices
    assert (dev.kind, dev.memory_limit, dev.over) == ("share", total // 4, True)
    assert dev.memory_used == total // 4 + MIB, "its own memory, not the server's total"
    views = {str(c.container_id): c for c in rig.service.list_containers()}
    assert views["a"].usage[0].over is True and views["b"].usage[0].over is False


def test_a_nested_containers_processes_count_for_its_top_level_container(rig: Rig) -> None:
    a = prepared(rig, "a", gpus=1)
    rig.cgroups.place(1500, f"{rig.cgroups.root_path()}/a/mesos/child/leaf")  # where Mesos puts a nested one
    rig.cgroups.place(1600, f"{rig.cgroups.root_path()}/ab/leaf")  # a name that merely starts with a's
    rig.inventory.start_process(index_of(rig, a), 1600, 128 * MIB)
    rig.inventory.start_process(index_of(rig, a), 1500, 128 * MIB)
    assert rig.service.usage(a).devices[0].pids == (1500,)


def test_when_nvml_cannot_list_a_gpu_usage_says_so_and_invents_nothing(rig: Rig) -> None:
    a = prepared(rig, "a", gpus=1)
    rig.inventory.fail_gpu(index_of(rig, a), "nvmlDeviceGetComputeRunningProcesses", 999)
    (dev,) = rig.service.usage(a).devices
    assert dev.error and (dev.memory_used, dev.sm_utilization) == (0, None)
    assert rig.service.describe_container(a).container.usage == (dev,)


def test_mig_units_are_counted_per_mig_device() -> None:
    rig = fake_service("dgx-a100")
    a = cid("a")
    rig.service.prepare(a, ask(mig_1g_5gb=1))
    rec = rig.service.core.store.get(a)
    assert rec is not None
    ((uuid, _parent),) = rec.holding.mig
    dev = next(m for r in rig.inventory.records for m in r.mig_devices if m.uuid == uuid)
    rig.cgroups.add_pid(a, 1001)
    rig.inventory.start_process(dev.parent_index, 1001, 200 * MIB, mig=(dev.gpu_instance_id, dev.compute_instance_id))
    (use,) = rig.service.usage(a).devices
    assert (use.kind, use.uuid, use.memory_used, use.memory_limit, use.sm_utilization) == (
        "mig",
        uuid,
        200 * MIB,
        dev.memory_total,
        None,
    )
