"""A sharer of any uid reaches its GPU's MPS pipe directory (docs/sharing.md): the work directory the
MPS root is in is 0700 (the sidecar makes it so, and the shipped unit's StateDirectoryMode), so the
edge opens it for search (0711) when it starts a daemon and at every start of the sidecar. Seen under
the real agent before the fix: a share task run as nobody got Permission denied on its pipe
directory, and its CUDA ran without MPS."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from isolator.host.mps import MpsControl
from isolator.simhost import mpscontrol

pytestmark = pytest.mark.root

UUID = "GPU-00000000-0000-0000-0000-000000000001"


def _nobody_can_list(path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ls", path],
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_daemon_start_opens_the_work_directory_for_search_and_a_nobody_reaches_the_pipe_directory(short_tmp):
    if os.geteuid() != 0:
        pytest.skip("[root] needs root: the directories are root's and the sharer is nobody")
    os.chmod(short_tmp, 0o755)
    work = os.path.join(short_tmp, "w")
    os.mkdir(work, 0o700)
    os.chmod(work, 0o700)
    exe = mpscontrol.install(os.path.join(short_tmp, "bin", "nvidia-cuda-mps-control"))
    control = MpsControl(exe, os.path.join(work, "mps"))
    try:
        os.makedirs(control.pipe_dir(UUID), exist_ok=True)
        assert _nobody_can_list(control.pipe_dir(UUID)).returncode != 0, "0700: nobody cannot pass"
        control.start(UUID)
        assert stat.S_IMODE(os.stat(work).st_mode) == 0o711, "search, not list, for group and others"
        seen = _nobody_can_list(control.pipe_dir(UUID))
        assert seen.returncode == 0 and "control" in seen.stdout, seen
        assert _nobody_can_list(work).returncode != 0, "the work directory is still not listable"
        os.chmod(work, 0o700)  # a restart under systemd: StateDirectoryMode=0700 again
        control.open_root()
        assert stat.S_IMODE(os.stat(work).st_mode) == 0o711
    finally:
        control.stop(UUID)
