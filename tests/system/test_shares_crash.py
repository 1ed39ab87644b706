"""A holder of gpu_shares across SIGKILLs at every crash point between booking its share and granting
it, and between revoking it and forgetting it (simulated dgx-1, GPU 4 shared two ways).

After each kill the sidecar is restarted and Recover called, as the agent does; then the records
and the kernel must agree (the consistency health check counts the sharer's GPU as granted), and
the two shares of GPU 4 must be neither lost nor granted twice: once the crashed container is
cleaned up, exactly two one-share containers fit again and a third is refused.
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
POINTS = [
    "prepare.recorded",
    "prepare.cgroup",
    "prepare.applied",
    "cleanup.cgroup",
    "cleanup.record",
    "handover.pending",
    "state.commit",
]


def share_config(containerizer: Containerizer, n: int = 1) -> dict:
    config = containerizer.config(gpus=None, image=False)
    config["resources"].append({"name": "gpu_shares", "type": "SCALAR", "scalar": {"value": n}, "role": "*"})
    return config


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("point", POINTS)
def test_a_sharer_survives_a_kill_at(point, version):
    extra = ("--shared-gpus", "4:2:mps")
    with quick_sidecar("dgx-1", version, extra=extra, env={ENV: f"{point}:1"}) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        crashy = container_id("crashy")
        try:
            isolator.prepare(crashy, share_config(containerizer))
            isolator.cleanup(crashy)
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
            listed = [c.id for c in admin.ListContainers(pb.ListContainersRequest(), timeout=10).containers]
            if "crashy" in listed:
                described = admin.DescribeContainer(
                    pb.DescribeContainerRequest(container_id=pb.ContainerID(value="crashy")), timeout=10
                )
                assert described.rules_agree, described
            isolator.cleanup(crashy)
            # Nothing leaked and nothing doubled: GPU 4's two shares, and no third.
            for name in ("one", "two"):
                isolator.prepare(container_id(name), share_config(containerizer))
            with pytest.raises(HookFailed) as err:
                isolator.prepare(container_id("three"), share_config(containerizer))
            assert err.value.code == "RESOURCE_EXHAUSTED", err.value
            for name in ("one", "two"):
                isolator.cleanup(container_id(name))
        finally:
            channel.close()
            isolator.close()
