"""A real Mesos cluster for tests/mesos/ (``make test-mesos``; marker ``mesos``).

Mesos comes from ``MESOS_HOME`` or ``../shared/mesos/setup.sh`` (isolator/testing/mesoshome.py). Without
one every test here fails, unless ``ALLOW_NO_MESOS=1`` turns that into a skip.

Every scenario that takes the ``cgroups`` fixture runs on both layouts the agent can see: ``v1``
(the hybrid host without its cgroup2 mount) and ``v2`` (a pure cgroup2 host in the agent's own mount
namespace); Mesos releases without cgroups v2 (1.11.0) skip the v2 ones, saying why.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from probed import opened_gpus, seen

from isolator.model import CgroupVersion
from isolator.testing.cgroupfs import cgroup_mount
from isolator.testing.cluster import Cluster
from isolator.testing.mesoshome import (
    CGROUPS,
    ROUTES,
    MesosNotFound,
    Program,
    Route,
    cgroups_v2_unsupported,
    device_programs,
    find_mesos_home,
    native_module,
)
from isolator.testing.task import Task

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")
CONTROL = {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers; and a module's ``LAYOUTS`` (default: both) says on which layouts its scenarios apply,
    the others deselected. (Not an indirect parametrize: pytest would group such a v2 with v1, by
    the parameter's index, and start the shared v2 agent twice.)"""
    keep, drop = [], []
    for item in items:
        item.add_marker(pytest.mark.mesos)
        item.add_marker(pytest.mark.root)
        # The v2 layout needs a cgroup2 mount on the host (the sidecar's view of the agent's).
        params = getattr(item, "callspec", None)
        layout = params.params.get("cgroups", CgroupVersion.V1) if params is not None else CgroupVersion.V1
        item.add_marker(pytest.mark.cgroup_v2 if layout == CgroupVersion.V2 else pytest.mark.cgroup_v1)
        applies = params is None or "cgroups" not in params.params
        (keep if applies or layout in getattr(item.module, "LAYOUTS", CGROUPS) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def mesos_home() -> str:
    try:
        return find_mesos_home()
    except MesosNotFound as exc:
        if os.environ.get("ALLOW_NO_MESOS") == "1":
            pytest.skip(f"[mesos] {exc} (ALLOW_NO_MESOS=1)")
        pytest.fail(f"[mesos] {exc}: set MESOS_HOME, or ALLOW_NO_MESOS=1 to skip", pytrace=False)


@pytest.fixture(scope="session", params=CGROUPS)
def cgroups(request: pytest.FixtureRequest, mesos_home: str) -> CgroupVersion:
    """The cgroup layout the agent sees: ``v1`` or ``v2`` (``Cluster(cgroups=...)``)."""
    layout = CgroupVersion(request.param)
    if layout == CgroupVersion.V2:
        reason = cgroups_v2_unsupported(mesos_home)
        if reason is not None:
            pytest.skip(f"[cgroup_v2] {reason}")
    return layout


@pytest.fixture(scope="session", params=ROUTES)
def route(request: pytest.FixtureRequest, mesos_home: str) -> Route:
    """How the agent reaches the sidecar: criteo's command module running our bridge, or our own
    module (mesos/, built by `make module` for this Mesos version). Every scenario runs through both."""
    if request.param == Route.NATIVE:
        try:
            native_module(mesos_home)
        except MesosNotFound as exc:
            pytest.fail(f"[mesos] {exc}", pytrace=False)
    return Route(request.param)


@pytest.fixture(scope="session")
def cluster(mesos_home: str, cgroups: CgroupVersion, route: Route) -> Iterator[Cluster]:
    """One master and one agent on a simulated DGX-1, shared by the scenarios that leave it as found
    (test_real_health.py, last, does not: it marks GPUs unhealthy). The agent advertises 9 GPUs for
    the 8 the sidecar has, so that a task can ask for more than are free. One per layout and route:
    pytest runs every scenario on each, tearing one down before the next starts."""
    with Cluster(mesos_home, gpus=9, cgroups=cgroups, route=route) as c:
        _SHARED.append(c)
        try:
            yield c
        finally:
            _SHARED.remove(c)
            _CHECKED.pop(id(c), None)


_SHARED: list[Cluster] = []  # the live shared ``cluster`` (one at a time)
_CHECKED: dict[int, int] = {}  # id(cluster) -> how many of its tasks were checked after their test


@pytest.fixture(autouse=True)
def _no_task_outlives_its_test() -> Iterator[None]:
    """Tear down what a scenario left running on the shared cluster (one that failed half-way).

    Otherwise its task keeps its GPUs, and every later scenario on that agent fails too ("holders
    not empty", "Requested 7 gpus but only 5 available"), which reads as a leak in cleanup."""
    yield
    for c in _SHARED:
        start, _CHECKED[id(c)] = _CHECKED.get(id(c), 0), len(c.tasks)
        left = []
        for task in c.tasks[start:]:
            executor = c.find_executor(task.name)
            if executor is not None and not executor.get("completed"):
                # Its framework may have ended already (a finished task being cleaned up): then the
                # master refuses the teardown, and waiting for the agent is all there is to do.
                with contextlib.suppress(OSError):
                    task.teardown()
                left.append(task)
        for task in left:
            task.wait_gone()


def libmesos_helper(source: str, mesos_home: str) -> str:
    """``source`` (a C++ file beside the tests) compiled against ``mesos_home``'s headers and linked with
    libmesos: build/<name>-<hash>, compiled once per source and Mesos; the compiler's own error otherwise
    (stout's jsonify needs rapidjson, which the error then names)."""
    with open(source, "rb") as fh:
        digest = hashlib.sha256(fh.read() + os.path.realpath(mesos_home).encode()).hexdigest()[:12]
    name = os.path.splitext(os.path.basename(source))[0].replace("_", "-")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    binary = os.path.join(root, "build", f"{name}-{digest}")
    if os.access(binary, os.X_OK):
        return binary
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.fail("g++ is missing: run ../shared/mesos/setup.sh --dev", pytrace=False)
    os.makedirs(os.path.dirname(binary), exist_ok=True)
    lib = os.path.join(mesos_home, "lib")
    # -w: Mesos's headers are not ours to warn about.
    argv = [compiler, "-std=c++17", "-O0", "-w", "-DPICOJSON_USE_INT64", "-D__STDC_FORMAT_MACROS"]
    argv += ["-I", os.path.join(mesos_home, "include"), "-o", f"{binary}.tmp", source]
    argv += [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lmesos", "-lprotobuf", "-lglog"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        hint = (
            " (stout's jsonify needs rapidjson: apt-get install rapidjson-dev)" if "rapidjson" in result.stderr else ""
        )
        pytest.fail(f"compiling {source} failed{hint}:\n{result.stderr[-4000:]}", pytrace=False)
    os.replace(f"{binary}.tmp", binary)
    return binary


def line_parser(binary: str) -> Any:
    """``binary LINE`` as a function: the JSON objects it prints, one a line, or None when it exits
    nonzero (Mesos refused the string; its LOG(FATAL) aborts)."""

    def run(line: str) -> list[dict[str, Any]] | None:
        result = subprocess.run([binary, line], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            return None
        return [json.loads(out) for out in result.stdout.splitlines()]

    return run


def probe(cluster: Cluster, gpus: int, seconds: float = 0, agent: int = 0, **kw: Any) -> Task:
    """Submit the probe as a command task with ``gpus`` GPUs.

    A test that needs GPUs a finished task held waits for that task's ``wait_gone()`` first: the
    master re-offers a command task's GPUs on its terminal update, before the agent has destroyed
    its container and run our cleanup (docs/mesos-agent.md, section 7)."""
    devdir = cluster.agents[agent].sidecar.dev_root  # type: ignore[union-attr]
    return cluster.submit(f"python3 {PROBE} {devdir} {seconds:g}", gpus=gpus, **kw)


def assert_sees_exactly(stdout: str, minors: set[int]) -> None:
    results = seen(stdout)
    assert results, stdout
    assert opened_gpus(stdout) == minors, results
    for name in CONTROL:
        assert results[name] == "ENXIO", (name, results)
    for name, result in results.items():
        if name[6:].isdigit() and int(name[6:]) not in minors:
            assert result == "EPERM", (name, results)


def gpu_rules(devices_list: list[str]) -> set[int]:
    """GPU minors (major 195, below 255) that a v1 devices.list allows."""
    return {int(m) for m in re.findall(r"^c 195:(\d+) rwm$", "\n".join(devices_list), re.M) if int(m) < 255}


def probe_command(cluster: Cluster, seconds: float = 0, agent: int = 0) -> str:
    devdir = cluster.agents[agent].sidecar.dev_root  # type: ignore[union-attr]
    return f"python3 {PROBE} {devdir} {seconds:g}"


# ---- what the kernel holds, on either layout ------------------------------------------------


def programs_along(cgroup: str) -> list[Program]:
    """The device programs on a cgroup2 path and each of its ancestors up to the mount."""
    stop = os.path.normpath(cgroup_mount(CgroupVersion.V2))
    path = os.path.normpath(cgroup)
    out = []
    while True:
        out += device_programs(path)
        if path == stop or not path.startswith(stop + os.sep):
            return out
        path = os.path.dirname(path)


def v2_allows(cgroup: str, type_: str, major: int, minor: int, access: str = "rw") -> bool:
    """Whether a process in ``cgroup`` (a cgroup2 path) may open the device: every program attached
    to it and to each ancestor up to the mount must allow (the kernel runs them all, AND)."""
    return all(p.allows(type_, major, minor, access) for p in programs_along(cgroup))


def granted_at(cgroup: str, layout: CgroupVersion) -> set[int]:
    """GPU minors (major 195, below 255) that the kernel lets a process in ``cgroup`` open
    read-write: v1 from its devices.list, v2 from the device programs on it and its ancestors."""
    if layout == CgroupVersion.V1:
        from isolator.testing.mesoshome import read_lines

        return gpu_rules(read_lines(os.path.join(cgroup, "devices.list")))
    progs = programs_along(cgroup)
    return {m for m in range(255) if all(p.allows("c", 195, m, "rw") for p in progs)}


def granted(task: Task, *nested: str) -> set[int]:
    """GPU minors the kernel lets the task's container open (v1: its cgroup; v2: its leaf)."""
    agent = task.agent()
    where = task.cgroup(*nested) if agent.cgroups == CgroupVersion.V1 else task.leaf(*nested)
    return granted_at(where, agent.cgroups)


def kernel_allows(task: Task, rule: str) -> bool:
    """``rule`` (``"c 195:255 rwm"``) in the v1 devices.list, or on v2 allowed (``rw``) by every
    program on the task's leaf and its ancestors."""
    agent = task.agent()
    if agent.cgroups == CgroupVersion.V1:
        return rule in task.devices_list()
    type_, numbers, _access = rule.split()
    major, minor = numbers.split(":")
    minors = (0, 1, 4095) if minor == "*" else (int(minor),)  # a wildcard: a few of its devices
    return all(v2_allows(task.leaf(), type_, int(major), m) for m in minors)


def kernel_view(task: Task) -> Any:
    """What the kernel holds for the task, to compare across a restart: v1 its devices.list; v2 the
    names of the programs on ``<id>`` and ``<id>/leaf`` and the GPUs they let through."""
    agent = task.agent()
    if agent.cgroups == CgroupVersion.V1:
        return task.devices_list()
    names = {where: sorted(p.name for p in device_programs(where)) for where in (task.cgroup(), task.leaf())}
    return names, granted(task)


def container_cgroup(stdout: str, layout: CgroupVersion) -> str:
    """The cgroup the probe ran in: v1 its devices cgroup, v2 its cgroup2 one, as a host path."""
    if layout == CgroupVersion.V1:
        return devices_cgroup(stdout)
    (path,) = re.findall(r"^cgroup2 (\S+)$", stdout, re.M)
    return os.path.join(cgroup_mount(CgroupVersion.V2), path.lstrip("/"))


def devices_cgroup(stdout: str) -> str:
    """The devices cgroup the probe ran in, as a path in the v1 devices hierarchy."""
    from isolator.testing.mesoshome import devices_hierarchy

    (path,) = re.findall(r"^cgroup (\S+)$", stdout, re.M)
    return os.path.join(devices_hierarchy(), path.lstrip("/"))
