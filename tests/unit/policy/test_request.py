"""A container's request read once from its resources, and the rules on its kinds
(isolator/policy/request.py): one kind at Prepare, kinds never mixed at Update."""

from __future__ import annotations

import pytest

from isolator.errors import FailedPrecondition, InvalidArgument, InvalidGpuCount
from isolator.model import ContainerId, Holding, Resource, Share, ShareMode
from isolator.policy import request as requests
from isolator.policy.request import Request

A = ContainerId("a")


def test_read_counts_each_kind() -> None:
    got = requests.read([Resource("gpus", 2.0), Resource("mig-1g.5gb", 1.0), Resource("cpus", 4.0)])
    assert got == Request(gpus=2, mig={"mig-1g.5gb": 1}) and not got.empty
    assert requests.read([Resource("cpus", 1.0)]).empty
    assert requests.read([Resource("gpu_shares", 1.0), Resource("gpu_shares", 2.0)]).shares == 3


def test_read_takes_one_unit_of_a_size_as_one_share_of_a_gpu_cut_that_many_ways() -> None:
    got = requests.read([Resource("gpu-share-4", 1.0), Resource("cpus", 1.0)])
    assert got == Request(shares=1, share_size=4) and not got.empty
    assert requests.read([Resource("gpu_shares", 2.0)]) == Request(shares=2, share_size=0)


def test_read_refuses_two_units_at_once_as_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="ask for gpu-share-2:1"):
        requests.read([Resource("gpu-share-4", 2.0)])


def test_prepare_refuses_a_unit_beside_whole_gpus() -> None:
    with pytest.raises(InvalidArgument, match="asks for gpu-share-4 together with whole GPUs or MIG"):
        requests.for_prepare(A, [Resource("gpu-share-4", 1.0), Resource("gpus", 1.0)])


def test_read_refuses_as_mesos_does() -> None:
    with pytest.raises(InvalidGpuCount):
        requests.read([Resource("gpus", 0.5)])


@pytest.mark.parametrize("other", [Resource("gpus", 1.0), Resource("mig-1g.5gb", 1.0)])
def test_prepare_refuses_shares_beside_another_kind(other: Resource) -> None:
    with pytest.raises(InvalidArgument, match="container a asks for gpu_shares together with whole GPUs or MIG"):
        requests.for_prepare(A, [Resource("gpu_shares", 1.0), other])


def test_prepare_takes_whole_gpus_with_mig_units() -> None:
    assert requests.for_prepare(A, [Resource("gpus", 1.0), Resource("mig-1g.5gb", 2.0)]) == Request(
        gpus=1, mig={"mig-1g.5gb": 2}
    )


def test_update_may_change_whole_gpus_and_mig_units() -> None:
    whole = Holding.whole({0})
    requests.check_update(A, whole, Request(gpus=3))
    requests.check_update(A, whole, Request(gpus=1, mig={"mig-1g.5gb": 1}))
    requests.check_update(A, Holding(mig=frozenset({("MIG-a", 1)})), Request())
    with pytest.raises(FailedPrecondition, match="container a holds no gpu_shares; shares are placed at launch"):
        requests.check_update(A, whole, Request(gpus=1, shares=1))


def test_update_may_change_a_sharers_shares_never_mix_them() -> None:
    sharer = Holding(share=Share(4, 2, ShareMode.MPS))
    for count in (0, 1, 2, 3):
        requests.check_update(A, sharer, Request(shares=count))
    for mixed in (Request(gpus=1, shares=2), Request(mig={"mig-1g.5gb": 1}), Request(gpus=1)):
        with pytest.raises(FailedPrecondition, match="container a holds 2 gpu_shares; shares are never mixed"):
            requests.check_update(A, sharer, mixed)


def _reads(name: str) -> bool:
    return any(name.startswith(r[:-1]) if r.endswith("*") else name == r for r in requests.UPDATE_READS)


@pytest.mark.parametrize(
    "other", ["cpus", "mem", "disk", "ports", "gpusx", "gpu", "gpu_shares_x", "mi-1g.5gb", "gpu-shar-4", "gpu_share_4"]
)
def test_update_reads_names_all_that_read_looks_at(other: str) -> None:
    # The module answers itself an Update that changes nothing UPDATE_READS names: a resource
    # outside it must never change what read() sees, and each one inside it must.
    base = [Resource("gpus", 2.0), Resource("mig-1g.5gb", 1.0)]
    assert not _reads(other)
    assert requests.read([*base, Resource(other, 3.0)]) == requests.read(base)
    for name, before, after in (("gpus", 2.0, 3.0), ("mig-1g.5gb", 1.0, 2.0), ("gpu_shares", 1.0, 2.0)):
        assert _reads(name)
        changed = [r for r in base if r.name != name] + [Resource(name, after)]
        kept = [r for r in base if r.name != name] + [Resource(name, before)]
        assert requests.read(changed) != requests.read(kept)
    # A share unit (gpu-share-<N>, one per request): its coming and going is an Update's business too
    # (the agent shrinks a sharer's executor when its task ends), so the module must forward it.
    for unit in ("gpu-share-2", "gpu-share-4", "gpu-share-48"):
        assert _reads(unit)
        assert requests.read([Resource(unit, 1.0)]) != requests.read([])
