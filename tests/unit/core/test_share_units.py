"""Shares offered as units named by their size (``gpu-share-<N>``, docs/sharing.md, issue 42 item 1),
in the core over the shipped fakes: a unit lands on a GPU cut that many ways and is granted exactly it;
more than one unit is refused before anything is booked; an update naming the unit held passes, one
naming none releases it, one naming another size is refused and changes nothing; a holder placed
through the pooled ``gpu_shares`` of earlier releases is updated through its unit's name."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hook_helpers import minor_of

from isolator.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.devices import NVIDIA_MAJOR, DeviceRule, permits
from isolator.policy.shares import parse_shared_gpus
from isolator.testing import Rig, fake_service

# dgx-1: GPUs 0-3 whole; GPU 4 cut four ways, GPUs 5-7 two ways (a mixed cut, as an operator sets it
# for a mix of quarter- and half-GPU tasks).
SHARED = parse_shared_gpus("4:4:mps,5-7:2:mps")


def cid(text: str) -> ContainerId:
    return ContainerId(text)


def unit(size: int, n: float = 1.0) -> list[Resource]:
    return [Resource(f"gpu-share-{size}", n), Resource("cpus", 1.0)]


def granted(rig: Rig, c: ContainerId) -> list[int] | None:
    rules = rig.cgroups.rules_of(c)
    if rules is None:
        return None
    return [m for m in range(16) if permits(rules, DeviceRule.char(NVIDIA_MAJOR, m, "rw"))]


def booked(rig: Rig) -> dict[int, int]:
    booking = rig.service.core.booking
    with booking.lock:
        return {m: n for m, n in booking.shares_held().items() if n}


@pytest.fixture(params=["v1", "v2"])
def rig(request) -> Rig:
    rig = fake_service("dgx-1", version=request.param)
    rig.settings = replace(rig.settings, shared_gpus=SHARED)
    rig.restart()
    return rig


def test_units_land_on_gpus_cut_that_many_ways_until_the_offer_is_spent(rig: Rig) -> None:
    quarter, halves = minor_of(rig, 4), {minor_of(rig, i) for i in (5, 6, 7)}
    for i in range(4):
        rig.service.prepare(cid(f"q{i}"), ContainerConfig(resources=tuple(unit(4))))
        assert granted(rig, cid(f"q{i}")) == [quarter]
    for i in range(6):
        rig.service.prepare(cid(f"h{i}"), ContainerConfig(resources=tuple(unit(2))))
        (got,) = granted(rig, cid(f"h{i}")) or [None]
        assert got in halves
    assert booked(rig) == {quarter: 4, **dict.fromkeys(halves, 2)}
    # The agent offered gpu-share-4:4 and gpu-share-2:6: all are granted, the master offers none more.
    with pytest.raises(ResourceExhausted, match="Requested 1 gpu-share-4 but no GPU cut 4 ways has one free"):
        rig.service.prepare(cid("q9"), ContainerConfig(resources=tuple(unit(4))))
    with pytest.raises(ResourceExhausted, match="no GPU here is cut 8 ways"):
        rig.service.prepare(cid("e9"), ContainerConfig(resources=tuple(unit(8))))
    assert rig.store.get(cid("q9")) is None and rig.store.get(cid("e9")) is None


def test_more_than_one_unit_is_refused_before_anything_is_booked(rig: Rig) -> None:
    with pytest.raises(InvalidArgument, match=r"asks for 2 gpu-share-4.*ask for gpu-share-2:1"):
        rig.service.prepare(cid("a"), ContainerConfig(resources=tuple(unit(4, 2.0))))
    assert booked(rig) == {} and rig.store.get(cid("a")) is None and granted(rig, cid("a")) is None


def test_an_update_keeps_releases_or_refuses_a_unit_and_never_moves_it(rig: Rig) -> None:
    a = cid("a")
    rig.service.prepare(a, ContainerConfig(resources=tuple(unit(2))))
    gpu = minor_of(rig, 5)
    rig.service.update(a, unit(2))  # the same unit: nothing changes
    assert booked(rig) == {gpu: 1} and granted(rig, a) == [gpu]
    with pytest.raises(FailedPrecondition, match="would move it to another GPU, and shares never move"):
        rig.service.update(a, unit(4))
    with pytest.raises(InvalidArgument, match="a request takes exactly 1 unit"):
        rig.service.update(a, unit(2, 2.0))
    assert booked(rig) == {gpu: 1} and granted(rig, a) == [gpu]
    rig.service.update(a, [Resource("cpus", 1.0)])  # the agent names no unit: released
    assert booked(rig) == {} and granted(rig, a) == []


def test_a_pooled_holder_of_one_share_is_kept_by_its_units_name_and_released_without_it(rig: Rig) -> None:
    a, b = cid("a"), cid("b")
    # GPUs 5-7 time-sliced: a pooled request of 2 never goes to an mps GPU (one share per MPS sharer).
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps,5-7:2"))
    rig.restart()
    rig.service.prepare(a, ContainerConfig(resources=(Resource("gpu_shares", 1.0),)))  # an older agent's task
    rig.service.prepare(b, ContainerConfig(resources=(Resource("gpu_shares", 2.0),)))
    gpu_a, gpu_b = minor_of(rig, 4), minor_of(rig, 5)  # the spread: the lowest minor, then the emptiest
    assert (granted(rig, a), granted(rig, b)) == ([gpu_a], [gpu_b])
    rig.service.update(a, unit(4))  # one share of the four-way GPU 4: its unit's name
    assert granted(rig, a) == [gpu_a]
    with pytest.raises(FailedPrecondition, match="holds 2 of the 2 shares of GPU 5"):
        rig.service.update(b, unit(2))  # two shares are not one unit
    rig.service.update(b, [Resource("gpu_shares", 2.0)])  # its own name still passes
    assert booked(rig) == {gpu_a: 1, gpu_b: 2}
    rig.restart()
    assert (granted(rig, a), granted(rig, b)) == ([gpu_a], [gpu_b]), "recovered from the records, whichever name"
    assert booked(rig) == {gpu_a: 1, gpu_b: 2}


def test_pack_placement_from_the_settings_fills_a_gpu_before_the_next() -> None:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4-7:4:mps"), share_placement="pack")
    rig.restart()
    for i in range(5):
        rig.service.prepare(cid(f"q{i}"), ContainerConfig(resources=tuple(unit(4))))
    assert booked(rig) == {minor_of(rig, 4): 4, minor_of(rig, 5): 1}
    assert [granted(rig, cid(f"q{i}")) for i in range(5)] == [[minor_of(rig, 4)]] * 4 + [[minor_of(rig, 5)]]
    rig.restart()  # recovered books keep the policy
    rig.service.prepare(cid("q5"), ContainerConfig(resources=tuple(unit(4))))
    assert booked(rig)[minor_of(rig, 5)] == 2
