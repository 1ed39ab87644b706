"""Pure planning: discovery results -> the contents of one ``nvidia_<version>`` volume.

Applies v1's and Mesos's filters plus libnvidia-container's version rule, and records every skip
with its reason. No I/O: the build edge (``build``) applies the plan to the filesystem.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from enum import StrEnum

from volumes.catalog import BINARIES, LIBRARIES, Component, Group, Kind, wanted
from volumes.discover import Discovery, LibraryCandidate
from volumes.errors import InvalidDriverVersion

VOLUME_PREFIX = "nvidia_"
# Driver versions name directories: digits, letters, '.', '-', '_' only (e.g. 550.54.15, 396.26-1).
_VERSION_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{0,63}$")

# Non-GLVND GL names: kept only when built by NVIDIA, i.e. when they need NVIDIA's GL/EGL core or the
# GLVND dispatcher (v1 blacklisted(): libnvidia-e?glcore.so; Mesos isBlacklisted(): also libGLdispatch).
COMPAT_GL = ("libGL.so", "libEGL.so", "libGLESv1_CM.so", "libGLESv2.so")
NVIDIA_GL_DEPS = ("libGLdispatch.so", "libnvidia-glcore.so", "libnvidia-eglcore.so")
# v1 keeps libnvidia-tls only when .note.ABI-tag at offset 24 reads 0x6300000003: kernel ABI 2.3.99,
# the "new TLS ABI" build (reference §1.3).
NEW_TLS_ABI = (2, 3, 99)


class Reason(StrEnum):
    FOREIGN_GL = "foreign-gl"
    OLD_TLS_ABI = "old-tls-abi"
    VERSION = "version-mismatch"
    UNREADABLE = "unreadable"
    CLASS_MISMATCH = "class-mismatch"
    DUPLICATE = "duplicate-name"


@dataclass(frozen=True)
class PlannedFile:
    dir: str  # "bin", "lib" (32-bit) or "lib64"
    name: str  # file name in the volume
    source: str  # path on this host to link or copy from
    real_path: str  # the same file as seen under the driver root
    group: str
    component: str
    soname: str | None = None
    elf_class: int | None = None


@dataclass(frozen=True)
class PlannedLink:
    dir: str
    name: str
    target: str  # relative: a file name in the same directory


@dataclass(frozen=True)
class Skipped:
    path: str  # as seen under the driver root (the cache's path when it did not resolve)
    component: str
    reason: str
    detail: str


@dataclass(frozen=True)
class Missing:
    component: str
    group: str
    kind: str
    optional: bool


@dataclass(frozen=True)
class VolumePlan:
    driver_version: str
    driver_root: str
    ldcache: str
    ldcache_format: str
    groups: tuple[str, ...]
    files: tuple[PlannedFile, ...]
    links: tuple[PlannedLink, ...]
    skipped: tuple[Skipped, ...]
    missing: tuple[Missing, ...]

    @property
    def name(self) -> str:
        return volume_name(self.driver_version)

    def digest(self) -> str:
        """Identity of what goes into the volume (file sources, names and links), for idempotence."""
        body = json.dumps(
            [[asdict(f) for f in self.files], [asdict(link) for link in self.links]], sort_keys=True
        ).encode()
        return hashlib.sha256(body).hexdigest()


def check_version(version: str) -> str:
    if not isinstance(version, str) or not _VERSION_RE.match(version) or ".." in version:
        raise InvalidDriverVersion(version=version, cause="expected something like 550.54.15")
    return version


def volume_name(version: str) -> str:
    return VOLUME_PREFIX + check_version(version)


def plan_volume(discovery: Discovery, driver_version: str) -> VolumePlan:
    """Decide the volume's files, links, skips and missing components. Pure."""
    check_version(driver_version)
    catalog = {c.name: c for c in (*BINARIES, *LIBRARIES)}
    files: list[PlannedFile] = []
    skipped: list[Skipped] = []
    taken: set[tuple[str, str]] = set()
    found: set[str] = set()

    for b in discovery.binaries:
        comp = catalog[b.component]
        found.add(comp.name)
        # Named after the command (v1 used the resolved basename, which breaks `nvidia-smi` when the
        # PATH entry is a symlink to a versioned file).
        files.append(PlannedFile("bin", comp.name, b.host_path, b.real_path, comp.group.value, comp.name))
        taken.add(("bin", comp.name))

    seen: set[str] = set()
    for cand in discovery.libraries:
        found.add(cand.component)
        path = cand.real_path or cand.cache_path
        if path in seen:  # libcuda.so, libcuda.so.1 and the real file collapse to one (v1)
            continue
        seen.add(path)
        comp = catalog[cand.component]
        verdict = _judge(cand, comp, driver_version)
        if verdict is not None:
            skipped.append(Skipped(path, comp.name, verdict[0].value, verdict[1]))
            continue
        assert cand.elf is not None and cand.host_path is not None and cand.real_path is not None
        d = "lib64" if cand.elf.elf_class == 64 else "lib"
        name = cand.real_path.rsplit("/", 1)[-1]
        if (d, name) in taken:
            skipped.append(
                Skipped(path, comp.name, Reason.DUPLICATE.value, f"{d}/{name} already comes from another file")
            )
            continue
        taken.add((d, name))
        files.append(
            PlannedFile(
                d,
                name,
                cand.host_path,
                cand.real_path,
                comp.group.value,
                comp.name,
                cand.elf.soname,
                cand.elf.elf_class,
            )
        )

    links = _links(files, taken)
    missing = tuple(
        Missing(c.name, c.group.value, c.kind.value, c.optional)
        for c in wanted(discovery.groups)
        if c.name not in found
    )
    return VolumePlan(
        driver_version=driver_version,
        driver_root=discovery.driver_root,
        ldcache=discovery.ldcache_path,
        ldcache_format=discovery.ldcache_format,
        groups=tuple(sorted(g.value for g in discovery.groups)),
        files=tuple(files),
        links=links,
        skipped=tuple(skipped),
        missing=missing,
    )


def _judge(cand: LibraryCandidate, comp: Component, version: str) -> tuple[Reason, str] | None:
    """None to keep the library, else (reason, detail). The order puts the most telling reason first."""
    if cand.elf is None:
        return Reason.UNREADABLE, cand.error or "no ELF information"
    if cand.bits is not None and cand.bits != cand.elf.elf_class:
        return (
            Reason.CLASS_MISMATCH,
            f"ld.so.cache says {cand.bits}-bit ({cand.arch}), the file is ELF{cand.elf.elf_class}",
        )
    if comp.name in COMPAT_GL and not any(n.startswith(NVIDIA_GL_DEPS) for n in cand.elf.needed):
        needed = ", ".join(cand.elf.needed) or "nothing"
        return Reason.FOREIGN_GL, f"another vendor's GL library: needs {needed}, none of {', '.join(NVIDIA_GL_DEPS)}"
    if comp.name == "libnvidia-tls.so":
        abi = cand.elf.abi_tag
        if abi is None or tuple(abi[1:]) != NEW_TLS_ABI:
            shown = "none" if abi is None else ".".join(map(str, abi[1:]))
            return Reason.OLD_TLS_ABI, f"ABI note is {shown}, the new TLS ABI build says 2.3.99"
    name = (cand.real_path or cand.cache_path).rsplit("/", 1)[-1]
    if comp.versioned and not name.endswith("." + version):
        found = name.split(".so.", 1)[1] if ".so." in name else "none"
        return Reason.VERSION, f"file version {found} is not the running driver's {version}"
    return None


def _links(files: list[PlannedFile], taken: set[tuple[str, str]]) -> tuple[PlannedLink, ...]:
    links: dict[tuple[str, str], PlannedLink] = {}

    def add(d: str, name: str, target: str) -> None:
        if name != target and (d, name) not in taken and (d, name) not in links:
            links[(d, name)] = PlannedLink(d, name, target)

    for f in files:
        if f.dir == "bin" or not f.soname:
            continue
        add(f.dir, f.soname, f.name)  # v1: a relative SONAME link next to the file
    for f in files:
        if f.dir == "bin" or not f.soname:
            continue
        if f.soname.startswith("libcuda.so"):
            # v1: "many applications wrongly dlopen libcuda.so"; libnvidia-container points it at the SONAME.
            add(f.dir, "libcuda.so", f.soname)
        elif f.soname.startswith("libGLX_nvidia.so"):
            # GLVND's indirect GLX (v1, Mesos, libnvidia-container).
            add(f.dir, "libGLX_indirect.so.0", f.name)
        elif f.soname.startswith("libnvidia-opticalflow.so"):
            add(f.dir, "libnvidia-opticalflow.so", f.soname)  # libnvidia-container's third extra link
    return tuple(sorted(links.values(), key=lambda link: (link.dir, link.name)))


def files_by_group(plan_files: tuple[PlannedFile, ...]) -> dict[str, int]:
    out = {g.value: 0 for g in Group}
    for f in plan_files:
        out[f.group] += 1
    return out


__all__ = [
    "Kind",
    "Missing",
    "PlannedFile",
    "PlannedLink",
    "Reason",
    "Skipped",
    "VolumePlan",
    "check_version",
    "files_by_group",
    "plan_volume",
    "volume_name",
]
