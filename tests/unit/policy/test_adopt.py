"""Adoption of unrecorded cgroups at start-up (isolator/policy/adopt.py): pure, the kernel's rules
and the records in, a plan or a refusal out."""

from __future__ import annotations

import pytest

from isolator.errors import FailedPrecondition
from isolator.model import ContainerId
from isolator.policy.adopt import allows_everything, explicit_grants, plan
from isolator.policy.devices import KernelRules, parse_rules

KNOWN = (0, 1, 2, 3)


def cid(value: str) -> ContainerId:
    return ContainerId(value)


def kernel(*lines: str, present: bool = True) -> KernelRules:
    return KernelRules(parse_rules(lines), "src", present)


def test_explicit_grants_are_known_gpus_granted_by_name_read_and_write() -> None:
    k = kernel("c 195:0 rw", "c 195:1 r", "c 195:2 w", "c 195:3 rwm", "c 195:7 rw", "b 195:0 rw", "c 10:0 rw")
    assert explicit_grants(k, KNOWN) == {0, 3}
    assert explicit_grants(kernel("c 195:* rwm"), KNOWN) == set()
    assert explicit_grants(kernel("c 195:0 rw", present=False), KNOWN) == set()


def test_allows_everything_without_rules_of_ours_or_with_gpus_only_through_wildcards() -> None:
    assert allows_everything(kernel(present=False), KNOWN)
    assert allows_everything(kernel("a *:* rwm"), KNOWN)
    assert not allows_everything(kernel("a *:* rwm", "c 195:0 rw"), KNOWN)
    assert not allows_everything(kernel("c 1:3 rwm"), KNOWN)  # restricted: no GPU at all
    assert not allows_everything(kernel(), KNOWN)


def test_a_lost_record_is_rebuilt_and_a_gpu_recorded_for_another_is_taken_back() -> None:
    a, b, owner = cid("a"), cid("b"), cid("owner")
    steps = plan({a: kernel("c 195:0 rw", "c 195:1 rw"), b: kernel("c 195:2 rw")}, {1: owner, 2: owner}, KNOWN, False)
    assert [(s.container, s.granted, s.stolen, s.owners, s.keep, s.deny_all) for s in steps] == [
        (a, {0, 1}, {1}, (owner,), {0}, False),
        (b, {2}, {2}, (owner,), set(), False),
    ]


def test_owners_are_named_once_each_in_order() -> None:
    (step,) = plan(
        {cid("x"): kernel("c 195:0 rw", "c 195:1 rw", "c 195:2 rw")},
        {0: cid("z"), 1: cid("y"), 2: cid("z")},
        KNOWN,
        False,
    )
    assert step.owners == (cid("y"), cid("z"))


def test_deny_all_only_in_standalone_mode_for_a_cgroup_nothing_restricts_and_nothing_kept() -> None:
    open_, restricted, held = cid("open"), cid("restricted"), cid("held")
    views = {open_: kernel(present=False), restricted: kernel("c 1:3 rwm"), held: kernel("a *:* rwm", "c 195:0 rw")}
    standalone = {s.container: s.deny_all for s in plan(views, {}, KNOWN, True)}
    assert standalone == {open_: True, restricted: False, held: False}
    assert not any(s.deny_all for s in plan(views, {}, KNOWN, False))
    # A cgroup whose only GPU is taken back keeps nothing; if nothing restricts it, deny all.
    (taken,) = plan({open_: kernel("a *:* rwm")}, {}, KNOWN, True)
    assert taken.deny_all and not taken.keep


def test_two_unrecorded_cgroups_granting_one_gpu_stop_the_start_naming_them() -> None:
    views = {
        cid("a"): kernel("c 195:0 rw"),
        cid("b"): kernel("c 195:0 rw", "c 195:1 rw"),
        cid("c"): kernel("c 195:1 rw"),
    }
    with pytest.raises(FailedPrecondition) as stopped:
        plan(views, {}, KNOWN, True)
    assert stopped.value.message == (
        "cannot start: the kernel grants GPUs to several containers that have no record (GPU 0 by a, b; GPU 1 by"
        " b, c); the state cannot be rebuilt from the kernel. Stop all but one container holding each GPU (or"
        " remove their cgroups) and start again (docs/reliability.md, 'Lost state')"
    )
    # ...but not when a record holds the GPU: then it is taken back from both.
    steps = plan(views, {0: cid("r"), 1: cid("r")}, KNOWN, True)
    assert [s.keep for s in steps] == [set(), set(), set()]
