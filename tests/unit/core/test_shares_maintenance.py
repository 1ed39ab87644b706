"""gpu_shares beside the rest of the redesigned core (the merge of issue 32 into integ): a maintenance
drain of a shared GPU keeps its sharers and grants it to no one new; no nvidia-cuda-mps-control
refuses an mps sharer and touches nothing (the pure policies' part: tests/unit/policy/test_shared_gpus.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from isolator.core.absent import NoMpsDaemons
from isolator.errors import FailedPrecondition
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.shares import SharesExhausted, parse_shared_gpus
from isolator.testing import Rig, fake_service

OPERATOR = "uid 0, pid 4242"


def shares(n: int) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpu_shares", n),))


def _rig(spec: str) -> Rig:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus(spec))
    rig.restart()
    return rig


def test_a_drained_shared_gpu_keeps_its_sharers_and_takes_no_new_one_until_undrained():
    rig = _rig("6:2:time-slice")
    svc = rig.service
    svc.prepare(ContainerId("a"), shares(1))
    done = svc.maintenance_drain("6", "fan swap", OPERATOR)
    assert done.holders == ("container a",), "the sharer keeps its GPU and is named"
    with pytest.raises(SharesExhausted, match=r"drained for maintenance: GPU 6 .*gpu-isolator undrain"):
        svc.prepare(ContainerId("b"), shares(1))
    assert rig.store.get(ContainerId("b")) is None, "a refusal leaves nothing recorded"
    assert rig.store.get(ContainerId("a")).holding.shares == 1
    svc.maintenance_undrain("6", OPERATOR)
    svc.prepare(ContainerId("b"), shares(1))
    assert rig.store.get(ContainerId("b")).holding.share.gpu == rig.store.get(ContainerId("a")).holding.share.gpu


def test_a_refusal_with_no_drained_shared_gpu_says_nothing_of_maintenance():
    rig = _rig("6:2:time-slice")
    rig.service.maintenance_drain("2", "board swap", OPERATOR)  # a whole GPU: not the sharers' business
    rig.service.prepare(ContainerId("a"), shares(2))
    with pytest.raises(SharesExhausted) as err:
        rig.service.prepare(ContainerId("b"), shares(1))
    assert "maintenance" not in err.value.message


def test_without_mps_control_an_mps_sharer_is_refused_before_the_compute_mode_is_touched():
    daemons = NoMpsDaemons()
    assert not daemons.alive("GPU-1") and daemons.stop("GPU-1") is None
    for call in (lambda: daemons.pipe_dir("GPU-1"), lambda: daemons.start("GPU-1")):
        with pytest.raises(FailedPrecondition, match="no nvidia-cuda-mps-control"):
            call()
    rig = fake_service("dgx-1")
    rig.mps = None  # type: ignore[assignment]
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("6:2:mps"))
    svc = rig.restart()
    with pytest.raises(FailedPrecondition, match="shared in mps mode but this sidecar has no nvidia-cuda-mps-control"):
        svc.prepare(ContainerId("a"), shares(1))
    assert rig.store.get(ContainerId("a")) is None
    assert rig.inventory.settings(6)[0] == 0, "the compute mode stays DEFAULT: no MPS, no EXCLUSIVE_PROCESS"
