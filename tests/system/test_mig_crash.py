"""A MIG holder across SIGKILLs at the crash points of prepare, update and cleanup (simulated DGX A100).

After each kill the sidecar is restarted and Recover called, as the agent does; then the records
and the kernel must agree (the consistency health check compares the parent nodes granted, and
Describe the full rule sets, caps nodes included), and the only 1g.10gb device must be either
held by the crashed container or free, never lost.
"""

from __future__ import annotations

import pytest
from invariants import killed_and_recovered

from isolator.rpc import isolator_pb2 as pb
from isolator.testing.mesos import Containerizer, GrpcIsolator, container_id

pytestmark = [pytest.mark.root]
VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]
POINTS = ["prepare.recorded", "prepare.cgroup", "prepare.applied", "cleanup.cgroup", "state.commit"]
# Issue 41: an update of its units, a release to 0 then (were it still running) a grow back to one.
UPDATE_POINTS = ["update.revoked", "update.recorded", "update.grown"]


def release_then_grow(isolator: GrpcIsolator, crashy: dict) -> None:
    cpus = {"name": "cpus", "type": "SCALAR", "scalar": {"value": 1}, "role": "*"}
    isolator.update_resources(crashy, [cpus])
    isolator.update_resources(crashy, [cpus, {"name": "mig-1g.10gb", "type": "SCALAR", "scalar": {"value": 1}}])


def mig_config(containerizer: Containerizer) -> dict:
    config = containerizer.config(gpus=None, image=False)
    config["resources"].append({"name": "mig-1g.10gb", "type": "SCALAR", "scalar": {"value": 1}, "role": "*"})
    return config


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("point", POINTS + UPDATE_POINTS)
def test_mig_holder_survives_a_kill_at(point, version):
    update = release_then_grow if point in UPDATE_POINTS else None
    with killed_and_recovered("dgx-a100", version, point, mig_config, update=update) as after:
        holders = [m.holder for g in after.admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus for m in g.mig_devices]
        assert set(h for h in holders if h) <= {"crashy"}
        recorded = 0
        if "crashy" in after.listed:
            described = after.admin.DescribeContainer(
                pb.DescribeContainerRequest(container_id=pb.ContainerID(value="crashy")), timeout=10
            )
            recorded = len(described.container.mig_uuids)
            # Only a kill after an update recorded the release leaves it listed with no unit.
            assert recorded == (0 if point == "update.recorded" else 1), described
        assert holders.count("crashy") == recorded, "the books hold exactly what the record holds"
        after.isolator.cleanup(container_id("crashy"))
        # Nothing leaked: the only 1g.10gb goes to the next container.
        again = container_id("after")
        after.isolator.prepare(again, mig_config(after.containerizer))
        after.isolator.cleanup(again)
