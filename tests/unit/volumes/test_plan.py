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


# ---- Each filter at its boundary, each skip's detail, each link rule ---------------------------
# So that a changed comparison, a swapped branch or a dropped link is noticed (make mutation,
# docs/mutation.md).

from volumes.plan import Reason, check_version, files_by_group  # noqa: E402


def _skip(candidate):
    plan = plan_volume(discovery(candidate), V)
    assert plan.files == ()
    (s,) = plan.skipped
    return s


def test_skip_details_say_what_was_found():
    s = _skip(lib("libcuda.so", f"/usr/lib/libcuda.so.{V}", elf=False, error="not an ELF file"))
    assert (s.path, s.component, s.reason, s.detail) == (
        f"/usr/lib/libcuda.so.{V}",
        "libcuda.so",
        "unreadable",
        "not an ELF file",
    )
    assert _skip(lib("libcuda.so", f"/usr/lib/libcuda.so.{V}", elf=False)).detail == "no ELF information"
    s = _skip(lib("libGL.so", "/usr/lib/libGL.so.1", needed=("libglapi.so.0", "libc.so.6")))
    assert s.detail == (
        "another vendor's GL library: needs libglapi.so.0, libc.so.6, none of "
        "libGLdispatch.so, libnvidia-glcore.so, libnvidia-eglcore.so"
    )
    assert _skip(lib("libEGL.so", "/usr/lib/libEGL.so.1")).detail.startswith(
        "another vendor's GL library: needs nothing, none of"
    )
    s = _skip(lib("libnvidia-tls.so", f"/usr/lib/libnvidia-tls.so.{V}", abi=(0, 2, 2, 0)))
    assert s.detail == "ABI note is 2.2.0, the new TLS ABI build says 2.3.99"
    s = _skip(lib("libnvidia-tls.so", f"/usr/lib/libnvidia-tls.so.{V}"))
    assert s.detail == "ABI note is none, the new TLS ABI build says 2.3.99"
    s = _skip(lib("libcuda.so", "/usr/lib/libcuda.so.535.104.05"))
    assert s.detail == f"file version 535.104.05 is not the running driver's {V}"
    s = _skip(lib("libcuda.so", "/usr/lib/libcuda.so"))
    assert s.detail == f"file version none is not the running driver's {V}"


def test_class_mismatch_detail_names_both_classes():
    wrong = LibraryCandidate(
        "libcuda.so", "libcuda.so.1", "/l/libcuda.so.1", f"/l/libcuda.so.{V}", "/h", 32, "i386",
        ElfInfo("/h", 64, 62, 3, "libcuda.so.1", (), None), None,
    )  # fmt: skip
    s = _skip(wrong)
    assert (s.reason, s.detail) == ("class-mismatch", "ld.so.cache says 32-bit (i386), the file is ELF64")
    assert s.path == f"/l/libcuda.so.{V}"


def test_a_cache_entry_without_bits_is_judged_by_the_file_alone():
    c = LibraryCandidate(
        "libcuda.so", "libcuda.so.1", "/l/libcuda.so.1", f"/l/libcuda.so.{V}", "/h", None, "x86-64",
        ElfInfo("/h", 32, 3, 3, "libcuda.so.1", (), None), None,
    )  # fmt: skip
    assert [(f.dir, f.elf_class) for f in plan_volume(discovery(c), V).files] == [("lib", 32)]


def test_an_unresolved_library_is_skipped_under_its_cache_path():
    c = LibraryCandidate("libcuda.so", "libcuda.so.1", "/usr/lib/libcuda.so.1", None, None, 64, "x86-64", None, "gone")
    s = _skip(c)
    assert (s.path, s.detail) == ("/usr/lib/libcuda.so.1", "gone")


@pytest.mark.parametrize(
    "needed, kept",
    [
        (("libGLdispatch.so.0",), True),
        (("libc.so.6", f"libnvidia-eglcore.so.{V}"), True),
        ((f"libnvidia-glcore.so.{V}",), True),
        (("libglapi.so.0", "libc.so.6"), False),
        (("xlibGLdispatch.so.0",), False),  # a prefix, not a substring
    ],
)
def test_compat_gl_is_kept_when_any_needed_library_is_nvidia_gl(needed, kept):
    plan = plan_volume(discovery(lib("libGLESv2.so", f"/usr/lib/libGLESv2.so.{V}", needed=needed)), V)
    assert bool(plan.files) is kept
    assert [s.reason for s in plan.skipped] == ([] if kept else [Reason.FOREIGN_GL.value])


def test_non_compat_gl_libraries_are_not_vendor_checked():
    plan = plan_volume(discovery(lib("libGLX_nvidia.so", f"/usr/lib/libGLX_nvidia.so.{V}", needed=())), V)
    assert [f.name for f in plan.files] == [f"libGLX_nvidia.so.{V}"]


@pytest.mark.parametrize(
    "abi, kept",
    [
        ((0, 2, 3, 99), True),
        ((1, 2, 3, 99), True),
        ((0, 2, 3, 98), False),
        ((0, 2, 4, 99), False),
        ((0, 3, 3, 99), False),
    ],
)
def test_tls_is_kept_only_for_the_new_abi_note_whatever_the_os_field(abi, kept):
    plan = plan_volume(discovery(lib("libnvidia-tls.so", f"/usr/lib/libnvidia-tls.so.{V}", abi=abi)), V)
    assert bool(plan.files) is kept


def test_version_must_end_the_file_name_exactly():
    assert _skip(lib("libcuda.so", f"/usr/lib/libcuda.so.{V}.1")).reason == "version-mismatch"
    assert _skip(lib("libcuda.so", f"/usr/lib/libcuda.so.1{V}")).reason == "version-mismatch"
    plan = plan_volume(discovery(lib("libnvidia-egl-wayland.so", "/usr/lib/libnvidia-egl-wayland.so.1.1.13")), V)
    assert [f.name for f in plan.files] == ["libnvidia-egl-wayland.so.1.1.13"]  # versioned=False


def test_planned_file_records_source_elf_facts_and_catalogue_group():
    plan = plan_volume(discovery(lib("libcuda.so", f"/usr/lib/libcuda.so.{V}", soname="libcuda.so.1")), V)
    (f,) = plan.files
    assert (f.dir, f.name, f.source, f.real_path, f.group, f.component, f.soname, f.elf_class) == (
        "lib64",
        f"libcuda.so.{V}",
        f"/host/usr/lib/libcuda.so.{V}",
        f"/usr/lib/libcuda.so.{V}",
        "compute",
        "libcuda.so",
        "libcuda.so.1",
        64,
    )


def test_plan_records_its_inputs_and_sorted_groups():
    d = Discovery("/driver", "/etc/ld.so.cache", "old+new", frozenset({Group.UTILITY, Group.COMPUTE}), (), ())
    plan = plan_volume(d, V)
    assert (plan.driver_version, plan.driver_root, plan.ldcache, plan.ldcache_format) == (
        V,
        "/driver",
        "/etc/ld.so.cache",
        "old+new",
    )
    assert plan.groups == ("compute", "utility")
    assert plan.name == f"nvidia_{V}"


def test_found_components_are_not_missing_even_when_skipped():
    plan = plan_volume(
        discovery(lib("libcuda.so", "/usr/lib/libcuda.so.1.0", soname="libcuda.so.1"), groups={Group.COMPUTE}), V
    )
    names = {m.component for m in plan.missing}
    assert "libcuda.so" not in names and "libnvidia-ptxjitcompiler.so" in names
    m = next(m for m in plan.missing if m.component == "libnvidia-ptxjitcompiler.so")
    assert (m.group, m.kind) == ("compute", "library")


def test_a_binary_takes_its_name_so_a_library_of_that_name_in_bin_cannot_collide():
    b = BinaryCandidate("nvidia-smi", "/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi", "/host/usr/bin/nvidia-smi")
    plan = plan_volume(discovery(bins=(b,), groups={Group.UTILITY}), V)
    (f,) = plan.files
    assert (f.real_path, f.group, f.component, f.soname) == ("/usr/bin/nvidia-smi", "utility", "nvidia-smi", None)
    assert plan.links == ()


def test_duplicate_detail_names_the_directory_and_file():
    plan = plan_volume(
        discovery(
            lib("libcuda.so", f"/a/libcuda.so.{V}"),
            lib("libcuda.so", f"/b/libcuda.so.{V}"),
            lib("libcuda.so", f"/c/libcuda.so.{V}", bits=32),
        ),
        V,
    )
    assert [(f.dir, f.real_path) for f in plan.files] == [
        ("lib64", f"/a/libcuda.so.{V}"),
        ("lib", f"/c/libcuda.so.{V}"),
    ]
    (s,) = plan.skipped
    assert (s.path, s.detail) == (f"/b/libcuda.so.{V}", f"lib64/libcuda.so.{V} already comes from another file")


def test_links_are_sorted_per_directory_and_never_point_at_themselves():
    plan = plan_volume(
        discovery(
            lib("libcuda.so", f"/usr/lib/libcuda.so.{V}", soname="libcuda.so.1"),
            lib("libcuda.so", f"/usr/lib32/libcuda.so.{V}", bits=32, soname="libcuda.so.1"),
            # A library whose SONAME is its own file name needs no link.
            lib("libnvidia-ml.so", "/usr/lib/libnvidia-ml.so.1", key="x", soname="libnvidia-ml.so.1"),
            lib("libnvidia-ml.so", f"/usr/lib/libnvidia-ml.so.{V}", soname="libnvidia-ml.so.1"),
        ),
        "1",
    )
    assert [(f.dir, f.name) for f in plan.files] == [("lib64", "libnvidia-ml.so.1")]
    assert plan.links == ()
    plan = plan_volume(
        discovery(
            lib("libnvidia-ml.so", f"/usr/lib/libnvidia-ml.so.{V}", soname="libnvidia-ml.so.1"),
            lib("libcuda.so", f"/usr/lib/libcuda.so.{V}", soname="libcuda.so.1"),
            lib("libcuda.so", f"/usr/lib32/libcuda.so.{V}", bits=32, soname="libcuda.so.1"),
        ),
        V,
    )
    assert [(link.dir, link.name, link.target) for link in plan.links] == [
        ("lib", "libcuda.so", "libcuda.so.1"),
        ("lib", "libcuda.so.1", f"libcuda.so.{V}"),
        ("lib64", "libcuda.so", "libcuda.so.1"),
        ("lib64", "libcuda.so.1", f"libcuda.so.{V}"),
        ("lib64", "libnvidia-ml.so.1", f"libnvidia-ml.so.{V}"),
    ]


def test_a_file_already_named_like_a_link_keeps_its_place():
    # The SONAME shipped as a file of its own (version-exempt components only): no link replaces it.
    plan = plan_volume(
        discovery(
            lib(
                "libnvidia-egl-wayland.so",
                "/usr/lib/libnvidia-egl-wayland.so.1.1.13",
                soname="libnvidia-egl-wayland.so.1",
            ),
            lib(
                "libnvidia-egl-wayland.so",
                "/usr/lib/libnvidia-egl-wayland.so.1",
                key="k",
                soname="libnvidia-egl-wayland.so.1",
            ),
        ),
        V,
    )
    assert {f.name for f in plan.files} == {"libnvidia-egl-wayland.so.1.1.13", "libnvidia-egl-wayland.so.1"}
    assert plan.links == ()


def test_the_first_link_of_a_name_wins():
    plan = plan_volume(
        discovery(
            lib("libGLX_nvidia.so", f"/usr/lib/libGLX_nvidia.so.{V}", soname="libGLX_nvidia.so.0"),
            lib("libGLX_nvidia.so", f"/usr/lib/x/libGLX_nvidia.so.0.{V}", soname="libGLX_nvidia.so.0"),
        ),
        f"0.{V}",
    )
    # Only the second file carries the running "version"; the first one is skipped.
    assert [f.name for f in plan.files] == [f"libGLX_nvidia.so.0.{V}"]
    assert [(link.name, link.target) for link in plan.links] == [
        ("libGLX_indirect.so.0", f"libGLX_nvidia.so.0.{V}"),
        ("libGLX_nvidia.so.0", f"libGLX_nvidia.so.0.{V}"),
    ]


def test_libraries_without_a_soname_get_no_links():
    plan = plan_volume(discovery(lib("libcuda.so", f"/usr/lib/libcuda.so.{V}")), V)
    assert plan.links == ()


def test_extra_links_only_for_their_own_sonames():
    plan = plan_volume(
        discovery(lib("libnvidia-ml.so", f"/usr/lib/libnvidia-ml.so.{V}", soname="libnvidia-ml.so.1")), V
    )
    assert [link.name for link in plan.links] == ["libnvidia-ml.so.1"]


def test_digest_covers_links_not_only_files():
    a = plan_volume(discovery(lib("libcuda.so", f"/a/libcuda.so.{V}", soname="libcuda.so.1")), V)
    b = plan_volume(discovery(lib("libcuda.so", f"/a/libcuda.so.{V}", soname="libcuda.so.2")), V)
    assert a.digest() != b.digest()
    assert len(a.digest()) == 64


def test_files_by_group_counts_every_group_including_empty_ones():
    plan = plan_volume(
        discovery(
            lib("libcuda.so", f"/usr/lib/libcuda.so.{V}"),
            lib("libcuda.so", f"/usr/lib32/libcuda.so.{V}", bits=32),
            lib("libnvidia-ml.so", f"/usr/lib/libnvidia-ml.so.{V}"),
        ),
        V,
    )
    counts = files_by_group(plan.files)
    assert counts == {g.value: 0 for g in Group} | {"compute": 2, "utility": 1}


@pytest.mark.parametrize("version", ["5", "550.54.15", "396.26-1", "a_b", "9" * 64])
def test_driver_versions_up_to_64_characters_name_a_directory(version):
    assert check_version(version) == version
    assert volume_name(version) == "nvidia_" + version


@pytest.mark.parametrize("version", ["9" * 65, "-1", "_x", None, 550])
def test_driver_versions_that_are_too_long_start_oddly_or_are_not_text_are_refused(version):
    with pytest.raises(InvalidDriverVersion) as err:
        check_version(version)
    assert err.value.fields == {"version": version, "cause": "expected something like 550.54.15"}


def test_digest_is_stable_across_releases_because_manifests_record_it():
    # volumes/build.py writes plan_digest into each volume's manifest; a change in how the plan is
    # serialised (key order included) would make every existing volume look different.
    plan = plan_volume(discovery(lib("libcuda.so", f"/usr/lib/libcuda.so.{V}", soname="libcuda.so.1")), V)
    assert plan.digest() == "8f1a5f48fb5970ac3f124fdf96f027293b1438b94255a84123f6dcd99bfc5e69"


def test_the_version_in_a_skip_is_everything_after_the_first_so_of_the_file_name():
    s = _skip(lib("libcuda.so", "/opt/nvidia.so.d/libcuda.so.550.so.1"))
    assert s.detail == f"file version 550.so.1 is not the running driver's {V}"
    s = _skip(lib("libcuda.so", "/opt/nvidia.so.d/libcuda.so"))
    assert s.detail == f"file version none is not the running driver's {V}"


def test_binaries_before_libraries_do_not_stop_the_links():
    b = BinaryCandidate("nvidia-smi", "/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi", "/host/usr/bin/nvidia-smi")
    plan = plan_volume(discovery(lib("libcuda.so", f"/usr/lib/libcuda.so.{V}", soname="libcuda.so.1"), bins=(b,)), V)
    assert [(link.dir, link.name) for link in plan.links] == [("lib64", "libcuda.so"), ("lib64", "libcuda.so.1")]
    assert "nvidia-smi" not in {m.component for m in plan.missing}


def test_cache_keys_of_one_file_collapse_silently():
    real = f"/usr/lib/libcuda.so.{V}"
    plan = plan_volume(
        discovery(lib("libcuda.so", real, key="libcuda.so.1"), lib("libcuda.so", real, key="libcuda.so")), V
    )
    assert len(plan.files) == 1 and plan.skipped == ()


def test_duplicate_skip_names_its_component():
    plan = plan_volume(discovery(lib("libcuda.so", f"/a/libcuda.so.{V}"), lib("libcuda.so", f"/b/libcuda.so.{V}")), V)
    assert [(s.component, s.reason) for s in plan.skipped] == [("libcuda.so", "duplicate-name")]
