"""Markers that need something of the machine, and the loud skips when it lacks it.

``root``: euid 0. ``cgroup_v1``: a writable v1 devices hierarchy. ``cgroup_v2``: a writable cgroup2
mount. ``gpu``: an NVIDIA driver with at least one GPU. ``cpuset_v1``/``cpuset_v2``: a writable v1
cpuset hierarchy / the cpuset controller on cgroup2. Each skip prints its reason (``-ra``).


Also the grouping for ``make test``'s parallel run (pytest-xdist, ``--dist loadgroup``): the tests that
share a daemon through a module-scoped fixture run on one worker, so the daemon starts once.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import shutil

import pytest


def _mount_points(fstype: str) -> list[tuple[str, str]]:
    out = []
    with open("/proc/self/mounts") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 4 and parts[2] == fstype:
                out.append((parts[1], parts[3]))
    return out


@functools.cache
def capability(name: str) -> str | None:
    """None when the machine has the capability, else the reason it does not."""
    if name == "root":
        return None if os.geteuid() == 0 else f"needs root (euid is {os.geteuid()})"
    if name == "cgroup_v1":
        if os.geteuid() != 0:
            return "needs root to write the v1 devices cgroup"
        for mnt, opts in _mount_points("cgroup"):
            if "devices" in opts.split(","):
                return None if os.access(mnt, os.W_OK) else f"v1 devices hierarchy at {mnt} is not writable"
        return "no cgroup v1 devices hierarchy is mounted"
    if name == "cgroup_v2":
        if os.geteuid() != 0:
            return "needs root to create cgroups and load bpf programs"
        mounts = _mount_points("cgroup2")
        if not mounts:
            return "no cgroup2 hierarchy is mounted"
        return None if os.access(mounts[0][0], os.W_OK) else f"cgroup2 at {mounts[0][0]} is not writable"
    if name == "cpuset_v1":
        if os.geteuid() != 0:
            return "needs root to create cpuset cgroups"
        for mnt, opts in _mount_points("cgroup"):
            if "cpuset" in opts.split(","):
                return None if os.access(mnt, os.W_OK) else f"v1 cpuset hierarchy at {mnt} is not writable"
        return "no cgroup v1 cpuset hierarchy is mounted"
    if name == "cpuset_v2":
        if os.geteuid() != 0:
            return "needs root to create cpuset cgroups"
        mounts = _mount_points("cgroup2")
        if not mounts:
            return "no cgroup2 hierarchy is mounted"
        try:
            with open(os.path.join(mounts[0][0], "cgroup.controllers")) as fh:
                offered = fh.read().split()
        except OSError as exc:
            return f"cannot read {mounts[0][0]}/cgroup.controllers: {exc}"
        if "cpuset" not in offered:
            return f"the cpuset controller is not available on cgroup2 at {mounts[0][0]} (offered: {offered})"
        return None
    if name == "gpu":
        if not ctypes.util.find_library("nvidia-ml") and not os.path.exists("/dev/nvidiactl"):
            return "no NVIDIA driver on this machine (libnvidia-ml not found, no /dev/nvidiactl)"
        if not shutil.which("nvidia-smi"):
            return "no nvidia-smi on PATH"
        return None
    raise KeyError(name)


CAPABILITY_MARKERS = ("root", "cgroup_v1", "cgroup_v2", "gpu", "cpuset_v1", "cpuset_v2")


MESOS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mesos")
NODE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node")


def pytest_ignore_collect(collection_path, config):  # type: ignore[no-untyped-def]
    """tests/mesos/ runs a real Mesos cluster: only under ``make test-mesos`` (``-m mesos``), never in
    ``make test``."""
    if str(collection_path) == MESOS_DIR and "mesos" not in (config.getoption("markexpr") or ""):
        return True
    if str(collection_path) == NODE_DIR and "node" not in (config.getoption("markexpr") or ""):
        return True  # tests/node/ boots a node: only under ``make test-node`` (``-m node``)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for name in CAPABILITY_MARKERS:
        if item.get_closest_marker(name) is not None:
            reason = capability(name)
            if reason is not None:
                pytest.skip(f"[{name}] {reason}")


@pytest.fixture
def short_tmp():
    """A short temporary directory: Unix socket paths must fit in 107 bytes."""
    import tempfile

    path = tempfile.mkdtemp(prefix="gi-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep the users of a module's ``SHARED_FIXTURES`` (module-scoped fixtures: a daemon, a built tree)
    on one xdist worker, one group per parameter of those fixtures, so each is set up once.

    Without xdist the mark does nothing. Tests with an ``xdist_group`` of their own keep it.
    """
    for item in items:
        shared = getattr(getattr(item, "module", None), "SHARED_FIXTURES", ())
        used = [name for name in shared if name in getattr(item, "fixturenames", ())]
        if not used or item.get_closest_marker("xdist_group") is not None:
            continue
        callspec = getattr(item, "callspec", None)
        indices = callspec.indices if callspec is not None else {}
        group = shared_group(item.module.__name__, {name: indices.get(name, 0) for name in used})
        item.add_marker(pytest.mark.xdist_group(group))


def shared_group(module: str, params: dict[str, int]) -> str:
    """The xdist group of a module's shared fixtures at these parameter indices.

    No brackets: xdist appends ``@<group>`` to the test's ID and takes what follows the last ``@``
    as the group only when it comes after the last ``]`` (a parameter may contain ``@``), so a
    group ending in ``]`` was no group at all, and each test went to any worker, starting the
    fixture's daemon again there (tests/system/test_xdist_groups.py).
    """
    return module + "".join(f":{name}={index}" for name, index in params.items())
