"""Before it serves, the real daemon reconciles every cgroup under its root with its records
(issue 16), whether or not the agent ever calls Recover: the command-module route never does.

Each case leaves the machine the way a crash or an unlucky operator would, restarts the real
daemon on real cgroups (v1 and v2), calls no Recover, and judges by what the kernel does: a probe
process joins each cgroup and opens every GPU node (tests/invariants.py).
"""

from __future__ import annotations

import glob
import os
import subprocess

import grpc
import pytest
from invariants import Observer, quick_sidecar, read_records

from isolator.daemon.crashpoints import ENV
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing.mesos import GrpcIsolator, HookFailed, MesosCgroups, container_id

pytestmark = [pytest.mark.root]

VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]
GPUS = 8


def gpus(n: int) -> dict[str, object]:
    return {"resources": [{"name": "gpus", "type": "SCALAR", "scalar": {"value": n}, "role": "*"}]}


def health(sidecar) -> dict[str, pb.HealthResponse.Check]:
    with grpc.insecure_channel(sidecar.address) as ch:
        return {c.name: c for c in pb_grpc.AdminStub(ch).Health(pb.HealthRequest(), timeout=30).checks}


@pytest.mark.parametrize("version", VERSIONS)
def test_a_kill_between_making_a_cgroup_and_restricting_it_is_repaired_before_serving(version):
    # v2: SIGKILL after the deny-all's checkpoint, before its program is attached. v1 has no
    # point between mkdir and the deny-all: kill after the record and make the cgroup by hand,
    # as the kernel would have it (it inherits its parent's "a *:* rwm").
    point = "v2.checkpoint:1" if version == "v2" else "prepare.recorded:1"
    with quick_sidecar("dgx-1", version, env={ENV: point}) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        with pytest.raises(HookFailed):
            isolator.prepare(container_id("victim"), gpus(1))
        assert sidecar.died() == -9, sidecar.log()
        isolator.close()
        cgroup = os.path.join(sidecar.cgroup_parent, "victim")
        if version == "v1":
            os.makedirs(cgroup)
        assert os.path.isdir(cgroup)
        sidecar.env = {}
        sidecar.start()
        isolator = GrpcIsolator(sidecar.socket)
        with pytest.raises(HookFailed) as info:
            isolator.prepare(container_id("victim"), gpus(1))  # the agent retries: it is recorded
        assert info.value.code == "ALREADY_EXISTS"
        sleeper = subprocess.Popen(["sleep", "60"])
        try:
            isolator.isolate(container_id("victim"), sleeper.pid)  # no Recover on this route
            assert Observer(sidecar, GPUS).problems() == []
            assert len(read_records(sidecar.work)["victim"]) == 1
        finally:
            sleeper.kill()
            sleeper.wait()
        isolator.cleanup(container_id("victim"))
        isolator.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_start_after_the_state_was_deleted_rebuilds_it_from_the_kernel(version):
    with quick_sidecar("dgx-1", version) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        isolator.prepare(container_id("a"), gpus(2))
        isolator.prepare(container_id("b"), gpus(1))
        sleeper = subprocess.Popen(["sleep", "60"])
        try:
            isolator.isolate(container_id("b"), sleeper.pid)
            before = read_records(sidecar.work)
            assert sidecar.terminate() == 0
            for path in glob.glob(os.path.join(sidecar.work, "state", "*")):
                os.unlink(path)  # the database deleted while the sidecar was stopped
            sidecar.start()
            assert read_records(sidecar.work) == before
            assert Observer(sidecar, GPUS).problems() == []
            state = health(sidecar)["state"]
            assert "rebuilt from the kernel at start: a, b" in state.detail, state.detail
            with pytest.raises(HookFailed) as info:
                isolator = GrpcIsolator(sidecar.socket)
                isolator.prepare(container_id("c"), gpus(6))  # the rebuilt records hold three GPUs
            assert info.value.code == "RESOURCE_EXHAUSTED"
        finally:
            sleeper.kill()
            sleeper.wait()
        for name in ("a", "b"):
            isolator.cleanup(container_id(name))
        isolator.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_stray_cgroup_under_our_root_that_allows_every_device_is_denied_before_serving(version):
    with quick_sidecar("dgx-1", version) as sidecar:
        assert sidecar.terminate() == 0
        os.makedirs(os.path.join(sidecar.cgroup_parent, "stray"))  # nothing restricts it
        assert Observer(sidecar, GPUS).problems(), "the kernel lets a process in it open every GPU"
        sidecar.start()
        assert Observer(sidecar, GPUS).problems() == []
        assert read_records(sidecar.work) == {}
        os.rmdir(os.path.join(sidecar.cgroup_parent, "stray"))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("point", ["state.commit:1", "prepare.recorded:1"])
def test_a_kill_after_an_early_prepare_answer_gives_no_task_a_grant_that_is_not_in_force(version, point):
    # A whole GPU's Prepare under the agent answers before its grant is on disk and in force, and the
    # agent goes on to Isolate (docs/mesos-agent.md, "Prepare answers before its grant is in force").
    # Killed before the commit, the restarted sidecar holds nothing of the container: the Isolate
    # fails and the launch with it. Killed after it, before the rules: the start repairs the grant
    # before serving, and the Isolate answers with it in force.
    with quick_sidecar("dgx-1", version, extra=("--mode", "mesos"), env={ENV: point}) as sidecar:
        agent = MesosCgroups(version, sidecar.cgroup_parent)
        agent.prepare(["victim"], {})
        isolator = GrpcIsolator(sidecar.socket)
        try:
            isolator.prepare(container_id("victim"), gpus(1))
            answered = True
        except HookFailed as exc:  # the kill came before the answer left the event loop
            assert exc.code == "UNAVAILABLE", exc
            answered = False
        assert sidecar.died() == -9, sidecar.log()
        isolator.close()
        sidecar.env = {}
        sidecar.start()
        isolator = GrpcIsolator(sidecar.socket)
        sleeper = subprocess.Popen(["sleep", "60"])
        try:
            agent.place(["victim"], sleeper.pid)
            if point.startswith("state.commit"):
                with pytest.raises(HookFailed) as info:
                    isolator.isolate(container_id("victim"), sleeper.pid)
                assert info.value.code == "NOT_FOUND", info.value
                assert read_records(sidecar.work).get("victim") is None
            elif answered:  # else the agent fails the launch at its Prepare, as before
                isolator.isolate(container_id("victim"), sleeper.pid)
                assert len(read_records(sidecar.work)["victim"]) == 1
                # Its cgroup grants exactly the recorded GPU. (The Observer's probe joins the
                # container's cgroup itself, which on v2 is not where Mesos's layout runs its pids,
                # <id>/leaf: it is judged on v1.)
                if version == "v1":
                    assert Observer(sidecar, GPUS).problems() == []
        finally:
            sleeper.kill()
            sleeper.wait()
        isolator.cleanup(container_id("victim"))
        isolator.close()
        agent.destroy(["victim"])
