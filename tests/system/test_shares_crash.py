"""A holder of gpu_shares across SIGKILLs at every crash point between booking its share and granting
it, and between revoking it and forgetting it, and in the agent's updates of it (a grow on its GPU, a
release to 0; simulated dgx-1, GPU 4 shared two ways).

After each kill the sidecar is restarted and Recover called, as the agent does; then the records
and the kernel must agree (the consistency health check counts the sharer's GPU as granted), and
the two shares of GPU 4 must be neither lost nor granted twice: once the crashed container is
cleaned up, exactly two one-share containers fit again and a third is refused.
"""

from __future__ import annotations

import pytest
from invariants import killed_and_recovered

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
    # Issue 41 item 5: killed while its GPU's MPS control daemon starts (the launch recorded, the
    # daemon not yet started / started, not yet recorded): after the restart the daemon is the one
    # recognised (stopped with its GPU's last sharer, or serving the next), never an orphan that
    # makes the next start fail "already running".
    "mps.launching",
    "mps.spawned",
]
# Issue 41: the agent's own updates of a sharer, one grow on its GPU then a release to 0.
UPDATE_POINTS = ["update.grown", "update.revoked", "update.recorded"]


def grow_then_release(isolator: GrpcIsolator, crashy: dict) -> None:
    cpus = {"name": "cpus", "type": "SCALAR", "scalar": {"value": 1}, "role": "*"}
    isolator.update_resources(crashy, [cpus, {"name": "gpu_shares", "type": "SCALAR", "scalar": {"value": 2}}])
    isolator.update_resources(crashy, [cpus])


def share_config(containerizer: Containerizer, n: int = 1) -> dict:
    config = containerizer.config(gpus=None, image=False)
    config["resources"].append({"name": "gpu_shares", "type": "SCALAR", "scalar": {"value": n}, "role": "*"})
    return config


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("point", POINTS + UPDATE_POINTS)
def test_a_sharer_survives_a_kill_at(point, version):
    update = grow_then_release if point in UPDATE_POINTS else None
    # The updates grow a pooled holder to 2 shares: time-sliced (under MPS every sharer holds one).
    shared = "4:2:time-slice" if update else "4:2:mps"
    with killed_and_recovered(
        "dgx-1", version, point, share_config, extra=("--shared-gpus", shared), update=update
    ) as after:
        isolator = after.isolator
        isolator.cleanup(container_id("crashy"))
        # Nothing leaked and nothing doubled: GPU 4's two shares, and no third.
        for name in ("one", "two"):
            isolator.prepare(container_id(name), share_config(after.containerizer))
        with pytest.raises(HookFailed) as err:
            isolator.prepare(container_id("three"), share_config(after.containerizer))
        assert err.value.code == "RESOURCE_EXHAUSTED", err.value
        for name in ("one", "two"):
            isolator.cleanup(container_id(name))
