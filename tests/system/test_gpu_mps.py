"""MPS on a real NVIDIA GPU host (marker ``gpu``; ``make test-gpu``), for the day one is lent: the
edge (isolator/host/mps.py) runs the driver's real ``nvidia-cuda-mps-control`` as it runs the
simulated host's stand-in, and the core's compute-mode step works on real NVML. The limits and users
checks (issue 41) run the core's Mps over the real edge and real CUDA clients (the driver API through
ctypes, as scripts/gpu_mps_probe.sh); with GI_GPU_KEEP_SETTINGS=1 they leave the GPU's compute mode
alone (Mps(keep_compute_mode=True)). Not run yet on a lent GPU (docs/sharing.md says so)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from isolator.core.mps import EXCLUSIVE_PROCESS, Mps, ServerPlan
from isolator.host.mps import MpsControl

NOBODY = 65534
KEEP = os.environ.get("GI_GPU_KEEP_SETTINGS") == "1"
# A CUDA client through the driver API (ctypes on libcuda, no framework): as ``uid``, it makes a context
# on device 0 and prints one JSON line: the SMs it got, the memory it sees, and each cuMemAlloc of the
# GiB sizes given (0: CUDA_SUCCESS, 2: CUDA_ERROR_OUT_OF_MEMORY); then holds the context ``hold`` s.
CLIENT = r"""
import ctypes as C, json, os, sys, time
uid, hold, sizes = int(sys.argv[1]), float(sys.argv[2]), [float(g) for g in sys.argv[3:]]
if uid != os.getuid():
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
cu = C.CDLL("libcuda.so.1")
cu.cuDevicePrimaryCtxRetain.argtypes = [C.POINTER(C.c_void_p), C.c_int]
cu.cuCtxSetCurrent.argtypes = [C.c_void_p]
cu.cuMemAlloc_v2.argtypes = [C.POINTER(C.c_uint64), C.c_size_t]
cu.cuMemFree_v2.argtypes = [C.c_uint64]
out = {"pid": os.getpid(), "uid": os.getuid(), "init": cu.cuInit(0)}
dev, ctx, sm = C.c_int(), C.c_void_p(), C.c_int()
if out["init"] == 0:
    rc = cu.cuDeviceGet(C.byref(dev), 0) or cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev)
    out["ctx"] = rc or cu.cuCtxSetCurrent(ctx)
    cu.cuDeviceGetAttribute(C.byref(sm), 16, dev)  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    out["sm"] = sm.value
    out["alloc"] = {}
    for g in sizes:
        p = C.c_uint64()
        rc = cu.cuMemAlloc_v2(C.byref(p), int(g * 2**30))
        out["alloc"][str(g)] = rc
        if rc == 0:
            cu.cuMemFree_v2(p)
print(json.dumps(out), flush=True)
time.sleep(hold)
"""

pytestmark = [pytest.mark.gpu, pytest.mark.root]


@pytest.mark.skipif(
    os.environ.get("GI_GPU_KEEP_SETTINGS") == "1",
    reason="GI_GPU_KEEP_SETTINGS=1: this test sets GPU 0's compute mode to EXCLUSIVE_PROCESS and back"
    " (nvmlDeviceSetComputeMode); a lent or shared GPU's settings are never changed",
)
def test_the_real_control_daemon_starts_answers_and_quits_on_gpu_0(gpu):
    inventory, first = gpu
    executable = shutil.which("nvidia-cuda-mps-control")
    if executable is None:
        pytest.skip("nvidia-cuda-mps-control is not installed on this GPU host")
    root = tempfile.mkdtemp(prefix="gi-mps-")
    control = MpsControl(executable, root)
    try:
        steps = inventory.reset_settings(first.index, EXCLUSIVE_PROCESS)
        assert not [s for s in steps if s.setting == "compute mode" and s.error], steps
        pid = control.start(first.uuid)
        assert control.pid(first.uuid) == pid, "the pid file the edge reads is where the real daemon keeps it"
        assert control.alive(first.uuid)
        assert float(control.command(first.uuid, "get_default_active_thread_percentage")) == 100.0
        control.stop(first.uuid)
        assert control.pid(first.uuid) is None
        assert os.listdir(control.log_dir(first.uuid)), "the daemon logs in the directory it was given"
    finally:
        control.stop(first.uuid)
        inventory.reset_settings(first.index, 0)
        shutil.rmtree(root, ignore_errors=True)


def _executable() -> str:
    for candidate in (shutil.which("nvidia-cuda-mps-control"), "/usr/local/nvidia/bin/nvidia-cuda-mps-control"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("nvidia-cuda-mps-control is not installed on this GPU host")


def _client(pipe: str | None, uid: int, *sizes: float, hold: float = 0, env: dict[str, str] | None = None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
    if pipe is not None:
        environ["CUDA_MPS_PIPE_DIRECTORY"] = pipe
    environ.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(uid), str(hold), *map(str, sizes)],
        env=environ,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )


def _result(proc: subprocess.Popen, timeout: float = 60) -> dict:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line, f"the CUDA client printed nothing (exit {proc.wait(timeout)})"
    return json.loads(line)


@pytest.fixture
def mps_gpu(gpu):
    """The core's Mps over the real daemon of GPU 0 (its compute mode untouched with GI_GPU_KEEP_SETTINGS=1)."""
    inventory, first = gpu
    root = tempfile.mkdtemp(prefix="gi-mps-", dir="/tmp")
    os.chmod(root, 0o755)  # other users' clients reach the pipe directory
    control = MpsControl(_executable(), root)
    mps = Mps(control, inventory, 0, keep_compute_mode=KEEP)
    try:
        yield mps, control, first
    finally:
        mps.stop(first, lambda: True)
        control.stop(first.uuid)
        if not KEEP:
            inventory.reset_settings(first.index, 0)
        shutil.rmtree(root, ignore_errors=True)


def test_limits_set_by_our_code_hold_against_a_client_that_unset_or_raised_its_variables(mps_gpu):
    mps, control, gpu = mps_gpu
    assert mps.ensure(gpu, ServerPlan(percent=25, pinned_mib=2048, uid=NOBODY))
    pipe = control.pipe_dir(gpu.uuid)
    whole = _result(_client(None, 0))  # CUDA_MPS_PIPE_DIRECTORY unset: under EXCLUSIVE_PROCESS no context
    for env in ({}, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=100G"}):
        got = _result(_client(pipe, NOBODY, 1, 3, env=env))
        assert got["init"] == 0 and got["ctx"] == 0, got
        assert got["alloc"] == {"1.0": 0, "3.0": 2}, f"held to 2 GiB: {got}"
        if whole.get("sm"):
            assert got["sm"] <= whole["sm"] * 25 // 100 + 2, f"held to 25% of {whole['sm']} SMs: {got}"


@pytest.mark.skipif(
    KEEP,
    reason="GI_GPU_KEEP_SETTINGS=1: a client that skips MPS is kept off only under EXCLUSIVE_PROCESS, which a"
    " lent or shared GPU's settings never get from this suite (in Default it gets the whole GPU, measured)",
)
def test_a_client_that_skips_mps_gets_no_context_beside_the_sharers_server(mps_gpu):
    mps, _control, gpu = mps_gpu
    assert mps.ensure(gpu, ServerPlan(percent=25, pinned_mib=2048, uid=NOBODY))  # its server holds the GPU
    whole = _result(_client(None, 0))  # CUDA_MPS_PIPE_DIRECTORY unset
    assert whole["init"] != 0 or whole.get("ctx") != 0, (
        f"under EXCLUSIVE_PROCESS a client beside MPS gets no context: {whole}"
    )


def test_two_users_clients_are_never_served_by_one_server(mps_gpu):
    mps, control, gpu = mps_gpu
    mps.ensure(gpu, ServerPlan(percent=50, pinned_mib=4096, uid=NOBODY))
    pipe = control.pipe_dir(gpu.uuid)
    holder = _client(pipe, NOBODY, hold=8)
    got = _result(holder)
    assert got["ctx"] == 0, got
    (server,) = control.command(gpu.uuid, "get_server_list").split()
    other = _client(pipe, 0, hold=0)  # root: another uid than the server's
    try:
        time.sleep(3)
        assert other.poll() is None, "root's client waits while nobody's server has clients (measured: cuInit blocks)"
        listed = control.command(gpu.uuid, "ps")
        assert str(holder.pid) in listed and str(other.pid) not in listed, listed
        assert control.command(gpu.uuid, "get_server_list").split() == [server]
        holder.wait(timeout=30)
        later = _result(other)
        assert later["init"] == 0, later
        assert control.command(gpu.uuid, "get_server_list").split() != [server], "a server of root's own"
    finally:
        for proc in (holder, other):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_supervise_read_back_of_the_real_daemon_finds_no_drift_and_sees_a_lifted_limit(mps_gpu):
    # core/mps.py reads a running daemon's limits back at every supervise pass and ends the GPU's
    # sharers where they differ: the real daemon's answers (a server with a client) must read as what
    # was set, or every pass would end every sharer; a server raised as root must read as changed.
    mps, control, gpu = mps_gpu
    lost: dict[int, str] = {}  # what the supervise pass tells the core it lost (core/mps.py on_lost)
    mps.on_lost = lost.__setitem__
    plan = ServerPlan(percent=25, pinned_mib=2048, uid=NOBODY)
    assert mps.ensure(gpu, plan)
    pipe = control.pipe_dir(gpu.uuid)
    holder = _client(pipe, NOBODY, hold=6)
    try:
        assert _result(holder)["ctx"] == 0
        assert mps.ensure(gpu, plan, under_sharers=True, verify=True) is False
        assert lost == {}, "the real daemon's answers read as the limits set"
        (server,) = control.command(gpu.uuid, "get_server_list").split()
        control.command(gpu.uuid, f"set_active_thread_percentage {server} 100")
        mps.ensure(gpu, plan, under_sharers=True, verify=True)
        assert list(lost) == [gpu.minor] and "active thread percentage" in lost[gpu.minor], lost
        assert control.command(gpu.uuid, f"get_active_thread_percentage {server}") == "25.0"
    finally:
        holder.wait(timeout=30)
