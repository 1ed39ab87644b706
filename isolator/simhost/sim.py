"""A simulated GPU host under one root directory: the fake NVML, its state, /proc and /dev.

It lays the host out and steers it at run time (XIDs, failing calls, usage); it never reads the
state back. The layout under ``root``:

    nvml/libnvidia-ml.so.1   a private copy of the fake NVML (each copy serves its own host)
    nvml/fakenvml.state      what the library reports (render_state)
    nvml/control/            fail, events, usage: re-read by the library on every call
    proc/driver/nvidia-caps/mig-minors
    dev/                     nvidia<minor>, nvidiactl, nvidia-uvm..., nvidia-caps/ (mknod, root only)
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile

from isolator.errors import IsolatorError
from isolator.simhost import devnodes
from isolator.simhost.host import HostSpec, load_host, mig_minors_text, render_state

LOG = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakenvml.c")
# `make build` puts the library here (the Makefile's FAKENVML).
REPO_BUILD = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "build")
LIBRARY_NAME = "libnvidia-ml.so.1"
GCC_FLAGS = ["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden", "-Wl,-soname," + LIBRARY_NAME]

# nvmlReturn_t values a test may inject (nvml.h).
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999


class SimHostError(IsolatorError):
    code = "FAILED_PRECONDITION"


def build_library(out_path: str) -> str:
    """Compile fakenvml.c with gcc to ``out_path`` (what `make build` does)."""
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise SimHostError(f"failed to build '{out_path}': no gcc on PATH (run `make build` on a machine with one)")
    tmp = out_path + ".tmp"
    result = subprocess.run([gcc, *GCC_FLAGS, "-o", tmp, SOURCE, "-lpthread", "-ldl"], capture_output=True, text=True)
    if result.returncode != 0:
        raise SimHostError(f"failed to build '{out_path}': {result.stderr.strip()[:2000]}")
    os.replace(tmp, out_path)
    return out_path


def built_library() -> str | None:
    """The library `make build` made, if it is newer than its source."""
    path = os.path.join(REPO_BUILD, LIBRARY_NAME)
    try:
        if os.path.getmtime(path) >= os.path.getmtime(SOURCE):
            return path
    except OSError:
        pass
    return None


class SimulatedHost:
    """One simulated host. ``setup()`` lays it out; the other methods steer it while it runs."""

    def __init__(self, host: str | HostSpec, root: str) -> None:
        self.spec = host if isinstance(host, HostSpec) else load_host(host)
        self.root = os.path.abspath(root)
        self.nvml_dir = os.path.join(self.root, "nvml")
        self.library_path = os.path.join(self.nvml_dir, LIBRARY_NAME)
        self.state_path = os.path.join(self.nvml_dir, "fakenvml.state")
        self.control_dir = os.path.join(self.nvml_dir, "control")
        self.dev_root = os.path.join(self.root, "dev")
        self.proc_root = os.path.join(self.root, "proc")
        self.driver_root = os.path.join(self.root, "driver")
        self.device_numbers: devnodes.DeviceNumbers | None = None

    def setup(self, make_devices: bool | None = None) -> SimulatedHost:
        """Write the library, its state, mig-minors and (as root, or when asked) the device nodes.

        Idempotent: a second call rewrites the state and keeps the control files.
        """
        os.makedirs(self.control_dir, exist_ok=True)
        self._install_library()
        self._write(self.state_path, render_state(self.spec, self.control_dir))
        for name in ("fail", "usage"):
            if not os.path.exists(os.path.join(self.control_dir, name)):
                self._write(os.path.join(self.control_dir, name), "")
        caps_dir = os.path.join(self.proc_root, "driver", "nvidia-caps")
        os.makedirs(caps_dir, exist_ok=True)
        mig_capable = [g.minor for g in self.spec.gpus if g.mig is not None]
        self._write(os.path.join(caps_dir, "mig-minors"), mig_minors_text(mig_capable))
        if make_devices is None:
            make_devices = os.geteuid() == 0
            if not make_devices:
                LOG.warning("not root: simulated host '%s' has no device nodes under %s", self.spec.name, self.dev_root)
        if make_devices:
            self.device_numbers = devnodes.make_device_nodes(
                self.dev_root,
                [g.minor for g in self.spec.gpus],
                caps_minors=self.spec.caps_minors if mig_capable else (),
            )
        return self

    def _install_library(self) -> None:
        # A private copy, not a link: the dynamic loader shares one handle per file, and each copy
        # must find its own state next to itself.
        source = built_library()
        if source is None:
            build_library(self.library_path)
            return
        tmp = self.library_path + ".tmp"
        shutil.copyfile(source, tmp)
        os.replace(tmp, self.library_path)

    @staticmethod
    def _write(path: str, text: str) -> None:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)

    def _append(self, name: str, line: str) -> None:
        # One write of one whole line with O_APPEND, so the library never reads half a line.
        fd = os.open(os.path.join(self.control_dir, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    def _check_index(self, index: int) -> None:
        if not any(g.index == index for g in self.spec.gpus):
            raise SimHostError(f"simulated host '{self.spec.name}' has no GPU {index}")

    # ---- steering ------------------------------------------------------------------------------

    def inject_xid(
        self, index: int, xid: int, gpu_instance: int | None = None, compute_instance: int | None = None
    ) -> None:
        """Raise an XID critical-error event on GPU ``index`` (optionally on a MIG GI/CI)."""
        self._check_index(index)
        gi = -1 if gpu_instance is None else gpu_instance
        ci = -1 if compute_instance is None else compute_instance
        self._append("events", f"{index} {xid} {gi} {ci}")

    def fail_gpu(self, index: int | None, call: str = "*", code: int = NVML_ERROR_GPU_IS_LOST) -> None:
        """Make ``call`` (an NVML function name without its _vN suffix, or ``*``) fail for GPU ``index``.

        ``index=None`` fails the calls that are about no single GPU (nvmlInit, nvmlEventSetWait...).
        """
        if index is not None:
            self._check_index(index)
        self._append("fail", f"{'*' if index is None else index} {call} {code}")

    def set_usage(self, index: int, memory_used: int, gpu_util: int, memory_util: int) -> None:
        """What nvmlDeviceGetMemoryInfo (used) and nvmlDeviceGetUtilizationRates report for GPU ``index``."""
        self._check_index(index)
        self._append("usage", f"{index} {memory_used} {gpu_util} {memory_util}")

    def clear(self) -> None:
        """Drop injected failures and usage; events already delivered stay delivered."""
        self._write(os.path.join(self.control_dir, "fail"), "")
        self._write(os.path.join(self.control_dir, "usage"), "")
