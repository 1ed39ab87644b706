"""The pure half of the v1 whitelist (isolator/cgroups/v1.py): the diff that turns one list into
another, and the read-back check that judges what the kernel holds. No cgroup needed.

The kernel keeps one entry per (type, major, minor) and adds or strips access bits on it
(security/device_cgroup.c ``dev_exception_add``/``dev_exception_rm``); ``apply`` below plays that
on a list, so the diff is judged by what the kernel would end up holding.

The lists come from a seeded stream (``examples``), not from hypothesis: over this small domain
(2 types x 6 majors x 6 minors x 7 access sets, lists of up to 8) hypothesis spent ~7 ms drawing each
example and the checks under test microseconds, so the same number of cases cost 12 s of CPU.
Each failure names its example's seed and its lists.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from isolator.cgroups.v1 import Write, _selector_order, _uncovered, whitelist_diff
from isolator.policy.devices import DeviceRule, permits

ACCESS = ("r", "w", "m", "rw", "rm", "wm", "rwm")
NUMBERS = (None, 0, 1, 2, 3, 4)


def rule_list(rng: random.Random, min_size: int = 0, max_size: int = 8) -> list[DeviceRule]:
    """A list of rules over the small domain, repeats of a selector (with other bits) included."""
    return [
        DeviceRule(rng.choice("bc"), rng.choice(NUMBERS), rng.choice(NUMBERS), rng.choice(ACCESS))
        for _ in range(rng.randint(min_size, max_size))
    ]


def examples(count: int, *sizes: tuple[int, int]) -> Iterator[tuple[int, list[list[DeviceRule]]]]:
    """``count`` seeded examples, each one list of rules per (min, max) size, the seed first."""
    for seed in range(count):
        rng = random.Random(seed)
        yield seed, [rule_list(rng, lo, hi) for lo, hi in sizes]


def kernel_form(rs: list[DeviceRule]) -> tuple[DeviceRule, ...]:
    """One entry per selector, access bits merged, as devices.list prints it."""
    merged: dict[tuple[str, int | None, int | None], set[str]] = {}
    for r in rs:
        merged.setdefault(r.selector, set()).update(r.access)
    return tuple(DeviceRule(t, ma, mi, "".join(a)) for (t, ma, mi), a in merged.items())


def apply(current: tuple[DeviceRule, ...], writes: tuple[Write, ...]) -> tuple[DeviceRule, ...]:
    held = {r.selector: set(r.access) for r in current}
    for w in writes:
        bits = held.setdefault(w.rule.selector, set())
        if w.allow:
            bits.update(w.rule.access)
        else:
            bits.difference_update(w.rule.access)
    return tuple(DeviceRule(t, ma, mi, "".join(a)) for (t, ma, mi), a in held.items() if a)


def test_the_diff_turns_the_current_list_into_the_desired_one_and_allows_before_it_denies():
    for seed, (have, want) in examples(600, (0, 8), (0, 8)):
        case = f"seed {seed}: have {have}, want {want}"
        current, desired = kernel_form(have), kernel_form(want)
        writes = whitelist_diff(current, desired)
        assert sorted(apply(current, writes), key=DeviceRule.sort_key) == sorted(desired, key=DeviceRule.sort_key), case
        kinds = [w.allow for w in writes]
        assert kinds == sorted(kinds, reverse=True), case  # every allow before any deny: a grow never drops access
        for allow in (True, False):  # each kind in the kernel's listing order: the same lists, the same writes
            keys = [w.rule.sort_key() for w in writes if w.allow == allow]
            assert keys == sorted(keys), case


def test_selectors_untouchable_are_never_written():
    for seed, (have, want) in examples(600, (0, 8), (0, 8)):
        untouchable = have[:2]
        frozen = {r.selector for r in untouchable}
        writes = whitelist_diff(kernel_form(have), kernel_form(want), untouchable)
        assert not [w for w in writes if w.rule.selector in frozen], f"seed {seed}: have {have}, want {want}"


def test_the_read_back_check_agrees_with_the_kernels_rule_by_rule_judgement():
    for seed, (asked, held, skipped) in examples(1000, (0, 8), (0, 8), (0, 2)):
        grants = kernel_form(held)
        skip = {r.selector for r in skipped}
        expected = [str(r) for r in asked if r.selector not in skip and not permits(grants, r)]
        assert _uncovered(asked, grants, skip) == expected, f"seed {seed}: {asked}, {held}, {skipped}"


def test_the_read_back_check_sees_a_missing_bit_an_extra_entry_and_a_wildcard_that_covers():
    c = DeviceRule.char
    held = (c(195, 0, "rw"), DeviceRule("c", 1, None, "rwm"))
    assert _uncovered([c(195, 0, "rwm")], held, set()) == ["c 195:0 rwm"]  # m is not held
    assert _uncovered([c(195, 0, "r"), c(1, 3, "rw")], held, set()) == []  # 'c 1:* rwm' covers 1:3
    assert _uncovered([c(195, 1, "r")], held, set()) == ["c 195:1 r"]
    assert _uncovered([c(195, 1, "r")], held, {("c", 195, 1)}) == []


def test_selectors_sort_as_their_rules_do():
    for seed, (rs,) in examples(300, (1, 10)):
        assert sorted({r.selector for r in rs}, key=_selector_order) == sorted(
            {r.selector for r in rs}, key=lambda s: DeviceRule(s[0], s[1], s[2], "r").sort_key()
        ), f"seed {seed}: {rs}"


def test_the_read_back_check_never_accepts_a_bit_the_grants_do_not_hold():
    # apply_path also calls it with the *desired* rules as grants, which may repeat a selector
    # ('c 195:0 r' and 'c 195:0 w'): there it may accept what permits() alone rejects, but only
    # an entry whose every bit a rule of the very same selector grants (the diff wrote that union);
    # never a device or a bit no grant names.
    for seed, (asked, held, skipped) in examples(1000, (0, 8), (0, 8), (0, 2)):
        case = f"seed {seed}: {asked}, {held}, {skipped}"
        skip = {r.selector for r in skipped}
        got = set(_uncovered(asked, tuple(held), skip))
        strict = {str(r) for r in asked if r.selector not in skip and not permits(held, r)}
        assert got <= strict, case
        for r in asked:
            if str(r) in strict and str(r) not in got:
                same = set().union(*(set(g.access) for g in held if g.selector == r.selector))
                assert set(r.access) <= same, case
