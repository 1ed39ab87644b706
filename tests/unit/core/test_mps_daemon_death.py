"""An MPS control daemon found dead (issue 41): its server died with it and every client it had fails
each later CUDA call (CUDA_ERROR_MPS_RPC_FAILURE, measured on driver 580, docs/gpu-host-results.md,
"second run"). The sidecar starts it again, with its limits, and ends the sharers that were admitted
under the dead one, as a FAULT ends them; the sharer whose Prepare restarted it, and sharers placed
after, are not ended. Over the fake service and FakeMps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.shares import parse_shared_gpus
from isolator.testing import Rig, fake_service


@pytest.fixture
def rig() -> Rig:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps,5:2:mps"))
    rig.restart()
    return rig


def unit(size: int) -> ContainerConfig:
    return ContainerConfig(resources=(Resource(f"gpu-share-{size}", 1.0), Resource("cpus", 1.0)))


def uuid_of(rig: Rig, index: int) -> str:
    return next(g.uuid for g in rig.inventory.topology().gpus if g.index == index)


def test_a_daemon_found_dead_by_the_supervise_pass_ends_that_gpus_sharers_only(rig: Rig) -> None:
    svc = rig.service
    a, c, b = ContainerId("a"), ContainerId("c"), ContainerId("b")
    svc.prepare(a, unit(4))  # GPU 4
    svc.prepare(c, unit(4))  # GPU 4
    svc.prepare(b, unit(2))  # GPU 5
    rig.mps.kill(uuid_of(rig, 4))
    svc.supervise_mps()
    assert rig.mps.alive(uuid_of(rig, 4)), "started again"
    for name in (a, c):
        limitation = svc.watch(name)
        assert limitation is not None, name
        assert "MPS control daemon" in limitation.message and "GPU 4" in limitation.message
        assert "found dead" in limitation.message, limitation.message
        assert limitation.mig == (("gpu_shares", 1),) and limitation.gpus == 0
    assert svc.watch(b) is None, "the other GPU's sharer keeps its daemon"
    later = ContainerId("d")
    svc.prepare(later, unit(4))
    assert svc.watch(later) is None, "a sharer placed under the new daemon is not ended"
    svc.cleanup(a)
    assert svc.watch(c) is not None, "ended until its own Cleanup"


def test_a_prepare_that_finds_the_daemon_dead_ends_the_older_sharers_not_itself(rig: Rig) -> None:
    svc = rig.service
    a, d = ContainerId("a"), ContainerId("d")
    svc.prepare(a, unit(4))
    rig.mps.kill(uuid_of(rig, 4))
    svc.prepare(d, unit(4))  # its ensure finds the daemon gone and starts it again
    assert rig.mps.alive(uuid_of(rig, 4))
    assert svc.watch(d) is None, "the sharer whose Prepare started the daemon connects to the new one"
    limitation = svc.watch(a)
    assert limitation is not None and "found dead" in limitation.message


def test_a_first_sharer_ends_nobody(rig: Rig) -> None:
    svc = rig.service
    a = ContainerId("a")
    svc.prepare(a, unit(4))
    svc.supervise_mps()
    assert svc.watch(a) is None
