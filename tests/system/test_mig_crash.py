"""A MIG holder across SIGKILLs at the crash points of prepare and cleanup (simulated DGX A100).

After each kill the sidecar is restarted and Recover called, as the agent does; then the records
and the kernel must agree (the consistency health check compares the parent nodes granted, and
Describe the full rule sets, caps nodes included), and the only 1g.10gb device must be either
held by the crashed container or free, never lost.
"""

from __future__ import annotations

import pytest
from invariants import killed_and_recovered

from isolator.rpc import isolator_pb2 as pb
from isolator.testing.mesos import Containerizer, container_id

pytestmark = [pytest.mark.root]
VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]
POINTS = ["prepare.recorded", "prepare.cgroup", "prepare.applied", "cleanup.cgroup", "state.commit"]


def mig_config(containerizer: Containerizer) -> dict:
    config = containerizer.config(gpus=None, image=False)
    config["resources"].append({"name": "mig-1g.10gb", "type": "SCALAR", "scalar": {"value": 1}, "role": "*"})
    return config


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("point", POINTS)
def test_mig_holder_survives_a_kill_at(point, version):
    with killed_and_recovered("dgx-a100", version, point, mig_config) as after:
        holders = [m.holder for g in after.admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus for m in g.mig_devices]
        assert set(h for h in holders if h) <= {"crashy"} and holders.count("crashy") == after.listed.count("crashy")
        if "crashy" in after.listed:
            described = after.admin.DescribeContainer(
                pb.DescribeContainerRequest(container_id=pb.ContainerID(value="crashy")), timeout=10
            )
            assert len(described.container.mig_uuids) == 1
        after.isolator.cleanup(container_id("crashy"))
        # Nothing leaked: the only 1g.10gb goes to the next container.
        again = container_id("after")
        after.isolator.prepare(again, mig_config(after.containerizer))
        after.isolator.cleanup(again)
