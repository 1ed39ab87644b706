"""Driver upgrades without a restart: which volume a container gets, and when old ones go.

Users are reference-counted **on disk**: one empty file per container under
``<volume root>/.users/<driver version>/``, created at acquire and removed at release, under a
manager-wide flock. So the count survives a sidecar restart and needs no read-modify-write.
"""

from __future__ import annotations

import logging
import os
import shutil
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from volumes.build import BuildResult, VolumeBuilder, flocked
from volumes.catalog import DEFAULT_GROUPS, Group
from volumes.discover import DEFAULT_LDCACHE, DEFAULT_PATH, Discoverer
from volumes.errors import InvalidUser, VolumeBuildError
from volumes.plan import VolumePlan, check_version, plan_volume

LOG = logging.getLogger(__name__)

USERS_DIR = ".users"
NAME_MAX = 255


@dataclass(frozen=True)
class Volume:
    """What a container gets: the host path to bind-mount and the driver version it holds."""

    path: str
    driver_version: str
    built: bool  # this call built it (False: reused)
    manifest: dict[str, Any]


class VolumeManager:
    """Builds the current driver's volume on demand and removes old ones after their last user."""

    def __init__(
        self,
        volume_root: str,
        driver_root: str = "/",
        *,
        ldcache: str = DEFAULT_LDCACHE,
        path: tuple[str, ...] = DEFAULT_PATH,
        groups: frozenset[Group] = DEFAULT_GROUPS,
        mountinfo: str = "/proc/self/mountinfo",
        tmpfs_on_noexec: bool = True,
        on_build: Callable[[BuildResult], None] | None = None,
    ) -> None:
        self.on_build = on_build  # told of every volume actually built (metrics)
        self.builder = VolumeBuilder(volume_root, mountinfo=mountinfo, tmpfs_on_noexec=tmpfs_on_noexec)
        self.discoverer = Discoverer(driver_root, ldcache=ldcache, path=path, groups=groups)
        self.volume_root = self.builder.volume_root
        self.users_root = os.path.join(self.volume_root, USERS_DIR)

    def plan(self, driver_version: str) -> VolumePlan:
        """Discover and plan without building (the admin view's dry run)."""
        return plan_volume(self.discoverer.discover(), driver_version)

    def ensure(self, driver_version: str) -> BuildResult:
        """The volume of ``driver_version``, built if absent (warm: one flock and a manifest read)."""
        check_version(driver_version)
        result = self.builder.ensure(driver_version, lambda: self.plan(driver_version))
        if result.built and self.on_build is not None:
            self.on_build(result)
        return result

    def acquire(self, container_id: str, driver_version: str) -> Volume:
        """Record ``container_id`` as a user of the current driver's volume and return it.

        ``driver_version`` is what NVML reports now (nvidia-smi --query-gpu=driver_version); a new
        value builds a new volume, while containers of the old one keep theirs. Idempotent.
        """
        user = _user_file(container_id)
        result = self.ensure(driver_version)
        with self._lock():
            d = os.path.join(self.users_root, driver_version)
            _makedirs(d)
            _touch(os.path.join(d, user))
            removed = self._collect_locked(driver_version)
        if removed:
            LOG.info("removed unused driver volumes %s", ", ".join(removed))
        LOG.info("container %s uses driver volume %s", container_id, result.path)
        return Volume(result.path, driver_version, result.built, result.manifest)

    def release(self, container_id: str, driver_version: str | None = None) -> tuple[str, ...]:
        """Forget ``container_id`` as a user of any volume; then remove volumes nobody uses.

        ``driver_version`` is the running driver's: its volume is kept even without users. With None,
        nothing is removed (the caller does not know which driver is current). Returns removed names.
        """
        user = _user_file(container_id)
        with self._lock():
            for version in self._user_versions():
                try:
                    os.unlink(os.path.join(self.users_root, version, user))
                except FileNotFoundError:
                    continue
            return self._collect_locked(driver_version) if driver_version is not None else ()

    def reconcile(self, live: Iterable[str]) -> tuple[str, ...]:
        """At recovery: drop user records of containers not in ``live``; returns the dropped ids."""
        keep = {_user_file(c) for c in live}
        dropped = []
        with self._lock():
            for version in self._user_versions():
                d = os.path.join(self.users_root, version)
                for name in os.listdir(d):
                    if name not in keep:
                        os.unlink(os.path.join(d, name))
                        dropped.append(urllib.parse.unquote(name))
        return tuple(sorted(set(dropped)))

    def users(self) -> dict[str, tuple[str, ...]]:
        """driver version -> container ids using its volume."""
        out = {}
        for version in self._user_versions():
            names = os.listdir(os.path.join(self.users_root, version))
            out[version] = tuple(sorted(urllib.parse.unquote(n) for n in names))
        return out

    def volumes(self) -> list[dict[str, Any]]:
        """Manifests of the complete volumes, each with its ``users`` added (the admin view)."""
        users = self.users()
        out = []
        for version in self.builder.versions():
            manifest = self.builder.existing(version)
            if manifest is not None:
                out.append({**manifest, "users": list(users.get(version, ()))})
        return out

    # ---- internals ----------------------------------------------------------------------------

    def _lock(self) -> Any:
        _makedirs(self.volume_root)
        return flocked(os.path.join(self.volume_root, ".manager.lock"))

    def _user_versions(self) -> list[str]:
        try:
            return sorted(os.listdir(self.users_root))
        except FileNotFoundError:
            return []

    def _collect_locked(self, current: str) -> tuple[str, ...]:
        removed = []
        for version in self.builder.versions():
            if version == current:
                continue
            d = os.path.join(self.users_root, version)
            if os.path.isdir(d) and os.listdir(d):
                continue
            if self.builder.remove(version):
                removed.append(self.builder.path_of(version))
            shutil.rmtree(d, ignore_errors=True)
        return tuple(removed)


def _user_file(container_id: str) -> str:
    if not isinstance(container_id, str) or not container_id:
        raise InvalidUser(user=container_id, cause="must be a non-empty string")
    name = urllib.parse.quote(container_id, safe="-_.")
    if name in (".", "..") or len(name) > NAME_MAX:
        raise InvalidUser(user=container_id[:80], cause=f"cannot be a file name of at most {NAME_MAX} bytes")
    return name


def _makedirs(path: str) -> None:
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise VolumeBuildError(op="create", path=path, cause=exc.strerror or str(exc)) from exc


def _touch(path: str) -> None:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    except OSError as exc:
        raise VolumeBuildError(op="record user", path=path, cause=exc.strerror or str(exc)) from exc
