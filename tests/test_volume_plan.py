"""The pure volume plan: filters, skip reasons, directories and links, on hand-made discovery data."""

from __future__ import annotations

import pytest

from volumes.catalog import ALL_GROUPS, BINARIES, LIBRARIES, Group, Kind, match_library, parse_groups, wanted
from volumes.discover import BinaryCandidate, Discovery, LibraryCandidate
from volumes.elf import ElfInfo
from volumes.errors import InvalidDriverVersion
from volumes.plan import plan_volume, volume_name

V = "550.54.15"


def lib(component, real, *, bits=64, soname=None, needed=(), abi=None, key=None, error=None, elf=True):
    info = ElfInfo(real, bits, 62 if bits == 64 else 3, 3, soname, tuple(needed), abi) if elf else None
    return LibraryCandidate(
        component, key or real.rsplit("/", 1)[-1], real, real, "/host" + real, bits, "x86-64", info, error
    )


def discovery(*libs, bins=(), groups=ALL_GROUPS):
    return Discovery("/", "/etc/ld.so.cache", "new", frozenset(groups), tuple(libs), tuple(bins))


@pytest.mark.parametrize(
    "candidate, reason",
    [
        (lib("libGL.so", "/usr/lib/libGL.so.1.2.0", soname="libGL.so.1", needed=("libglapi.so.0",)), "foreign-gl"),
        (lib("libEGL.so", "/usr/lib/libEGL.so.1.0.0", needed=()), "foreign-gl"),
        (lib("libnvidia-tls.so", f"/usr/lib/libnvidia-tls.so.{V}", abi=(0, 2, 2, 0)), "old-tls-abi"),
        (lib("libnvidia-tls.so", f"/usr/lib/libnvidia-tls.so.{V}", abi=None), "old-tls-abi"),
        (lib("libcuda.so", "/usr/lib/libcuda.so.535.104.05", soname="libcuda.so.1"), "version-mismatch"),
        (lib("libGL.so", "/usr/lib/libGL.so.1.7.0", needed=("libGLdispatch.so.0",)), "version-mismatch"),
        (lib("libcuda.so", f"/usr/lib/libcuda.so.{V}", elf=False, error="not an ELF file"), "unreadable"),
        (
            LibraryCandidate(
                "libcuda.so", "libcuda.so.1", "/usr/lib/libcuda.so.1", None, None, 64, "x86-64", None, "cannot resolve"
            ),
            "unreadable",
        ),
    ],
)
def test_plan_skips_a_library_with_the_reason_recorded(candidate, reason):
    plan = plan_volume(discovery(candidate), V)
    assert plan.files == ()
    assert [s.reason for s in plan.skipped] == [reason]
    assert plan.skipped[0].detail


def test_plan_keeps_nvidia_built_compat_gl_libraries():
    ok = lib("libGL.so", f"/usr/lib/libGL.so.{V}", soname="libGL.so.1", needed=(f"libnvidia-glcore.so.{V}",))
    plan = plan_volume(discovery(ok), V)
    assert [(f.dir, f.name) for f in plan.files] == [("lib64", f"libGL.so.{V}")]


def test_plan_puts_32_bit_libraries_in_lib_and_64_bit_in_lib64_by_elf_class():
    plan = plan_volume(
        discovery(
            lib("libcuda.so", f"/usr/lib64/libcuda.so.{V}", soname="libcuda.so.1"),
            lib("libcuda.so", f"/usr/lib32/libcuda.so.{V}", bits=32, soname="libcuda.so.1"),
        ),
        V,
    )
    assert sorted((f.dir, f.name) for f in plan.files) == [("lib", f"libcuda.so.{V}"), ("lib64", f"libcuda.so.{V}")]


def test_plan_skips_a_library_whose_elf_class_contradicts_the_cache():
    wrong = LibraryCandidate(
        "libcuda.so", "libcuda.so.1", "/l/libcuda.so.1", f"/l/libcuda.so.{V}", "/h", 64, "x86-64",
        ElfInfo("/h", 32, 3, 3, "libcuda.so.1", (), None), None,
    )  # fmt: skip
    assert [s.reason for s in plan_volume(discovery(wrong), V).skipped] == ["class-mismatch"]


def test_plan_collapses_cache_keys_of_one_file_and_links_soname_libcuda_and_glx_indirect():
    real = f"/usr/lib/libcuda.so.{V}"
    plan = plan_volume(
        discovery(
            lib("libcuda.so", real, soname="libcuda.so.1", key="libcuda.so.1"),
            lib("libcuda.so", real, soname="libcuda.so.1", key="libcuda.so"),
            lib("libGLX_nvidia.so", f"/usr/lib/libGLX_nvidia.so.{V}", soname="libGLX_nvidia.so.0"),
            lib(
                "libnvidia-opticalflow.so",
                f"/usr/lib/libnvidia-opticalflow.so.{V}",
                soname="libnvidia-opticalflow.so.1",
            ),
        ),
        V,
    )
    assert len(plan.files) == 3
    links = {(link.name, link.target) for link in plan.links}
    assert ("libcuda.so.1", f"libcuda.so.{V}") in links
    assert ("libcuda.so", "libcuda.so.1") in links
    assert ("libGLX_indirect.so.0", f"libGLX_nvidia.so.{V}") in links
    assert ("libnvidia-opticalflow.so", "libnvidia-opticalflow.so.1") in links


def test_plan_skips_a_second_file_with_the_same_name_in_the_same_directory():
    plan = plan_volume(
        discovery(
            lib("libnvidia-tls.so", f"/a/libnvidia-tls.so.{V}", abi=(0, 2, 3, 99)),
            lib("libnvidia-tls.so", f"/b/libnvidia-tls.so.{V}", abi=(0, 2, 3, 99)),
        ),
        V,
    )
    assert [f.real_path for f in plan.files] == [f"/a/libnvidia-tls.so.{V}"]
    assert [s.reason for s in plan.skipped] == ["duplicate-name"]


def test_plan_names_binaries_after_the_command_and_reports_missing_components():
    b = BinaryCandidate("nvidia-smi", "/usr/bin/nvidia-smi", "/opt/nvidia/nvidia-smi.550", "/opt/nvidia/nvidia-smi.550")
    plan = plan_volume(discovery(bins=(b,), groups={Group.UTILITY}), V)
    assert [(f.dir, f.name, f.source) for f in plan.files] == [("bin", "nvidia-smi", "/opt/nvidia/nvidia-smi.550")]
    missing = {m.component: m.optional for m in plan.missing}
    assert missing["libnvidia-ml.so"] is False and missing["nv-fabricmanager"] is True
    assert "libcuda.so" not in missing  # compute was not asked for


def test_plan_digest_changes_with_the_contents():
    a = plan_volume(discovery(lib("libcuda.so", f"/a/libcuda.so.{V}")), V)
    b = plan_volume(discovery(lib("libcuda.so", f"/b/libcuda.so.{V}")), V)
    assert a.digest() != b.digest()
    assert a.digest() == plan_volume(discovery(lib("libcuda.so", f"/a/libcuda.so.{V}")), V).digest()


@pytest.mark.parametrize("version", ["", "../etc", "5/5", ".hidden", "5..0", "x" * 80])
def test_driver_versions_that_cannot_name_a_directory_are_refused(version):
    with pytest.raises(InvalidDriverVersion):
        volume_name(version)


def test_catalogue_covers_todays_lists_and_the_historical_entries_each_with_a_note():
    names = {c.name for c in (*BINARIES, *LIBRARIES)}
    for name in (
        "libnvoptix.so",
        "libnvidia-rtcore.so",
        "libnvidia-glvkspirv.so",
        "libnvidia-nvvm.so",
        "libnvidia-gpucomp.so",
    ):
        assert name in names  # libnvidia-container's modern entries
    for name in ("libnvidia-compiler.so", "libnvidia-fatbinaryloader.so", "libGLX.so", "libnvidia-ifr.so"):
        assert name in names  # nvidia-docker v1 and Mesos entries
    assert all(c.note for c in (*BINARIES, *LIBRARIES))
    assert {c.group for c in (*BINARIES, *LIBRARIES)} == set(Group)
    assert "libGLX.so" not in {c.name for c in wanted()}  # disabled: the image ships GLVND's loaders


def test_library_prefixes_do_not_match_their_longer_relatives():
    comps = wanted(kind=Kind.LIBRARY)
    assert match_library("libGLX_nvidia.so.0", comps).name == "libGLX_nvidia.so"
    assert match_library("libGL.so.1", comps).name == "libGL.so"
    assert match_library("libnvidia-pkcs11-openssl3.so.550", comps).name == "libnvidia-pkcs11-openssl3.so"
    assert match_library("libGLX.so.0", comps) is None


def test_parse_groups_reads_capability_lists():
    assert parse_groups("all") == ALL_GROUPS
    assert parse_groups("utility, compute") == {Group.UTILITY, Group.COMPUTE}
    with pytest.raises(ValueError):
        parse_groups("utility,bogus")


def test_the_volumes_package_imports_without_isolator():
    import subprocess
    import sys

    code = (
        "import sys, volumes.build, volumes.manager, volumes.inject, volumes.manifest;"
        "bad = [m for m in sys.modules if m == 'isolator' or m.startswith('isolator.')];"
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_mountinfo_finds_the_innermost_mount_and_its_noexec_flag():
    from volumes.mounts import mount_of, parse_mountinfo

    text = (
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "30 22 0:25 / /var/run rw,nosuid,noexec shared:5 - tmpfs tmpfs rw,mode=755\n"
        "31 30 0:26 / /var/run/my\\040dir rw shared:6 - tmpfs tmpfs rw\n"
    )
    entries = parse_mountinfo(text)
    assert mount_of("/var/run/mesos/isolators/gpu", entries).noexec
    assert mount_of("/var/run/my dir/x", entries).mount_point == "/var/run/my dir"
    assert not mount_of("/var/lib", entries).noexec
    assert mount_of("/var/runner", entries).mount_point == "/"
