"""MPS faults and the pipe directory on a real NVIDIA GPU (marker ``gpu``; ``make test-gpu``), for the
day one is lent (issue 41 items 4 and 5). Kept apart from test_gpu_mps.py (limits and users) so that
each can run alone; both skip loudly without a GPU.

- A real fatal fault (one kernel writing address 0x10, as scripts/gpu_mps_probe.sh provokes it) is
  seen by the sidecar's watcher (core/mps.py's supervise pass over the real nvidia-cuda-mps-control)
  as FAULT of that GPU; a new client is refused while it lasts, and once the clients exited the
  server is ACTIVE again, the fault cleared and a new client served.
- A client reaches the daemon through a read-only bind mount of the pipe directory (as an image
  sharer gets it, core/prepare.py), and the daemon names it a client (control.log).

With GI_GPU_KEEP_SETTINGS=1 (a lent or shared GPU) the GPU's compute mode is never changed: the
daemon runs in the mode the GPU has (Default on the lent H200), and the test checks it is the same after.
Clients call the CUDA driver API through ctypes (libcuda.so.1), no framework needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from isolator.core.mps import Mps, ServerPlan
from isolator.host.mps import MpsControl

pytestmark = [pytest.mark.gpu, pytest.mark.root]

KEEP = os.environ.get("GI_GPU_KEEP_SETTINGS") == "1"

CLIENT = r"""
import ctypes as C, os, sys, time
cu = C.CDLL("libcuda.so.1")
for n in ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuMemAlloc_v2", "cuMemsetD8_v2",
          "cuCtxSynchronize", "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel", "cuGetErrorName"):
    getattr(cu, n).restype = C.c_int
cu.cuDevicePrimaryCtxRetain.argtypes = [C.POINTER(C.c_void_p), C.c_int]
cu.cuCtxSetCurrent.argtypes = [C.c_void_p]
cu.cuMemAlloc_v2.argtypes = [C.POINTER(C.c_uint64), C.c_size_t]
cu.cuMemsetD8_v2.argtypes = [C.c_uint64, C.c_ubyte, C.c_size_t]
cu.cuModuleGetFunction.argtypes = [C.POINTER(C.c_void_p), C.c_void_p, C.c_char_p]
cu.cuLaunchKernel.argtypes = [C.c_void_p] + [C.c_uint] * 7 + [C.c_void_p, C.POINTER(C.c_void_p), C.c_void_p]
def name(rc):
    s = C.c_char_p(); cu.cuGetErrorName(rc, C.byref(s)); return (s.value or b"?").decode()
def say(*a): print(*a, flush=True)
say("pid", os.getpid())
mode = sys.argv[1]
rc = cu.cuInit(0)
if rc: say("init", name(rc)); sys.exit(2)
dev, ctx = C.c_int(), C.c_void_p()
rc = cu.cuDeviceGet(C.byref(dev), 0) or cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev) or cu.cuCtxSetCurrent(ctx)
if rc: say("context", name(rc)); sys.exit(2)
say("ready")
if mode == "hold":
    p = C.c_uint64(); cu.cuMemAlloc_v2(C.byref(p), 1 << 20)
    end = time.time() + float(sys.argv[2])
    while time.time() < end:
        rc = cu.cuMemsetD8_v2(p, 1, 1 << 20) or cu.cuCtxSynchronize()
        if rc: say("work", name(rc))
        time.sleep(0.2)
elif mode == "fault":
    ptx = sys.argv[2].encode() + b"\0"
    mod, fn = C.c_void_p(), C.c_void_p()
    rc = cu.cuModuleLoadData(C.byref(mod), C.c_char_p(ptx)) or cu.cuModuleGetFunction(C.byref(fn), mod, b"bad")
    if rc: say("module", name(rc)); sys.exit(2)
    addr = C.c_uint64(0x10)  # unmapped: an MMU fault (Xid 31), an application error
    params = (C.c_void_p * 1)(C.cast(C.pointer(addr), C.c_void_p))
    cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
    say("sync", name(cu.cuCtxSynchronize()))
"""

PTX = """.version 8.0
.target sm_90
.address_size 64
.visible .entry bad(.param .u64 p)
{
	.reg .b64 %rd<2>;
	.reg .b32 %r<2>;
	ld.param.u64 %rd1, [p];
	mov.u32 %r1, 42;
	st.global.u32 [%rd1], %r1;
	ret;
}
"""


@pytest.fixture
def daemon(gpu, tmp_path):
    executable = shutil.which("nvidia-cuda-mps-control")
    if executable is None:
        pytest.skip("nvidia-cuda-mps-control is not installed on this GPU host")
    inventory, first = gpu
    before = _compute_mode(first.index)
    root = tempfile.mkdtemp(prefix="gi-mpsf-")
    control = MpsControl(executable, root)
    mps = Mps(control, inventory, keep_compute_mode=KEEP)
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    try:
        mps.ensure(first, PLAN)
        yield mps, control, first, str(client)
    finally:
        control.stop(first.uuid)
        if not KEEP:
            inventory.reset_settings(first.index, 0)
        shutil.rmtree(root, ignore_errors=True)
    if KEEP:
        assert _compute_mode(first.index) == before, "GI_GPU_KEEP_SETTINGS=1: the compute mode is unchanged"


PLAN = ServerPlan(percent=100, pinned_mib=0)  # no limit: this test is about faults, not limits


def _compute_mode(index: int) -> str:
    out = subprocess.run(
        ["nvidia-smi", "-i", str(index), "--query-gpu=compute_mode", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.strip()


def _env(control: MpsControl, uuid: str) -> dict[str, str]:
    return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": control.pipe_dir(uuid)}


def _run(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def test_a_real_fault_is_fault_of_that_gpu_to_the_watcher_and_the_server_recovers(daemon):
    mps, control, first, client = daemon
    env = _env(control, first.uuid)

    def passed() -> dict[int, str]:
        mps.supervise([(first, PLAN)], [], lambda minor: False)
        return mps.faults()

    bystander = subprocess.Popen([sys.executable, client, "hold", "90"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert bystander.stdout is not None
        lines = [bystander.stdout.readline().strip() for _ in range(2)]
        assert lines[1] == "ready", lines
        assert passed() == {}, "an ACTIVE server is no fault"
        # The bystander's client started the server: one server, root's.
        (server,) = control.command(first.uuid, "get_server_list").split()
        faulty = _run([sys.executable, client, "fault", PTX], env)
        assert "CUDA_ERROR_ILLEGAL_ADDRESS" in faulty, faulty
        _until(lambda: first.minor in passed(), 30, "the watcher never saw the FAULT")
        assert mps.faults()[first.minor] == f"MPS server {server} in FAULT"
        refused = _run([sys.executable, client, "info"], env)
        assert "CUDA_ERROR_MPS_SERVER_NOT_READY" in refused, refused
        ok, detail = mps.check([first])
        assert not ok and "in FAULT" in detail
    finally:
        bystander.terminate()
        bystander.wait(timeout=60)
    _until(lambda: passed() == {}, 60, "the server never came back ACTIVE after its clients exited")
    assert control.command(first.uuid, f"get_server_status {server}") == "ACTIVE"
    served = _run([sys.executable, client, "info"], env)
    assert "ready" in served, served


def test_a_client_reaches_the_daemon_through_a_read_only_pipe_directory(daemon):
    _mps, control, first, client = daemon
    pipe = control.pipe_dir(first.uuid)
    # As an image sharer gets it (MS_BIND then a read-only remount), in a mount namespace of its own.
    script = f"mount --bind {pipe} {pipe} && mount -o remount,bind,ro {pipe} && exec {sys.executable} {client} info"
    out = _run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], _env(control, first.uuid))
    assert "ready" in out, out
    pid = next(line.split()[1] for line in out.splitlines() if line.startswith("pid "))
    with open(os.path.join(control.log_dir(first.uuid), "control.log")) as fh:
        log = fh.read()
    assert f"NEW CLIENT {pid}" in log, f"the daemon never saw client {pid}: {log[-2000:]}"
