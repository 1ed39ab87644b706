"""Paths inside a container image's rootfs, resolved as if the rootfs were ``/``.

The daemon runs as root and the image is the tenant's: any directory in it may be a symlink
(``usr -> /X``, ``usr/local -> ../../../../tmp/x``, ``dev -> /dev``), a loop, or a file where a
directory is expected. Everything the core creates in an image or hands back as a mount target goes
through here: each path is resolved with ``openat2(RESOLVE_IN_ROOT)`` (Linux >= 5.6; an absolute
link or a ``..`` at the top stays inside the rootfs), or, where openat2 is missing (ENOSYS), by a
walk one component at a time from the rootfs's fd with ``O_NOFOLLOW`` that expands links itself
under the same rules. Nothing outside the rootfs is ever created, followed or returned; the host
path handed back is the one the kernel resolved, so mounting on it follows no link of the image.
This module owns its ctypes call (openat2 has no Python binding); it never mounts anything.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import posixpath
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager

from isolator.errors import FailedPrecondition, InvalidArgument
from isolator.model import check_rootfs

# include/uapi/linux/openat2.h; openat2 is syscall 437 on every architecture (unified table).
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
MAXSYMLINKS = 40  # the kernel's limit on links in one lookup (include/linux/namei.h)
_OPEN_HOW = struct.Struct("QQQ")  # struct open_how {u64 flags; u64 mode; u64 resolve;}

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_OPENAT2_OK = platform.system() == "Linux"


def _components(path: str) -> list[str]:
    return [c for c in path.split("/") if c and c != "."]


def _openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    how = ctypes.create_string_buffer(_OPEN_HOW.pack(flags, 0, resolve), _OPEN_HOW.size)
    fd = _syscall(SYS_OPENAT2, dirfd, os.fsencode(path), how, _OPEN_HOW.size)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


class ImageRoot:
    """One image rootfs, held open by fd for the duration of a ``with`` block."""

    def __init__(self, rootfs: str, *, use_openat2: bool = True) -> None:
        self.rootfs = check_rootfs(rootfs)
        self.use_openat2 = use_openat2 and _OPENAT2_OK
        self._fd = -1

    def __enter__(self) -> ImageRoot:
        try:
            self._fd = os.open(self.rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise InvalidArgument(f"the container's rootfs '{self.rootfs}' does not exist") from exc
        except NotADirectoryError as exc:
            raise InvalidArgument(f"the container's rootfs '{self.rootfs}' is not a directory") from exc
        except OSError as exc:
            raise FailedPrecondition(f"failed to open rootfs '{self.rootfs}': {exc.strerror}") from exc
        # The real path of the root: what every resolved path must stay below.
        self.real = os.readlink(f"/proc/self/fd/{self._fd}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ---- resolution -------------------------------------------------------------------------------

    def _refuse(self, path: str, exc: OSError) -> Exception:
        where = f"'{path}' in rootfs '{self.rootfs}'"
        if exc.errno == errno.ELOOP:
            return InvalidArgument(f"failed to resolve {where}: too many symbolic links (a loop in the image)")
        if exc.errno == errno.ENOTDIR:
            return InvalidArgument(f"failed to resolve {where}: a component is not a directory")
        if exc.errno == errno.EXDEV:
            return InvalidArgument(f"failed to resolve {where}: it would leave the rootfs")
        if exc.errno == errno.ENOENT:
            return InvalidArgument(f"failed to resolve {where}: a component is missing (a dangling link in the image?)")
        return FailedPrecondition(f"failed to resolve {where}: {exc.strerror}")

    def _open_dir(self, path: str) -> int:
        """An O_PATH fd of directory ``path`` (relative to the root), resolved inside the root."""
        flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
        if self.use_openat2:
            try:
                return _openat2(self._fd, path or ".", flags, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
            except OSError as exc:
                if exc.errno != errno.ENOSYS:
                    raise
                self.use_openat2 = False  # kernel < 5.6: walk by hand from now on
        return self._walk(path)

    def _walk(self, path: str) -> int:
        """openat2(RESOLVE_IN_ROOT) by hand: one component at a time with O_NOFOLLOW; a link is
        read and its target pushed in front of what is left (an absolute one from the root); ``..``
        never goes above the root. Raises OSError like the kernel (ELOOP, ENOTDIR, ENOENT)."""
        stack = [os.dup(self._fd)]  # fds from the root down to the current directory
        todo = _components(path)
        links = 0
        try:
            while todo:
                name = todo.pop(0)
                if name == "..":
                    if len(stack) > 1:
                        os.close(stack.pop())
                    continue
                st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    links += 1
                    if links > MAXSYMLINKS:
                        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                    target = os.readlink(name, dir_fd=stack[-1])
                    if target.startswith("/"):
                        while len(stack) > 1:
                            os.close(stack.pop())
                    todo[:0] = _components(target)
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
                # O_NOFOLLOW: if the name was swapped for a link since the stat, this fails (ENOTDIR
                # with O_DIRECTORY) instead of following it.
                flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                stack.append(os.open(name, flags, dir_fd=stack[-1]))
            fd = stack.pop()
            return fd
        finally:
            for fd in stack:
                os.close(fd)

    def _host_path(self, fd: int) -> str:
        host = os.readlink(f"/proc/self/fd/{fd}")
        if host != self.real and not host.startswith(self.real.rstrip("/") + "/"):
            raise InvalidArgument(f"'{host}' resolved outside the rootfs '{self.rootfs}'")  # never expected
        return host

    @contextmanager
    def _dir(self, path: str, create: bool) -> Iterator[int]:
        """An fd of directory ``path`` in the root, making missing directories when ``create``."""
        done: list[str] = []
        fd = self._open_dir("")
        try:
            for name in _components(path):
                candidate = "/".join([*done, name])
                try:
                    nxt = self._open_dir(candidate)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        # mkdirat on the resolved parent never follows the new name: a dangling link
                        # planted there gives EEXIST, then the open below resolves it inside the root.
                        os.mkdir(name, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nxt = self._open_dir(candidate)
                os.close(fd)
                fd = nxt
                done.append(name)
            yield fd
        except OSError as exc:
            raise self._refuse(path, exc) from exc
        finally:
            os.close(fd)

    def make_dirs(self, path: str) -> str:
        """Create directory ``path`` (e.g. ``usr/local/nvidia``) inside the root; its host path."""
        with self._dir(path, create=True) as fd:
            return self._host_path(fd)

    def mount_target(self, path: str) -> str:
        """The host path to mount a file on at ``path`` (e.g. ``dev/nvidia0``): its directory is
        resolved (and made) inside the root; the last component must not be a link or a directory."""
        parent, name = posixpath.split(path.strip("/"))
        if not name or name in (".", ".."):
            raise InvalidArgument(f"'{path}' does not name a file in the rootfs")
        with self._dir(parent, create=True) as fd:
            host = self._host_path(fd)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return posixpath.join(host, name)
            except OSError as exc:
                raise self._refuse(path, exc) from exc
        if stat.S_ISLNK(st.st_mode):
            raise InvalidArgument(
                f"refusing mount target '{path}' in rootfs '{self.rootfs}': it is a symbolic link in the image"
            )
        if stat.S_ISDIR(st.st_mode):
            raise InvalidArgument(f"refusing mount target '{path}' in rootfs '{self.rootfs}': it is a directory")
        return posixpath.join(host, name)


def make_dirs_in(rootfs: str, path: str, *, use_openat2: bool = True) -> str:
    with ImageRoot(rootfs, use_openat2=use_openat2) as root:
        return root.make_dirs(path)


def mount_target_in(rootfs: str, path: str, *, use_openat2: bool = True) -> str:
    with ImageRoot(rootfs, use_openat2=use_openat2) as root:
        return root.mount_target(path)
