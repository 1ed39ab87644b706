"""A real Mesos cluster for tests/mesos/ (``make test-mesos``; marker ``mesos``).

Mesos comes from ``MESOS_HOME`` or ``../shared/mesos/setup.sh`` (isolator/testing/agent.py). Without
one every test here fails, unless ``ALLOW_NO_MESOS=1`` turns that into a skip.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

from isolator.testing.agent import ROUTES, Cluster, MesosNotFound, Task, find_mesos_home, native_module

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")
CONTROL = {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.mesos)
        item.add_marker(pytest.mark.root)
        item.add_marker(pytest.mark.cgroup_v1)


@pytest.fixture(scope="session")
def mesos_home() -> str:
    try:
        return find_mesos_home()
    except MesosNotFound as exc:
        if os.environ.get("ALLOW_NO_MESOS") == "1":
            pytest.skip(f"[mesos] {exc} (ALLOW_NO_MESOS=1)")
        pytest.fail(f"[mesos] {exc}: set MESOS_HOME, or ALLOW_NO_MESOS=1 to skip", pytrace=False)


@pytest.fixture(scope="session", params=ROUTES)
def route(request: pytest.FixtureRequest, mesos_home: str) -> str:
    """How the agent reaches the sidecar: criteo's command module running our bridge, or our own
    module (mesos/, built by `make module` for this Mesos version). Every scenario runs through both."""
    if request.param == "native":
        try:
            native_module(mesos_home)
        except MesosNotFound as exc:
            pytest.fail(f"[mesos] {exc}", pytrace=False)
    return str(request.param)


@pytest.fixture(scope="session")
def cluster(mesos_home: str, route: str) -> Iterator[Cluster]:
    """One master and one agent on a simulated DGX-1, shared by the scenarios that leave it as found
    (test_real_health.py, last, does not: it marks GPUs unhealthy). The agent advertises 9 GPUs for
    the 8 the sidecar has, so that a task can ask for more than are free."""
    with Cluster(mesos_home, gpus=9, route=route) as c:
        yield c


def probe(cluster: Cluster, gpus: int, seconds: float = 0, agent: int = 0, **kw: Any) -> Task:
    """Submit the probe as a command task with ``gpus`` GPUs.

    A test that needs GPUs a finished task held waits for that task's ``wait_gone()`` first: the
    master re-offers a command task's GPUs on its terminal update, before the agent has destroyed
    its container and run our cleanup (docs/mesos-agent.md, section 7)."""
    devdir = cluster.agents[agent].sidecar.dev_root  # type: ignore[union-attr]
    return cluster.submit(f"python3 {PROBE} {devdir} {seconds:g}", gpus=gpus, **kw)


def seen(stdout: str) -> dict[str, str]:
    """What the probe opened: device name -> ok/EPERM/ENXIO."""
    return dict(re.findall(r"^dev (\S+) (\S+)$", stdout, re.M))


def opened_gpus(stdout: str) -> set[int]:
    """GPU minors the task could open (the open passed the device cgroup: ENXIO without a driver)."""
    return {int(name[6:]) for name, r in seen(stdout).items() if name[6:].isdigit() and r != "EPERM"}


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


def devices_cgroup(stdout: str) -> str:
    """The devices cgroup the probe ran in, as a path in the v1 devices hierarchy."""
    from isolator.testing.agent import devices_hierarchy

    (path,) = re.findall(r"^cgroup (\S+)$", stdout, re.M)
    return os.path.join(devices_hierarchy(), path.lstrip("/"))
