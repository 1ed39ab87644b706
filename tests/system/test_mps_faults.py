"""An MPS fault through the real sidecar (issue 41 item 4): a daemon on a simulated dgx-1 with real v1
devices cgroups, the stand-in nvidia-cuda-mps-control with real server and client processes
(simhost/mpscontrol.py, mpsclient.py). A fatal fault in GPU 4's server (the stand-in's ``sim_fault``,
as the measured illegal address on an H200) ends exactly GPU 4's sharers through Watch, a new sharer
of GPU 4 is refused naming the fault until every client of it exited and the server is ACTIVE again,
then it is accepted; a sharer of GPU 5 is never told."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import grpc
import pytest
from mps_helpers import control, end, until
from watch_helpers import assert_no_limitation

from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing.cgroupfs import TEST_PARENT
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import Sidecar

pytestmark = [pytest.mark.root, pytest.mark.cgroup_v1]


def _unit(containerizer: Containerizer, size: int) -> dict:
    config = containerizer.config(gpus=None, image=False)
    config["resources"] = [
        *config.get("resources", []),
        {"name": f"gpu-share-{size}", "type": "SCALAR", "scalar": {"value": 1}},
    ]
    return config


def _pipe(info: dict | None) -> str:
    assert info is not None
    env = {e["name"]: e.get("value", "") for e in info["environment"]["variables"]}
    return env["CUDA_MPS_PIPE_DIRECTORY"]


def _client(pipe: str) -> subprocess.Popen:
    """A stand-in MPS client (a CUDA process of the sharer) on ``pipe``; returns once it is served."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe}
    proc = subprocess.Popen(
        [sys.executable, "-m", "isolator.simhost.mpsclient", "--seconds", "120"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    assert first["mps"] is True, first
    return proc


def test_a_fault_ends_that_gpus_sharers_refuses_new_ones_until_active_then_accepts(short_tmp):
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    extra = ("--shared-gpus", "4:4:mps,5:2:mps", "--gpu-probe-interval", "0.2")
    sidecar = Sidecar(work=short_tmp, host="dgx-1", cgroup_version="v1", cgroups_root=root, extra=extra)
    sidecar.start()
    clients: list[subprocess.Popen] = []
    channel = grpc.insecure_channel(sidecar.address)
    stub = pb_grpc.IsolatorStub(channel)
    isolator = GrpcIsolator(sidecar.socket)
    try:
        c = Containerizer(isolator, short_tmp)
        pipe4 = _pipe(isolator.prepare(container_id("a"), _unit(c, 4)))  # GPU 4
        assert _pipe(isolator.prepare(container_id("c"), _unit(c, 4))) == pipe4
        pipe5 = _pipe(isolator.prepare(container_id("b"), _unit(c, 2)))  # GPU 5
        clients = [_client(pipe4), _client(pipe4), _client(pipe5)]
        (server,) = control(sidecar.sim.mps_control, pipe4, "get_server_list").split()
        watches = {
            n: stub.Watch.future(pb.WatchRequest(container_id=pb.ContainerID(value=n)), timeout=60) for n in "ac"
        }

        control(sidecar.sim.mps_control, pipe4, f"sim_fault {server}")
        for name, future in watches.items():
            message = future.result().limitation.message
            assert f"MPS server {server} in FAULT" in message and "GPU 4" in message, (name, message)
        assert_no_limitation(stub, "b")
        with pytest.raises(HookFailed) as refused:
            isolator.prepare(container_id("d"), _unit(c, 4))
        assert refused.value.code == "RESOURCE_EXHAUSTED" and "MPS server in FAULT" in str(refused.value)

        # The agent ends a and c: their clients exit, the same server is ACTIVE again.
        for proc in clients[:2]:
            proc.terminate()
            proc.wait(timeout=30)
        until(lambda: control(sidecar.sim.mps_control, pipe4, f"get_server_status {server}") == "ACTIVE")
        isolator.cleanup(container_id("a"))
        isolator.cleanup(container_id("c"))

        def accepted() -> bool:
            try:
                isolator.prepare(container_id("d"), _unit(c, 4))
            except HookFailed as exc:
                assert "MPS server in FAULT" in str(exc), exc  # until the next supervise pass
                return False
            return True

        until(accepted)
        assert _pipe(isolator.prepare(container_id("e"), _unit(c, 4))) == pipe4
        assert_no_limitation(stub, "d")
        assert "in FAULT" not in sidecar.log().split("ACTIVE again")[-1]
    finally:
        end(clients, isolator, "abcde")
        channel.close()
        sidecar.stop()
