"""ld.so.cache (old, new and compat formats, as ldconfig writes them) and ELF parsing."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess

import pytest

from isolator.simhost.driver import build_driver_root, ldconfig, run_ldconfig, write_elf_so
from volumes.elf import parse_elf, read_elf
from volumes.errors import ElfError, LdCacheError
from volumes.ldcache import parse_ldcache, read_ldcache

# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("sim",)


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    return build_driver_root(str(tmp_path_factory.mktemp("driver")))


def ldconfig_print(cache: str) -> list[str]:
    out = subprocess.run([ldconfig(), "-p", "-C", cache], capture_output=True, text=True, check=True).stdout
    return [line.split(" => ")[1] for line in out.splitlines() if " => " in line]


@pytest.mark.parametrize("fmt", ["new", "old", "compat"])
def test_ldcache_parses_every_format_ldconfig_writes_with_the_same_entries_as_ldconfig_p(sim, tmp_path, fmt):
    cache = str(tmp_path / f"ld.so.cache.{fmt}")
    conf = tmp_path / "ld.so.conf"
    conf.write_text("".join(sim.root + d + "\n" for d in (sim.lib64_dir, sim.lib32_dir)))
    proc = subprocess.run([ldconfig(), "-c", fmt, "-C", cache, "-f", str(conf), "-X"], capture_output=True, text=True)
    if proc.returncode != 0 and "format" in proc.stderr:
        pytest.skip(f"this ldconfig cannot write the {fmt} format: {proc.stderr.strip()}")
    parsed = read_ldcache(cache)
    assert parsed.format == fmt
    assert [e.value for e in parsed.entries] == ldconfig_print(cache)
    keys = {(e.key, e.bits) for e in parsed.entries}
    assert ("libcuda.so.1", 64) in keys
    assert ("libcuda.so.1", 32) in keys


def test_ldcache_of_the_simulated_root_splits_64_and_32_bit_entries_by_flags(sim):
    cache = read_ldcache(sim.ldcache)
    by_path = {e.value: e for e in cache.entries}
    assert by_path[f"{sim.lib64_dir}/libnvidia-ml.so.1"].arch == "x86-64"
    assert by_path[f"{sim.lib32_dir}/libnvidia-ml.so.1"].bits == 32
    assert all(e.is_elf for e in cache.entries)


def test_crafted_old_format_cache_parses_without_ldconfig():
    strings = b"libfoo.so.1\0/lib/libfoo.so.1\0"
    data = b"ld.so-1.7.0\0" + struct.pack("<I", 1) + struct.pack("<iII", 0x0303, 0, 12) + strings
    cache = parse_ldcache(data)
    assert cache.format == "old"
    assert [(e.key, e.value, e.bits) for e in cache.entries] == [("libfoo.so.1", "/lib/libfoo.so.1", 64)]


@pytest.mark.parametrize(
    "data, cause",
    [
        (b"not a cache at all", "unknown format"),
        (b"ld.so-1.7.0\0" + struct.pack("<I", 1000), "do not fit"),
        (b"glibc-ld.so.cache1.0" + b"\0" * 28, "unsupported new-format version"),
        (b"glibc-ld.so.cache1.1" + b"\0", "truncated"),
        (b"ld.so-1.7.0\0" + struct.pack("<I", 1) + struct.pack("<iII", 3, 500, 600), "outside the file"),
    ],
)
def test_ldcache_rejects_damaged_files_with_a_typed_error(data, cause):
    with pytest.raises(LdCacheError, match=cause) as err:
        parse_ldcache(data, "/etc/ld.so.cache")
    assert err.value.message.startswith("failed to parse ld.so.cache '/etc/ld.so.cache'")


def test_missing_ldcache_is_a_typed_error(tmp_path):
    with pytest.raises(LdCacheError, match="No such file"):
        read_ldcache(str(tmp_path / "nope"))


def test_elf_reader_sees_class_soname_needed_and_abi_note_of_the_simulated_driver(sim):
    v = sim.version
    glx = read_elf(f"{sim.root}{sim.lib64_dir}/libGLX_nvidia.so.{v}")
    assert (glx.elf_class, glx.soname) == (64, "libGLX_nvidia.so.0")
    assert f"libnvidia-glcore.so.{v}" in glx.needed
    tls = read_elf(f"{sim.root}{sim.lib64_dir}/libnvidia-tls.so.{v}")
    assert tls.abi_tag == (0, 2, 3, 99)
    cuda32 = read_elf(f"{sim.root}{sim.lib32_dir}/libcuda.so.{v}")
    assert (cuda32.elf_class, cuda32.soname) == (32, "libcuda.so.1")


@pytest.mark.parametrize("bits", [32, 64])
def test_written_elf_objects_parse_and_ldconfig_caches_them(tmp_path, bits):
    libdir = tmp_path / "lib"
    libdir.mkdir()
    data = write_elf_so(bits, "libnvidia-tls.so.1.2", ("libdep.so.3",), (0, 2, 3, 99))
    (libdir / "libnvidia-tls.so.1.2").write_bytes(data)
    info = parse_elf(data)
    assert (info.elf_class, info.soname, info.needed, info.abi_tag) == (
        bits,
        "libnvidia-tls.so.1.2",
        ("libdep.so.3",),
        (0, 2, 3, 99),
    )
    cache = str(tmp_path / "cache")
    conf = tmp_path / "conf"
    conf.write_text(f"{libdir}\n")
    subprocess.run([ldconfig(), "-C", cache, "-f", str(conf), "-X"], check=True, capture_output=True)
    # ldconfig always adds the system's trusted directories; look at ours only.
    entries = [e for e in read_ldcache(cache).entries if e.value.startswith(str(libdir))]
    assert [(e.key, e.bits) for e in entries] == [("libnvidia-tls.so.1.2", bits)]


@pytest.mark.parametrize(
    "data, cause",
    [
        (b"#!/bin/sh\n", "bad magic"),
        (b"\x7fELF\x03\x01\x01" + b"\0" * 9, "unknown ELF class"),
        (b"\x7fELF\x02\x01\x01" + b"\0" * 20, "truncated"),
    ],
)
def test_elf_reader_rejects_non_elf_and_truncated_files(data, cause):
    with pytest.raises(ElfError, match=cause):
        parse_elf(data, "/x")


def test_elf_reader_reads_a_real_system_library():
    libc = "/lib/x86_64-linux-gnu/libc.so.6"
    if not os.path.exists(libc) or shutil.which("gcc") is None:
        pytest.skip("not a Debian x86-64 host")
    info = read_elf(libc)
    assert info.soname == "libc.so.6" and info.elf_class == 64


def test_ldconfig_is_found_with_a_normal_users_path(tmp_path, monkeypatch):
    # A normal user's PATH has no sbin (Debian's login.defs: /usr/local/bin:/usr/bin:/bin:...), and
    # `make test-unit` runs as one; ldconfig lives in /sbin.
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin:/bin")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "ld.so.conf").write_text("")
    run_ldconfig(str(tmp_path))
    assert (tmp_path / "etc" / "ld.so.cache").exists()
    cache = str(tmp_path / "etc" / "ld.so.cache")
    assert ldconfig_print(cache) == []
