"""The one record-vs-kernel comparison (isolator/policy/drift.py): pure, rules and GPUs in, a Drift out."""

from __future__ import annotations

from isolator.model import Holding
from isolator.policy.affinity import Affinity
from isolator.policy.devices import KernelRules, parse_rules
from isolator.policy.drift import compare, cpuset_drift, granted

KNOWN = (0, 1, 2, 3)


def rules(*lines: str):
    return parse_rules(lines)


def test_granted_counts_read_and_write_of_known_gpus_only_sorted() -> None:
    assert granted(rules("c 195:2 rw", "c 195:0 rwm", "c 195:1 r", "c 195:9 rw", "c 10:0 rw"), KNOWN) == (0, 2)
    assert granted(rules("c 195:* rw"), (3, 1)) == (1, 3)
    assert granted(rules("a *:* rwm"), KNOWN) == KNOWN
    assert granted((), KNOWN) == ()


def test_nothing_of_ours_in_force_is_drift_whatever_the_rules_and_says_why() -> None:
    found = compare(rules("c 195:0 rw"), Holding.whole({0}), KernelRules((), "none: no program", False), KNOWN)
    assert not found.present and not found.gpus_agree and not found.rules_agree
    assert found.finding(strict=False) == "no program" == found.gpu_finding()
    assert found.finding(strict=True) == "no program"


def test_a_kernel_that_grants_exactly_the_record_agrees_everywhere() -> None:
    record = rules("c 195:0 rw", "c 195:255 rw")
    found = compare(record, Holding.whole({0}), KernelRules(record, "devices.list"), KNOWN)
    assert found.gpus_agree and found.rules_agree
    assert found.finding(strict=True) is None and found.gpu_finding() is None
    assert (found.granted, found.recorded, found.expected) == ((0,), (0,), (0,))


def test_other_gpus_granted_is_drift_for_start_audit_health_and_describe() -> None:
    record = rules("c 195:0 rw")
    found = compare(record, Holding.whole({0}), KernelRules(rules("c 195:1 rw"), "v1"), KNOWN)
    assert not found.gpus_agree and not found.rules_agree
    assert found.missing == record and found.extra == rules("c 195:1 rw")
    assert found.finding(strict=False) == "kernel grants GPUs [1] (recorded [0]), missing ['c 195:0 rw']"
    assert found.finding(strict=True) == (
        "kernel grants GPUs [1] (recorded [0]), missing ['c 195:0 rw'], unrecorded ['c 195:1 rw']"
    )
    assert found.gpu_finding() == "recorded GPUs [0], kernel grants [1]"


def test_a_mig_holder_is_expected_to_be_granted_its_devices_parents() -> None:
    record = rules("c 195:2 rw")
    found = compare(record, Holding(mig=frozenset({("MIG-2", 2)})), KernelRules(record, "v2"), KNOWN)
    assert (found.recorded, found.expected, found.granted) == ((), (2,), (2,))
    assert found.gpus_agree and found.gpu_finding() is None
    bare = compare(record, Holding(mig=frozenset({("MIG-2", 2)})), KernelRules((), "v2"), KNOWN)
    assert bare.gpu_finding() == "recorded GPUs [], kernel grants []"
    assert bare.finding(strict=False) == "kernel grants GPUs [] (recorded [2]), missing ['c 195:2 rw']"


def test_rules_beyond_the_record_count_only_where_the_cgroup_is_all_ours() -> None:
    record = rules("c 195:0 rw")
    kernel = KernelRules(rules("c 195:0 rw", "c 1:3 rwm"), "v1")
    found = compare(record, Holding.whole({0}), kernel, KNOWN)
    assert found.gpus_agree and not found.rules_agree
    assert found.finding(strict=False) is None
    assert found.finding(strict=True) == "kernel grants GPUs [0] (recorded [0]), unrecorded ['c 1:3 rwm']"


def test_a_rule_encompassed_by_the_kernel_is_not_missing() -> None:
    found = compare(rules("c 195:0 r"), Holding(), KernelRules(rules("c 195:* rwm"), "v1"), KNOWN)
    assert found.missing == () and found.extra == rules("c 195:* rwm")
    assert found.granted == KNOWN


def test_cpuset_drift_names_a_gone_or_different_cpuset_and_is_silent_otherwise() -> None:
    aff = Affinity(frozenset({0, 1}), frozenset({0}))
    assert cpuset_drift(None, None, "/c") is None
    assert cpuset_drift(aff, aff, "/c") is None
    assert cpuset_drift(aff, None, "/c") == "its cpuset '/c' is gone (recorded CPUs 0-1, nodes 0)"
    assert cpuset_drift(aff, Affinity(frozenset({0, 1}), frozenset()), "/c") == (
        "its cpuset holds CPUs 0-1, memory nodes (none) (recorded CPUs 0-1, nodes 0)"
    )
    assert cpuset_drift(aff, Affinity(frozenset(), frozenset({0})), "/c") == (
        "its cpuset holds CPUs (none), memory nodes 0 (recorded CPUs 0-1, nodes 0)"
    )
