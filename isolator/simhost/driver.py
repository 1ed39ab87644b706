"""A simulated NVIDIA driver installation under a driver root: real ELF files and a real ld.so.cache.

Shared objects are compiled with gcc from tiny C sources and named and SONAMEd like a real driver of
the requested version; 32-bit ones use ``gcc -m32 -nostdlib`` or, where that toolchain is missing, a
minimal ELF writer here. The system's ldconfig writes the cache. Built trees are cached per version.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field

LOG = logging.getLogger(__name__)

DEFAULT_DRIVER_VERSION = "550.54.15"
# A 440-series driver still shipped libnvidia-fatbinaryloader; it was gone by 450.57, so an upgraded
# host can keep the stale file (and its ldcache entry) around: the case v1 mishandled.
STALE_VERSION = "440.33.01"
# CUDA version each simulated driver branch reports (cuDriverGetVersion), for inject tests.
CUDA_BY_BRANCH = {"440": "10.2", "470": "11.4", "535": "12.2", "550": "12.4", "555": "12.5", "560": "12.6"}

LIB64_DIR = "/usr/lib/x86_64-linux-gnu"
LIB32_DIR = "/usr/lib/i386-linux-gnu"
MESA_DIR = "/usr/lib/mesa"  # another vendor's GL stack, as Debian's glx-alternative diverts it
CLASSIC_TLS_DIR = "/usr/lib/nvidia/classic-tls"  # the old-ABI libnvidia-tls build
BIN_DIR = "/usr/bin"

BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)

# The GNU ABI note of the "new TLS ABI" libnvidia-tls (v1: .note.ABI-tag == 2.3.99) and of a classic one.
NEW_TLS_ABI = (0, 2, 3, 99)
CLASSIC_TLS_ABI = (0, 2, 2, 0)


@dataclass(frozen=True)
class Lib:
    """One shared object: its file name, SONAME, the names it needs, an optional ABI note."""

    file: str
    soname: str
    needed: tuple[str, ...] = ()
    abi: tuple[int, int, int, int] | None = None


def nvidia_libs(v: str) -> tuple[list[Lib], list[Lib]]:
    """The 64-bit and 32-bit NVIDIA libraries of driver ``v``, every capability group represented."""
    lib64 = [
        Lib(f"libnvidia-ml.so.{v}", "libnvidia-ml.so.1"),  # utility
        Lib(f"libnvidia-cfg.so.{v}", "libnvidia-cfg.so.1"),
        Lib(f"libcuda.so.{v}", "libcuda.so.1"),  # compute
        Lib(f"libcudadebugger.so.{v}", "libcudadebugger.so.1"),
        Lib(f"libnvidia-opencl.so.{v}", "libnvidia-opencl.so.1"),
        Lib(f"libnvidia-gpucomp.so.{v}", f"libnvidia-gpucomp.so.{v}"),
        Lib(f"libnvidia-ptxjitcompiler.so.{v}", "libnvidia-ptxjitcompiler.so.1"),
        Lib(f"libnvidia-allocator.so.{v}", "libnvidia-allocator.so.1"),
        Lib(f"libnvidia-nvvm.so.{v}", "libnvidia-nvvm.so.4"),
        Lib(f"libnvidia-pkcs11-openssl3.so.{v}", f"libnvidia-pkcs11-openssl3.so.{v}"),
        Lib(f"libvdpau_nvidia.so.{v}", "libvdpau_nvidia.so.1"),  # video
        Lib(f"libnvidia-encode.so.{v}", "libnvidia-encode.so.1"),
        Lib(f"libnvidia-opticalflow.so.{v}", "libnvidia-opticalflow.so.1"),
        Lib(f"libnvcuvid.so.{v}", "libnvcuvid.so.1"),
        Lib(f"libnvidia-glcore.so.{v}", f"libnvidia-glcore.so.{v}"),  # graphics
        Lib(f"libnvidia-eglcore.so.{v}", f"libnvidia-eglcore.so.{v}"),
        Lib(f"libnvidia-tls.so.{v}", f"libnvidia-tls.so.{v}", abi=NEW_TLS_ABI),
        Lib(f"libnvidia-glsi.so.{v}", f"libnvidia-glsi.so.{v}"),
        Lib(f"libnvidia-fbc.so.{v}", "libnvidia-fbc.so.1"),
        Lib(f"libnvidia-rtcore.so.{v}", f"libnvidia-rtcore.so.{v}"),
        Lib(f"libnvoptix.so.{v}", "libnvoptix.so.1"),
        Lib(f"libnvidia-glvkspirv.so.{v}", f"libnvidia-glvkspirv.so.{v}"),
        Lib(f"libGLX_nvidia.so.{v}", "libGLX_nvidia.so.0", (f"libnvidia-glcore.so.{v}", f"libnvidia-tls.so.{v}")),
        Lib(f"libEGL_nvidia.so.{v}", "libEGL_nvidia.so.0", (f"libnvidia-eglcore.so.{v}",)),
        Lib(f"libGLESv2_nvidia.so.{v}", "libGLESv2_nvidia.so.2", (f"libnvidia-eglcore.so.{v}",)),
        Lib(f"libGLESv1_CM_nvidia.so.{v}", "libGLESv1_CM_nvidia.so.1", (f"libnvidia-eglcore.so.{v}",)),
        Lib("libnvidia-egl-wayland.so.1.1.13", "libnvidia-egl-wayland.so.1"),  # display; own version
    ]
    lib32 = [
        Lib(f"libnvidia-ml.so.{v}", "libnvidia-ml.so.1"),
        Lib(f"libcuda.so.{v}", "libcuda.so.1"),
        Lib(f"libnvidia-ptxjitcompiler.so.{v}", "libnvidia-ptxjitcompiler.so.1"),
        Lib(f"libnvidia-encode.so.{v}", "libnvidia-encode.so.1"),
        Lib(f"libnvcuvid.so.{v}", "libnvcuvid.so.1"),
        Lib(f"libnvidia-glcore.so.{v}", f"libnvidia-glcore.so.{v}"),
        Lib(f"libnvidia-eglcore.so.{v}", f"libnvidia-eglcore.so.{v}"),
        Lib(f"libnvidia-tls.so.{v}", f"libnvidia-tls.so.{v}", abi=NEW_TLS_ABI),
        Lib(f"libGLX_nvidia.so.{v}", "libGLX_nvidia.so.0", (f"libnvidia-glcore.so.{v}", f"libnvidia-tls.so.{v}")),
        Lib(f"libEGL_nvidia.so.{v}", "libEGL_nvidia.so.0", (f"libnvidia-eglcore.so.{v}",)),
    ]
    return lib64, lib32


# Not NVIDIA's, or not this driver's: every one must be skipped by the volume plan, with a reason.
GLVND_LIBS = [  # GLVND's loader: NVIDIA-compatible (needs libGLdispatch) but versioned 1.7.0, not the driver's
    Lib("libGLdispatch.so.0.0.0", "libGLdispatch.so.0"),
    Lib("libGL.so.1.7.0", "libGL.so.1", ("libGLdispatch.so.0",)),
]
MESA_LIBS = [  # pre-GLVND Mesa: libGL needs libglapi, nothing of NVIDIA's
    Lib("libglapi.so.0.0.0", "libglapi.so.0"),
    Lib("libGL.so.1.2.0", "libGL.so.1", ("libglapi.so.0",)),
]


@dataclass(frozen=True)
class DriverInfo:
    """What ``build_driver_root`` made. Paths in tuples are as seen under ``root`` (start with '/')."""

    root: str
    version: str
    cuda_version: str
    ldcache: str  # host path of <root>/etc/ld.so.cache
    path: tuple[str, ...]  # the PATH to search for binaries, under root
    lib64_dir: str
    lib32_dir: str
    binaries: tuple[str, ...]
    libraries64: tuple[str, ...]  # file names of this driver's 64-bit libraries
    libraries32: tuple[str, ...]
    foreign: tuple[str, ...]  # other vendors' GL libraries
    stale: tuple[str, ...]  # files of an older driver
    classic_tls: tuple[str, ...]  # the old-ABI libnvidia-tls
    elf32_maker: str  # "gcc" or "writer"
    sonames: dict[str, str] = field(default_factory=dict)  # file name -> SONAME (both classes)


def cuda_version_for(driver_version: str) -> str:
    return CUDA_BY_BRANCH.get(driver_version.split(".")[0], "12.4")


def build_driver_root(
    root: str, driver_version: str = DEFAULT_DRIVER_VERSION, cache_dir: str | None = None, elf32: str | None = None
) -> DriverInfo:
    """Populate ``root`` with a driver installation of ``driver_version`` and its ld.so.cache.

    The tree is built once per (version, generator) in ``cache_dir`` (default: a per-user directory
    under the temp dir, or $GPU_ISOLATOR_SIM_CACHE) and copied into ``root`` afterwards. Existing
    files in ``root`` are overwritten; the cache is regenerated for the new set of files.
    ``elf32`` forces how 32-bit objects are made ("gcc" or "writer"); by default gcc when it can.
    """
    if not driver_version or "/" in driver_version or driver_version.startswith("."):
        raise ValueError(f"failed to build driver root '{root}': bad driver version {driver_version!r}")
    cache_dir = cache_dir or os.environ.get("GPU_ISOLATOR_SIM_CACHE") or _default_cache()

    def cached_tree(maker: str) -> str:
        return os.path.join(cache_dir, f"driver-{driver_version}-{_cache_key(driver_version, maker)}")

    # A tree gcc built is there only where gcc -m32 worked: every later start (each daemon of a test
    # run) skips probing gcc again, a compiler run per start.
    if elf32 is None and os.path.isdir(cached_tree("gcc")):
        elf32 = "gcc"
    elf32_maker = elf32 or ("gcc" if _gcc_m32_works() else "writer")
    cached = cached_tree(elf32_maker)
    if not os.path.isdir(cached):
        _build_cached(cached, driver_version, elf32_maker)
    _overlay(cached, root)
    # Regenerate the cache for whatever is now in root (an upgrade over an older simulated driver).
    run_ldconfig(root)
    lib64, lib32 = nvidia_libs(driver_version)
    sonames = {lib.file: lib.soname for lib in (*lib64, *lib32, *GLVND_LIBS, *MESA_LIBS)}
    return DriverInfo(
        root=os.path.abspath(root),
        version=driver_version,
        cuda_version=cuda_version_for(driver_version),
        ldcache=os.path.join(os.path.abspath(root), "etc/ld.so.cache"),
        path=(BIN_DIR, "/usr/sbin"),
        lib64_dir=LIB64_DIR,
        lib32_dir=LIB32_DIR,
        binaries=BINARIES,
        libraries64=tuple(lib.file for lib in lib64),
        libraries32=tuple(lib.file for lib in lib32),
        foreign=(f"{MESA_DIR}/libGL.so.1.2.0",),
        stale=(f"{LIB64_DIR}/libnvidia-fatbinaryloader.so.{STALE_VERSION}",),
        classic_tls=(f"{CLASSIC_TLS_DIR}/libnvidia-tls.so.{driver_version}",),
        elf32_maker=elf32_maker,
        sonames=sonames,
    )


def _overlay(src: str, dst: str) -> None:
    """Copy the tree ``src`` over ``dst``: files and links replace what is there (an in-place upgrade)."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target = os.path.normpath(os.path.join(dst, rel))
        os.makedirs(target, exist_ok=True)
        for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
            s_path, d_path = os.path.join(dirpath, name), os.path.join(target, name)
            if os.path.lexists(d_path) and (os.path.islink(d_path) or os.path.islink(s_path)):
                os.unlink(d_path)
            if os.path.islink(s_path):
                os.symlink(os.readlink(s_path), d_path)
            else:
                shutil.copy2(s_path, d_path)


def ldconfig() -> str:
    """The system's ldconfig: on PATH, else in the sbin directories a normal user's PATH lacks."""
    found = shutil.which("ldconfig") or shutil.which("ldconfig", path="/usr/sbin:/sbin")
    if found is None:
        raise RuntimeError("no ldconfig on PATH, in /usr/sbin or in /sbin")
    return found


def run_ldconfig(root: str) -> None:
    """Write <root>/etc/ld.so.cache with the system's ldconfig (-r needs chroot, so root or a userns)."""
    cmd = [ldconfig(), "-r", root]
    if os.geteuid() != 0:
        cmd = ["unshare", "--user", "--map-root-user", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"failed to run ldconfig for '{root}': {proc.stderr.strip() or proc.returncode}")


# ---- building the cached tree --------------------------------------------------------------------


def _default_cache() -> str:
    return os.path.join(tempfile.gettempdir(), f"gpu-isolator-simdriver-{os.getuid()}")


@functools.cache
def _cache_key(version: str, elf32_maker: str) -> str:
    with open(__file__, "rb") as fh:
        src = fh.read()
    return hashlib.sha256(src + version.encode() + elf32_maker.encode()).hexdigest()[:16]


_M32: bool | None = None


def _gcc_m32_works() -> bool:
    global _M32
    if _M32 is None:
        with tempfile.TemporaryDirectory(prefix="gi-m32-") as tmp:
            src = os.path.join(tmp, "t.c")
            with open(src, "w") as fh:
                fh.write("int gi_probe(void) { return 32; }\n")
            proc = subprocess.run(
                ["gcc", "-m32", "-nostdlib", "-shared", "-fPIC", "-o", os.path.join(tmp, "t.so"), src],
                capture_output=True,
                check=False,
            )
            _M32 = proc.returncode == 0
    return _M32


def _build_cached(dest: str, v: str, elf32_maker: str) -> None:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(dest) + ".tmp-", dir=os.path.dirname(dest))
    try:
        _populate(tmp, v, elf32_maker)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process cached the same tree first; theirs is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _populate(root: str, v: str, elf32_maker: str) -> None:
    def d(p: str) -> str:
        path = os.path.join(root, p.lstrip("/"))
        os.makedirs(path, exist_ok=True)
        return path

    lib64, lib32 = nvidia_libs(v)
    work = d("/.build")
    lib64_dir, lib32_dir = d(LIB64_DIR), d(LIB32_DIR)
    for lib in (*lib64, *GLVND_LIBS):
        _gcc_lib(lib, lib64_dir, work, 64)
    for lib in MESA_LIBS:
        _gcc_lib(lib, d(MESA_DIR), work, 64)
    _gcc_lib(Lib(f"libnvidia-tls.so.{v}", f"libnvidia-tls.so.{v}", abi=CLASSIC_TLS_ABI), d(CLASSIC_TLS_DIR), work, 64)
    stale = f"libnvidia-fatbinaryloader.so.{STALE_VERSION}"
    _gcc_lib(Lib(stale, stale), lib64_dir, work, 64)
    for lib in lib32:
        if elf32_maker == "gcc":
            _gcc_lib(lib, lib32_dir, work, 32)
        else:
            with open(os.path.join(lib32_dir, lib.file), "wb") as out:
                out.write(write_elf_so(32, lib.soname, lib.needed, lib.abi))
    # The installer's development links, which ldconfig does not make (v1 adds libcuda.so itself too).
    for libdir in (lib64_dir, lib32_dir):
        os.symlink("libcuda.so.1", os.path.join(libdir, "libcuda.so"))
        os.symlink("libnvidia-ml.so.1", os.path.join(libdir, "libnvidia-ml.so"))
    bindir = d(BIN_DIR)
    d("/usr/sbin")
    for name in BINARIES:
        _gcc_bin(name, v, bindir, work)
    shutil.rmtree(work)
    d("/var/cache/ldconfig")
    etc = d("/etc/ld.so.conf.d")
    with open(os.path.join(root, "etc/ld.so.conf"), "w") as fh:
        fh.write("include /etc/ld.so.conf.d/*.conf\n")
    for name, libdir in (
        ("x86_64-linux-gnu.conf", LIB64_DIR),
        ("i386-linux-gnu.conf", LIB32_DIR),
        ("zz-mesa.conf", MESA_DIR),
        ("zz-nvidia-classic-tls.conf", CLASSIC_TLS_DIR),
    ):
        with open(os.path.join(etc, name), "w") as fh:
            fh.write(libdir + "\n")
    run_ldconfig(root)


_ABI_ASM = (
    '__asm__(".section .note.ABI-tag,\\"a\\",@note\\n.balign 4\\n.long 4\\n.long 16\\n.long 1\\n'
    '.asciz \\"GNU\\"\\n.long {0}\\n.long {1}\\n.long {2}\\n.long {3}\\n.previous\\n");\n'
)


def _gcc_lib(lib: Lib, outdir: str, work: str, bits: int) -> None:
    ident = "".join(c if c.isalnum() else "_" for c in lib.file)
    src = os.path.join(work, ident + f"_{bits}.c")
    with open(src, "w") as fh:
        fh.write(f"/* stand-in for {lib.file} */\nint gi_{ident}(void) {{ return {bits}; }}\n")
        if lib.abi:
            fh.write(_ABI_ASM.format(*lib.abi))
    out = os.path.join(outdir, lib.file)
    cmd = ["gcc", "-shared", "-fPIC", "-O0", "-o", out, src, f"-Wl,-soname,{lib.soname}", "-Wl,--no-as-needed"]
    if bits == 32:
        cmd[1:1] = ["-m32", "-nostdlib"]
    # Link the dependencies by path so DT_NEEDED carries their SONAME, as a real link does.
    for need in lib.needed:
        cmd.append(_find_by_soname(outdir, need))
    subprocess.run(cmd, check=True, capture_output=True)


def _find_by_soname(libdir: str, soname: str) -> str:
    for name in sorted(os.listdir(libdir)):
        if name == soname or name.startswith(soname.split(".so")[0] + ".so."):
            path = os.path.join(libdir, name)
            if not os.path.islink(path):
                return path
    raise FileNotFoundError(f"failed to find '{soname}' in '{libdir}': build it first")


def _gcc_bin(name: str, version: str, outdir: str, work: str) -> None:
    src = os.path.join(work, name.replace("-", "_") + ".c")
    with open(src, "w") as fh:
        fh.write(
            "#include <stdio.h>\n"
            f'int main(void) {{ puts("{name}: simulated NVIDIA driver {version}, no GPU"); return 0; }}\n'
        )
    subprocess.run(["gcc", "-O0", "-o", os.path.join(outdir, name), src], check=True, capture_output=True)


# ---- a minimal ELF shared-object writer, for hosts whose gcc cannot make 32-bit objects ------------

EM_386, EM_X86_64 = 3, 62


def write_elf_so(
    bits: int,
    soname: str,
    needed: tuple[str, ...] = (),
    abi: tuple[int, int, int, int] | None = None,
    machine: int | None = None,
) -> bytes:
    """Bytes of an ET_DYN object with PT_LOAD, PT_DYNAMIC (SONAME, NEEDED) and an optional ABI note.

    It holds no code; ldconfig and ELF readers (ours, the loader's header checks) accept it, which is
    all a volume build needs of a library it only links or copies.
    """
    is64 = bits == 64
    machine = machine if machine is not None else (EM_X86_64 if is64 else EM_386)
    e = "<"
    ehsize, phentsize = (64, 56) if is64 else (52, 32)
    nph = 3 if abi else 2
    strtab = b"\0"
    offsets = {}
    for name in (soname, *needed):
        offsets[name] = len(strtab)
        strtab += name.encode() + b"\0"
    note = struct.pack(e + "III4sIIII", 4, 16, 1, b"GNU\0", *abi) if abi else b""
    str_off = ehsize + nph * phentsize
    note_off = (str_off + len(strtab) + 7) & ~7
    dyn_off = (note_off + len(note) + 7) & ~7
    dyn_fmt = e + ("qQ" if is64 else "iI")
    dyn = [(5, str_off), (10, len(strtab)), (14, offsets[soname])]
    dyn += [(1, offsets[n]) for n in needed]
    dyn.append((0, 0))
    dyn_bytes = b"".join(struct.pack(dyn_fmt, t, v) for t, v in dyn)
    total = dyn_off + len(dyn_bytes)
    ident = b"\x7fELF" + bytes([2 if is64 else 1, 1, 1, 0]) + b"\0" * 8
    if is64:
        hdr = ident + struct.pack(e + "HHIQQQIHHHHHH", 3, machine, 1, 0, ehsize, 0, 0, ehsize, phentsize, nph, 64, 0, 0)
        ph = struct.pack(e + "IIQQQQQQ", 1, 5, 0, 0, 0, total, total, 0x1000)
        ph += struct.pack(e + "IIQQQQQQ", 2, 6, dyn_off, dyn_off, dyn_off, len(dyn_bytes), len(dyn_bytes), 8)
        if abi:
            ph += struct.pack(e + "IIQQQQQQ", 4, 4, note_off, note_off, note_off, len(note), len(note), 4)
    else:
        hdr = ident + struct.pack(e + "HHIIIIIHHHHHH", 3, machine, 1, 0, ehsize, 0, 0, ehsize, phentsize, nph, 40, 0, 0)
        ph = struct.pack(e + "IIIIIIII", 1, 0, 0, 0, total, total, 5, 0x1000)
        ph += struct.pack(e + "IIIIIIII", 2, dyn_off, dyn_off, dyn_off, len(dyn_bytes), len(dyn_bytes), 6, 4)
        if abi:
            ph += struct.pack(e + "IIIIIIII", 4, note_off, note_off, note_off, len(note), len(note), 4, 4)
    out = bytearray(total)
    out[0 : len(hdr)] = hdr
    out[ehsize : ehsize + len(ph)] = ph
    out[str_off : str_off + len(strtab)] = strtab
    out[note_off : note_off + len(note)] = note
    out[dyn_off:total] = dyn_bytes
    return bytes(out)
