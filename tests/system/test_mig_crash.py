"""A MIG holder across SIGKILLs at the crash points of prepare and cleanup (simulated DGX A100).

After each kill the sidecar is restarted and Recover called, as the agent does; then the records
and the kernel must agree (the consistency health check compares the parent nodes granted, and
Describe the full rule sets, caps nodes included), and the only 1g.10gb device must be either
held by the crashed container or free, never lost.
"""

from __future__ import annotations

import grpc
import pytest
from invariants import quick_sidecar

from isolator.daemon.crashpoints import ENV
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id

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
    with quick_sidecar("dgx-a100", version, env={ENV: f"{point}:1"}) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        cid = container_id("crashy")
        try:
            isolator.prepare(cid, mig_config(containerizer))
            isolator.cleanup(cid)
        except HookFailed:
            pass
        assert sidecar.died(timeout=10) is not None, f"the daemon did not die at {point}"
        sidecar.env = {}
        sidecar.start()
        isolator.__init__(sidecar.socket)
        isolator.recover([], [])
        channel = grpc.insecure_channel(sidecar.address)
        admin = pb_grpc.AdminStub(channel)
        try:
            health = {c.name: (c.ok, c.detail) for c in admin.Health(pb.HealthRequest(), timeout=10).checks}
            assert health["consistency"][0], health["consistency"][1]
            holders = [m.holder for g in admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus for m in g.mig_devices]
            listed = [c.id for c in admin.ListContainers(pb.ListContainersRequest(), timeout=10).containers]
            assert set(h for h in holders if h) <= {"crashy"} and holders.count("crashy") == listed.count("crashy")
            if "crashy" in listed:
                described = admin.DescribeContainer(
                    pb.DescribeContainerRequest(container_id=pb.ContainerID(value="crashy")), timeout=10
                )
                assert described.rules_agree, described
                assert len(described.container.mig_uuids) == 1
            isolator.cleanup(cid)
            # Nothing leaked: the only 1g.10gb goes to the next container.
            again = container_id("after")
            isolator.prepare(again, mig_config(containerizer))
            isolator.cleanup(again)
        finally:
            channel.close()
            isolator.close()
