"""The catalogue of NVIDIA driver user-space files that may go into the volume: data only.

Names are ldcache key *prefixes* (as nvidia-docker v1 and libnvidia-container match them) or binary
names; each entry says which capability group it serves and where the entry comes from. No I/O.
Sources: libnvidia-container ``src/nvc_info.c`` (lists), nvidia-docker v1.0.1 ``src/nvidia/volumes.go``,
Mesos ``isolators/gpu/volume.cpp`` (see docs/volume.md and reference/nvidia-volume-cdi.md §1.2, §2.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Group(StrEnum):
    """Capability groups, named as NVIDIA_DRIVER_CAPABILITIES names them."""

    UTILITY = "utility"
    COMPUTE = "compute"
    VIDEO = "video"
    GRAPHICS = "graphics"
    DISPLAY = "display"


class Kind(StrEnum):
    BINARY = "binary"
    LIBRARY = "library"


@dataclass(frozen=True)
class Component:
    """One binary name or library prefix.

    ``enabled`` False keeps an entry that a source lists but comments out (X server modules, the
    loaders GLVND expects the image to ship): it documents the choice and is never searched for.
    ``optional`` entries are absent from today's drivers; their absence is reported, not warned about.
    ``versioned`` False marks libraries with their own version (EGL platform libs), exempt from the
    rule that a file name must end with the running driver's version.
    """

    name: str
    group: Group
    kind: Kind
    note: str
    enabled: bool = True
    optional: bool = False
    versioned: bool = True


B, L = Kind.BINARY, Kind.LIBRARY
U, C, V, G, D = Group.UTILITY, Group.COMPUTE, Group.VIDEO, Group.GRAPHICS, Group.DISPLAY

BINARIES: tuple[Component, ...] = (
    # utility_bins in libnvidia-container; the five below are also v1's and Mesos's whole list.
    Component("nvidia-smi", U, B, "System management CLI; Mesos's VolumeCreation test checks it is in bin/."),
    Component("nvidia-debugdump", U, B, "Collects GPU state for bug reports (v1, Mesos, libnvidia-container)."),
    Component("nvidia-persistenced", U, B, "Persistence daemon; containers query it (v1, Mesos, libnvidia-container)."),
    Component("nv-fabricmanager", U, B, "NVSwitch fabric manager; libnvidia-container only.", optional=True),
    # compute_bins in libnvidia-container.
    Component("nvidia-cuda-mps-control", C, B, "MPS control daemon front end (v1, Mesos, libnvidia-container)."),
    Component(
        "nvidia-cuda-mps-server", C, B, "MPS server spawned by the control daemon (v1, Mesos, libnvidia-container)."
    ),
    # Commented out in v1, Mesos and libnvidia-container alike: host administration tools.
    Component("nvidia-modprobe", U, B, "Setuid module loader; host-only, commented out everywhere.", enabled=False),
    Component("nvidia-settings", D, B, "X settings GUI; commented out everywhere.", enabled=False),
    Component(
        "nvidia-xconfig",
        D,
        B,
        "Writes xorg.conf; commented out in v1/Mesos, CDI mounts it for graphics.",
        enabled=False,
    ),
)

LIBRARIES: tuple[Component, ...] = (
    # ---- utility_libs (libnvidia-container) ----
    Component("libnvidia-ml.so", U, L, "NVML; Mesos's VolumeCreation test checks lib64/libnvidia-ml.so.1."),
    Component(
        "libnvidia-cfg.so", U, L, "GPU configuration queries; a commented-out X11 entry in v1, utility in Mesos."
    ),
    Component("libnvidia-nscq.so", U, L, "NVSwitch configuration and query; libnvidia-container only.", optional=True),
    # ---- compute_libs (libnvidia-container) ----
    Component("libcuda.so", C, L, "CUDA driver API; gets the extra libcuda.so link (v1: apps dlopen it)."),
    Component("libcudadebugger.so", C, L, "cuda-gdb backend, R450+; libnvidia-container only.", optional=True),
    Component("libnvidia-opencl.so", C, L, "NVIDIA OpenCL ICD (v1, Mesos, libnvidia-container)."),
    Component(
        "libnvidia-gpucomp.so",
        C,
        L,
        "Shader/compute compiler split out in R530; Mesos PR #456 lists it.",
        optional=True,
    ),
    Component("libnvidia-ptxjitcompiler.so", C, L, "PTX JIT used by libcuda (v1, Mesos, libnvidia-container)."),
    Component("libnvidia-fatbinaryloader.so", C, L, "Fat binary loader; gone from drivers by 450.57.", optional=True),
    Component("libnvidia-allocator.so", C, L, "GBM/EGL buffer allocator backend, R470+.", optional=True),
    Component(
        "libnvidia-compiler.so", C, L, "OpenCL compiler; removed from the driver package in R535.", optional=True
    ),
    Component("libnvidia-pkcs11.so", C, L, "Confidential computing PKCS#11 (OpenSSL 1.1), R535+.", optional=True),
    Component("libnvidia-pkcs11-openssl3.so", C, L, "Confidential computing PKCS#11 (OpenSSL 3).", optional=True),
    Component("libnvidia-nvvm.so", C, L, "NVVM compiler used by the JIT (LTO, cuda::jit), R495+.", optional=True),
    Component(
        "libnvidia-tileiras.so", C, L, "Newest compute JIT library in libnvidia-container's list.", optional=True
    ),
    Component("libOpenCL.so", C, L, "The OpenCL ICD loader: the image's business; commented out in v1.", enabled=False),
    # ---- video_libs (libnvidia-container); video also brings compute there ----
    Component("libvdpau_nvidia.so", V, L, "VDPAU driver (v1, Mesos, libnvidia-container)."),
    Component("libnvidia-encode.so", V, L, "NVENC (v1, Mesos, libnvidia-container)."),
    Component(
        "libnvidia-opticalflow.so", V, L, "Optical flow SDK, R418+; gets the extra libnvidia-opticalflow.so link."
    ),
    Component("libnvcuvid.so", V, L, "NVDEC/NVCUVID (v1, Mesos, libnvidia-container)."),
    # ---- graphics_libs (libnvidia-container) ----
    Component("libnvidia-eglcore.so", G, L, "EGL core; its presence in DT_NEEDED marks NVIDIA's compat GL libs."),
    Component("libnvidia-glcore.so", G, L, "OpenGL core; its presence in DT_NEEDED marks NVIDIA's compat GL libs."),
    Component("libnvidia-tls.so", G, L, "TLS helper; only the new TLS ABI build (ABI note 2.3.99) is taken."),
    Component("libnvidia-glsi.so", G, L, "OpenGL system interface (v1, Mesos, libnvidia-container)."),
    Component("libnvidia-fbc.so", G, L, "NVFBC frame buffer capture (a video entry in v1)."),
    Component(
        "libnvidia-ifr.so", G, L, "NVIFR in-band frame readback; dropped from drivers after R470.", optional=True
    ),
    Component("libnvidia-rtcore.so", G, L, "OptiX ray tracing core, in the driver since OptiX 6."),
    Component("libnvoptix.so", G, L, "OptiX runtime; libnvidia-container v1.0.4 added it (issue #58)."),
    # ---- graphics_libs_glvnd (libnvidia-container's default) ----
    Component("libGLX_nvidia.so", G, L, "GLVND GLX vendor library and Vulkan ICD; gets libGLX_indirect.so.0."),
    Component("libEGL_nvidia.so", G, L, "GLVND EGL vendor library."),
    Component("libGLESv2_nvidia.so", G, L, "GLVND GLES 2/3 vendor library."),
    Component("libGLESv1_CM_nvidia.so", G, L, "GLVND GLES 1 vendor library."),
    Component("libnvidia-glvkspirv.so", G, L, "Vulkan SPIR-V compiler, R396+; v1 lacked it (libnvidia-container #55)."),
    Component("libnvidia-cbl.so", G, L, "VK_NV_ray_tracing support, R418+; dropped in recent drivers.", optional=True),
    Component("libnvidia-ngx.so", G, L, "NGX/DLSS; its own 'ngx' capability in libnvidia-container.", optional=True),
    # ---- graphics_libs_compat: non-GLVND libs; only NVIDIA's own builds pass the vendor check ----
    Component(
        "libGL.so",
        G,
        L,
        "Legacy GL / GLVND loader: v1 and Mesos shipped it; other vendors' builds are skipped.",
        optional=True,
    ),
    Component("libEGL.so", G, L, "Legacy EGL / loader (v1, Mesos); vendor-checked.", optional=True),
    Component("libGLESv1_CM.so", G, L, "Legacy GLES 1 / loader (v1, Mesos); vendor-checked.", optional=True),
    Component("libGLESv2.so", G, L, "Legacy GLES 2 / loader (v1, Mesos); vendor-checked.", optional=True),
    # GLVND loaders: v1 mounted them for backward compatibility; libnvidia-container and Mesos expect
    # the image to ship them, and so do we.
    Component("libGLX.so", G, L, "GLVND GLX loader: v1 only; the image ships it.", enabled=False),
    Component("libOpenGL.so", G, L, "GLVND OpenGL loader: v1 only; the image ships it.", enabled=False),
    Component("libGLdispatch.so", G, L, "GLVND dispatch: v1 only; the image ships it.", enabled=False),
    # ---- display: EGL platform libraries the toolkit's CDI spec mounts for compositors ----
    Component(
        "libnvidia-egl-wayland.so",
        D,
        L,
        "EGL Wayland platform; v1 mounted it, libnvidia-container comments it out.",
        versioned=False,
    ),
    Component(
        "libnvidia-egl-gbm.so",
        D,
        L,
        "EGL GBM platform, R495+; mounted by nvidia-ctk's CDI spec.",
        optional=True,
        versioned=False,
    ),
    # X server modules and GTK helpers: host X only, commented out in every source.
    Component("libnvidia-gtk2.so", D, L, "nvidia-settings GTK2 UI; commented out everywhere.", enabled=False),
    Component("libnvidia-gtk3.so", D, L, "nvidia-settings GTK3 UI; commented out everywhere.", enabled=False),
    Component("libnvidia-wfb.so", D, L, "X wrapped framebuffer module; commented out everywhere.", enabled=False),
    Component("libglx.so", D, L, "Pre-GLVND X server GLX module; commented out everywhere.", enabled=False),
    Component("libglxserver_nvidia.so", D, L, "X server GLX module; host X only.", enabled=False),
)

ALL_GROUPS: frozenset[Group] = frozenset(Group)
# Mesos builds one volume for every container, with every group it knows; we default to the same
# (display adds only the EGL platform libraries).
DEFAULT_GROUPS: frozenset[Group] = ALL_GROUPS


def wanted(groups: frozenset[Group] | set[Group] = DEFAULT_GROUPS, kind: Kind | None = None) -> tuple[Component, ...]:
    """Enabled components of the given groups (and kind), in catalogue order."""
    out = []
    for comp in (*BINARIES, *LIBRARIES):
        if comp.enabled and comp.group in groups and (kind is None or comp.kind is kind):
            out.append(comp)
    return tuple(out)


def match_library(key: str, components: tuple[Component, ...]) -> Component | None:
    """The component whose prefix the ldcache key starts with (v1's bytes.HasPrefix), if any."""
    for comp in components:
        if comp.kind is Kind.LIBRARY and key.startswith(comp.name):
            return comp
    return None


def parse_groups(text: str) -> frozenset[Group]:
    """'utility,compute' or 'all' -> groups; unknown names raise ValueError."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or names == ["all"]:
        return ALL_GROUPS
    return frozenset(Group(n) for n in names)
