"""Simulated hosts as model.Topology objects, for the allocator tests and its benchmark.

Facts from k8s-topology.md §1.7 (fixtures F1-F3, D2, D5) and the vendors' published
``nvidia-smi topo -m`` layouts. Until the shipped host files (isolator/simhost/hosts/*.toml) land,
``shipped_hosts()`` is what the benchmark runs on.
"""

from __future__ import annotations

from collections.abc import Callable

from isolator.model import Gpu, Link, PcieLevel, Topology

PIX, PXB, PHB, NODE, SYS = (
    PcieLevel.SINGLE,
    PcieLevel.MULTIPLE,
    PcieLevel.HOSTBRIDGE,
    PcieLevel.NODE,
    PcieLevel.SYSTEM,
)


def build(
    n: int,
    link: Callable[[int, int], Link],
    numa: Callable[[int], int | None] = lambda i: None,
    name: str = "GPU",
) -> Topology:
    """A host of ``n`` GPUs (index = minor) whose pair (a, b), a < b, is ``link(a, b)``."""
    gpus = tuple(
        Gpu(index=i, minor=i, uuid=f"GPU-{i:08x}", name=name, pci_bus_id=f"0000:{i + 7:02x}:00.0", numa_node=numa(i))
        for i in range(n)
    )
    links = {(a, b): link(a, b) for a in range(n) for b in range(a + 1, n)}
    return Topology(gpus=gpus, links=links)


# ---- DGX-1 hybrid cube mesh (F2 Pascal, F3 Volta) ---------------------------------------------

_CUBE_EDGES = (
    (0, 1), (0, 2), (0, 3), (0, 4), (1, 2), (1, 3), (1, 5), (2, 3),
    (2, 6), (3, 7), (4, 5), (4, 6), (4, 7), (5, 6), (5, 7), (6, 7),
)  # fmt: skip
_VOLTA_NV2 = {(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)}


def dgx1_volta() -> Topology:
    """F3: 8x V100, NV2 on 8 cube edges and NV1 on the other 8; PIX 0-1, 2-3, 4-5, 6-7."""

    def link(a: int, b: int) -> Link:
        lanes = 2 if (a, b) in _VOLTA_NV2 else 1 if (a, b) in _CUBE_EDGES else 0
        if a // 4 != b // 4:
            pcie = SYS
        elif (a, b) in {(0, 1), (2, 3), (4, 5), (6, 7)}:
            pcie = PIX
        else:
            pcie = PHB
        return Link(pcie, lanes)

    return build(8, link, numa=lambda i: i // 4, name="Tesla V100-SXM2-16GB")


def dgx1_pascal() -> Topology:
    """F2: 8x P100, NV1 on every cube edge; PIX 0-2, 1-3, 4-6, 5-7."""

    def link(a: int, b: int) -> Link:
        lanes = 1 if (a, b) in _CUBE_EDGES else 0
        if a // 4 != b // 4:
            pcie = SYS
        elif (a, b) in {(0, 2), (1, 3), (4, 6), (5, 7)}:
            pcie = PIX
        else:
            pcie = PHB
        return Link(pcie, lanes)

    return build(8, link, numa=lambda i: i // 4, name="Tesla P100-SXM2-16GB")


# ---- NVSwitch hosts (lanes already counted per pair, as the inventory does) -----------------------


def dgx2() -> Topology:
    """16x V100 on NVSwitch (NV6 every pair); PCIe: pairs under a switch (PIX), quads (PXB), 8 per
    socket (NODE), SYS across the two sockets."""

    def link(a: int, b: int) -> Link:
        if a // 8 != b // 8:
            pcie = SYS
        elif a // 2 == b // 2:
            pcie = PIX
        elif a // 4 == b // 4:
            pcie = PXB
        else:
            pcie = NODE
        return Link(pcie, 6)

    return build(16, link, numa=lambda i: i // 8, name="Tesla V100-SXM3-32GB")


def dgx_a100() -> Topology:
    """8x A100 on NVSwitch (NV12 every pair); pairs share a PCIe switch (PXB), all else SYS; the
    AMD hosts run NPS4, so the pairs sit on NUMA nodes 3, 1, 7, 5."""
    numa = (3, 3, 1, 1, 7, 7, 5, 5)
    return build(
        8,
        lambda a, b: Link(PXB if a // 2 == b // 2 else SYS, 12),
        numa=lambda i: numa[i],
        name="NVIDIA A100-SXM4-80GB",
    )


def hgx_h100() -> Topology:
    """8x H100 on NVSwitch (NV18 every pair), two sockets: 0-3 on NUMA 0 (NODE), 4-7 on NUMA 1."""
    return build(
        8,
        lambda a, b: Link(NODE if a // 4 == b // 4 else SYS, 18),
        numa=lambda i: i // 4,
        name="NVIDIA H100 80GB HBM3",
    )


# ---- PCIe-only and small hosts ------------------------------------------------------------------


def workstation() -> Topology:
    """4 GPUs, two sockets, no NVLink: 0-1 under one PCIe switch (PIX) on socket 0, 2-3 on socket 1."""
    return build(
        4,
        lambda a, b: Link(PIX if a // 2 == b // 2 else SYS, 0),
        numa=lambda i: i // 2,
        name="NVIDIA RTX A6000",
    )


def single() -> Topology:
    return build(1, lambda a, b: Link(), numa=lambda i: 0, name="Tesla T4")


def shipped_hosts() -> dict[str, Topology]:
    """The simulated hosts the project ships, by name (the benchmark's default set)."""
    return {
        "dgx-1": dgx1_volta(),
        "dgx-2": dgx2(),
        "dgx-a100": dgx_a100(),
        "hgx-h100": hgx_h100(),
        "workstation-4": workstation(),
        "single-1": single(),
    }


# ---- fixtures for specific defects ----------------------------------------------------------------


def rtx8000_x4() -> Topology:
    """F1: NV2 on 0-3 and 1-2 (no PCIe link stored: modelled as SYS), NODE 0-1 and 2-3, SYS 0-2 and 1-3."""
    table = {(0, 3): Link(SYS, 2), (1, 2): Link(SYS, 2), (0, 1): Link(NODE), (2, 3): Link(NODE)}
    return build(4, lambda a, b: table.get((a, b), Link(SYS)))


def padded_trap() -> Topology:
    """D2: 0-1 NV4 + NODE; 2, 3, 4 pairwise PIX; 0/1 to 2/3/4 SYS. go-gpuallocator returns [0, 1, nil]
    for size 3 from all five."""

    def link(a: int, b: int) -> Link:
        if (a, b) == (0, 1):
            return Link(NODE, 4)
        if a >= 2:
            return Link(PIX)
        return Link(SYS)

    return build(5, link)


def a10_cliques() -> Topology:
    """D5: 8x A10, NVLink cliques {0..3} and {4..7} with 1 lane per pair, no PCIe link stored."""
    return build(8, lambda a, b: Link(SYS, 1 if a // 4 == b // 4 else 0))


def joined_dgx1(halves: int) -> Topology:
    """``halves`` DGX-1V boards joined by SYS links (16 GPUs for 2, 32 for 4): a large host with
    enough structure that the exact search has real work to do."""
    base = dgx1_volta()

    def link(a: int, b: int) -> Link:
        if a // 8 != b // 8:
            return Link(SYS)
        return base.link(a % 8, b % 8)

    return build(8 * halves, link, numa=lambda i: i // 4)
