"""What one daemon owns besides its work directory, claimed before it reads any state: each of its
sockets (gRPC, bridge, a ``unix:`` metrics path) and the (hierarchy, cgroups root) it manages.

Each claim is an flock (isolator/host/pidlock.py) that the kernel drops with its holder, SIGKILL
included; a second daemon that would share one refuses with exit 75 naming the holder's pid. It
decides nothing about the cgroups or the sockets themselves: the controller and the server do.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from isolator.cgroups.detect import Hierarchy
from isolator.daemon.config import Config
from isolator.errors import CgroupsRootHeld, StateError
from isolator.host.pidlock import PidLock, sweep
from isolator.transport.server import SocketGuard, socket_guards

# The cgroups roots' lock files live in the daemon's runtime directory, which the unit creates
# (RuntimeDirectory=, writable under ProtectSystem=strict) and every daemon on the host shares
# whatever its --work-dir and --socket: not in the cgroup file system, which holds no regular files,
# and not under the root itself, which is Mesos's in mesos mode and may not exist yet.
LOCK_DIR = "/run/gpu-isolator/cgroups"


def cgroups_key(hierarchy: Hierarchy, cgroups_root: str) -> str:
    """The identity of a (hierarchy, cgroups root): the hierarchy by its root directory's device
    and inode, so that one hierarchy mounted at two paths (cgroup2 at /sys/fs/cgroup/unified and,
    in a mount namespace, at /sys/fs/cgroup) is one; the root as the controllers join it."""
    try:
        st = os.stat(hierarchy.mount)
    except OSError as exc:
        raise StateError(op="stat", path=hierarchy.mount, cause=exc.strerror or str(exc)) from exc
    root = os.path.normpath("/" + cgroups_root.strip("/"))
    return f"{hierarchy.version} {os.major(st.st_dev)}:{os.minor(st.st_dev)}:{st.st_ino} {root}"


def cgroups_lock_path(lock_dir: str, hierarchy: Hierarchy, cgroups_root: str) -> str:
    digest = hashlib.sha256(cgroups_key(hierarchy, cgroups_root).encode()).hexdigest()[:20]
    return os.path.join(lock_dir, f"{hierarchy.version}-{digest}.lock")


def _lock_dir(path: str) -> None:
    """Create ``path`` (0755) or accept it only if it is a directory of ours that nobody else can
    write: a planted directory would let anyone hold or steal a cgroups root's lock."""
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise StateError(op="create lock directory", path=path, cause=exc.strerror or str(exc)) from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise StateError(
            op="use lock directory", path=path, cause=f"not a directory of uid {os.geteuid()} that only it can write"
        )


@dataclass
class Claims:
    """Everything claimed, released together (in reverse) when the daemon stops."""

    sockets: tuple[SocketGuard, SocketGuard | None]
    metrics: SocketGuard | None = None
    cgroups: PidLock | None = None
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        for guard in (self.metrics, self.sockets[1], self.sockets[0]):
            if guard is not None:
                guard.release(remove_socket=False)  # each server removes the socket it bound
        if self.cgroups is not None:
            self.cgroups.release()


def claim(config: Config, hierarchy: Hierarchy, lock_dir: str = LOCK_DIR) -> Claims:
    """Claim the gRPC socket, the bridge socket, a ``unix:`` metrics path, then the cgroups root.

    Raises SocketHeld or CgroupsRootHeld (exit 75) naming the holder, or SocketError for a path
    that cannot be a socket, having released whatever it claimed before.
    """
    from isolator.exporters.metrics import parse_address

    claims = Claims(socket_guards(config.server_settings()))
    with _undo_on_error(claims):
        for guard in claims.sockets:
            if guard is not None:
                guard.acquire()
        if config.metrics_address:
            kind, target = parse_address(config.metrics_address)
            if kind == "unix":
                claims.metrics = SocketGuard(str(target), "--metrics-address")
                claims.metrics.acquire()
        _lock_dir(lock_dir)
        sweep(lock_dir)  # what daemons killed with SIGKILL left: /run should not fill up with them
        root = config.cgroups_root
        claims.cgroups = PidLock.acquire(
            cgroups_lock_path(lock_dir, hierarchy, root),
            f"cgroups root '{root}'",
            removable=True,
            held=CgroupsRootHeld,
            root=root,
            version=hierarchy.version,
            mount=hierarchy.mount,
        )
    return claims


@contextlib.contextmanager
def _undo_on_error(claims: Claims) -> Iterator[None]:
    try:
        yield
    except BaseException:
        claims.release()
        raise
