"""Throwaway cgroups for tests, the demo and the benchmark: always under ``gpu-isolator-test/``.

Everything made here lives below ``<mount>/gpu-isolator-test/<unique>`` and is removed, with any
process left inside, however the caller ends. Nothing outside that parent is ever touched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
import uuid
from collections.abc import Iterator

from isolator.cgroups.detect import read_mounts
from isolator.model import CgroupVersion

TEST_PARENT = "gpu-isolator-test"


def unique_name(tag: str) -> str:
    return f"{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def hierarchy_mounts() -> tuple[str | None, str | None]:
    """(the v1 devices hierarchy, the cgroup2 mount), each None when absent."""
    mounts = read_mounts("/proc/self/mounts")
    return mounts.v1_devices, mounts.v2


def cgroup_mount(version: CgroupVersion | str) -> str:
    v1, v2 = hierarchy_mounts()
    mount = v1 if CgroupVersion(version) is CgroupVersion.V1 else v2
    if mount is None:
        raise RuntimeError(f"no cgroup {version} devices hierarchy on this machine")
    return mount


def _kill_all(cgroup: str) -> None:
    for root, _dirs, _files in os.walk(cgroup):
        with contextlib.suppress(OSError), open(os.path.join(root, "cgroup.procs")) as fh:
            for line in fh:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(line), signal.SIGKILL)


def remove_cgroup_tree(cgroup: str) -> None:
    """Kill what is left inside, then rmdir bottom-up (cgroup dirs hold only kernel files)."""
    if not os.path.isdir(cgroup):
        return
    _kill_all(cgroup)
    for _ in range(50):
        try:
            for root, dirs, _files in os.walk(cgroup, topdown=False):
                for name in dirs:
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir(os.path.join(root, name))
            os.rmdir(cgroup)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            time.sleep(0.05)  # killed processes leave the cgroup asynchronously
    raise RuntimeError(f"could not remove test cgroup {cgroup}")


@contextlib.contextmanager
def scratch_cgroups_root(mount: str, tag: str) -> Iterator[str]:
    """``<mount>/gpu-isolator-test/<unique>``, removed (with everything below) however the test ends.

    Yields the path relative to the mount, to be used as ``cgroups_root``.
    """
    relative = os.path.join(TEST_PARENT, unique_name(tag))
    path = os.path.join(mount, relative)
    os.makedirs(path)
    try:
        yield relative
    finally:
        remove_cgroup_tree(path)
