"""The pure start-up policies over shared GPUs (docs/sharing.md): adoption revokes a shared GPU from an
unrecorded cgroup instead of rebuilding it (how many shares it had is unknown), and the record-against-
kernel comparison expects a sharer's GPU. In make mutation for policy/adopt.py and policy/drift.py."""

from __future__ import annotations

from isolator.model import ContainerId, Holding, Share, ShareMode
from isolator.policy import adopt, drift
from isolator.policy.devices import NVIDIA_MAJOR, DeviceRule, KernelRules


def _rw(minor: int) -> DeviceRule:
    return DeviceRule.char(NVIDIA_MAJOR, minor, "rw")


def test_adoption_revokes_a_shared_gpu_from_an_unrecorded_cgroup_and_rebuilds_only_whole_ones():
    lost = ContainerId("lost")
    kernel = {lost: KernelRules((_rw(2), _rw(5)), "v1")}
    (step,) = adopt.plan(kernel, {}, range(8), standalone=True, shared={5})
    assert (step.keep, step.lost_shares, step.stolen, step.deny_all) == ({2}, {5}, frozenset(), False)
    (only,) = adopt.plan({lost: KernelRules((_rw(5),), "v1")}, {}, range(8), standalone=False, shared={5})
    assert (only.keep, only.lost_shares) == (frozenset(), {5})


def test_two_unrecorded_cgroups_on_one_shared_gpu_do_not_stop_the_start():
    kernel = {ContainerId(n): KernelRules((_rw(5),), "v1") for n in "xy"}
    steps = adopt.plan(kernel, {}, range(8), standalone=False, shared={5})
    assert [s.lost_shares for s in steps] == [{5}, {5}], "both revoked; neither is a lost whole holder"


def test_the_drift_comparison_expects_a_sharers_gpu():
    kernel = KernelRules((_rw(5),), "v1")
    found = drift.compare((_rw(5),), Holding(share=Share(5, 1, ShareMode.TIME_SLICE)), kernel, range(8))
    assert found.gpu_finding() is None and found.expected == (5,)
    assert drift.compare((_rw(5),), Holding(), kernel, range(8)).gpu_finding() is not None
