"""--cpu-affinity in the core, in-process over the shipped fakes (docs/affinity.md): hint, enforce,
refusal, isolate, update, cleanup, start-up reconciliation, the drift audit and describe.

The simulated host is numa-2 (GPU 0 local to CPU 0 on node 0, GPU 1 to CPU 1 on node 1); the fake
machine has CPUs 0-1 and one memory node, 0, as the project's VM.
"""

from __future__ import annotations

import pytest

from isolator.errors import AffinityEmpty, CgroupBusy, CgroupError
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.affinity import ENV_CPUS, ENV_NUMA_NODES, Affinity, Machine
from isolator.testing import FakeCpusets, Rig, fake_service


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def gpus(n: int, command_task: bool = False) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpus", n),), command_task=command_task)


def local(minors: frozenset[int]) -> Affinity:
    """numa-2 on the fake machine: each GPU's CPU is its minor; memory is node 0 either way."""
    return Affinity(frozenset(minors), frozenset({0}))


def enforcing(mode: str = "standalone", machine: Machine | None = None) -> Rig:
    return fake_service("numa-2", mode=mode, cpu_affinity="enforce", cpusets=FakeCpusets(machine))


def gpus_of(rig: Rig, c: ContainerId) -> frozenset[int]:
    rec = rig.store.get(c)
    assert rec is not None
    return rec.holding.gpus


# ---- hint ---------------------------------------------------------------------------------------


def test_hint_puts_the_gpus_local_cpus_and_nodes_in_the_environment_and_no_cpuset() -> None:
    rig = fake_service("numa-2", cpu_affinity="hint")
    a = cid("a")
    info = rig.service.prepare(a, gpus(1))
    want = local(gpus_of(rig, a))
    assert info is not None and dict(info.environment) == {ENV_CPUS: want.cpu_list, ENV_NUMA_NODES: "0"}
    assert not rig.cpusets.exists(a) and rig.store.get(a).cpus == ""  # type: ignore[union-attr]


def test_hint_goes_to_a_command_tasks_task_environment() -> None:
    rig = fake_service("numa-2", cpu_affinity="hint")
    info = rig.service.prepare(cid("a"), gpus(2, command_task=True))
    assert info is not None and info.environment == ()
    assert dict(info.task_environment) == {ENV_CPUS: "0-1", ENV_NUMA_NODES: "0"}


def test_hint_gives_a_nested_container_its_top_level_containers_locality() -> None:
    rig = fake_service("numa-2", cpu_affinity="hint")
    rig.service.prepare(cid("a"), gpus(1))
    info = rig.service.prepare(cid("a.b"), ContainerConfig(resources=()))
    assert info is not None and dict(info.environment)[ENV_CPUS] == local(gpus_of(rig, cid("a"))).cpu_list


def test_off_and_no_gpus_give_nothing() -> None:
    assert fake_service("numa-2").service.prepare(cid("a"), gpus(1)) is None
    rig = enforcing()
    assert rig.service.prepare(cid("z"), gpus(0)) is None
    assert not rig.cpusets.exists(cid("z")) and rig.cpusets.applied == []


def test_hint_whose_locality_leaves_nothing_here_gives_no_hint_and_prepares() -> None:
    rig = fake_service("numa-2", cpu_affinity="hint", cpusets=FakeCpusets(Machine(frozenset({7}), frozenset({0}))))
    assert rig.service.prepare(cid("a"), gpus(1)) is None
    assert gpus_of(rig, cid("a"))


# ---- enforce ------------------------------------------------------------------------------------


def test_enforce_records_then_applies_the_cpuset_of_the_gpus() -> None:
    rig = enforcing()
    a = cid("a")
    info = rig.service.prepare(a, gpus(1))
    want = local(gpus_of(rig, a))
    rec = rig.store.get(a)
    assert rec is not None and (rec.cpus, rec.mems) == (want.cpu_list, "0")
    assert rig.cpusets.current(a) == want
    assert info is not None and dict(info.environment)[ENV_CPUS] == want.cpu_list


def test_enforce_refuses_an_affinity_that_leaves_nothing_and_leaves_nothing_behind() -> None:
    rig = enforcing(machine=Machine(frozenset({7}), frozenset({0}), {0: frozenset({7})}))
    with pytest.raises(AffinityEmpty, match="never given every CPU"):
        rig.service.prepare(cid("a"), gpus(1))
    assert rig.store.get(cid("a")) is None and not rig.cgroups.exists(cid("a"))
    assert rig.service.core.booking.available == frozenset({0, 1}) and rig.cpusets.applied == []


def test_a_cpuset_that_cannot_be_written_undoes_the_prepare() -> None:
    rig = enforcing()
    rig.cpusets.faults.fail_at("apply")
    with pytest.raises(CgroupError, match="injected fault"):
        rig.service.prepare(cid("a"), gpus(1))
    assert rig.store.get(cid("a")) is None and not rig.cgroups.exists(cid("a")) and not rig.cpusets.exists(cid("a"))
    assert rig.service.core.booking.available == frozenset({0, 1})


@pytest.mark.parametrize("mode", ["standalone", "mesos"])
def test_isolate_joins_the_pid_and_nested_pids_to_the_cpuset(mode: str) -> None:
    rig = enforcing(mode)
    a = cid("a")
    if mode == "mesos":
        rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    pid, nested = rig.processes.spawn(), rig.processes.spawn()
    if mode == "mesos":
        rig.cgroups.add_pid(a, pid)
        rig.cgroups.add_pid(a, nested)  # a nested container sharing its parent's cgroup
    rig.service.isolate(a, pid)
    rig.service.prepare(cid("a.b"), ContainerConfig(resources=()))
    rig.service.isolate(cid("a.b"), nested)
    assert rig.cpusets.pids(a) == (pid, nested)
    assert rig.cpusets.allowed_of(pid) == local(gpus_of(rig, a)).cpus


def test_isolate_remakes_a_cpuset_lost_after_it_was_recorded() -> None:
    rig = enforcing()
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    del rig.cpusets.sets[a]  # a kill between record and write would leave this
    pid = rig.processes.spawn()
    rig.service.isolate(a, pid)
    assert rig.cpusets.current(a) == local(gpus_of(rig, a)) and rig.cpusets.pids(a) == (pid,)


def test_update_moves_the_cpuset_with_the_gpus() -> None:
    rig = enforcing()
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    first = gpus_of(rig, a)
    rig.service.update(a, [Resource("gpus", 2)])
    assert rig.cpusets.current(a) == local(frozenset({0, 1})) and rig.store.get(a).cpus == "0-1"  # type: ignore[union-attr]
    rig.service.update(a, [Resource("gpus", 1)])
    kept = gpus_of(rig, a)
    assert rig.cpusets.current(a) == local(kept) and rig.store.get(a).cpus == local(kept).cpu_list  # type: ignore[union-attr]
    assert len(first) == len(kept) == 1


def test_update_to_no_gpus_lets_the_container_go_back_to_every_cpu() -> None:
    rig = enforcing()
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    rig.service.update(a, [Resource("gpus", 0)])
    assert rig.cpusets.current(a) == Affinity(frozenset({0, 1}), frozenset({0}))


def test_update_from_no_gpus_makes_a_cpuset_and_moves_the_processes_into_it() -> None:
    rig = enforcing()
    a = cid("a")
    rig.service.prepare(a, gpus(0))
    pid = rig.processes.spawn()
    rig.service.isolate(a, pid)
    assert not rig.cpusets.exists(a)
    rig.service.update(a, [Resource("gpus", 1)])
    assert rig.cpusets.current(a) == local(gpus_of(rig, a)) and rig.cpusets.pids(a) == (pid,)


def test_cleanup_removes_the_cpuset_and_refuses_while_it_holds_processes() -> None:
    rig = enforcing()
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    pid = rig.processes.spawn()
    rig.service.isolate(a, pid)
    rig.cgroups.members.pop(pid)  # it left the devices cgroup, but not the cpuset
    with pytest.raises(CgroupBusy):
        rig.service.cleanup(a)
    assert rig.store.get(a) is not None, "the record stays until the cpuset is gone"
    rig.cpusets.exit(pid)
    rig.service.cleanup(a)
    assert not rig.cpusets.exists(a) and rig.store.get(a) is None


# ---- start-up, audit, describe ------------------------------------------------------------------


def test_a_restart_restores_a_recorded_cpuset_that_was_never_written_and_removes_unrecorded_ones() -> None:
    rig = enforcing()
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    del rig.cpusets.sets[a]  # killed between recording and writing it
    rig.cpusets.drift(cid("stray"), frozenset({0}), frozenset({0}))  # ours, with no record
    rig.restart()
    assert rig.cpusets.current(a) == local(gpus_of(rig, a))
    assert not rig.cpusets.exists(cid("stray"))


def test_the_audit_repairs_and_reports_a_cpuset_changed_behind_our_back() -> None:
    rig = enforcing()
    a = cid("a")
    rig.service.prepare(a, gpus(1))
    want = local(gpus_of(rig, a))
    rig.cpusets.drift(a, frozenset({0, 1}), frozenset({0}))
    report = rig.service.audit()
    assert len(report.repaired) == 1 and "re-applied the recorded cpuset" in report.repaired[0]
    assert "CPUs 0-1" in report.repaired[0] and rig.cpusets.current(a) == want
    assert rig.service.audit().repaired == ()


def test_describe_shows_the_locality_and_the_cpuset_recorded_and_in_force() -> None:
    rig = enforcing()
    a = cid("a")
    rig.service.prepare(a, gpus(2))
    d = rig.service.describe_container(a)
    assert (d.cpu_affinity, d.local_cpus, d.local_numa_nodes) == ("enforce", "0-1", "0")
    assert (d.cpuset_recorded_cpus, d.cpuset_cpus, d.cpuset_mems) == ("0-1", "0-1", "0")
    assert d.cpuset_cgroup == rig.cpusets.path(a)


def test_a_forced_release_in_mesos_mode_leaves_the_cpuset_to_the_processes_still_running() -> None:
    rig = enforcing("mesos")
    a = cid("a")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    pid = rig.processes.spawn()
    rig.cgroups.add_pid(a, pid)
    rig.service.isolate(a, pid)
    released = rig.service.release(a, force=True)
    assert released.pids == (pid,) and rig.store.get(a) is None
    assert rig.cpusets.pids(a) == (pid,), "its processes keep their CPUs"
    rig.cpusets.exit(pid)
    rig.restart()  # the start-up reconciliation removes it once empty
    assert not rig.cpusets.exists(a)
