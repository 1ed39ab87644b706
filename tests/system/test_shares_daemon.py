"""gpu_shares through a real daemon on a simulated dgx-1 with real v1 devices cgroups (docs/sharing.md):
Prepare over gRPC with the agent's JSON, the kernel's whitelist, a restart with sharers live, and a
SIGHUP that would switch a held GPU (refused, old value kept) or changes only free GPUs (taken)."""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from isolator.testing.cgroupfs import TEST_PARENT
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import Sidecar

pytestmark = [pytest.mark.root, pytest.mark.cgroup_v1]


def _granted(sidecar: Sidecar, name: str) -> list[int]:
    """The GPU minors the kernel's v1 whitelist of container ``name`` lets it open (c 195:N)."""
    with open(os.path.join(sidecar.cgroup_parent, name, "devices.list")) as fh:
        out = []
        for line in fh.read().split("\n"):
            kind, _, rest = line.partition(" ")
            number = rest.split(" ")[0]
            major, _, minor = number.partition(":")
            if kind == "c" and major == "195" and minor.isdigit() and int(minor) < 255:
                out.append(int(minor))
        return sorted(out)


def _shares(containerizer: Containerizer, n: float | str) -> dict:
    config = containerizer.config(gpus=None, image=False)
    config["resources"] = [
        *config.get("resources", []),
        {"name": "gpu_shares", "type": "SCALAR", "scalar": {"value": n}},
    ]
    return config


def _wait(sidecar: Sidecar, text: str, offset: int) -> str:
    from system.test_daemon_lifecycle import _wait_for_log

    return _wait_for_log(sidecar, text, offset)


def _size(sidecar: Sidecar) -> int:
    with open(sidecar.log_path) as fh:
        return len(fh.read())


def test_sharers_through_the_daemon_restart_and_reload(short_tmp):
    config = os.path.join(short_tmp, "config.toml")
    with open(config, "w") as fh:
        fh.write('shared-gpus = "4-7:4:mps"\n')
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sidecar = Sidecar(work=short_tmp, host="dgx-1", cgroup_version="v1", cgroups_root=root, extra=("--config", config))
    sidecar.start()
    try:
        isolator = GrpcIsolator(sidecar.socket)
        c = Containerizer(isolator, short_tmp)
        try:
            for name in ("a", "b", "c", "d", "e"):
                isolator.prepare(container_id(name), _shares(c, 1))
            with pytest.raises(HookFailed) as err:
                isolator.prepare(container_id("big"), _shares(c, 5))
            assert err.value.code == "INVALID_ARGUMENT" and "holds at most 4" in str(err.value)
            with pytest.raises(HookFailed) as err:
                isolator.prepare(container_id("nan"), _shares(c, "NaN"))
            assert err.value.code == "INVALID_ARGUMENT"
            isolator.prepare(container_id("w"), c.config(gpus=4, image=False))
        finally:
            isolator.close()
        got = {n: _granted(sidecar, n) for n in ("a", "b", "c", "d", "e", "w")}
        shared = [got[n][0] for n in ("a", "b", "c", "d")]
        assert all(len(got[n]) == 1 for n in "abcde"), got
        assert len(set(shared)) == 4 and got["e"] == got["a"], got
        assert not set(got["w"]) & set(shared), got
        assert shared == [4, 5, 6, 7], "dgx-1's minors are its indices"

        # A reload that would make GPU 4 (two sharers) whole is refused whole; the old value stays.
        with open(config, "w") as fh:
            fh.write('shared-gpus = "5-7:4:mps"\n')
        offset = _size(sidecar)
        assert sidecar.proc is not None
        sidecar.proc.send_signal(signal.SIGHUP)
        log = _wait(sidecar, "shared-gpus not changed", offset)
        assert "still 4:4:mps,5:4:mps,6:4:mps,7:4:mps" in log and "has 2 gpu_shares held" in log, log

        # A restart with sharers live: the same grants, the same books (a sixth share goes to GPU 5).
        with open(config, "w") as fh:
            fh.write('shared-gpus = "4-7:4:mps"\n')
        assert sidecar.terminate() == 0
        sidecar.start()
        assert {n: _granted(sidecar, n) for n in ("a", "b", "c", "d", "e", "w")} == got
        isolator = GrpcIsolator(sidecar.socket)
        try:
            isolator.prepare(container_id("f"), _shares(c, 1))
            assert _granted(sidecar, "f") == got["b"]
            for name in ("a", "b", "c", "d", "e", "f"):
                isolator.cleanup(container_id(name))
        finally:
            isolator.close()

        # Nobody shares any more: a reload may make GPU 7 whole and share GPU 3... which w holds: refused.
        with open(config, "w") as fh:
            fh.write('shared-gpus = "3-6:4:mps"\n')
        offset = _size(sidecar)
        sidecar.proc.send_signal(signal.SIGHUP)
        log = _wait(sidecar, "shared-gpus not changed", offset)
        assert "is held whole and cannot become shared" in log, log
        with open(config, "w") as fh:
            fh.write('shared-gpus = "4-6:2:time-slice"\n')
        offset = _size(sidecar)
        sidecar.proc.send_signal(signal.SIGHUP)
        log = _wait(sidecar, "SIGHUP: reloaded", offset)
        assert "shared_gpus 4:4:mps,5:4:mps,6:4:mps,7:4:mps -> 4:2:time-slice,5:2:time-slice,6:2:time-slice" in log
        assert sidecar.terminate() == 0
    finally:
        sidecar.stop()


def _stand_ins(work: str) -> dict[str, int]:
    """GPU UUID -> pid of each live stand-in MPS control daemon the sidecar under ``work`` recorded.

    Read-only: the launch record the sidecar keeps beside each pipe directory (host/mps.py,
    ``daemon.json``), its pid taken while that process still has the recorded start tick and is no
    zombie. Not through an ``MpsControl`` of its own: that edge, finding a launch recorded without its
    daemon (the supervisor between starting a daemon and recording it), looks for the daemon in /proc
    and writes the record itself, racing the sidecar's write of the same file (one of the two then
    fails on the other's temporary file) and able to record the intermediate fork of ``-d``: the
    cause of this module's supervision test failing about one run in three under load.
    """
    import json

    root = os.path.join(work, "mps")
    out = {}
    for uuid_ in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, uuid_, "daemon.json")) as fh:
                record = json.load(fh)
        except FileNotFoundError:
            continue
        if record.get("pid") is None:
            continue  # launched, not yet recorded: the sidecar is still starting it
        try:
            with open(f"/proc/{record['pid']}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # gone
        if fields[0] != b"Z" and int(fields[19]) == record["start"]:
            out[uuid_] = record["pid"]
    return out


def test_mps_daemons_through_the_daemon_started_supervised_and_stopped(short_tmp):
    import time

    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    extra = ("--shared-gpus", "4-5:4:mps", "--gpu-probe-interval", "0.2")
    sidecar = Sidecar(work=short_tmp, host="dgx-1", cgroup_version="v1", cgroups_root=root, extra=extra)
    sidecar.start()
    try:
        isolator = GrpcIsolator(sidecar.socket)
        c = Containerizer(isolator, short_tmp)
        try:
            info = isolator.prepare(container_id("a"), _shares(c, 1))
            assert info is not None
            env = {e["name"]: e.get("value", "") for e in info["environment"]["variables"]}
            running = _stand_ins(short_tmp)
            assert len(running) == 1, running
            (gpu_uuid,) = running
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == os.path.join(short_tmp, "mps", gpu_uuid, "pipe")
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].startswith("0=") and env[
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
            ].endswith("M")
            with open(os.path.join(short_tmp, "mps", gpu_uuid, "log", "control.log")) as fh:
                assert f"Startup: CUDA_VISIBLE_DEVICES={gpu_uuid}" in fh.read()
            assert sidecar.sim.settings(4)[0] == 3, "EXCLUSIVE_PROCESS"

            # Killed under its sharer: the supervisor starts it again.
            os.kill(running[gpu_uuid], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while _stand_ins(short_tmp).get(gpu_uuid) in (None, running[gpu_uuid]):
                assert time.monotonic() < deadline, sidecar.log()
                time.sleep(0.05)
            _wait(sidecar, "its MPS control daemon was gone; started it again", 0)

            # The sidecar restarted with the sharer live: the daemon is adopted, not started twice.
            pid = _stand_ins(short_tmp)[gpu_uuid]
            assert sidecar.terminate() == 0
            sidecar.start()
            assert _stand_ins(short_tmp) == {gpu_uuid: pid}
            isolator.close()
            isolator = GrpcIsolator(sidecar.socket)

            # The last sharer gone: the daemon quits.
            isolator.cleanup(container_id("a"))
            assert _stand_ins(short_tmp) == {}
            with open(os.path.join(short_tmp, "mps", gpu_uuid, "log", "control.log")) as fh:
                assert fh.read().rstrip().endswith("Shutdown")
        finally:
            isolator.close()
        assert sidecar.terminate() == 0
    finally:
        sidecar.stop()
        for pid in _stand_ins(short_tmp).values():  # ours, started by the daemon under test
            os.kill(pid, signal.SIGKILL)


def test_updates_of_a_sharer_through_the_daemon_release_keep_and_resize_on_its_gpu(short_tmp):
    # Issue 41: the agent shrinks a share task's executor when the task ends and calls update;
    # the shares go (the kernel first), a resize stays on the GPU, a grow past it is refused by name.
    import grpc

    from isolator.rpc import isolator_pb2 as pb
    from isolator.rpc import isolator_pb2_grpc as pb_grpc

    config = os.path.join(short_tmp, "config.toml")
    with open(config, "w") as fh:
        fh.write('shared-gpus = "4:2:time-slice"\n')
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sidecar = Sidecar(work=short_tmp, host="dgx-1", cgroup_version="v1", cgroups_root=root, extra=("--config", config))
    sidecar.start()
    isolator = GrpcIsolator(sidecar.socket)
    channel = grpc.insecure_channel(sidecar.address)
    stub, admin = pb_grpc.IsolatorStub(channel), pb_grpc.AdminStub(channel)

    def update(name: str, shares: int) -> None:
        request = pb.UpdateRequest(container_id=pb.ContainerID(value=name))
        request.resource_requests.add(name="cpus", type=pb.Value.SCALAR, role="*").scalar.value = 1
        if shares:  # the agent names no resource it has none of
            request.resource_requests.add(name="gpu_shares", type=pb.Value.SCALAR, role="*").scalar.value = shares
        stub.Update(request, timeout=10)
        described = admin.DescribeContainer(pb.DescribeContainerRequest(container_id=request.container_id), timeout=10)
        assert described.rules_agree, described

    try:
        c = Containerizer(isolator, short_tmp)
        isolator.prepare(container_id("a"), _shares(c, 1))
        update("a", 1)
        update("a", 2)
        assert _granted(sidecar, "a") == [4]
        with pytest.raises(HookFailed) as err:
            isolator.prepare(container_id("b"), _shares(c, 1))
        assert err.value.code == "RESOURCE_EXHAUSTED", "a's grow is booked"
        update("a", 1)
        isolator.prepare(container_id("b"), _shares(c, 1))
        with pytest.raises(grpc.RpcError) as rpc:
            update("b", 2)
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "asks for 2 gpu_shares but holds 1 of GPU 4" in rpc.value.details() and "0 free" in rpc.value.details()
        update("a", 0)
        assert _granted(sidecar, "a") == [] and _granted(sidecar, "b") == [4]
        update("b", 2)  # a's share is free again: b grows on the same GPU
        for name in ("a", "b"):
            isolator.cleanup(container_id(name))
    finally:
        channel.close()
        isolator.close()
        sidecar.stop()
