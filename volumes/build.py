"""The filesystem edge that turns a ``VolumePlan`` into ``<volume root>/nvidia_<version>/``.

Hard links when the volume root shares the driver's filesystem, copies otherwise (per file, reported);
built in a temporary directory and renamed into place under a per-version flock, so a crash never
leaves a half volume under the real name and racing builders produce one volume. Decides nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from volumes import manifest as mf
from volumes.errors import VolumeBuildError
from volumes.mounts import mount_of, mount_tmpfs, read_mountinfo
from volumes.plan import PlannedFile, VolumePlan, files_by_group, volume_name

LOG = logging.getLogger(__name__)

SUBDIRS = ("bin", "lib", "lib64")
# Errors after which a hard link cannot work but a copy can: another filesystem, a refused link
# (fs.protected_hardlinks without CAP_FOWNER), too many links.
LINK_FALLBACK_ERRNOS = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES)

Progress = Callable[[int, PlannedFile], None]


@dataclass(frozen=True)
class BuildResult:
    path: str
    manifest: dict[str, Any]
    built: bool  # False: a complete volume was already there and was reused


@contextlib.contextmanager
def flocked(path: str) -> Iterator[None]:
    """An exclusive flock on ``path`` (created if needed); released when the block ends or we die."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise VolumeBuildError(op="open lock", path=path, cause=exc.strerror or str(exc)) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class VolumeBuilder:
    """Builds, finds and removes volumes under ``volume_root``."""

    def __init__(
        self,
        volume_root: str,
        mountinfo: str = "/proc/self/mountinfo",
        tmpfs_on_noexec: bool = True,
        progress: Progress | None = None,
    ) -> None:
        self.volume_root = os.path.realpath(volume_root)
        self.mountinfo = mountinfo
        self.tmpfs_on_noexec = tmpfs_on_noexec
        self.progress = progress
        self._tmpfs = False

    def path_of(self, version: str) -> str:
        return os.path.join(self.volume_root, volume_name(version))

    def lock_path(self, version: str) -> str:
        return os.path.join(self.volume_root, f".{volume_name(version)}.lock")

    # ---- reading ------------------------------------------------------------------------------

    def existing(self, version: str) -> dict[str, Any] | None:
        """The manifest of a complete volume for ``version``, or None (absent, foreign or damaged)."""
        path = self.path_of(version)
        try:
            with open(os.path.join(path, mf.MANIFEST_NAME)) as fh:
                manifest = mf.loads(fh.read())
        except OSError:
            return None
        if manifest is None or manifest.get("driver_version") != version:
            return None
        for f in manifest["files"]:
            if not os.path.isfile(os.path.join(path, f["dir"], f["name"])):
                LOG.warning("volume %s lacks %s/%s; it will be rebuilt", path, f["dir"], f["name"])
                return None
        return manifest

    def versions(self) -> list[str]:
        try:
            names = os.listdir(self.volume_root)
        except FileNotFoundError:
            return []
        prefix = volume_name("0")[:-1]
        return sorted(
            n[len(prefix) :] for n in names if n.startswith(prefix) and os.path.isdir(os.path.join(self.volume_root, n))
        )

    # ---- building -----------------------------------------------------------------------------

    def build(self, plan: VolumePlan) -> BuildResult:
        return self.ensure(plan.driver_version, lambda: plan)

    def ensure(self, version: str, make_plan: Callable[[], VolumePlan]) -> BuildResult:
        """The volume for ``version``: reused when complete, else built from ``make_plan()``."""
        path = self.path_of(version)
        self._prepare_root()
        with flocked(self.lock_path(version)):
            self._clean_leftovers(version)
            manifest = self.existing(version)
            if manifest is not None:
                return BuildResult(path, manifest, built=False)
            plan = make_plan()
            if plan.driver_version != version:
                raise VolumeBuildError(op="build", path=path, cause=f"the plan is for driver {plan.driver_version}")
            replaced = self._move_aside(path)
            manifest = self._build(plan, path, replaced)
            LOG.info(
                "built driver volume %s: %d files (%s), %d skipped",
                path,
                len(manifest["files"]),
                manifest["mode"],
                len(manifest["skipped"]),
            )
            return BuildResult(path, manifest, built=True)

    def _prepare_root(self) -> None:
        try:
            os.makedirs(self.volume_root, mode=0o755, exist_ok=True)
        except OSError as exc:
            raise VolumeBuildError(
                op="create volume root", path=self.volume_root, cause=exc.strerror or str(exc)
            ) from exc
        entry = mount_of(self.volume_root, read_mountinfo(self.mountinfo))
        if self.tmpfs_on_noexec and entry is not None and entry.noexec:
            # The lock sits beside the root: a lock inside it would be hidden by the tmpfs we mount.
            parent, base = os.path.split(self.volume_root)
            with flocked(os.path.join(parent, f".{base}.mount.lock")):
                entry = mount_of(self.volume_root, read_mountinfo(self.mountinfo))
                if entry is not None and entry.noexec:
                    LOG.info(
                        "volume root %s is on a noexec mount; mounting a tmpfs over it (MESOS-5923)", self.volume_root
                    )
                    mount_tmpfs(self.volume_root)
                    entry = mount_of(self.volume_root, read_mountinfo(self.mountinfo))
        self._tmpfs = entry is not None and entry.mount_point == self.volume_root and entry.fstype == "tmpfs"

    def _clean_leftovers(self, version: str) -> None:
        """Remove temporary and trash directories a killed builder of this version left behind."""
        prefixes = (f".{volume_name(version)}.tmp-", f".{volume_name(version)}.trash-")
        for name in os.listdir(self.volume_root):
            if name.startswith(prefixes):
                LOG.info("removing %s left by an interrupted build", os.path.join(self.volume_root, name))
                shutil.rmtree(os.path.join(self.volume_root, name), ignore_errors=True)

    def _move_aside(self, path: str) -> str | None:
        """Rename a damaged or foreign (e.g. Mesos-built) directory aside; never delete it, a container may use it."""
        if not os.path.lexists(path):
            return None
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%f")
        aside = f"{path}.replaced-{stamp}"
        LOG.warning("moving %s aside to %s: it is not a complete volume of ours", path, aside)
        try:
            os.rename(path, aside)
        except OSError as exc:
            raise VolumeBuildError(op="move aside", path=path, cause=exc.strerror or str(exc)) from exc
        return aside

    def _build(self, plan: VolumePlan, path: str, replaced: str | None) -> dict[str, Any]:
        tmp = ""
        try:
            tmp = _mkdtemp(self.volume_root, f".{plan.name}.tmp-")
            os.chmod(tmp, 0o755)
            for sub in SUBDIRS:
                os.mkdir(os.path.join(tmp, sub), 0o755)
            dev = os.stat(tmp).st_dev
            records = []
            for i, f in enumerate(plan.files):
                if self.progress is not None:
                    self.progress(i, f)
                records.append(_place(f, os.path.join(tmp, f.dir, f.name), dev))
            for link in plan.links:
                os.symlink(link.target, os.path.join(tmp, link.dir, link.name))
            manifest = _manifest(plan, path, records, self._tmpfs, replaced)
            _write_synced(os.path.join(tmp, mf.MANIFEST_NAME), mf.dumps(manifest))
            os.rename(tmp, path)
            _fsync_dir(self.volume_root)
            return manifest
        except OSError as exc:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
            raise VolumeBuildError(
                op="build volume", path=path, cause=f"{exc.strerror or exc} ({exc.filename})"
            ) from exc
        except BaseException:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    # ---- removing -----------------------------------------------------------------------------

    def remove(self, version: str) -> bool:
        """Remove the volume of ``version`` (rename to trash, then delete). False if there was none."""
        path = self.path_of(version)
        with flocked(self.lock_path(version)):
            if not os.path.lexists(path):
                return False
            trash = _mkdtemp(self.volume_root, f".{volume_name(version)}.trash-")
            try:
                os.rename(path, os.path.join(trash, "volume"))
            except OSError as exc:
                os.rmdir(trash)
                raise VolumeBuildError(op="remove volume", path=path, cause=exc.strerror or str(exc)) from exc
            shutil.rmtree(trash, ignore_errors=True)
        LOG.info("removed driver volume %s", path)
        return True


def _mkdtemp(parent: str, prefix: str) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def _place(f: PlannedFile, dest: str, dev: int) -> dict[str, Any]:
    st = os.stat(f.source)
    method = "copy"
    if st.st_dev == dev:
        try:
            os.link(f.source, dest)
            method = "link"
        except OSError as exc:
            if exc.errno not in LINK_FALLBACK_ERRNOS:
                raise
            LOG.info("cannot hard-link %s (%s); copying it", f.source, exc.strerror)
    if method == "copy":
        shutil.copy2(f.source, dest)
    return {
        "dir": f.dir,
        "name": f.name,
        "group": f.group,
        "component": f.component,
        "source": f.real_path,
        "method": method,
        "bytes": st.st_size,
        "soname": f.soname,
        "elf_class": f.elf_class,
    }


def _manifest(
    plan: VolumePlan, path: str, records: list[dict[str, Any]], tmpfs: bool, replaced: str | None
) -> dict[str, Any]:
    methods = {r["method"] for r in records}
    mode = methods.pop() if len(methods) == 1 else ("mixed" if methods else "empty")
    return {
        "schema": mf.SCHEMA,
        "name": plan.name,
        "path": path,
        "driver_version": plan.driver_version,
        "driver_root": plan.driver_root,
        "ldcache": plan.ldcache,
        "ldcache_format": plan.ldcache_format,
        "groups": list(plan.groups),
        "mode": mode,
        "tmpfs": tmpfs,
        "built_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "plan_digest": plan.digest(),
        "counts": files_by_group(plan.files),
        "bytes": sum(r["bytes"] for r in records),
        "files": records,
        "links": [{"dir": link.dir, "name": link.name, "target": link.target} for link in plan.links],
        "skipped": [
            {"path": s.path, "component": s.component, "reason": s.reason, "detail": s.detail} for s in plan.skipped
        ],
        "missing": [
            {"component": m.component, "group": m.group, "kind": m.kind, "optional": m.optional} for m in plan.missing
        ],
        "replaced": replaced,
    }


def _write_synced(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
