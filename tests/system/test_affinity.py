"""--cpu-affinity on real cgroups with the real daemon (docs/affinity.md), on the shipped simulated
host numa-2: GPU 0 is local to CPU 0 (node 0), GPU 1 to CPU 1 (node 1). This machine has CPUs 0-1
and one memory node, so each container's processes must read ``Cpus_allowed_list`` = its GPU's CPU
and ``Mems_allowed_list`` = 0 in /proc/<pid>/status.

The cpuset goes where the controller is bound: the v1 ``cpuset`` hierarchy, or cgroup2's ``cpuset``
(those cases skip loudly where the machine lacks it). Judged by what the kernel does to a process.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import grpc
import pytest
from invariants import quick_sidecar, read_records

from isolator.daemon.crashpoints import ENV
from isolator.policy.affinity import ENV_CPUS, ENV_NUMA_NODES
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing.mesos import GrpcIsolator, HookFailed, MesosCgroups, container_id

pytestmark = [pytest.mark.root]

# (devices cgroup version, markers): the cpuset follows the controller wherever it is bound.
ROUTES = [
    pytest.param("v1", marks=[pytest.mark.cgroup_v1, pytest.mark.cpuset_v1], id="devices-v1-cpuset-v1"),
    pytest.param("v2", marks=[pytest.mark.cgroup_v2, pytest.mark.cpuset_v1], id="devices-v2-cpuset-v1"),
    pytest.param("v2", marks=[pytest.mark.cgroup_v2, pytest.mark.cpuset_v2], id="devices-v2-cpuset-v2"),
]
ENFORCE = ("--cpu-affinity", "enforce")


def gpus(n: int) -> dict[str, object]:
    return {"resources": [{"name": "gpus", "type": "SCALAR", "scalar": {"value": n}, "role": "*"}]}


def allowed(pid: int) -> tuple[str, str]:
    """(Cpus_allowed_list, Mems_allowed_list) of a process, as the kernel holds it."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out["Cpus_allowed_list"], out["Mems_allowed_list"]


def minor_of(sidecar, name: str) -> int:
    (minor,) = read_records(sidecar.work)[name]
    return minor


def env_of(info: dict | None) -> dict[str, str]:
    variables = (info or {}).get("environment", {}).get("variables", [])
    return {v["name"]: v["value"] for v in variables}


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def spawn(procs: list[subprocess.Popen[bytes]]) -> int:
    proc = subprocess.Popen(["sleep", "600"])
    procs.append(proc)
    return proc.pid


def stop(procs: list[subprocess.Popen[bytes]], pid: int) -> None:
    for p in procs:
        if p.pid == pid:
            p.kill()
            p.wait()


def cpuset_dir(sidecar, name: str, mesos: bool = False) -> str:
    return os.path.join(sidecar.cpuset_parents[1 if mesos else 0], name)


def audit(sidecar) -> pb.AuditResponse:
    with grpc.insecure_channel(sidecar.address) as ch:
        return pb_grpc.AdminStub(ch).Audit(pb.AuditRequest(), timeout=30)


@pytest.mark.parametrize("version", ROUTES)
def test_enforce_holds_each_container_to_the_cpus_and_memory_of_its_gpus_node(version, sleepers):
    with quick_sidecar("numa-2", version, extra=ENFORCE) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        infos = {name: isolator.prepare(container_id(name), gpus(1)) for name in ("a", "b")}
        for name in ("a", "b"):
            minor = minor_of(sidecar, name)
            pid = spawn(sleepers)
            isolator.isolate(container_id(name), pid)
            assert allowed(pid) == (str(minor), "0"), f"{name} holds GPU {minor}"
            assert env_of(infos[name]) == {ENV_CPUS: str(minor), ENV_NUMA_NODES: "0"}
        assert {minor_of(sidecar, "a"), minor_of(sidecar, "b")} == {0, 1}
        for name in ("a", "b"):
            for p in list(sleepers):
                stop(sleepers, p.pid)
            isolator.cleanup(container_id(name))
            assert not os.path.exists(cpuset_dir(sidecar, name))
        isolator.close()


def test_hint_gives_the_environment_and_makes_no_cpuset(sleepers):
    with quick_sidecar("numa-2", "v1", extra=("--cpu-affinity", "hint")) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        info = isolator.prepare(container_id("a"), gpus(2))
        assert env_of(info) == {ENV_CPUS: "0-1", ENV_NUMA_NODES: "0"}
        pid = spawn(sleepers)
        before = allowed(pid)
        isolator.isolate(container_id("a"), pid)
        assert allowed(pid) == before and not os.path.exists(cpuset_dir(sidecar, "a"))
        stop(sleepers, pid)
        isolator.cleanup(container_id("a"))
        isolator.close()


def test_enforce_refuses_gpus_whose_cpus_this_machine_does_not_have_and_leaves_nothing(tmp_path):
    host = tmp_path / "far.toml"
    host.write_text(
        'name = "far"\ndriver_version = "535.104.05"\ncuda_driver_version = "12.2"\n'
        '[[numa]]\nnode = 3\ncpus = "200-203"\n'
        '[[gpu]]\nindex = 0\nminor = 0\nname = "NVIDIA L4"\npci_bus_id = "0000:17:00.0"\nmemory_mib = 23034\n'
        "numa_node = 3\n"
    )
    with quick_sidecar(str(host), "v1", extra=ENFORCE) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        with pytest.raises(HookFailed) as info:
            isolator.prepare(container_id("far"), gpus(1))
        assert info.value.code == "FAILED_PRECONDITION", info.value
        assert "local to 200-203" in info.value.message and "never given every CPU" in info.value.message
        assert read_records(sidecar.work) == {}
        assert not os.path.exists(os.path.join(sidecar.cgroup_parent, "far"))
        assert not os.path.exists(cpuset_dir(sidecar, "far"))
        isolator.prepare(container_id("none"), gpus(0))  # no GPUs: left alone, not refused
        isolator.cleanup(container_id("none"))
        isolator.close()


@pytest.mark.parametrize("version", ROUTES[:2])
def test_a_kill_between_recording_the_cpuset_and_writing_it_is_restored_at_start(version, sleepers):
    with quick_sidecar("numa-2", version, extra=ENFORCE, env={ENV: "cpuset.recorded:1"}) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        with pytest.raises(HookFailed):
            isolator.prepare(container_id("victim"), gpus(1))
        assert sidecar.died() == -9, sidecar.log()
        isolator.close()
        minor = minor_of(sidecar, "victim")  # recorded
        assert not os.path.exists(cpuset_dir(sidecar, "victim")), "killed before the cpuset was written"
        sidecar.env = {}
        sidecar.start()  # no Recover: the start-up reconciliation alone
        with open(os.path.join(cpuset_dir(sidecar, "victim"), "cpuset.cpus")) as fh:
            assert fh.read().strip() == str(minor)
        isolator = GrpcIsolator(sidecar.socket)
        pid = spawn(sleepers)
        isolator.isolate(container_id("victim"), pid)
        assert allowed(pid) == (str(minor), "0")
        stop(sleepers, pid)
        isolator.cleanup(container_id("victim"))
        isolator.close()


def test_the_audit_repairs_a_cpuset_changed_behind_our_back_and_reports_it(sleepers):
    with quick_sidecar("numa-2", "v1", extra=ENFORCE) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        isolator.prepare(container_id("a"), gpus(1))
        minor = minor_of(sidecar, "a")
        pid = spawn(sleepers)
        isolator.isolate(container_id("a"), pid)
        with open(os.path.join(cpuset_dir(sidecar, "a"), "cpuset.cpus"), "w") as fh:
            fh.write("0-1")
        assert allowed(pid)[0] == "0-1"
        report = audit(sidecar)
        assert len(report.repaired) == 1 and "re-applied the recorded cpuset" in report.repaired[0], report
        assert allowed(pid) == (str(minor), "0")
        assert list(audit(sidecar).repaired) == []
        stop(sleepers, pid)
        isolator.cleanup(container_id("a"))
        isolator.close()


def test_update_moves_the_cpuset_with_the_gpus(sleepers):
    with quick_sidecar("numa-2", "v1", extra=ENFORCE) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        isolator.prepare(container_id("a"), gpus(1))
        pid = spawn(sleepers)
        isolator.isolate(container_id("a"), pid)
        isolator.update(container_id("a"), 2)
        assert allowed(pid) == ("0-1", "0")
        isolator.update(container_id("a"), 1)
        assert allowed(pid) == (str(minor_of(sidecar, "a")), "0")
        stop(sleepers, pid)
        isolator.cleanup(container_id("a"))
        isolator.close()


def test_mesos_mode_holds_the_container_in_a_cpuset_of_our_own_removed_at_cleanup(sleepers):
    with quick_sidecar("numa-2", "v1", extra=(*ENFORCE, "--mode", "mesos")) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        agent = MesosCgroups("v1", sidecar.cgroup_parent)
        agent.prepare(["a"], {})
        isolator.prepare(container_id("a"), gpus(1))
        pid, nested = spawn(sleepers), spawn(sleepers)
        agent.place(["a"], pid)
        # Prepare may answer before its grant and cpuset exist; the launch waits for Isolate, and
        # they exist when it answers (docs/mesos-agent.md, "Prepare answers before its grant is in force").
        isolator.isolate(container_id("a"), pid)
        minor = minor_of(sidecar, "a")
        ours = cpuset_dir(sidecar, "a", mesos=True)
        assert os.path.isdir(ours) and not os.path.exists(cpuset_dir(sidecar, "a"))
        assert allowed(pid) == (str(minor), "0")
        # A nested container's pid comes from the agent, not from its parent: Isolate places it too.
        agent.place(["a"], nested)
        isolator.prepare(container_id(["a", "b"]), {"resources": []})
        isolator.isolate(container_id(["a", "b"]), nested)
        assert allowed(nested) == (str(minor), "0")
        stop(sleepers, pid)
        stop(sleepers, nested)
        isolator.cleanup(container_id(["a", "b"]))
        isolator.cleanup(container_id("a"))
        assert not os.path.exists(ours)
        agent.destroy(["a"])
        isolator.close()
