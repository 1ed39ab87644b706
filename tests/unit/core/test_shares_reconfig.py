"""Reconfiguration of shared GPUs is never partial (issue 41 item 6, docs/sharing.md "Changing which
GPUs are shared"): a restart that would switch the mode of a GPU with sharers stops the start, and
no admin override resets a GPU's compute mode or clocks while it has sharers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from isolator.errors import FailedPrecondition
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.shares import parse_shared_gpus
from isolator.testing import Rig, fake_service

SHARED = parse_shared_gpus("4-7:4:mps")


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def shares(n: float) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpu_shares", n), Resource("cpus", 1.0)))


@pytest.fixture
def rig() -> Rig:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=SHARED)
    rig.restart()
    return rig


def test_a_restart_that_switches_the_mode_of_a_gpu_with_sharers_is_refused_naming_it(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))  # GPU 4, mps
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4-7:4:time-slice"))
    with pytest.raises(FailedPrecondition, match=r"container a holds 1 gpu_shares of GPU 4 in mps mode.*time-slice"):
        rig.restart()


def test_a_restart_that_switches_the_mode_of_free_gpus_only_is_taken(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))  # GPU 4
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps,5-7:4:time-slice"))
    rig.restart()
    rig.service.prepare(cid("b"), shares(1))
    rec = rig.store.get(cid("b"))
    assert rec is not None and rec.holding.share is not None and rec.holding.share.mode == "time-slice"


def test_the_handover_override_is_refused_on_a_gpu_with_sharers_and_changes_nothing(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))  # GPU 4: EXCLUSIVE_PROCESS for its MPS daemon
    assert rig.inventory.settings(4)[0] == 3
    with pytest.raises(FailedPrecondition, match=r"GPU 4 .*has sharers \(container a: 1 gpu_shares\)"):
        rig.service.undrain("4")
    assert rig.inventory.settings(4)[0] == 3, "its compute mode stays what its MPS daemon needs"


def test_the_handover_override_still_works_on_a_free_shared_gpu(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))
    rig.service.cleanup(cid("a"))
    done = rig.service.undrain("4")
    assert "was not draining" in done.detail


def _without_mps(spec: str) -> Rig:
    """A service as compose.py builds it when nothing was shared in mps mode at start: no MPS edge."""
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus(spec))
    rig.without_mps()
    return rig


def test_a_reload_to_mps_on_a_sidecar_without_nvidia_cuda_mps_control_is_refused_whole() -> None:
    from isolator.errors import ConfigError

    rig = _without_mps("4:4")
    booking = rig.service.core.booking
    before = (booking.shared, booking.share_specs)
    with pytest.raises(ConfigError, match=r"GPU 4 cannot be shared in mps mode: this sidecar has no"):
        rig.service.share_gpus(parse_shared_gpus("4:4:mps,5:2"))
    assert (booking.shared, booking.share_specs) == before, "GPU 5 not taken either: all or nothing"
    rig.service.share_gpus(parse_shared_gpus("4:2,5:2"))  # time-slice changes still pass
    assert sorted(booking.shared) == [4, 5]


def test_a_restart_that_recuts_a_gpu_with_sharers_is_refused_naming_it(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))  # GPU 4, a quarter
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4-7:2:mps"))
    with pytest.raises(FailedPrecondition, match=r"container a holds 1 gpu_shares of GPU 4 cut 4 ways.*2"):
        rig.restart()


def test_a_restart_that_recuts_free_shared_gpus_only_is_taken(rig: Rig) -> None:
    rig.service.prepare(cid("a"), shares(1))  # GPU 4
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps,5-7:2:mps"))
    rig.restart()
    assert rig.store.get(cid("a")) is not None


def test_the_handover_override_is_refused_on_a_mig_parent_with_held_units() -> None:
    rig = fake_service("dgx-a100")
    rig.service.prepare(cid("m"), ContainerConfig(resources=(Resource("mig-1g.5gb", 1.0), Resource("cpus", 1.0))))
    rec = rig.store.get(cid("m"))
    assert rec is not None
    ((_, parent),) = rec.holding.mig
    index = rig.service.core.gpus[parent].index
    with pytest.raises(FailedPrecondition, match=rf"GPU {index} .*MIG devices? held .*container m"):
        rig.service.undrain(str(index))
