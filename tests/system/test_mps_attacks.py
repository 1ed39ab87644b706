"""A reviewer's attacks on issue 41's MPS work through the real sidecar on a simulated dgx-1 (real v1
devices cgroups, the stand-in nvidia-cuda-mps-control with real server and client processes): a root
sharer lifting its daemon's limits through the pipe directory, and the daemon SIGKILLed under a
sharer with a client connected (docs/sharing.md, "MPS", "Limits a task cannot lift")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import grpc
import pytest
from invariants import quick_sidecar
from mps_helpers import control, end, until

from isolator.daemon.crashpoints import ENV
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing.cgroupfs import TEST_PARENT
from isolator.testing.mesos import Containerizer, GrpcIsolator, container_id
from isolator.testing.sidecar import Sidecar

pytestmark = [pytest.mark.root, pytest.mark.cgroup_v1]


def _unit(containerizer: Containerizer) -> dict:
    config = containerizer.config(gpus=None, image=False)
    config["resources"] = [
        *config.get("resources", []),
        {"name": "gpu-share-4", "type": "SCALAR", "scalar": {"value": 1}},
    ]
    return config


def _env(info: dict | None) -> dict[str, str]:
    assert info is not None
    return {e["name"]: e.get("value", "") for e in info["environment"]["variables"]}


def _client(pipe: str, seconds: str = "0.2") -> tuple[dict, subprocess.Popen]:
    """A stand-in MPS client of root with nothing but the pipe directory (its limit variables unset)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "isolator.simhost.mpsclient", "--seconds", seconds],
        env={**base, "CUDA_MPS_PIPE_DIRECTORY": pipe},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return json.loads(proc.stdout.readline()), proc


@pytest.fixture
def sidecar(short_tmp):
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    extra = ("--shared-gpus", "4:4:mps", "--gpu-probe-interval", "0.2")
    sidecar = Sidecar(work=short_tmp, host="dgx-1", cgroup_version="v1", cgroups_root=root, extra=extra)
    sidecar.start()
    yield sidecar
    sidecar.stop()


def test_limits_a_root_sharer_lifts_through_its_pipe_directory_are_set_back_by_the_next_pass(sidecar, short_tmp):
    isolator = GrpcIsolator(sidecar.socket)
    try:
        c = Containerizer(isolator, short_tmp)
        pipe = _env(isolator.prepare(container_id("a"), _unit(c)))["CUDA_MPS_PIPE_DIRECTORY"]
        (server,) = control(sidecar.sim.mps_control, pipe, "get_server_list").split()
        # The sharer runs as root (no user: the agent's): the daemon takes its privileged commands.
        control(sidecar.sim.mps_control, pipe, f"set_active_thread_percentage {server} 100")
        control(sidecar.sim.mps_control, pipe, "set_default_active_thread_percentage 100")
        until(lambda: _client(pipe)[0]["active_thread_percentage"] == 25.0)
        assert "changed behind the sidecar's back" in sidecar.log()
        assert control(sidecar.sim.mps_control, pipe, "get_default_active_thread_percentage") == "25.0"
        with grpc.insecure_channel(sidecar.address) as channel:
            watch = pb_grpc.IsolatorStub(channel).Watch(
                pb.WatchRequest(container_id=pb.ContainerID(value="a")), timeout=60
            )
        assert "limits changed behind the sidecar's back" in watch.limitation.message, watch
        isolator.cleanup(container_id("a"))
    finally:
        isolator.close()


def test_a_daemon_sigkilled_under_a_sharer_ends_it_and_a_new_sharer_is_held_to_its_share(sidecar, short_tmp):
    channel = grpc.insecure_channel(sidecar.address)
    stub = pb_grpc.IsolatorStub(channel)
    isolator = GrpcIsolator(sidecar.socket)
    clients: list[subprocess.Popen] = []
    try:
        c = Containerizer(isolator, short_tmp)
        pipe = _env(isolator.prepare(container_id("a"), _unit(c)))["CUDA_MPS_PIPE_DIRECTORY"]
        got, proc = _client(pipe, seconds="120")
        clients.append(proc)
        assert got["mps"] is True and got["active_thread_percentage"] == 25.0
        watch = stub.Watch.future(pb.WatchRequest(container_id=pb.ContainerID(value="a")), timeout=60)
        with open(os.path.join(os.path.dirname(pipe), "daemon.json")) as fh:
            daemon = json.load(fh)["pid"]
        os.kill(daemon, signal.SIGKILL)
        message = watch.result().limitation.message
        assert "MPS control daemon on GPU 4" in message and "found dead and is started again" in message, message
        assert "gpu_isolator_mps" not in message
        got, proc = _client(pipe)
        clients.append(proc)
        assert (got["mps"], got["active_thread_percentage"]) == (True, 25.0), "limits set again on the new daemon"
        b = _env(isolator.prepare(container_id("b"), _unit(c)))
        assert b["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    finally:
        end(clients, isolator, "ab")
        channel.close()


def test_a_sidecar_killed_after_starting_a_dead_daemon_again_ends_its_sharer_after_its_restart(short_tmp):
    # SIGKILLed once the pass has started the daemon again and set its limits, before ending the
    # sharers: the restarted sidecar adopts a daemon that holds its limits (nothing to see there) and
    # ends the sharer from the record written before the start (state schema 12, mps_ended).
    extra = ("--shared-gpus", "4:4:mps", "--gpu-probe-interval", "0.2")
    with quick_sidecar(extra=extra, env={ENV: "mps.restarted:1"}) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        try:
            c = Containerizer(isolator, short_tmp)
            pipe = _env(isolator.prepare(container_id("a"), _unit(c)))["CUDA_MPS_PIPE_DIRECTORY"]
            with open(os.path.join(os.path.dirname(pipe), "daemon.json")) as fh:
                os.kill(json.load(fh)["pid"], signal.SIGKILL)
            assert sidecar.died(timeout=30) is not None, sidecar.log()
            assert "crash point mps.restarted" in sidecar.log(), sidecar.log()
            sidecar.env = {}
            sidecar.start()
            with grpc.insecure_channel(sidecar.address) as channel:
                watch = pb_grpc.IsolatorStub(channel).Watch(
                    pb.WatchRequest(container_id=pb.ContainerID(value="a")), timeout=15
                )
            assert "found dead and is started again" in watch.limitation.message, watch
            b = _env(isolator.prepare(container_id("b"), _unit(c)))
            with grpc.insecure_channel(sidecar.address) as channel:
                # A Watch answers empty just before its deadline when nothing happened.
                quiet = pb_grpc.IsolatorStub(channel).Watch(
                    pb.WatchRequest(container_id=pb.ContainerID(value="b")), timeout=1
                )
            assert not quiet.HasField("limitation"), f"a later sharer is not ended: {quiet}"
            assert b["CUDA_MPS_PIPE_DIRECTORY"] == pipe
            for name in ("a", "b"):
                isolator.cleanup(container_id(name))
        finally:
            isolator.close()
