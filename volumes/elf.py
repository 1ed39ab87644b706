"""A small ELF reader: class, machine, SONAME, DT_NEEDED and the GNU ABI note of a shared object.

Reads through the program headers only (PT_LOAD, PT_DYNAMIC, PT_NOTE), as the dynamic loader and
ldconfig do, so stripped files and files without section headers read the same. Reading only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from volumes.errors import ElfError

ELFCLASS32, ELFCLASS64 = 1, 2
ELFDATA2LSB, ELFDATA2MSB = 1, 2
ET_DYN, ET_EXEC = 3, 2
PT_LOAD, PT_DYNAMIC, PT_NOTE = 1, 2, 4
DT_NULL, DT_NEEDED, DT_STRTAB, DT_STRSZ, DT_SONAME = 0, 1, 5, 10, 14
NT_GNU_ABI_TAG = 1
# Refuse absurd tables instead of reading gigabytes from a corrupt or hostile file.
MAX_PHDRS = 512
MAX_DYN = 8192


@dataclass(frozen=True)
class ElfInfo:
    path: str
    elf_class: int  # 32 or 64
    machine: int  # e_machine: 3 i386, 62 x86-64, 183 aarch64, 21 ppc64
    type: int  # e_type: 3 ET_DYN, 2 ET_EXEC
    soname: str | None
    needed: tuple[str, ...]
    # (os, major, minor, patch) of NT_GNU_ABI_TAG; libnvidia-tls's new TLS ABI build says (0, 2, 3, 99).
    abi_tag: tuple[int, int, int, int] | None


def read_elf(path: str) -> ElfInfo:
    """Parse the file at ``path``; raises ElfError if it is not a readable ELF object."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ElfError(path=path, cause=exc.strerror or str(exc)) from exc
    return parse_elf(data, path)


def parse_elf(data: bytes, path: str = "<bytes>") -> ElfInfo:
    try:
        return _parse(data, path)
    except struct.error as exc:
        raise ElfError(path=path, cause=f"truncated ({exc})") from exc


def _parse(data: bytes, path: str) -> ElfInfo:
    if data[:4] != b"\x7fELF":
        raise ElfError(path=path, cause="not an ELF file (bad magic)")
    if len(data) < 16:
        raise ElfError(path=path, cause="truncated ELF identification")
    cls, enc = data[4], data[5]
    if cls not in (ELFCLASS32, ELFCLASS64):
        raise ElfError(path=path, cause=f"unknown ELF class {cls}")
    if enc not in (ELFDATA2LSB, ELFDATA2MSB):
        raise ElfError(path=path, cause=f"unknown ELF data encoding {enc}")
    e = "<" if enc == ELFDATA2LSB else ">"
    is64 = cls == ELFCLASS64
    if is64:
        e_type, e_machine, _v, _entry, e_phoff, _shoff, _flags, _ehsize, e_phentsize, e_phnum = struct.unpack_from(
            e + "HHIQQQIHHH", data, 16
        )
    else:
        e_type, e_machine, _v, _entry, e_phoff, _shoff, _flags, _ehsize, e_phentsize, e_phnum = struct.unpack_from(
            e + "HHIIIIIHHH", data, 16
        )
    if e_phnum > MAX_PHDRS:
        raise ElfError(path=path, cause=f"{e_phnum} program headers is more than {MAX_PHDRS}")
    phdrs = []  # (type, offset, vaddr, filesz)
    for i in range(e_phnum):
        off = e_phoff + i * e_phentsize
        if is64:
            p_type, _pf, p_offset, p_vaddr, _pa, p_filesz = struct.unpack_from(e + "IIQQQQ", data, off)
        else:
            p_type, p_offset, p_vaddr, _pa, p_filesz = struct.unpack_from(e + "IIIII", data, off)
        phdrs.append((p_type, p_offset, p_vaddr, p_filesz))

    def vaddr_to_offset(vaddr: int) -> int:
        for p_type, p_offset, p_vaddr, p_filesz in phdrs:
            if p_type == PT_LOAD and p_vaddr <= vaddr < p_vaddr + p_filesz:
                return vaddr - p_vaddr + p_offset
        raise ElfError(path=path, cause=f"address {vaddr:#x} is in no loadable segment")

    soname: str | None = None
    needed: list[str] = []
    abi: tuple[int, int, int, int] | None = None
    for p_type, p_offset, _vaddr, p_filesz in phdrs:
        if p_type == PT_DYNAMIC:
            soname, needed = _dynamic(data, e, is64, p_offset, p_filesz, vaddr_to_offset, path)
        elif p_type == PT_NOTE and abi is None:
            abi = _abi_tag(data, e, p_offset, p_filesz)
    return ElfInfo(path, 64 if is64 else 32, e_machine, e_type, soname, tuple(needed), abi)


def _dynamic(
    data: bytes, e: str, is64: bool, offset: int, size: int, vaddr_to_offset: Callable[[int], int], path: str
) -> tuple[str | None, list[str]]:
    fmt, entsize = (e + "qQ", 16) if is64 else (e + "iI", 8)
    count = min(size // entsize, MAX_DYN)
    strtab = strsz = None
    soname_off = None
    needed_offs: list[int] = []
    for i in range(count):
        tag, val = struct.unpack_from(fmt, data, offset + i * entsize)
        if tag == DT_NULL:
            break
        if tag == DT_STRTAB:
            strtab = val
        elif tag == DT_STRSZ:
            strsz = val
        elif tag == DT_SONAME:
            soname_off = val
        elif tag == DT_NEEDED:
            needed_offs.append(val)
    if strtab is None:
        if soname_off is None and not needed_offs:
            return None, []
        raise ElfError(path=path, cause="dynamic section has names but no DT_STRTAB")
    base = vaddr_to_offset(strtab)
    limit = base + strsz if strsz else len(data)

    def string(off: int) -> str:
        start = base + off
        end = data.find(b"\0", start, limit)
        if start >= limit or end < 0:
            raise ElfError(path=path, cause=f"string at {off} runs past the string table")
        return data[start:end].decode("utf-8", "replace")

    return (string(soname_off) if soname_off is not None else None), [string(o) for o in needed_offs]


def _abi_tag(data: bytes, e: str, offset: int, size: int) -> tuple[int, int, int, int] | None:
    pos, end = offset, offset + size
    while pos + 12 <= end:
        namesz, descsz, ntype = struct.unpack_from(e + "III", data, pos)
        name_start = pos + 12
        desc_start = name_start + ((namesz + 3) & ~3)
        name = data[name_start : name_start + namesz].rstrip(b"\0")
        if ntype == NT_GNU_ABI_TAG and name == b"GNU" and descsz >= 16:
            os_, major, minor, patch = struct.unpack_from(e + "IIII", data, desc_start)
            return (os_, major, minor, patch)
        pos = desc_start + ((descsz + 3) & ~3)
    return None
