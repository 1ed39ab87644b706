"""Task groups under a real agent: the default executor and its nested containers."""

from __future__ import annotations

import os

import pytest
from conftest import assert_sees_exactly, container_cgroup, granted, granted_at, probe_command

from isolator.model import CgroupVersion
from isolator.testing.cluster import Cluster


@pytest.mark.parametrize("share_cgroups", [True, False], ids=["shared-cgroups", "own-cgroups"])
def test_a_task_group_gets_its_gpus_in_every_nested_container(cluster: Cluster, share_cgroups: bool) -> None:
    """The group's GPUs (one per task here) are folded into the executor's container at prepare
    (Mesos 1.9+); every task sees all of them. With ``share_cgroups: false`` (Mesos 1.10+, the
    same for every task of a group) each task has its own cgroup below the executor's, which the
    agent fills with its default whitelist and the sidecar with the group's GPUs. On cgroup v2 every
    nested task has its own ``<executor>/mesos/<task>/leaf`` either way, and the sidecar's program
    there holds the group's GPUs."""
    agent = cluster.agents[0]
    command = probe_command(cluster, seconds=60)
    extra = {} if share_cgroups else {"container": {"type": "MESOS", "linux_info": {"share_cgroups": False}}}
    names = ("first", "second")
    group = cluster.submit_group(
        [
            {"name": f"{n}-{share_cgroups}", "command": command, "resources": "cpus:0.1;mem:32;gpus:1", **extra}
            for n in names
        ]
    )
    group.wait("TASK_RUNNING")
    outs = {n: group.wait_stdout("probed", task=f"{n}-{share_cgroups}") for n in names}
    cid = group.container_id()
    held = {i for i, h in agent.holders().items() if h == cid}
    assert len(held) == 2, agent.holders()
    for out in outs.values():
        assert_sees_exactly(out, held)
    layout = agent.cgroups
    top = group.cgroup()
    assert granted(group) == held
    for out in outs.values():
        cgroup = container_cgroup(out, layout)
        if share_cgroups and layout == CgroupVersion.V1:
            assert cgroup == top
        else:
            assert cgroup.startswith(top + "/mesos/"), cgroup
            assert os.path.basename(cgroup) == ("leaf" if layout == CgroupVersion.V2 else os.path.basename(cgroup))
            assert granted_at(cgroup, layout) == held
    group.teardown()
    group.wait_gone()
    assert cid not in agent.holders().values()
