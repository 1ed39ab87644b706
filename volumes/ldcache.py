"""Parser of glibc's /etc/ld.so.cache, both on-disk formats; reading only, never writing.

Old ``ld.so-1.7.0`` (12-byte entries, strings after the entry table), new ``glibc-ld.so.cache1.1``
(24-byte entries, strings relative to the new header), and the compat file holding both. Layouts
follow glibc ``sysdeps/generic/dl-cache.h``; the 32/64-bit split comes from the entry flags.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from volumes.errors import LdCacheError

OLD_MAGIC = b"ld.so-1.7.0"
NEW_MAGIC = b"glibc-ld.so.cache"
NEW_VERSION = b"1.1"
OLD_HEADER = struct.Struct("<12sI")  # magic padded to 12, nlibs
OLD_ENTRY = struct.Struct("<iII")  # flags, key, value
NEW_HEADER = struct.Struct("<17s3sIIB3xI12x")  # magic, version, nlibs, len_strings, flags, extension_offset
NEW_ENTRY = struct.Struct("<iIIIQ")  # flags, key, value, osversion, hwcap
# glibc's ALIGN_CACHE: the new header after the old table starts on an 8-byte boundary (alignof uint64_t).
NEW_ALIGN = 8
# cache_file_new.flags: 2 means little-endian (cache_file_new_flags_endian_little). We read
# little-endian only, as every host this sidecar runs on (x86-64, aarch64, ppc64le) is.
ENDIAN_BIG = 3

FLAG_TYPE_MASK = 0x00FF
FLAG_ELF, FLAG_ELF_LIBC5, FLAG_ELF_LIBC6 = 1, 2, 3
FLAG_ARCH_MASK = 0xFF00
# FLAG_* arch values of dl-cache.h and the word size of their libraries.
ARCH_BITS: dict[int, tuple[str, int]] = {
    0x0000: ("i386/generic-32", 32),
    0x0100: ("sparc64", 64),
    0x0200: ("ia64", 64),
    0x0300: ("x86-64", 64),
    0x0400: ("s390x", 64),
    0x0500: ("ppc64", 64),
    0x0600: ("mips64-n32", 32),
    0x0700: ("mips64-n64", 64),
    0x0800: ("x32", 32),
    0x0900: ("arm-hf", 32),
    0x0A00: ("aarch64", 64),
    0x0B00: ("arm-sf", 32),
    0x0C00: ("mips32-nan2008", 32),
    0x0D00: ("mips64-n32-nan2008", 32),
    0x0E00: ("mips64-n64-nan2008", 64),
    0x0F00: ("riscv-soft", 64),
    0x1000: ("riscv-double", 64),
    0x1100: ("loongarch-soft", 64),
    0x1200: ("loongarch-double", 64),
}


@dataclass(frozen=True)
class Entry:
    key: str  # the library name the loader looks up, e.g. libcuda.so.1
    value: str  # the path ldconfig found it at, e.g. /usr/lib/x86_64-linux-gnu/libcuda.so.1
    flags: int
    osversion: int = 0
    hwcap: int = 0

    @property
    def is_elf(self) -> bool:
        # v1 keeps `flags & 0xff` with bit 1 set; 0 would be an a.out libc4 library.
        return (self.flags & FLAG_TYPE_MASK) in (FLAG_ELF, FLAG_ELF_LIBC5, FLAG_ELF_LIBC6)

    @property
    def arch(self) -> str:
        return ARCH_BITS.get(self.flags & FLAG_ARCH_MASK, (f"unknown-{self.flags & FLAG_ARCH_MASK:#06x}", 0))[0]

    @property
    def bits(self) -> int | None:
        """32 or 64 from the arch flag; None for an arch this table does not know."""
        found = ARCH_BITS.get(self.flags & FLAG_ARCH_MASK)
        return found[1] if found else None


@dataclass(frozen=True)
class LdCache:
    path: str
    format: str  # "old", "new" or "compat" (old table followed by a new one)
    entries: tuple[Entry, ...]  # the new table when present (what glibc reads), else the old one


def read_ldcache(path: str) -> LdCache:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise LdCacheError(path=path, cause=exc.strerror or str(exc)) from exc
    return parse_ldcache(data, path)


def parse_ldcache(data: bytes, path: str = "<bytes>") -> LdCache:
    try:
        if data.startswith(OLD_MAGIC):
            old, end = _parse_old(data, path)
            new_at = (end + NEW_ALIGN - 1) & ~(NEW_ALIGN - 1)
            if data[new_at : new_at + len(NEW_MAGIC)] == NEW_MAGIC:
                return LdCache(path, "compat", _parse_new(data, new_at, path))
            return LdCache(path, "old", old)
        if data.startswith(NEW_MAGIC):
            return LdCache(path, "new", _parse_new(data, 0, path))
    except struct.error as exc:
        raise LdCacheError(path=path, cause=f"truncated ({exc})") from exc
    raise LdCacheError(path=path, cause=f"unknown format (magic {data[:20]!r})")


def _string(data: bytes, offset: int, path: str) -> str:
    end = data.find(b"\0", offset)
    if offset >= len(data) or end < 0:
        raise LdCacheError(path=path, cause=f"string offset {offset} is outside the file")
    return data[offset:end].decode("utf-8", "surrogateescape")


def _parse_old(data: bytes, path: str) -> tuple[tuple[Entry, ...], int]:
    _magic, nlibs = OLD_HEADER.unpack_from(data, 0)
    end = OLD_HEADER.size + nlibs * OLD_ENTRY.size
    if end > len(data):
        raise LdCacheError(path=path, cause=f"{nlibs} old-format entries do not fit in {len(data)} bytes")
    entries = []
    for i in range(nlibs):
        flags, key, value = OLD_ENTRY.unpack_from(data, OLD_HEADER.size + i * OLD_ENTRY.size)
        # Old-format offsets count from the end of the entry table (glibc: &cache->libs[nlibs]).
        entries.append(Entry(_string(data, end + key, path), _string(data, end + value, path), flags))
    return tuple(entries), end


def _parse_new(data: bytes, base: int, path: str) -> tuple[Entry, ...]:
    _magic, version, nlibs, _len_strings, flags, _ext = NEW_HEADER.unpack_from(data, base)
    if version != NEW_VERSION:
        raise LdCacheError(path=path, cause=f"unsupported new-format version {version!r}")
    if flags == ENDIAN_BIG:
        raise LdCacheError(path=path, cause="big-endian cache files are not supported")
    first = base + NEW_HEADER.size
    if first + nlibs * NEW_ENTRY.size > len(data):
        raise LdCacheError(path=path, cause=f"{nlibs} new-format entries do not fit in {len(data)} bytes")
    entries = []
    for i in range(nlibs):
        eflags, key, value, osversion, hwcap = NEW_ENTRY.unpack_from(data, first + i * NEW_ENTRY.size)
        # New-format offsets count from the new header (glibc: cache_data = (char *) cache_new).
        entries.append(
            Entry(_string(data, base + key, path), _string(data, base + value, path), eflags, osversion, hwcap)
        )
    return tuple(entries)
