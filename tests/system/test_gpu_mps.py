"""MPS on a real NVIDIA GPU host (marker ``gpu``; ``make test-gpu``), for the day one is lent: the
edge (isolator/host/mps.py) runs the driver's real ``nvidia-cuda-mps-control`` as it runs the
simulated host's stand-in, and the core's compute-mode step works on real NVML. Not run yet: no GPU
host has been available (docs/sharing.md says so)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from isolator.core.mps import EXCLUSIVE_PROCESS
from isolator.host.mps import MpsControl

pytestmark = [pytest.mark.gpu, pytest.mark.root]


@pytest.fixture(scope="module")
def gpu():
    from isolator.gpu.nvml import Inventory

    inv = Inventory().open()
    inv.read()
    yield inv, inv.records[0].gpu
    inv.close()


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
