"""Discovery edge: reads a driver root's ld.so.cache, resolves and ELF-inspects the catalogue's files.

Returns plain data for ``plan``; it decides nothing. Paths are resolved *under* the driver root
(absolute symlinks re-rooted, '..' clamped), never through the host's own '/', so a driver root that
is not '/' cannot point discovery at host files (the CVE-2024-0134 lesson, reference §4).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass

from volumes.catalog import DEFAULT_GROUPS, Component, Group, Kind, match_library, wanted
from volumes.elf import ElfInfo, read_elf
from volumes.errors import ElfError
from volumes.ldcache import read_ldcache

LOG = logging.getLogger(__name__)

DEFAULT_LDCACHE = "/etc/ld.so.cache"
# The PATH searched for binaries (libnvidia-container uses the caller's $PATH; we take it from config
# so the sidecar's own environment does not decide what goes into every container).
DEFAULT_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
MAX_SYMLINKS = 40  # Linux's MAXSYMLINKS


@dataclass(frozen=True)
class LibraryCandidate:
    component: str  # catalogue prefix the ldcache key matched
    key: str  # ldcache key, e.g. libcuda.so.1
    cache_path: str  # the path the cache names, as seen under the driver root
    real_path: str | None  # resolved under the driver root; None when it does not resolve
    host_path: str | None  # the same file as this process opens it
    bits: int | None  # from the ldcache flags
    arch: str
    elf: ElfInfo | None
    error: str | None  # why it could not be resolved or read


@dataclass(frozen=True)
class BinaryCandidate:
    component: str
    searched: str  # <PATH dir>/<name> under the driver root
    real_path: str
    host_path: str


@dataclass(frozen=True)
class Discovery:
    driver_root: str
    ldcache_path: str  # as seen under the driver root
    ldcache_format: str
    groups: frozenset[Group]
    libraries: tuple[LibraryCandidate, ...]
    binaries: tuple[BinaryCandidate, ...]


def resolve_under(root: str, path: str) -> str:
    """Resolve ``path`` as if ``root`` were '/': returns the real path under root (starting with '/').

    Raises OSError (ENOENT, ELOOP) like realpath(3) would.
    """
    root = root.rstrip("/")
    resolved: list[str] = []
    pending = [p for p in reversed(path.split("/"))]
    links = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        host = root + "/" + "/".join([*resolved, part])
        st = os.lstat(host)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), host)
            target = os.readlink(host)
            if target.startswith("/"):
                resolved = []
            pending.extend(reversed(target.split("/")))
        else:
            resolved.append(part)
    return "/" + "/".join(resolved)


def host_path(root: str, path: str) -> str:
    return root.rstrip("/") + path if root.rstrip("/") else path


class Discoverer:
    """Finds the catalogue's libraries in ``<driver_root><ldcache>`` and binaries along ``path``."""

    def __init__(
        self,
        driver_root: str = "/",
        ldcache: str = DEFAULT_LDCACHE,
        path: tuple[str, ...] = DEFAULT_PATH,
        groups: frozenset[Group] = DEFAULT_GROUPS,
    ) -> None:
        self.driver_root = os.path.abspath(driver_root)
        self.ldcache = ldcache
        self.path = tuple(path)
        self.groups = frozenset(groups)

    def discover(self) -> Discovery:
        components = wanted(self.groups)
        cache = read_ldcache(host_path(self.driver_root, self.ldcache))
        elf_cache: dict[str, ElfInfo | str] = {}
        libs: list[LibraryCandidate] = []
        for entry in cache.entries:
            if not entry.is_elf or entry.bits is None:
                continue
            comp = match_library(entry.key, components)
            if comp is None:
                continue
            libs.append(self._library(comp, entry.key, entry.value, entry.bits, entry.arch, elf_cache))
        bins = [b for b in (self._binary(c) for c in components if c.kind is Kind.BINARY) if b is not None]
        LOG.debug("discovered %d library entries and %d binaries under %s", len(libs), len(bins), self.driver_root)
        return Discovery(self.driver_root, self.ldcache, cache.format, self.groups, tuple(libs), tuple(bins))

    def _library(
        self, comp: Component, key: str, value: str, bits: int, arch: str, elf_cache: dict[str, ElfInfo | str]
    ) -> LibraryCandidate:
        try:
            real = resolve_under(self.driver_root, value)
        except OSError as exc:
            cause = f"cannot resolve: {exc.strerror or exc}"
            return LibraryCandidate(comp.name, key, value, None, None, bits, arch, None, cause)
        hpath = host_path(self.driver_root, real)
        if real not in elf_cache:
            try:
                elf_cache[real] = read_elf(hpath)
            except ElfError as exc:
                elf_cache[real] = str(exc.fields.get("cause", exc))
        got = elf_cache[real]
        if isinstance(got, str):
            return LibraryCandidate(comp.name, key, value, real, hpath, bits, arch, None, got)
        return LibraryCandidate(comp.name, key, value, real, hpath, bits, arch, got, None)

    def _binary(self, comp: Component) -> BinaryCandidate | None:
        for d in self.path:
            searched = os.path.join(d, comp.name)
            try:
                real = resolve_under(self.driver_root, searched)
                st = os.stat(host_path(self.driver_root, real))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
                return BinaryCandidate(comp.name, searched, real, host_path(self.driver_root, real))
        return None
