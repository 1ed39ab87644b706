"""The container's init, as the Mesos launcher would run it (stdlib only; runs as ``python3 -I -S``).

Started by the harness under ``unshare --mount --propagation private``, so it already has its own
mount namespace. It waits on stdin until the harness has called Isolate with its pid, then
builds a small root filesystem from read-only binds of the host's system directories, applies
the launch info's mounts in order (as the launcher does: create a missing target, remount
read-only binds), chroots, sets the environment and execs the check program.

argv: SPEC_JSON. The spec holds rootfs, mounts, environment and the command to exec.
"""

import ctypes
import json
import os
import stat
import sys

MS_RDONLY = 1
MS_NOSUID = 2
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]


def mount(source, target, fstype, flags, data=None):
    if (
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        )
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} -> {target} (flags {flags:#x}): {os.strerror(err)}")


def bind(source, target, flags):
    """A bind mount; MS_RDONLY only takes effect on a remount (mount(2))."""
    mount(source, target, None, MS_BIND | (flags & MS_REC))
    if flags & MS_RDONLY:
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | (flags & MS_REC))


def ensure_target(source, target):
    if os.path.lexists(target):
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if source and os.path.isdir(source):
        os.mkdir(target)
    else:
        open(target, "a").close()


HOST_DIRS = ("bin", "sbin", "lib", "lib64", "usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "usr/share", "etc")
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")


def build_rootfs(rootfs):
    for d in HOST_DIRS:
        src = "/" + d
        if not os.path.isdir(src) or os.path.islink(src):
            continue
        tgt = os.path.join(rootfs, d)
        os.makedirs(tgt, exist_ok=True)
        bind(src, tgt, MS_REC | MS_RDONLY)
    for d in ("lib", "lib64", "bin", "sbin"):
        src = "/" + d
        tgt = os.path.join(rootfs, d)
        if os.path.islink(src) and not os.path.lexists(tgt):
            os.symlink(os.readlink(src), tgt)
    # A fresh /dev with the standard nodes, as Mesos's filesystem/linux isolator makes it.
    dev = os.path.join(rootfs, "dev")
    os.makedirs(dev, exist_ok=True)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=755,size=64k")
    for name in DEV_NODES:
        st = os.stat("/dev/" + name)
        os.mknod(os.path.join(dev, name), stat.S_IMODE(st.st_mode) | stat.S_IFCHR, st.st_rdev)
    for d in ("proc", "tmp"):
        os.makedirs(os.path.join(rootfs, d), exist_ok=True)


def main():
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    # Block until the harness says Isolate has returned (the launcher's sync pipe).
    if sys.stdin.buffer.read(1) != b"g":
        sys.exit(101)
    rootfs = spec["rootfs"]
    if rootfs:
        build_rootfs(rootfs)
    for m in spec["mounts"]:
        ensure_target(m.get("source"), m["target"])
        if m.get("source") and m.get("flags", 0) & MS_BIND:
            bind(m["source"], m["target"], m.get("flags", 0))
        else:
            mount(m.get("source") or "none", m["target"], m.get("type"), m.get("flags", 0), m.get("options"))
    if rootfs:
        os.chroot(rootfs)
        os.chdir("/")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    env.update(spec["environment"])
    argv = spec["command"]
    os.execve(argv[0], argv, env)


if __name__ == "__main__":
    main()
