"""The handover check on a real daemon over a simulated host (docs/handover.md): a process left on a
GPU after Cleanup keeps that GPU out of every later Prepare until it is gone, through gRPC and
through the command-module bridge, and an admin sees why (`gpu-isolator gpus`, health, describe)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from isolator.cli import main as cli
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing.mesos import BridgeIsolator, Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import Sidecar, running_sidecar

pytestmark = [pytest.mark.root]

VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]
ROUTES = ["grpc", "bridge"]
LEFT_PID = 424242  # what NVML reports on the GPU: a leaked child, a hung context


def _cli(sock: str, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([*argv, "--socket", sock])
    return rc, out.getvalue(), err.getvalue()


def _gpus(sidecar: Sidecar) -> dict[int, Any]:
    with grpc.insecure_channel(sidecar.address) as channel:
        reply = pb_grpc.AdminStub(channel).ListGpus(pb.ListGpusRequest(), timeout=10)
    return {g.index: g for g in reply.gpus}


def _wait_for(what: str, check: Callable[[], bool], budget: float = 30.0) -> None:
    deadline = time.monotonic() + budget
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(
    params=[(v, r) for v in VERSIONS for r in ROUTES], ids=lambda p: f"{p[0].values[0]}-{p[1]}", scope="module"
)
def agent(request):
    version, route = request.param
    with running_sidecar("dgx-1", version.values[0]) as sidecar:
        if route == "grpc":
            isolator: Any = GrpcIsolator(sidecar.socket)
        else:
            from isolator.bridge import install

            bridge_dir = os.path.join(sidecar.work, "bridge")
            install(bridge_dir, sidecar.bridge_socket)
            isolator = BridgeIsolator(bridge_dir, sidecar.work)
        containerizer = Containerizer(isolator, sidecar.work)
        containerizer.recover()
        yield sidecar, containerizer
        isolator.close()


def test_a_process_left_after_cleanup_keeps_its_gpu_out_of_every_prepare_until_it_is_gone(agent):
    sidecar, containerizer = agent
    first = container_id("leaves-a-process")
    containerizer.start(first, containerizer.config(gpus=8, image=False))
    sidecar.sim.start_process(5, LEFT_PID, 1 << 30)
    containerizer.destroy(first)
    try:
        with pytest.raises(HookFailed) as info:
            containerizer.start(container_id("wants-all"), containerizer.config(gpus=8, image=False))
        assert info.value.code == "RESOURCE_EXHAUSTED"
        assert "1 more are draining: [5]" in info.value.message
        seven = container_id("takes-seven")
        containerizer.start(seven, containerizer.config(gpus=7, image=False))
        try:
            gpus = _gpus(sidecar)
            assert not gpus[5].holder and all(gpus[i].holder == "takes-seven" for i in gpus if i != 5)
            with pytest.raises(HookFailed):
                containerizer.start(container_id("one-more"), containerizer.config(gpus=1, image=False))
        finally:
            containerizer.destroy(seven)
        # What an admin sees.
        drained = _gpus(sidecar)[5]
        assert (drained.drain_state, list(drained.drain_pids)) == ("draining", [LEFT_PID])
        assert "processes still run on it: 424242 (compute, 1024 MiB)" in drained.drain_reason
        rc, out, _ = _cli(sidecar.socket, "gpus")
        assert rc == 0 and f"DRAINING (pids {LEFT_PID})" in out
        assert "GPU 5: draining since" in out and "processes still run on it" in out
        rc, out, _ = _cli(sidecar.socket, "health", "--json")
        handover = {c["name"]: c for c in json.loads(out)["checks"]}["handover"]
        assert handover["ok"] and "GPU 5 draining since" in handover["detail"] and str(LEFT_PID) in handover["detail"]
    finally:
        sidecar.sim.stop_process(5)
    # Gone: the next Prepare checks again and gets all eight.
    again = container_id("gets-all-again")
    containerizer.start(again, containerizer.config(gpus=8, image=False))
    containerizer.destroy(again)
    assert _gpus(sidecar)[5].drain_state == ""


def test_clocks_and_compute_mode_a_container_changed_are_reset_at_cleanup(agent):
    sidecar, containerizer = agent
    cid = container_id("changes-settings")
    containerizer.start(cid, containerizer.config(gpus=8, image=False))
    sidecar.sim.set_compute_mode(2, 3)  # nvidia-smi -c EXCLUSIVE_PROCESS
    sidecar.sim.set_application_clocks(2, 900, 700)  # nvidia-smi -ac 700,900
    containerizer.destroy(cid)
    assert sidecar.sim.settings(2) == (0, 1312, 877)
    gpu = _gpus(sidecar)[2]
    assert gpu.drain_state == "" and list(gpu.last_reset) == [
        "application clocks: reset from graphics 900 MHz, memory 700 MHz to graphics 1312 MHz, memory 877 MHz",
        "compute mode: reset from EXCLUSIVE_PROCESS to DEFAULT",
    ]
    rc, out, _ = _cli(sidecar.socket, "gpus")
    assert rc == 0 and "GPU 2: compute mode: reset from EXCLUSIVE_PROCESS to DEFAULT" in out


@pytest.mark.cgroup_v1
def test_undrain_restart_durability_and_the_timeout_on_a_real_daemon():
    extra = ("--drain-timeout", "1", "--gpu-probe-interval", "0.1")
    with running_sidecar("dgx-1", "v1", extra=extra) as sidecar:
        containerizer = Containerizer(GrpcIsolator(sidecar.socket), sidecar.work)
        cid = container_id("leaves-two")
        containerizer.start(cid, containerizer.config(gpus=8, image=False))
        sidecar.sim.start_process(1, 1111)
        sidecar.sim.start_process(6, 6666)
        containerizer.destroy(cid)
        since = _gpus(sidecar)[1].drain_since
        # Past --drain-timeout (the daemon's clock, re-checked every probe interval): unhealthy.
        _wait_for("GPU 1 to turn unhealthy", lambda: _gpus(sidecar)[1].drain_state == "unhealthy")
        sick = _gpus(sidecar)[1]
        assert not sick.healthy and sick.health_reason.startswith("drain timed out: processes still run on it")
        rc, out, _ = _cli(sidecar.socket, "health")
        assert rc == 1 and "handover" in out
        # A restart keeps both out, since the same time.
        assert sidecar.terminate() == 0
        sidecar.start()
        after = _gpus(sidecar)
        assert (after[1].drain_state, after[6].drain_state) == ("unhealthy", "unhealthy")
        assert after[1].drain_since == since
        # The admin's way out, for one of them.
        rc, out, err = _cli(sidecar.socket, "undrain", "--handover", after[6].uuid)
        assert rc == 0, err
        assert "returned to the pool by an admin" in out and "6666" in out
        containerizer.start(container_id("seven"), containerizer.config(gpus=7, image=False))
        assert _gpus(sidecar)[1].holder == ""
        containerizer.destroy(container_id("seven"))
        # The other returns by itself once its process is gone.
        sidecar.sim.stop_process(1)
        _wait_for("GPU 1 to be free", lambda: _gpus(sidecar)[1].drain_state == "")
        assert _gpus(sidecar)[1].healthy
        rc, _out, err = _cli(sidecar.socket, "undrain", "99")
        assert rc == 1 and "no managed GPU '99'" in err and "NOT_FOUND" in err


@pytest.mark.cgroup_v1
def test_a_crash_between_a_release_and_its_check_leaves_the_busy_gpu_out_after_the_restart(monkeypatch):
    from isolator.daemon.crashpoints import ENV

    monkeypatch.setenv(ENV, "handover.pending:1")  # SIGKILL once the record is gone, before the check
    with running_sidecar("dgx-1", "v1") as sidecar:
        containerizer = Containerizer(GrpcIsolator(sidecar.socket), sidecar.work)
        cid = container_id("crashes-in-cleanup")
        containerizer.start(cid, containerizer.config(gpus=8, image=False))
        sidecar.sim.start_process(4, 4444)
        with pytest.raises(HookFailed):
            containerizer.destroy(cid)
        assert sidecar.proc is not None and sidecar.proc.wait(timeout=30) == -9
        monkeypatch.delenv(ENV)
        sidecar.start()  # nothing was written about GPU 4: the check at start finds the process
        gpus = _gpus(sidecar)
        assert (gpus[4].drain_state, list(gpus[4].drain_pids)) == ("draining", [4444])
        assert all(g.drain_state == "" and not g.holder for i, g in gpus.items() if i != 4)
