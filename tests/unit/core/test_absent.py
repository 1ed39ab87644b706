"""The optional edges' null objects (isolator/core/absent.py) through the real core: no volume root,
no CPU view, no cpuset hierarchy. Each answers "nothing here" and refuses what needs the real edge."""

from __future__ import annotations

import pytest

from isolator.core.absent import NoCpus, NoCpusets, NoVolumes
from isolator.errors import CgroupError, FailedPrecondition
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.affinity import Machine
from isolator.testing import FakeCpusets, fake_service

A = ContainerId("a")


def test_the_null_objects_hold_nothing_and_refuse_to_make_anything() -> None:
    volumes, cpus, cpusets = NoVolumes(), NoCpus(), NoCpusets()
    assert (volumes.volume_root, volumes.volumes(), volumes.release("a"), volumes.reconcile(["a"])) == ("", [], (), ())
    with pytest.raises(FailedPrecondition, match="no volume root is configured"):
        volumes.acquire("a", "535.104.05")
    assert cpus.machine() == Machine(frozenset(), frozenset()) and cpus.allowed_of(1) is None
    assert (cpusets.containers(), cpusets.current(A), cpusets.exists(A), cpusets.pids(A)) == ((), None, False, ())
    assert (cpusets.path(A), cpusets.allowed(A), cpusets.version) == ("", frozenset(), "")
    with pytest.raises(CgroupError, match="no cpuset hierarchy is bound"):
        cpusets.apply(A, frozenset({0}), frozenset({0}))
    cpusets.join(A, 7)
    cpusets.remove(A)


def test_a_recorded_cpuset_is_left_alone_where_no_cpuset_hierarchy_is_bound() -> None:
    # Recorded under enforce, then restarted on a machine without a cpuset hierarchy (hint mode):
    # nothing to compare it with, nothing re-applied, nothing counted as a repair; the hooks go on.
    rig = fake_service("numa-2", cpu_affinity="enforce", cpusets=FakeCpusets())
    rig.service.prepare(A, ContainerConfig(resources=(Resource("gpus", 1),)))
    rec = rig.store.get(A)
    assert rec is not None and rec.cpus
    rig.cpusets = None  # type: ignore[assignment]
    rig.settings = type(rig.settings)(mode="standalone", cpu_affinity="hint")
    service = rig.restart()
    assert not service.core.cpuset.enforcing and service.core.cpuset.recorded_affinity(rec) is None
    report = service.audit()
    assert (report.checked, report.repaired) == (1, ())
    pid = rig.processes.spawn()
    service.isolate(A, pid)
    description = service.describe_container(A)
    assert (description.cpuset_recorded_cpus, description.cpuset_cpus, description.cpuset_cgroup) == (rec.cpus, "", "")
    assert description.local_cpus == ""  # no CPU view: no locality to show
    rig.cgroups.kill(pid)
    service.cleanup(A)
    assert rig.store.get(A) is None
