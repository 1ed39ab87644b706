"""The kernel grant (isolator/core/grant.py) of nested containers with cgroups of their own (mesos mode,
share_cgroups=false), in-process over the shipped fakes.
"""

from __future__ import annotations

import pytest
from hook_helpers import cid, gpus, granted, held

from isolator.errors import CgroupError
from isolator.model import Resource
from isolator.testing import fake_service


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_nested_cgroup_follows_its_top_level_containers_grants(version: str) -> None:
    rig = fake_service("dgx-1", mode="mesos", version=version)
    a, child = cid("a"), cid("a.task")
    rig.cgroups.mesos_creates(a)
    rig.service.prepare(a, gpus(1))
    rig.cgroups.mesos_creates(child)  # the agent makes <a>/mesos/task for the nested container
    core = rig.service.core
    assert core.grants.nested_cgroups(a) == [child]
    assert core.grants.governing(child) == child and core.grants.governing(cid("a.shared")) == a
    rig.service.update(a, [Resource("gpus", 2.0)])
    assert granted(rig, child) == held(rig, a) and len(held(rig, a)) == 2
    rig.service.update(a, [Resource("gpus", 0.0)])
    assert granted(rig, child) == [] == held(rig, a)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_apply_nested_gives_a_nested_cgroup_exactly_the_rules_asked(version: str) -> None:
    rig = fake_service("dgx-1", mode="mesos", version=version)
    a, child = cid("a"), cid("a.task")
    rig.cgroups.mesos_creates(a)
    rig.cgroups.mesos_creates(child)
    core = rig.service.core
    with core.locks.hold(child):
        if version == "v1":  # the kernel refuses a grant below beyond what the parent allows (EPERM)
            with pytest.raises(CgroupError):
                core.grants.apply_nested(child, core.grants.rules(frozenset({3})))
            rig.cgroups.apply(a, core.grants.rules(frozenset({3})))  # once the parent allows it, it passes
        core.grants.apply_nested(child, core.grants.rules(frozenset({3})))
    assert granted(rig, child) == [3]
