"""Host descriptions and the simulated host's layout (parsing is pure; setup writes under a temp root)."""

from __future__ import annotations

import os
import stat

import pytest

from isolator.errors import HostFileError
from isolator.model import PcieLevel
from isolator.simhost.host import (
    format_cpu_list,
    load_host,
    mig_caps_minors,
    normalise_bus_id,
    parse_cpu_list,
    parse_host,
    shipped_hosts,
)
from isolator.simhost.sim import SimulatedHost

GOOD = """\
name = "two"
driver_version = "535.104.05"
cuda_driver_version = "12.2"

[[numa]]
node = 0
cpus = "0-7"

[[gpu]]
index = 0
minor = 0
name = "Tesla V100-SXM2-16GB"
pci_bus_id = "0000:06:00.0"
memory_mib = 16160
numa_node = 0
nvlink = { 1 = 2 }

[[gpu]]
index = 1
minor = 1
name = "Tesla V100-SXM2-16GB"
pci_bus_id = "0000:07:00.0"
memory_mib = 16160
numa_node = 0
nvlink = { 0 = 2 }
"""


def test_shipped_hosts_are_the_six_the_issue_asks_for_and_all_load():
    # numa-2 (issue 28): two GPUs local to CPU 0 and CPU 1, for --cpu-affinity tests on a 2-CPU machine.
    assert shipped_hosts() == ["dgx-1", "dgx-2", "dgx-a100", "hgx-h100", "numa-2", "single", "workstation-4"]
    sizes = {name: len(load_host(name).gpus) for name in shipped_hosts()}
    assert sizes == {
        "dgx-1": 8, "dgx-2": 16, "dgx-a100": 8, "hgx-h100": 8, "numa-2": 2, "single": 1, "workstation-4": 4,
    }  # fmt: skip


def test_dgx1_is_the_hybrid_cube_mesh_of_the_f3_fixture():
    spec = load_host("dgx-1")
    nv2 = {(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)}
    nv1 = {(0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7)}
    for g in spec.gpus:
        for peer, lanes in g.nvlink.items():
            pair = (min(g.index, peer), max(g.index, peer))
            assert lanes == (2 if pair in nv2 else 1 if pair in nv1 else 0), pair
    assert sum(len(g.nvlink) for g in spec.gpus) == 32  # 16 edges, seen from both ends
    assert spec.level(0, 1) == PcieLevel.SINGLE and spec.level(0, 2) == PcieLevel.HOSTBRIDGE
    assert spec.level(0, 4) == PcieLevel.SYSTEM and spec.level(6, 7) == PcieLevel.SINGLE


def test_workstation_minors_differ_from_indices():
    spec = load_host("workstation-4")
    assert [(g.index, g.minor) for g in spec.gpus] == [(0, 2), (1, 3), (2, 0), (3, 1)]


def test_a_good_file_parses_with_defaults_filled_in():
    spec = parse_host(GOOD)
    assert spec.cuda_driver_version == 12020
    assert spec.gpus[0].uuid.startswith("GPU-") and spec.gpus[0].uuid != spec.gpus[1].uuid
    assert spec.gpus[0].nvml_bus_id == "00000000:06:00.0"
    assert spec.level(0, 1) == PcieLevel.NODE  # same NUMA node, no group given


def _line(text: str, needle: str) -> int:
    return text[: text.index(needle)].count("\n") + 1


def _bad(text: str) -> str:
    with pytest.raises(HostFileError) as info:
        parse_host(text, "bad.toml")
    return info.value.message


def test_duplicate_minor_is_refused_with_its_line():
    text = GOOD.replace("index = 1\nminor = 1", "index = 1\nminor = 0")
    msg = _bad(text)
    line = _line(text, "index = 1") + 1
    assert msg == f"failed to load host file 'bad.toml': line {line} (gpu[1].minor): minor 0 is already used by gpu[0]"


def test_link_to_a_missing_gpu_is_refused():
    text = GOOD.replace("nvlink = { 1 = 2 }", "nvlink = { 1 = 2, 5 = 1 }")
    msg = _bad(text)
    assert f"line {_line(text, 'nvlink = { 1 = 2, 5')} (gpu[0].nvlink): link to GPU 5, which does not exist" in msg


def test_asymmetric_link_is_refused_naming_both_ends():
    msg = _bad(GOOD.replace("nvlink = { 0 = 2 }", "nvlink = { 0 = 1 }"))
    assert "asymmetric link: GPU 0 has 2 lane(s) to GPU 1, but GPU 1 has 1 back" in msg


def test_syntax_error_names_the_line():
    text = GOOD.replace("memory_mib = 16160\nnuma_node = 0\nnvlink = { 0", "memory_mib = = 1\nnvlink = { 0")
    msg = _bad(text)
    assert "not valid TOML" in msg and f"line {_line(text, 'memory_mib = = 1')}" in msg


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (("minor = 1", "minor = 255"), "(gpu[1].minor): minor 255 is above 253"),
        (
            ('pci_bus_id = "0000:07:00.0"', 'pci_bus_id = "0000:06:00.0"'),
            "(gpu[1].pci_bus_id): pci_bus_id 0000:06:00.0 is already used by gpu[0]",
        ),
        (('pci_bus_id = "0000:07:00.0"', 'pci_bus_id = "zz"'), "is not a PCI bus id"),
        (("index = 1", "index = 2"), "indices must be 0..1; 1 is missing"),
        (("numa_node = 0\nnvlink = { 0", "numa_node = 3\nnvlink = { 0"), "NUMA node 3 is not declared"),
        (
            ("memory_mib = 16160\nnuma_node = 0\nnvlink = { 1", "memory_mib = true\nnuma_node = 0\nnvlink = { 1"),
            "got a boolean",
        ),
        (('name = "two"', 'name = "two"\ncolour = "red"'), "line 2 (colour): unknown key 'colour'"),
        (('cuda_driver_version = "12.2"', 'cuda_driver_version = "twelve"'), "is not a CUDA version"),
        (("nvlink = { 1 = 2 }", "nvlink = { 0 = 2 }"), "has an NVLink to itself"),
        (("nvlink = { 1 = 2 }", "nvlink = { 1 = 2 }\nnvswitch = { 3 = 2 }"), "NVSwitch 3, which is not declared"),
        (
            (
                "nvlink = { 1 = 2 }",
                "nvlink = { 1 = 2 }\n[[gpu.mig_device]]\ngpu_instance = 1\ncompute_instance = 0\n"
                'profile = "1g.5gb"\nmemory_mib = 4864',
            ),
            "MIG devices on a GPU whose 'mig' is not true",
        ),
        (
            ("[[numa]]\nnode = 0", '[[pcie]]\nlevel = "PIX"\ngpus = [0, 9]\n\n[[numa]]\nnode = 0'),
            "GPU 9 does not exist",
        ),
    ],
)
def test_inconsistent_files_are_refused_with_the_reason(edit, expected):
    old, new = edit
    assert old in GOOD
    assert expected in _bad(GOOD.replace(old, new, 1))


def _mig_gpu(*devices: str) -> str:
    body = "".join(f"\n[[gpu.mig_device]]\n{d}\n" for d in devices)
    return GOOD.replace("nvlink = { 1 = 2 }", "nvlink = { 1 = 2 }\nmig = true\n" + body, 1)


def _mig(gi: int, profile: str, mem: int, extra: str = "", ci: int = 0) -> str:
    return f'gpu_instance = {gi}\ncompute_instance = {ci}\nprofile = "{profile}"\nmemory_mib = {mem}\n{extra}'


def test_mig_placements_default_to_the_first_free_aligned_slot_and_are_shared_by_a_gis_cis():
    # A 16 GiB GPU: one memory slice is 2 GB, so 3g.8gb takes 4 slices, 2g.4gb 2 and 1g.2gb 1.
    text = _mig_gpu(
        _mig(1, "3g.8gb", 4000, "placement = 0"),
        _mig(5, "2g.4gb", 2000),
        _mig(2, "1c.2g.4gb", 2000),
        _mig(2, "1c.2g.4gb", 2000, ci=1),
    )
    gpu = parse_host(text).gpus[0]
    got = [(m.gpu_instance, m.compute_instance, m.placement_start, m.placement_size) for m in gpu.mig_devices]
    assert got == [(1, 0, 0, 4), (5, 0, 4, 2), (2, 0, 6, 2), (2, 1, 6, 2)]
    assert [(m.gpu_slices, m.compute_slices) for m in gpu.mig_devices] == [(3, 3), (2, 2), (2, 1), (2, 1)]
    # Full: nothing of size 2 fits any more.
    full = _mig_gpu(
        _mig(1, "3g.8gb", 4000, "placement = 0"),
        _mig(5, "2g.4gb", 2000),
        _mig(2, "2g.4gb", 2000),
        _mig(6, "2g.4gb", 10),
    )
    assert "no free placement of size 2" in _bad(full)


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ((_mig(1, "3g.20gb", 1000, "placement = 0"), _mig(2, "1g.5gb", 1000, "placement = 2")), "overlaps"),
        ((_mig(1, "1g.5gb", 1000, "placement = 8"),), "outside slices 0..7"),
        ((_mig(1, "9g.5gb", 1000),), "slices must satisfy"),
        ((_mig(1, "1g.5gb", 1000), _mig(1, "1g.5gb", 1000, "placement = 3", ci=1)), "already placed at 0"),
        ((_mig(1, "1g.5gb", 1000, "colour = 1"),), "unknown key 'colour'"),
    ],
)
def test_impossible_mig_layouts_are_refused(devices, expected):
    assert expected in _bad(_mig_gpu(*devices))


def test_missing_file_and_unknown_host_name_are_refused(short_tmp):
    with pytest.raises(HostFileError, match="No such file"):
        load_host(os.path.join(short_tmp, "absent.toml"))
    with pytest.raises(HostFileError, match=r"no shipped host of that name \(shipped: dgx-1, dgx-2"):
        load_host("dgx-9")


def test_bus_ids_and_cpu_lists_round_trip():
    assert normalise_bus_id("00000000:1A:00.0") == "0000:1a:00.0"
    assert normalise_bus_id("1a:00.0") == "0000:1a:00.0"
    assert parse_cpu_list("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert format_cpu_list(parse_cpu_list("0-19,40-59")) == "0-19,40-59"


def test_setup_writes_library_state_and_mig_minors(short_tmp):
    host = SimulatedHost("dgx-a100", short_tmp).setup(make_devices=False)
    assert os.path.exists(host.library_path)
    with open(host.state_path) as fh:
        assert f"control {host.control_dir}" in fh.read()
    with open(os.path.join(host.proc_root, "driver", "nvidia-caps", "mig-minors")) as fh:
        minors = fh.read()
    gi, ci = mig_caps_minors(0, 1, 0)
    assert f"gpu0/gi1/access {gi}\n" in minors and f"gpu0/gi1/ci0/access {ci}\n" in minors


@pytest.mark.root
def test_setup_makes_device_nodes_by_minor_including_mig_caps(short_tmp):
    host = SimulatedHost("workstation-4", short_tmp).setup()
    for minor in (0, 1, 2, 3):
        st = os.stat(os.path.join(host.dev_root, f"nvidia{minor}"))
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, minor)
    mig = SimulatedHost("dgx-a100", os.path.join(short_tmp, "a100")).setup()
    gi, ci = mig_caps_minors(0, 1, 0)
    for minor in (gi, ci):
        assert stat.S_ISCHR(os.stat(os.path.join(mig.dev_root, "nvidia-caps", f"nvidia-cap{minor}")).st_mode)


def test_steering_an_absent_gpu_is_refused(short_tmp):
    host = SimulatedHost("single", short_tmp).setup(make_devices=False)
    with pytest.raises(Exception, match="has no GPU 3"):
        host.inject_xid(3, 79)
