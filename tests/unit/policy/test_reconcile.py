"""Recovery reconciliation, one row per situation: records x kernel x what Mesos says."""

from __future__ import annotations

import logging

import pytest

from isolator.model import ContainerId
from isolator.policy.reconcile import Kind, reconcile

A = ContainerId.parse("a")
B = ContainerId.parse("b")
A_CHILD = ContainerId.parse("a", A)  # same value as A, nested: must not be confused with it


def g(*minors: int) -> frozenset[int]:
    return frozenset(minors)


# (name, records, kernel, running (None = standalone), orphans, expected [(kind, container, gpus)])
CASES = [
    ("agreement is kept", {A: g(0, 1)}, {A: g(0, 1)}, [A], [], [(Kind.KEEP, A, g(0, 1))]),
    (
        "a kernel grant beyond the record is revoked, the record kept",
        {A: g(0)},
        {A: g(0, 1)},
        [A],
        [],
        [(Kind.REVOKE, A, g(1)), (Kind.KEEP, A, g(0))],
    ),
    (
        "a recorded GPU missing in the kernel is granted again",
        {A: g(0, 1)},
        {A: g(0)},
        [A],
        [],
        [(Kind.REAPPLY, A, g(1))],
    ),
    (
        "a container Mesos runs without a cgroup keeps its GPUs reserved",
        {A: g(2)},
        {},
        [A],
        [],
        [(Kind.KEEP, A, g(2))],
    ),
    (
        "an orphan keeps its GPUs until cleanup",
        {A: g(3)},
        {A: g(3)},
        [],
        [A],
        [(Kind.MARK_ORPHAN, A, g(3))],
    ),
    (
        "an orphan loses kernel grants that are not recorded",
        {A: g(3)},
        {A: g(3, 4)},
        [],
        [A],
        [(Kind.REVOKE, A, g(4)), (Kind.MARK_ORPHAN, A, g(3))],
    ),
    (
        "an orphan we never recorded is marked with no GPUs and its grants revoked",
        {},
        {A: g(5)},
        [],
        [A],
        [(Kind.REVOKE, A, g(5)), (Kind.MARK_ORPHAN, A, g())],
    ),
    (
        "a record Mesos does not know is released after its grants are revoked",
        {A: g(0, 1)},
        {A: g(0, 1)},
        [],
        [],
        [(Kind.REVOKE, A, g(0, 1)), (Kind.RELEASE, A, g(0, 1))],
    ),
    (
        "a record Mesos does not know, without a cgroup, is released; a running one without a record needs nothing",
        {A: g(6)},
        {},
        [B],
        [],
        [(Kind.RELEASE, A, g(6))],
    ),
    (
        "a running container without a record needs nothing but the revocation of its grants",
        {},
        {B: g(7)},
        [B],
        [],
        [(Kind.REVOKE, B, g(7))],
    ),
    (
        "a GPU the kernel grants to a second container is revoked from the one without the record",
        {A: g(0)},
        {A: g(0), B: g(0)},
        [A, B],
        [],
        [(Kind.REVOKE, B, g(0)), (Kind.KEEP, A, g(0))],
    ),
    (
        "a stray cgroup nobody knows loses its grants",
        {},
        {B: g(1)},
        [],
        [],
        [(Kind.REVOKE, B, g(1))],
    ),
    (
        "standalone mode trusts the records and revokes the rest",
        {A: g(0)},
        {A: g(0), B: g(1)},
        None,
        [],
        [(Kind.REVOKE, B, g(1)), (Kind.KEEP, A, g(0))],
    ),
    (
        "a nested container with its parent's value is a different container",
        {A: g(0)},
        {A: g(0), A_CHILD: g(1)},
        [A, A_CHILD],
        [],
        [(Kind.REVOKE, A_CHILD, g(1)), (Kind.KEEP, A, g(0))],
    ),
    (
        "a container listed as both running and orphan is treated as an orphan",
        {A: g(0)},
        {A: g(0)},
        [A],
        [A],
        [(Kind.MARK_ORPHAN, A, g(0))],
    ),
    ("nothing anywhere is nothing to do", {}, {}, [], [], []),
]


@pytest.mark.parametrize(
    ("records", "kernel", "running", "orphans", "expected"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_reconcile(records, kernel, running, orphans, expected):
    actions = reconcile(records, kernel, running, orphans)
    assert [(a.kind, a.container_id, a.gpus) for a in actions] == expected


def test_nothing_unrecorded_is_ever_granted():
    actions = reconcile({A: g(0)}, {A: g()}, [A, B], [])
    granted = {(a.container_id, m) for a in actions if a.kind is Kind.REAPPLY for m in a.gpus}
    assert granted == {(A, 0)}


def test_a_disagreement_is_logged_with_both_sides(caplog):
    with caplog.at_level(logging.WARNING, logger="isolator.policy.reconcile"):
        actions = reconcile({A: g(0)}, {A: g(0, 1)}, [A], [])
    assert "state records {0}, kernel grants {0, 1}, mesos says running" in actions[0].reason
    assert any("revoke-kernel-entries for container a, GPUs {1}" in r.getMessage() for r in caplog.records)
