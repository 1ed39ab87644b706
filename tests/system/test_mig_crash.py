"""A MIG holder across SIGKILLs at the crash points of prepare, update and cleanup (simulated DGX A100).

After each kill the sidecar is restarted and Recover called, as the agent does; then the records
and the kernel must agree (the consistency health check compares the parent nodes granted, and
Describe the full rule sets, caps nodes included), and the only 1g.10gb device must be either
held by the crashed container or free, never lost.

Every point runs on cgroup v2; on v1 only the points where the kernel holds, at the kill, a state
the two layouts keep differently (``LAYOUT_POINTS``), as in test_shares_crash (its docstring): what
the layouts do differently is the cgroup backend (isolator/cgroups/v1.py, v2.py), and the kernel
can hold four states at a kill here, each with a point on both layouts: no cgroup and a record
(``prepare.recorded``), a cgroup without rules (``prepare.cgroup``), the holder's rules with its
parent's node and caps nodes in force (``prepare.applied``), and rules rewritten on a live cgroup
without the unit while the record still holds it (``update.revoked``). The others leave one of
those states and add only what reads no layout: ``state.commit`` dies inside the record's SQLite
transaction, before any cgroup; ``cleanup.cgroup`` after the cgroup is gone, the record kept (the
backend sees what it sees at ``prepare.recorded``); ``update.recorded`` after recording the
release, ``update.grown`` after recording the grow back, before granting it: the kernel as at
``update.revoked`` both times.
"""

from __future__ import annotations

import pytest
from invariants import killed_and_recovered

from isolator.rpc import isolator_pb2 as pb
from isolator.testing.mesos import Containerizer, GrpcIsolator, container_id

pytestmark = [pytest.mark.root, pytest.mark.crash_matrix]
POINTS = ["prepare.recorded", "prepare.cgroup", "prepare.applied", "cleanup.cgroup", "state.commit"]
# Issue 41: an update of its units, a release to 0 then (were it still running) a grow back to one.
UPDATE_POINTS = ["update.revoked", "update.recorded", "update.grown"]
# The points that leave a kernel state the layouts keep differently (the docstring): run on v1 too.
LAYOUT_POINTS = ["prepare.recorded", "prepare.cgroup", "prepare.applied", "update.revoked"]
CASES = [pytest.param(p, "v2", marks=pytest.mark.cgroup_v2, id=f"{p}-v2") for p in POINTS + UPDATE_POINTS] + [
    pytest.param(p, "v1", marks=pytest.mark.cgroup_v1, id=f"{p}-v1") for p in LAYOUT_POINTS
]


def release_then_grow(isolator: GrpcIsolator, crashy: dict) -> None:
    cpus = {"name": "cpus", "type": "SCALAR", "scalar": {"value": 1}, "role": "*"}
    isolator.update_resources(crashy, [cpus])
    isolator.update_resources(crashy, [cpus, {"name": "mig-1g.10gb", "type": "SCALAR", "scalar": {"value": 1}}])


def mig_config(containerizer: Containerizer) -> dict:
    config = containerizer.config(gpus=None, image=False)
    config["resources"].append({"name": "mig-1g.10gb", "type": "SCALAR", "scalar": {"value": 1}, "role": "*"})
    return config


@pytest.mark.parametrize(("point", "version"), CASES)
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
