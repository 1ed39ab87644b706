"""Shares of a GPU, the pure decisions (isolator/policy/shares.py): the operator's --shared-gpus, the
agent's resources, placement of N shares, the books, hostile counts and role changes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isolator.errors import ConfigError, FailedPrecondition, InvalidArgument, ResourceExhausted
from isolator.model import Resource, ShareMode
from isolator.policy import shares
from isolator.policy.shares import (
    MAX_REQUEST,
    MAX_SHARES,
    RESOURCE,
    InvalidShareCount,
    Placement,
    RoleChangeRefused,
    ShareBook,
    SharedGpu,
    ShareRequestTooLarge,
    SharesExhausted,
    SharesNotHeld,
    ShareSpec,
    agent_resources,
    check_roles,
    checked_share_count,
    format_shared_gpus,
    limits,
    parse_shared_gpus,
    place,
    resolve,
    role_problems,
    share_request,
)


def four(
    n: int = 4, mode: str = ShareMode.TIME_SLICE, first: int = 4, numa: tuple[int | None, ...] = ()
) -> dict[int, SharedGpu]:
    """GPUs ``first``.. ``first+3`` shared ``n`` ways (minor = index here)."""
    return {m: SharedGpu(m, m, n, mode, numa[m - first] if numa else None) for m in range(first, first + 4)}


# ---- --shared-gpus -------------------------------------------------------------------------------


def test_parse_reads_index_shares_and_mode_with_time_slice_the_default():
    assert parse_shared_gpus("4:4:mps, 5:2") == (ShareSpec(4, 4, ShareMode.MPS), ShareSpec(5, 2, ShareMode.TIME_SLICE))


def test_parse_expands_ranges_and_sorts_by_index():
    assert parse_shared_gpus("6-7:3:time-slice,2:2:mps") == (
        ShareSpec(2, 2, ShareMode.MPS),
        ShareSpec(6, 3, ShareMode.TIME_SLICE),
        ShareSpec(7, 3, ShareMode.TIME_SLICE),
    )


def test_parse_takes_a_toml_list_and_ignores_empty_items():
    assert parse_shared_gpus(["1:2", "", " 3:4:mps "]) == (ShareSpec(1, 2), ShareSpec(3, 4, ShareMode.MPS))
    assert parse_shared_gpus("") == ()
    assert parse_shared_gpus(",,") == ()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("4", "is not INDEX"),
        ("4:x", "is not INDEX"),
        ("-1:2", "is not INDEX"),
        ("4:2:mig", "mode 'mig' is not one of time-slice, mps"),
        ("4:1", "shared 2 to 64 ways in time-slice mode, not 1"),
        ("4:0:mps", "shared 2 to 48 ways in mps mode, not 0"),
        ("4:65", "not 65"),
        ("4:49:mps", "not 49"),
        ("5-4:2", "the range 5-4 is empty"),
        ("4:2,4:3", "names GPU 4 twice"),
        ("3-5:2,5:2", "names GPU 5 twice"),
        ("4:2.5", "is not INDEX"),
    ],
)
def test_parse_refuses_bad_items_naming_them(text, says):
    with pytest.raises(ConfigError) as err:
        parse_shared_gpus(text)
    assert says in str(err.value)


def test_parse_accepts_the_limits_of_each_mode():
    assert parse_shared_gpus("0:64,1:48:mps,2:2,3:2:mps") == (
        ShareSpec(0, 64),
        ShareSpec(1, 48, ShareMode.MPS),
        ShareSpec(2, 2),
        ShareSpec(3, 2, ShareMode.MPS),
    )
    assert MAX_SHARES == {ShareMode.TIME_SLICE: 64, ShareMode.MPS: 48}
    assert MAX_REQUEST == 64


def test_parse_refuses_what_is_not_text():
    with pytest.raises(ConfigError, match="a string or a list"):
        parse_shared_gpus(4)


@settings(deadline=None)  # timing is the benchmarks' business, not a test's (a loaded machine)
@given(
    st.dictionaries(
        st.integers(0, 63),
        st.tuples(st.sampled_from([ShareMode.TIME_SLICE, ShareMode.MPS]), st.integers(2, 48)),
        max_size=8,
    )
)
def test_format_reads_back(specs):
    items = tuple(ShareSpec(i, n, mode) for i, (mode, n) in sorted(specs.items()))
    text = format_shared_gpus(items)
    assert parse_shared_gpus(text) == items
    assert text == ",".join(f"{s.index}:{s.shares}:{s.mode}" for s in items)


# ---- resolve and the agent's resources -----------------------------------------------------------


def test_resolve_maps_indices_to_minors_with_numa():
    managed = [(0, 10, False), (1, 11, False), (2, 12, False)]
    got = resolve(parse_shared_gpus("2:4:mps,1:2"), managed, numa={11: 0, 12: 1})
    assert got == {11: SharedGpu(11, 1, 2, ShareMode.TIME_SLICE, 0), 12: SharedGpu(12, 2, 4, ShareMode.MPS, 1)}
    assert resolve(parse_shared_gpus("1:2"), managed) == {11: SharedGpu(11, 1, 2, ShareMode.TIME_SLICE, None)}


def test_resolve_refuses_a_gpu_not_managed_naming_the_managed_ones():
    with pytest.raises(ConfigError, match=r"names GPU 3, which is not managed \(managed indices: 0,1\)"):
        resolve(parse_shared_gpus("3:2"), [(1, 1, False), (0, 0, False)])
    with pytest.raises(ConfigError, match=r"managed indices: none"):
        resolve(parse_shared_gpus("0:2"), [])


def test_resolve_refuses_a_gpu_in_mig_mode_clearly():
    with pytest.raises(ConfigError) as err:
        resolve(parse_shared_gpus("1:2"), [(0, 0, False), (1, 1, True)])
    assert "GPU 1, which is in MIG mode" in str(err.value)
    assert "mig-<profile>" in str(err.value)


def test_agent_resources_offer_each_size_as_units_named_by_it_beside_whole_gpus():
    assert agent_resources(4, four(4)) == "gpus:4;gpu-share-4:16"
    mixed = {1: SharedGpu(1, 1, 3), 2: SharedGpu(2, 2, 5, ShareMode.MPS), 3: SharedGpu(3, 3, 10), 4: SharedGpu(4, 4, 3)}
    assert agent_resources(2, mixed) == "gpus:2;gpu-share-3:6;gpu-share-5:5;gpu-share-10:10"  # sizes ascending
    assert agent_resources(8, {}) == "gpus:8"
    assert agent_resources(0, four(2)) == "gpus:0;gpu-share-2:8"
    assert RESOURCE not in agent_resources(4, four(4)), "the pooled name is no longer offered"


# ---- counts --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [0, -1, -0.0, 0.5, 1.5, 2.0000001, math.nan, math.inf, -math.inf, MAX_REQUEST + 1, 10**30, True, "1", None]
)
def test_hostile_counts_are_refused_with_a_typed_error(value):
    with pytest.raises(InvalidShareCount) as err:
        checked_share_count(value)
    assert err.value.code == "INVALID_ARGUMENT"
    assert f"from 1 to {MAX_REQUEST}" in str(err.value)


@pytest.mark.parametrize(
    ("value", "n"), [(1, 1), (2.0, 2), (float(MAX_REQUEST), MAX_REQUEST), (MAX_REQUEST, MAX_REQUEST)]
)
def test_whole_counts_are_taken(value, n):
    assert checked_share_count(value) == n
    assert type(checked_share_count(value)) is int


def test_share_request_sums_the_entries_and_is_zero_without_any():
    res = (Resource("cpus", 1.0), Resource(RESOURCE, 2.0), Resource(RESOURCE, 1.0, role="web"), Resource("gpus", 1.0))
    assert share_request(res) == 3
    assert share_request((Resource("gpus", 2.0),)) == 0
    assert share_request(()) == 0


@pytest.mark.parametrize("value", [0.0, 0.5, -1.0, math.nan, math.inf, 1e9])
def test_share_request_refuses_hostile_entries(value):
    with pytest.raises(InvalidShareCount):
        share_request((Resource(RESOURCE, value),))


def test_share_request_refuses_a_sum_out_of_range_and_non_scalars():
    with pytest.raises(InvalidShareCount):
        share_request((Resource(RESOURCE, 40.0), Resource(RESOURCE, 40.0)))
    with pytest.raises(InvalidShareCount, match="must be a scalar"):
        share_request((Resource(RESOURCE, 1.0, type="RANGES"),))


# ---- placement -----------------------------------------------------------------------------------


def test_one_share_goes_to_the_lowest_minor_when_all_are_empty():
    assert place(1, four(), {}) == Placement(4, 1, ShareMode.TIME_SLICE, 4)


def test_placement_prefers_the_gpu_holding_the_fewest_shares():
    assert place(1, four(), {4: 1, 5: 0, 6: 1, 7: 1}).minor == 5
    assert place(2, four(), {4: 2, 5: 1, 6: 3, 7: 1}).minor == 5
    assert place(1, four(), {4: 3, 5: 2, 6: 2, 7: 4}).minor == 5


def test_placement_skips_gpus_without_room_even_if_they_hold_fewer():
    gpus = {1: SharedGpu(1, 1, 2), 2: SharedGpu(2, 2, 8)}
    assert place(2, gpus, {1: 1, 2: 5}).minor == 2
    assert place(3, gpus, {1: 0, 2: 5}).minor == 2


def test_placement_skips_blocked_gpus():
    assert place(1, four(), {}, blocked=[4, 5]).minor == 6


def test_placement_breaks_ties_by_numa_then_minor():
    gpus = four(numa=(0, 0, 1, 1))
    assert place(1, gpus, {}, near=[1]).minor == 6
    assert place(1, gpus, {6: 1}, near=[1]).minor == 7
    assert place(1, gpus, {6: 1, 7: 1}, near=[1]).minor == 4  # fewest shares comes before the node
    assert place(1, gpus, {}, near=[]).minor == 4  # no node is near: the lowest minor
    assert place(1, gpus, {}, near=None).minor == 4
    assert place(1, four(), {}, near=[0]).minor == 4  # unknown nodes are not near


def test_placement_carries_the_mode_and_total():
    assert place(1, four(8, ShareMode.MPS), {4: 6}) == Placement(5, 1, ShareMode.MPS, 8)
    assert place(3, four(8, ShareMode.TIME_SLICE), {4: 6}) == Placement(5, 3, ShareMode.TIME_SLICE, 8)


def test_a_request_bigger_than_any_gpu_is_refused_as_never_satisfiable():
    gpus = {1: SharedGpu(1, 1, 2), 2: SharedGpu(2, 2, 4)}
    with pytest.raises(ShareRequestTooLarge) as err:
        place(5, gpus, {})
    assert err.value.code == "INVALID_ARGUMENT"
    assert "Requested 5 gpu_shares but a shared GPU here holds at most 4" in str(err.value)
    assert "never split across GPUs" in str(err.value)
    assert place(4, gpus, {}).minor == 2
    with pytest.raises(ShareRequestTooLarge, match="holds at most 0"):
        place(1, {}, {})


def test_exhausted_names_what_each_gpu_has_free():
    with pytest.raises(SharesExhausted) as err:
        place(2, four(), {4: 3, 5: 4, 6: 3, 7: 0}, blocked=[7])
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert isinstance(err.value, ResourceExhausted)
    assert str(err.value) == (
        "Requested 2 gpu_shares but no shared GPU has that many free "
        "(GPU 4: 1, GPU 5: 0, GPU 6: 1, GPU 7: 4 (not usable))"
    )


@pytest.mark.parametrize("value", [0, -2, 1.5, math.nan, math.inf, 10**12])
def test_place_refuses_hostile_counts(value):
    with pytest.raises(InvalidShareCount):
        place(value, four(), {})


# Up to six shared GPUs cut 2-8 ways, some shares held, some GPUs blocked, maybe a NUMA preference,
# and a request of n shares: what both placements' properties are checked over.
PLACEMENT_CASES = dict(
    sizes=st.lists(st.integers(2, 8), min_size=1, max_size=6),
    fill=st.lists(st.integers(0, 8), min_size=6, max_size=6),
    numa=st.lists(st.sampled_from([0, 1, None]), min_size=6, max_size=6),
    blocked=st.sets(st.integers(0, 5), max_size=3),
    near=st.one_of(st.none(), st.sets(st.integers(0, 1))),
    n=st.integers(1, 8),
)


@settings(max_examples=300, deadline=None)
@given(**PLACEMENT_CASES)
def test_placement_is_the_best_gpu_with_room(sizes, fill, numa, blocked, near, n):
    gpus = {m: SharedGpu(m, m, s, ShareMode.TIME_SLICE, numa[m]) for m, s in enumerate(sizes)}
    held = {m: min(fill[m], g.shares) for m, g in gpus.items()}
    room = [g for g in gpus.values() if g.minor not in blocked and g.shares - held[g.minor] >= n]
    if n > max(sizes):
        with pytest.raises(ShareRequestTooLarge):
            place(n, gpus, held, blocked, near)
        return
    if not room:
        with pytest.raises(SharesExhausted):
            place(n, gpus, held, blocked, near)
        return
    got = place(n, gpus, held, blocked, near)
    chosen = gpus[got.minor]
    assert chosen in room
    assert got.shares == n and got.total == chosen.shares
    # The spread goal: no GPU with room held fewer; among equals, a near one if any; then the lowest minor.
    fewest = min(held[g.minor] for g in room)
    assert held[got.minor] == fewest
    ties = [g for g in room if held[g.minor] == fewest]
    if near is not None and any(g.numa in near for g in ties):
        assert chosen.numa in near
        ties = [g for g in ties if g.numa in near]
    assert got.minor == min(g.minor for g in ties)
    # Deterministic: the same question, the same answer, whatever the dict order.
    assert place(n, dict(reversed(list(gpus.items()))), dict(reversed(list(held.items()))), blocked, near) == got


# ---- the books -----------------------------------------------------------------------------------


def test_book_places_and_releases():
    book = ShareBook(four())
    assert book.held() == {4: 0, 5: 0, 6: 0, 7: 0}
    assert book.place("a", 1).minor == 4
    assert book.place("b", 2).minor == 5
    assert book.place("c", 1).minor == 6
    assert book.held() == {4: 1, 5: 2, 6: 1, 7: 0}
    assert book.holders(4) == {"a": 1}
    assert book.holders(7) == {}
    assert book.of("b") == (5, 2)
    assert book.of("z") is None
    assert book.release("b") == (5, 2)
    assert book.held()[5] == 0
    with pytest.raises(SharesNotHeld, match="container b holds no gpu_shares"):
        book.release("b")


def test_book_refuses_a_second_booking_of_one_holder_and_changes_nothing():
    book = ShareBook(four())
    book.place("a", 1)
    with pytest.raises(InvalidArgument, match="already holds"):
        book.place("a", 1)
    assert book.held() == {4: 1, 5: 0, 6: 0, 7: 0}


def test_book_refusal_books_nothing():
    book = ShareBook(four(2))
    for h in "abcd":
        book.place(h, 2)
    with pytest.raises(SharesExhausted):
        book.place("e", 1)
    assert book.of("e") is None
    assert sum(book.held().values()) == 8


def test_book_holders_are_sorted_by_holder():
    book = ShareBook({1: SharedGpu(1, 1, 4)})
    book.place("z", 1)
    book.place("a", 2)
    assert list(book.holders(1)) == ["a", "z"]


def test_book_restore_refuses_what_the_flags_cannot_hold():
    book = ShareBook({1: SharedGpu(1, 1, 4)})
    book.restore("a", 1, 3)
    assert book.held() == {1: 3}
    with pytest.raises(FailedPrecondition, match="GPU 2, which is not shared"):
        book.restore("b", 2, 1)
    with pytest.raises(FailedPrecondition, match="booked twice"):
        book.restore("a", 1, 1)
    with pytest.raises(FailedPrecondition, match="more than are left of its 4"):
        book.restore("c", 1, 2)
    book.restore("d", 1, 1)
    assert book.held() == {1: 4}
    with pytest.raises(InvalidShareCount):
        ShareBook({1: SharedGpu(1, 1, 4)}).restore("e", 1, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=60), st.sets(st.integers(4, 7), max_size=2))
def test_book_never_grants_a_share_twice_and_never_refuses_with_room(ops, blocked):
    """Arrivals (True) and departures (False, the oldest holder) of 1-4 shares on four GPUs shared four ways."""
    book = ShareBook(four())
    live: list[str] = []
    for i, (arrive, n) in enumerate(ops):
        if not arrive and live:
            book.release(live.pop(0))
            continue
        before = book.held()
        room = [m for m in book.shared if m not in blocked and 4 - before[m] >= n]
        try:
            got = book.place(f"c{i}", n, blocked)
        except SharesExhausted:
            assert not room
            continue
        live.append(f"c{i}")
        assert got.minor in room
        assert before[got.minor] == min(before[m] for m in room)
        held = book.held()
        assert all(0 <= held[m] <= 4 for m in held)
        assert sum(held.values()) == sum(book.of(h)[1] for h in live)


# ---- ShareMode.MPS limits ----------------------------------------------------------------------------------


def test_limits_are_in_proportion_to_the_shares():
    gib = 1 << 30
    assert limits(1, 4, 80 * gib) == (25, 20480)
    assert limits(3, 4, 80 * gib) == (75, 61440)
    assert limits(4, 4, 80 * gib) == (100, 81920)
    assert limits(1, 3, 3 * 1024 * 1024) == (33, 1)


def test_limits_never_fall_to_zero_and_leave_unknown_memory_unlimited():
    assert limits(1, 48, 1024 * 1024) == (2, 1)
    assert limits(1, 64, 10 * 1024 * 1024) == (1, 1)
    assert limits(1, 4, 0) == (25, 0)


@pytest.mark.parametrize(("n", "total"), [(0, 4), (5, 4), (-1, 4)])
def test_limits_refuse_shares_outside_the_gpu(n, total):
    with pytest.raises(InvalidShareCount, match=f"{n} of {total}"):
        limits(n, total, 1 << 30)


# ---- changes of role -----------------------------------------------------------------------------


def test_a_gpu_nobody_holds_may_change_role_freely():
    old = four(4)
    new = {4: SharedGpu(4, 4, 2, ShareMode.MPS), 9: SharedGpu(9, 9, 4)}
    assert role_problems(old, new, whole_held=[1], shares_held={}) == []
    assert role_problems(old, {}, whole_held=[], shares_held={5: 0}) == []
    check_roles(old, new, [], {})


def test_a_gpu_held_whole_cannot_become_shared():
    assert role_problems({}, four(), whole_held=[5], shares_held={}) == ["GPU 5 is held whole and cannot become shared"]


def test_a_shared_gpu_with_sharers_cannot_become_whole_switch_mode_or_be_re_cut():
    old = four(4)
    new = {5: SharedGpu(5, 5, 4, ShareMode.MPS), 6: SharedGpu(6, 6, 2), 7: SharedGpu(7, 7, 3)}
    got = role_problems(old, new, whole_held=[], shares_held={4: 1, 5: 2, 6: 3, 7: 3})
    assert got == [
        "GPU 4 has 1 gpu_shares held and cannot become whole",
        "GPU 5 has 2 gpu_shares held and cannot switch from time-slice to mps",
        "GPU 6 has 3 gpu_shares held and cannot be re-cut from 4 to 2 ways (its sharers hold gpu-share-4 units)",
        "GPU 7 has 3 gpu_shares held and cannot be re-cut from 4 to 3 ways (its sharers hold gpu-share-4 units)",
    ]
    with pytest.raises(RoleChangeRefused) as err:
        check_roles(old, new, [], {4: 1})
    assert err.value.code == "FAILED_PRECONDITION"
    assert str(err.value) == (
        "refused to change how GPUs are shared while they are held: GPU 4 has 1 gpu_shares held and cannot become whole"
    )


def test_a_shared_gpu_with_sharers_keeps_its_cut_and_one_without_may_change_it():
    old = four(4)
    new = {4: SharedGpu(4, 4, 8), 5: SharedGpu(5, 5, 2), 6: SharedGpu(6, 6, 4), 7: SharedGpu(7, 7, 8)}
    assert role_problems(old, new, whole_held=[], shares_held={6: 4, 7: 0}) == []  # 4, 5, 7: nobody holds them
    assert role_problems(old, new, whole_held=[], shares_held={4: 4, 5: 1, 6: 4}) == [
        "GPU 4 has 4 gpu_shares held and cannot be re-cut from 4 to 8 ways (its sharers hold gpu-share-4 units)",
        "GPU 5 has 1 gpu_shares held and cannot be re-cut from 4 to 2 ways (its sharers hold gpu-share-4 units)",
    ]


def test_module_exports_the_resource_name():
    assert shares.RESOURCE == "gpu_shares"


# ---- what the errors carry -----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["x" * 100, -5, 0.5, math.nan])
def test_a_refused_count_names_the_value_as_given_cut_to_40_characters(value):
    with pytest.raises(InvalidShareCount) as err:
        checked_share_count(value)
    assert err.value.fields == {"value": repr(value)[:40], "most": MAX_REQUEST}
    assert str(err.value).endswith(f"got {repr(value)[:40]}")


def test_a_long_refused_value_is_cut_at_exactly_40_characters():
    with pytest.raises(InvalidShareCount) as err:
        checked_share_count(10**60)
    assert err.value.fields["value"] == repr(10**60)[:40] and len(err.value.fields["value"]) == 40


def test_refused_limits_name_the_gpu_share_count():
    with pytest.raises(InvalidShareCount) as err:
        limits(5, 4, 1 << 30)
    assert err.value.fields == {"value": "5 of 4", "most": 4}
    assert "from 1 to 4, got 5 of 4" in str(err.value)


def test_limits_round_memory_down_to_whole_mib():
    assert limits(1, 2, 3 * 1024 * 1024 + 512 * 1024) == (50, 1)
    assert limits(1, 3, 10 * 1024 * 1024 + 1) == (33, 3)
    assert type(limits(1, 3, 10 * 1024 * 1024 + 1)[1]) is int
    assert limits(1, 2, 1) == (50, 1)


def test_exhausted_counts_gpus_missing_from_the_held_map_as_empty():
    gpus = {1: SharedGpu(1, 1, 2), 2: SharedGpu(2, 2, 2)}
    with pytest.raises(SharesExhausted) as err:
        place(2, gpus, {2: 1}, blocked=[1])
    assert err.value.fields["free"] == "GPU 1: 2 (not usable), GPU 2: 1"


def test_several_role_problems_are_joined_in_one_message():
    with pytest.raises(RoleChangeRefused) as err:
        check_roles(four(4), {}, [], {4: 1, 5: 2})
    assert err.value.fields["problems"] == (
        "GPU 4 has 1 gpu_shares held and cannot become whole; GPU 5 has 2 gpu_shares held and cannot become whole"
    )


def test_nodes_of_a_tasks_cpus():
    from isolator.policy.shares import nodes_of

    node_cpus = {0: [0, 1], 1: [2, 3], 2: []}
    assert nodes_of({1}, node_cpus) == {0}
    assert nodes_of({1, 2}, node_cpus) == {0, 1}
    assert nodes_of({9}, node_cpus) == frozenset()
    assert nodes_of((), node_cpus) == frozenset()


def test_the_mig_refusal_says_what_is_offered_instead():
    with pytest.raises(ConfigError) as err:
        resolve(parse_shared_gpus("1:2"), [(1, 1, True)])
    assert str(err.value) == (
        "--shared-gpus names GPU 1, which is in MIG mode; its MIG devices are offered as"
        " mig-<profile> resources and are not shared (docs/sharing.md)"
    )


def test_the_book_places_near_the_tasks_nodes():
    book = ShareBook(four(numa=(0, 0, 1, 1)))
    assert book.place("a", 1, near=[1]).minor == 6
    assert book.place("b", 1).minor == 4


def test_role_problems_treat_a_gpu_missing_from_the_held_map_as_empty():
    assert role_problems(four(4), {}, whole_held=[], shares_held={}) == []
    assert role_problems(four(4), {}, whole_held=[], shares_held={6: 2}) == [
        "GPU 6 has 2 gpu_shares held and cannot become whole"
    ]


def test_a_refused_float_names_its_repr_whole():
    with pytest.raises(InvalidShareCount) as err:
        checked_share_count(-1.2345678901234567e300)
    assert err.value.fields["value"] == "-1.2345678901234567e+300"


# ---- units named by their size (issue 42 item 1) ---------------------------------------------------


def unit(size: int, value: object = 1.0, **kw: object) -> Resource:
    return Resource(shares.unit_name(size), value, **kw)  # type: ignore[arg-type]


def test_a_unit_name_says_how_many_ways_its_gpu_is_cut_and_reads_back():
    assert shares.unit_name(4) == "gpu-share-4"
    names = ("gpu-share-4", "gpu-share-48", "gpu_shares", "gpu-share-", "gpu-share-04")
    assert [shares.unit_size(n) for n in names] == [4, 48, None, None, None]
    assert shares.is_share_resource("gpu-share-2") and shares.is_share_resource(RESOURCE)
    assert not shares.is_share_resource("gpus") and not shares.is_share_resource("mig-1g.5gb")


def test_a_unit_name_is_one_mesos_takes_in_both_forms_of_resources():
    from isolator.policy import mig

    for size in range(2, MAX_REQUEST + 1):
        assert mig.valid_resource_name(shares.unit_name(size))


def test_a_request_of_one_unit_asks_one_share_of_a_gpu_cut_that_many_ways():
    assert shares.share_ask([unit(4), Resource("cpus", 1.0)]) == shares.ShareAsk(1, 4)
    assert shares.share_ask([unit(2, 0.5, role="a"), unit(2, 0.5, role="b")]) == shares.ShareAsk(1, 2)
    assert shares.share_ask([unit(4, 0.0)]) == shares.ShareAsk()  # a zero entry asks nothing
    assert shares.share_ask([Resource(RESOURCE, 3.0)]) == shares.ShareAsk(3, 0)  # pooled: still read


@pytest.mark.parametrize(
    ("resources", "says"),
    [
        ([unit(4, 2.0)], "ask for gpu-share-2:1 (offered where a GPU is cut 2 ways)"),
        ([unit(8, 4.0)], "ask for gpu-share-2:1"),
        ([unit(4, 3.0)], "for 3/4 of a GPU ask for a larger unit (gpu-share-N:1 is 1/N of a GPU) or whole 'gpus'"),
        ([unit(4, 5.0)], "or whole 'gpus'"),
        ([unit(4, 1.0, role="a"), unit(4, 1.0, role="b")], "asks for 2 gpu-share-4; a request takes exactly 1 unit"),
        ([unit(4, 0.5)], "ask for gpu-share-4:1"),
        ([unit(2), unit(4)], "asks for gpu-share-2 and gpu-share-4"),
        ([unit(4), Resource(RESOURCE, 1.0)], "asks for both gpu_shares and gpu-share-4"),
        ([unit(4, -1.0)], "must be 1"),
        ([unit(4, math.nan)], "must be 1"),
        ([unit(4, math.inf)], "must be 1"),
        ([unit(4, True)], "must be 1"),
        ([unit(4, 1.0, type="RANGES")], "must be a scalar"),
        ([Resource("gpu-share-1", 1.0)], "'gpu-share-1' is not a share unit"),
        ([Resource("gpu-share-65", 1.0)], "is not a share unit"),
        ([Resource("gpu-share-x", 1.0)], "is not a share unit"),
    ],
)
def test_anything_but_exactly_one_unit_is_refused_at_once_saying_what_to_ask(resources, says):
    with pytest.raises(shares.InvalidShareUnit) as err:
        shares.share_ask(resources)
    assert err.value.code == "INVALID_ARGUMENT"
    assert says in str(err.value)


def test_a_unit_is_placed_only_on_a_gpu_cut_that_many_ways():
    gpus = {4: SharedGpu(4, 4, 4), 5: SharedGpu(5, 5, 2, ShareMode.MPS), 6: SharedGpu(6, 6, 4)}
    assert place(1, gpus, {}, size=2) == Placement(5, 1, ShareMode.MPS, 2)
    assert place(1, gpus, {4: 1}, size=4).minor == 6
    with pytest.raises(SharesExhausted, match=r"Requested 1 gpu-share-2 but no GPU cut 2 ways has one free \(GPU 5: 0"):
        place(1, gpus, {5: 2, 4: 0}, size=2)
    with pytest.raises(SharesExhausted, match="Requested 1 gpu-share-8 but no GPU here is cut 8 ways"):
        place(1, gpus, {}, size=8)
    with pytest.raises(SharesExhausted, match=r"GPU 5: 2 \(not usable\)"):
        place(1, gpus, {}, blocked=[5], size=2)


@settings(max_examples=300, deadline=None)
@given(
    cuts=st.lists(st.sampled_from([2, 3, 4, 8]), min_size=1, max_size=6),
    stream=st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 40)), max_size=60),
)
def test_every_unit_the_master_can_grant_fits_one_gpu(cuts, stream):
    """The master's view: per unit name, what the agent offered less what it granted. A request of one
    unit is granted whenever that count is positive; the sidecar must then place it (never
    RESOURCE_EXHAUSTED), and the count always equals the free shares of the GPUs of that size."""
    gpus = {m: SharedGpu(m, m, n) for m, n in enumerate(cuts)}
    book = ShareBook(gpus)
    master = dict(shares.units_offered(gpus))
    sizes = sorted(set(cuts))
    holders: list[tuple[str, int]] = []
    for i, (arrive, pick, who) in enumerate(stream):
        if arrive:
            size = sizes[pick % len(sizes)]
            name = shares.unit_name(size)
            if master[name] == 0:
                continue  # not offered: the master grants nothing, nothing reaches the sidecar
            ask = shares.share_ask([Resource(name, 1.0)])
            got = book.place(f"t{i}", ask.count, size=ask.size)
            assert gpus[got.minor].shares == size
            master[name] -= 1
            holders.append((f"t{i}", size))
        elif holders:
            holder, size = holders.pop(who % len(holders))
            book.release(holder)
            master[shares.unit_name(size)] += 1
        held = book.held()
        for size in sizes:
            free = sum(g.shares - held[m] for m, g in gpus.items() if g.shares == size)
            assert master[shares.unit_name(size)] == free


# ---- pack or spread (issue 42 item 2) --------------------------------------------------------------


def test_pack_fills_a_started_gpu_before_opening_an_empty_one():
    gpus = four(4)
    assert place(1, gpus, {}, placement="pack").minor == 4  # all empty: the lowest minor
    assert place(1, gpus, {4: 1}, placement="pack").minor == 4  # spread would open GPU 5
    assert place(1, gpus, {4: 1}).minor == 5
    assert place(2, gpus, {4: 3, 5: 1}, placement="pack").minor == 5  # GPU 4 has no room for two
    assert place(1, gpus, {4: 3, 5: 1}, placement="pack").minor == 4  # best fit: GPU 4 left full
    assert place(1, gpus, {4: 4, 5: 2, 6: 1}, blocked=[5], placement="pack").minor == 6


def test_pack_leaves_whole_gpus_free_where_spread_does_not():
    book_pack, book_spread = ShareBook(four(4), "pack"), ShareBook(four(4))
    for i in range(4):
        book_pack.place(f"t{i}", 1)
        book_spread.place(f"t{i}", 1)
    assert book_pack.held() == {4: 4, 5: 0, 6: 0, 7: 0}
    assert book_spread.held() == {4: 1, 5: 1, 6: 1, 7: 1}
    assert book_pack.place("big", 4).minor == 5  # a whole GPU's worth still fits under pack
    with pytest.raises(SharesExhausted):
        book_spread.place("big", 4)


def test_an_unknown_placement_is_refused():
    with pytest.raises(ValueError, match="share placement 'fill' is not one of spread, pack"):
        place(1, four(), {}, placement="fill")
    with pytest.raises(ValueError, match="not one of spread, pack"):
        ShareBook(four(), "fill")


@settings(max_examples=300, deadline=None)
@given(**PLACEMENT_CASES)
def test_pack_is_the_best_fit_gpu_with_room(sizes, fill, numa, blocked, near, n):
    gpus = {m: SharedGpu(m, m, s, ShareMode.TIME_SLICE, numa[m]) for m, s in enumerate(sizes)}
    held = {m: min(fill[m], g.shares) for m, g in gpus.items()}
    room = [g for g in gpus.values() if g.minor not in blocked and g.shares - held[g.minor] >= n]
    if n > max(sizes) or not room:
        with pytest.raises((ShareRequestTooLarge, SharesExhausted)):
            place(n, gpus, held, blocked, near, placement="pack")
        return
    got = place(n, gpus, held, blocked, near, placement="pack")
    chosen = gpus[got.minor]
    assert chosen in room

    # The pack goal: no GPU with room would be left with fewer free; among equals a near one; then the lowest minor.
    def left(g: SharedGpu) -> int:
        return g.shares - held[g.minor] - n

    least = min(left(g) for g in room)
    assert left(chosen) == least
    ties = [g for g in room if left(g) == least]
    if near is not None and any(g.numa in near for g in ties):
        ties = [g for g in ties if g.numa in near]
    assert got.minor == min(g.minor for g in ties)
    assert place(n, dict(reversed(list(gpus.items()))), held, blocked, near, placement="pack") == got
