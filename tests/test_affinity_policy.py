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
