"""The pure CPU-affinity decision (isolator/policy/affinity.py): which CPUs and memory nodes, or a refusal."""

from __future__ import annotations

import pytest

from isolator.errors import AffinityEmpty, AffinityUnknown, InvalidArgument
from isolator.policy.affinity import (
    ENV_CPUS,
    ENV_NUMA_NODES,
    Affinity,
    GpuLocality,
    Machine,
    decide,
    format_list,
    narrowed,
    parse_list,
)

TWO_SOCKETS = Machine(
    cpus=frozenset(range(80)),
    mems=frozenset({0, 1}),
    node_cpus={
        0: frozenset(range(20)) | frozenset(range(40, 60)),
        1: frozenset(range(20, 40)) | frozenset(range(60, 80)),
    },
)
SMALL = Machine(cpus=frozenset({0, 1}), mems=frozenset({0}), node_cpus={0: frozenset({0, 1})})


def gpu(minor: int, node: int | None, cpus: str) -> GpuLocality:
    return GpuLocality(minor, node, cpus)


@pytest.mark.parametrize(
    ("text", "numbers"),
    [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-1,4,6-7", {0, 1, 4, 6, 7}), ("", set()), ("3\n", {3}), (" 1 , 2 ", {1, 2})],
)
def test_parse_list_reads_sysfs_cpulist_syntax(text: str, numbers: set[int]) -> None:
    assert parse_list(text) == frozenset(numbers)


@pytest.mark.parametrize("text", ["a", "1-", "-1", "3-1", "1-99999999", "0x1"])
def test_parse_list_refuses_what_is_not_a_list(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_list(text)


def test_format_list_collapses_ranges_and_round_trips() -> None:
    assert format_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert format_list(()) == ""
    assert parse_list(format_list(range(0, 80, 3))) == frozenset(range(0, 80, 3))


def test_a_container_without_gpus_is_left_alone() -> None:
    assert decide([], TWO_SOCKETS) is None


def test_gpus_on_one_node_get_that_nodes_cpus_and_memory() -> None:
    aff = decide([gpu(4, 1, "20-39,60-79"), gpu(5, 1, "20-39,60-79")], TWO_SOCKETS)
    assert aff == Affinity(frozenset(range(20, 40)) | frozenset(range(60, 80)), frozenset({1}))
    assert (aff.cpu_list, aff.mem_list) == ("20-39,60-79", "1")
    assert dict(aff.environment()) == {ENV_CPUS: "20-39,60-79", ENV_NUMA_NODES: "1"}


def test_gpus_spanning_nodes_get_the_union() -> None:
    aff = decide([gpu(0, 0, "0-19,40-59"), gpu(7, 1, "20-39,60-79")], TWO_SOCKETS)
    assert aff is not None and aff.cpu_list == "0-79" and aff.mem_list == "0-1"


def test_affinity_is_intersected_with_the_cpus_the_machine_has_online() -> None:
    aff = decide([gpu(0, 0, "0-19,40-59")], SMALL)
    assert aff == Affinity(frozenset({0, 1}), frozenset({0}))


def test_a_gpu_on_a_node_without_memory_here_takes_the_memory_node_of_its_cpus() -> None:
    # numa-2 on a 2-CPU, one-node machine: GPU 1 is local to CPU 1 on node 1, which has no memory here.
    assert decide([gpu(1, 1, "1")], SMALL) == Affinity(frozenset({1}), frozenset({0}))
    assert decide([gpu(0, 0, "0")], SMALL) == Affinity(frozenset({0}), frozenset({0}))


def test_an_affinity_that_leaves_no_cpu_is_refused_never_widened_to_all() -> None:
    with pytest.raises(AffinityEmpty, match=r"GPUs \[4\].*local to 20-39,60-79, this machine has 0-1 online"):
        decide([gpu(4, 1, "20-39,60-79")], SMALL)


def test_no_memory_node_left_is_refused() -> None:
    machine = Machine(cpus=frozenset({0, 1}), mems=frozenset({0}), node_cpus={})  # no node holds the CPUs
    with pytest.raises(AffinityEmpty, match="memory nodes"):
        decide([gpu(1, 1, "1")], machine)


def test_a_gpu_with_unknown_cpu_affinity_is_refused() -> None:
    with pytest.raises(AffinityUnknown, match=r"GPUs \[3\]"):
        decide([gpu(0, 0, "0"), gpu(3, None, "")], SMALL)


def test_narrowed_names_what_the_container_loses() -> None:
    assert narrowed(frozenset({0, 1}), frozenset({1})) == frozenset({0})
    assert narrowed(frozenset({1}), frozenset({0, 1})) == frozenset()


def test_parse_list_skips_empty_items_anywhere_in_the_list() -> None:
    assert parse_list("0,,2") == frozenset({0, 2})
    assert parse_list(",1,") == frozenset({1})


def test_parse_list_accepts_the_highest_cpu_number_and_refuses_the_next() -> None:
    assert parse_list("65535") == frozenset({65535})
    assert parse_list("65534-65535") == frozenset({65534, 65535})
    with pytest.raises(InvalidArgument, match=r"'65536' in '65536' is not a valid range"):
        parse_list("65536")
    with pytest.raises(InvalidArgument, match=r"'65535-65536' in '1,65535-65536' is not a valid range"):
        parse_list("1,65535-65536")


def test_parse_list_refusals_name_the_text_and_the_expected_syntax() -> None:
    with pytest.raises(InvalidArgument) as bad:
        parse_list("0,x")
    assert bad.value.message == "'0,x' is not a CPU or node list (expected e.g. 0-19,40-59)"
    with pytest.raises(InvalidArgument) as backwards:
        parse_list("3-1")
    assert backwards.value.message == "'3-1' in '3-1' is not a valid range"


def test_parse_list_accepts_a_range_of_one() -> None:
    assert parse_list("4-4") == frozenset({4})


def test_format_list_writes_single_numbers_and_pairs() -> None:
    assert format_list([3]) == "3"
    assert format_list([3, 4]) == "3-4"
    assert format_list([1, 3]) == "1,3"
    assert format_list([5, 3, 4, 4]) == "3-5"


def test_unknown_cpu_affinity_names_every_such_gpu_in_minor_order() -> None:
    with pytest.raises(AffinityUnknown) as err:
        decide([gpu(5, 0, ""), gpu(0, 0, "0"), gpu(3, None, " \n")], SMALL)
    assert err.value.fields == {"gpus": [3, 5]}


def test_a_cpu_affinity_of_only_whitespace_is_unknown_not_empty() -> None:
    with pytest.raises(AffinityUnknown):
        decide([gpu(2, 0, "  ")], SMALL)


def test_an_empty_cpu_refusal_names_the_gpus_in_minor_order_and_both_lists() -> None:
    with pytest.raises(AffinityEmpty) as err:
        decide([gpu(6, 1, "60-79"), gpu(4, 1, "20-39")], SMALL)
    assert err.value.fields == {"gpus": [4, 6], "what": "CPUs", "local": "20-39,60-79", "machine": "0-1"}


def test_a_memory_node_refusal_names_the_gpus_nodes_and_the_machines_memory_nodes() -> None:
    machine = Machine(cpus=frozenset({0, 1}), mems=frozenset({0, 2}), node_cpus={})
    with pytest.raises(AffinityEmpty) as err:
        decide([gpu(7, 3, "1"), gpu(1, 1, "0")], machine)
    assert err.value.fields == {"gpus": [1, 7], "what": "memory nodes", "local": "1,3", "machine": "0,2"}


def test_a_memory_node_refusal_for_gpus_without_a_numa_node_says_unknown() -> None:
    machine = Machine(cpus=frozenset({0, 1}), mems=frozenset({0}), node_cpus={})
    with pytest.raises(AffinityEmpty) as err:
        decide([gpu(1, None, "1")], machine)
    assert err.value.fields["local"] == "unknown"


def test_gpus_with_unknown_numa_node_take_the_memory_nodes_of_their_cpus() -> None:
    aff = decide([gpu(0, None, "20-21")], TWO_SOCKETS)
    assert aff == Affinity(frozenset({20, 21}), frozenset({1}))


def test_a_gpus_own_memory_node_wins_over_the_nodes_of_its_cpus() -> None:
    # GPU on node 1 whose CPUs are on node 0: memory follows the GPU's node when it has memory here.
    aff = decide([gpu(0, 1, "0-1"), gpu(1, None, "2")], TWO_SOCKETS)
    assert aff == Affinity(frozenset({0, 1, 2}), frozenset({1}))


def test_memory_fallback_takes_only_nodes_holding_chosen_cpus_that_have_memory_here() -> None:
    machine = Machine(
        cpus=frozenset(range(6)),
        mems=frozenset({0, 1}),
        node_cpus={0: frozenset({0, 1}), 1: frozenset({2, 3}), 2: frozenset({4, 5})},
    )
    # node 5 is no memory node here; the CPUs 2 and 4 lie on node 1 (memory) and node 2 (no memory).
    assert decide([gpu(0, 5, "2,4")], machine) == Affinity(frozenset({2, 4}), frozenset({1}))
