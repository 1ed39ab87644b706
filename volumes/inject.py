"""Pure decision: does a container with an image get the driver volume, with which mount and env.

Mesos ``shouldInject`` and ``NvidiaVolume::ENV`` (mesos-gpu-isolator.md §2.7-2.9) plus nvidia-docker
v1's CUDA check (reference §1.7). Returns plain data; the caller makes the directory and the mount.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from volumes.errors import CudaVersionUnsupported, InvalidImageConfig

CONTAINER_PATH = "/usr/local/nvidia"
# <linux/mount.h>; Mesos mounts the volume with MS_RDONLY|MS_BIND|MS_REC.
MS_RDONLY = 1
MS_BIND = 4096
MS_REC = 16384
VOLUME_MOUNT_FLAGS = MS_RDONLY | MS_BIND | MS_REC

PATH_ADDITIONS = ("/usr/local/nvidia/bin",)
# In this order: the image's CUDA forward-compat libraries win over the host's (MESOS-9549).
LD_LIBRARY_PATH_ADDITIONS = ("/usr/local/cuda/compat", "/usr/local/nvidia/lib", "/usr/local/nvidia/lib64")
# Docker's PATH for an image that sets none. Mesos would give just /usr/local/nvidia/bin (a quirk
# we do not copy: the task could no longer find /bin/sh).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

LABEL_VOLUMES_NEEDED = "com.nvidia.volumes.needed"
LABEL_CUDA_VERSION = "com.nvidia.cuda.version"

_VERSION_RE = re.compile(r"^\d+(\.\d+)*$")
_COND_RE = re.compile(r"^(cuda|driver|arch|brand)(>=|<=|==|=|>|<)(.+)$")


@dataclass(frozen=True)
class Image:
    """The parts of a Docker image config that matter here (config.Env and config.Labels)."""

    env: tuple[str, ...] = ()  # "KEY=VALUE" entries, as the manifest lists them
    labels: Mapping[str, str] | None = None


@dataclass(frozen=True)
class DriverFacts:
    driver_version: str  # nvmlSystemGetDriverVersion, e.g. 550.54.15
    cuda_version: str  # cuDriverGetVersion as "major.minor", e.g. 12.4
    brand: str | None = None  # for NVIDIA_REQUIRE_CUDA brand= terms (nvmlDeviceGetBrand, lower case)
    arch: str | None = None  # for arch= terms (compute capability, e.g. 8.0)


@dataclass(frozen=True)
class MountSpec:
    source: str
    target: str
    flags: int
    mkdir: bool = True  # the target directory must be created first (Mesos mkdirs it)


@dataclass(frozen=True)
class Injection:
    mounts: tuple[MountSpec, ...]
    env: dict[str, str]
    reason: str


def cuda_version_from_int(value: int) -> str:
    """cuDriverGetVersion's integer -> "major.minor" (v1: d/1000 . (d%100)/10; 12040 -> 12.4)."""
    return f"{value // 1000}.{(value % 100) // 10}"


def image_env(image: Image) -> dict[str, str]:
    """The image's env as a dict; the first occurrence of a key wins, as Mesos scans it."""
    out: dict[str, str] = {}
    for item in image.env:
        key, sep, value = item.partition("=")
        if sep and key not in out:
            out[key] = value
    return out


def should_inject(image: Image) -> tuple[bool, str]:
    """Mesos's shouldInject: NVIDIA_VISIBLE_DEVICES first, then the v1 label."""
    env = image_env(image)
    if "NVIDIA_VISIBLE_DEVICES" in env:
        value = env["NVIDIA_VISIBLE_DEVICES"]
        if value in ("", "void"):
            return False, f"image sets NVIDIA_VISIBLE_DEVICES={value!r}"
        return True, f"image sets NVIDIA_VISIBLE_DEVICES={value}"
    if LABEL_VOLUMES_NEEDED in (image.labels or {}):
        return True, f"image has label {LABEL_VOLUMES_NEEDED}"
    return False, "image neither sets NVIDIA_VISIBLE_DEVICES nor has label " + LABEL_VOLUMES_NEEDED


def _append(value: str | None, additions: Sequence[str]) -> str:
    # Empty components mean "the current directory" to the loader: never create one by joining.
    parts = [p for p in value.split(":")] if value else []
    present = set(parts)
    parts = [p for p in parts if p] + [a for a in additions if a not in present]
    return ":".join(parts)


def volume_env(image: Image) -> dict[str, str]:
    """PATH and LD_LIBRARY_PATH built from the image's own values (Mesos NvidiaVolume::ENV)."""
    env = image_env(image)
    return {
        "PATH": _append(env.get("PATH", DEFAULT_PATH), PATH_ADDITIONS),
        "LD_LIBRARY_PATH": _append(env.get("LD_LIBRARY_PATH"), LD_LIBRARY_PATH_ADDITIONS),
    }


def plan_injection(rootfs: str | None, image: Image | None, volume_path: str, facts: DriverFacts) -> Injection | None:
    """None when the container gets no volume; raises CudaVersionUnsupported for a too-new image."""
    if rootfs is None or image is None:
        return None  # host filesystem: the container already sees the host's libraries (Mesos)
    inject, reason = should_inject(image)
    if not inject:
        return None
    check_cuda(image, facts, rootfs)
    return volume_injection(rootfs, image, volume_path, reason)


def volume_injection(rootfs: str, image: Image, volume_path: str, reason: str) -> Injection:
    """The volume's mount and environment for an image already found to take it (``should_inject``
    said yes for ``reason`` and ``check_cuda`` passed): ``plan_injection`` once it has decided, for
    a caller that decided earlier (Prepare decides before it allocates, and does not decide again)."""
    target = rootfs.rstrip("/") + CONTAINER_PATH
    return Injection((MountSpec(volume_path, target, VOLUME_MOUNT_FLAGS),), volume_env(image), reason)


# ---- CUDA requirements ---------------------------------------------------------------------------


def _version(text: str, field: str) -> tuple[int, ...]:
    m = _VERSION_RE.match(text.strip())
    if not m:
        raise InvalidImageConfig(field=field, value=text, cause="expected a version like 12.4")
    parts = re.findall(r"\d+", text.strip())
    return tuple(int(p) for p in parts)


def _compare(a: tuple[int, ...], op: str, b: tuple[int, ...]) -> bool:
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return {
        ">=": a >= b,
        "<=": a <= b,
        ">": a > b,
        "<": a < b,
        "=": a == b,
        "==": a == b,
    }[op]


def _condition_holds(cond: str, facts: DriverFacts, field: str) -> bool:
    m = _COND_RE.match(cond)
    if not m:
        raise InvalidImageConfig(field=field, value=cond, cause="expected cuda|driver|arch|brand<op><value>")
    name, op, value = m.groups()
    if name == "brand":
        return facts.brand is not None and facts.brand.lower() == value.lower()
    if name == "arch":
        return facts.arch is not None and _compare(_version(facts.arch, "arch"), op, _version(value, field))
    have = facts.cuda_version if name == "cuda" else facts.driver_version
    return _compare(_version(have, name), op, _version(value, field))


def _cuda_requirement(expr: str) -> str:
    """The cuda>= version an expression asks for, for the refusal message."""
    m = re.search(r"cuda>=?(\d+\.\d+)", expr)
    return m.group(1) if m else expr


def check_cuda(image: Image, facts: DriverFacts, rootfs: str = "") -> None:
    """Refuse an image that needs a newer CUDA than the driver supports.

    Checked, all that are present: the v1 label ``com.nvidia.cuda.version`` (major.minor <= driver);
    ``NVIDIA_REQUIRE_CUDA`` (space-separated alternatives of comma-joined conditions, as
    libnvidia-container reads it; brand/arch terms hold only when ``facts`` knows them); else
    ``CUDA_VERSION`` as ``cuda>=major.minor`` (the toolkit's legacy rule). ``NVIDIA_DISABLE_REQUIRE``
    turns the env checks off, as in the toolkit.
    """
    env = image_env(image)
    label = (image.labels or {}).get(LABEL_CUDA_VERSION)
    driver = _version(facts.cuda_version, "driver CUDA version")[:2]
    if label is not None and _version(label, LABEL_CUDA_VERSION)[:2] > driver:
        raise CudaVersionUnsupported(
            rootfs=rootfs,
            required=label,
            source=f"label {LABEL_CUDA_VERSION}",
            driver_version=facts.driver_version,
            driver_cuda=facts.cuda_version,
        )
    if env.get("NVIDIA_DISABLE_REQUIRE", "").lower() not in ("", "0", "false"):
        return
    require = env.get("NVIDIA_REQUIRE_CUDA", "").strip()
    if require:
        alternatives = require.split()
        if not any(
            all(_condition_holds(c, facts, "NVIDIA_REQUIRE_CUDA") for c in alt.split(",") if c) for alt in alternatives
        ):
            raise CudaVersionUnsupported(
                rootfs=rootfs,
                required=_cuda_requirement(require),
                source=f"NVIDIA_REQUIRE_CUDA={require}",
                driver_version=facts.driver_version,
                driver_cuda=facts.cuda_version,
            )
        return
    cuda = env.get("CUDA_VERSION")
    if cuda and _version(cuda, "CUDA_VERSION")[:2] > driver:
        raise CudaVersionUnsupported(
            rootfs=rootfs,
            required=".".join(map(str, _version(cuda, "CUDA_VERSION")[:2])),
            source=f"CUDA_VERSION={cuda}",
            driver_version=facts.driver_version,
            driver_cuda=facts.cuda_version,
        )
