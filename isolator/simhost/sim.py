"""A simulated GPU host under one root directory: the fake NVML, its state, /proc and /dev.

It lays the host out and steers it at run time (XIDs, failing calls, usage, processes, clocks and
compute mode); it reads back only what the sidecar may change through NVML (``settings``). The
layout under ``root``:

    nvml/libnvidia-ml.so.1   a private copy of the fake NVML (each copy serves its own host)
    nvml/fakenvml.state      what the library reports (render_state)
    nvml/control/            fail, events, usage, absent, processes, settings: re-read by the library
                             on every call (the library rewrites ``settings`` when told to set);
                             uevents: kernel device events for the daemon (isolator/gpu/uevents.py)
    proc/driver/nvidia-caps/mig-minors
    dev/                     nvidia<minor>, nvidiactl, nvidia-uvm..., nvidia-caps/ (mknod, root only)
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import replace

from isolator.errors import IsolatorError
from isolator.gpu import uevents
from isolator.simhost import devnodes, mpscontrol
from isolator.simhost.host import HostSpec, load_host, mig_minors_text, render_state

LOG = logging.getLogger(__name__)

# The application clocks every simulated GPU boots with (fakenvml.c DEFAULT_APP_*_MHZ).
DEFAULT_APP_GRAPHICS_MHZ = 1312
DEFAULT_APP_MEMORY_MHZ = 877

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakenvml.c")
# `make build` puts the library here (the Makefile's FAKENVML).
REPO_BUILD = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "build")
LIBRARY_NAME = "libnvidia-ml.so.1"
GCC_FLAGS = ["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden", "-Wl,-soname," + LIBRARY_NAME]

# nvmlReturn_t values a test may inject (nvml.h).
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
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


# What a line of control/processes may say a process is (fakenvml.c).
PROCESS_KINDS = ("compute", "graphics", "mps-server", "mps")


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
        self.uevents_path = os.path.join(self.control_dir, "uevents")
        # The stand-in nvidia-cuda-mps-control (isolator/simhost/mpscontrol.py), run as the real one is.
        self.mps_control = os.path.join(self.root, "bin", "nvidia-cuda-mps-control")

    def setup(self, make_devices: bool | None = None) -> SimulatedHost:
        """Write the library, its state, mig-minors and (as root, or when asked) the device nodes.

        Idempotent: a second call rewrites the state and keeps the control files.
        """
        os.makedirs(self.control_dir, exist_ok=True)
        self._install_library()
        self._write(self.state_path, render_state(self.spec, self.control_dir))
        for name in ("fail", "usage", "absent", "uevents", "processes"):
            if not os.path.exists(os.path.join(self.control_dir, name)):
                self._write(os.path.join(self.control_dir, name), "")
        mpscontrol.install(self.mps_control)
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

    # ---- what a container leaves behind (docs/handover.md) ---------------------------------------

    def start_process(
        self,
        index: int,
        pid: int,
        memory_used: int = 0,
        kind: str = "compute",
        sm_util: int | None = None,
        memory_util: int = 0,
        mig: tuple[int, int] | None = None,
    ) -> None:
        """A process appears on GPU ``index`` (on its MIG device ``mig`` = (GI, CI) when given); its
        ``memory_used`` bytes add to what nvmlDeviceGetMemoryInfo reports as used. ``kind``: compute,
        graphics, mps-server (listed with its clients' memory added) or mps (an MPS client: the
        MPS call). ``sm_util`` (and ``memory_util``): its nvmlDeviceGetProcessUtilization sample."""
        self._check_index(index)
        if kind not in PROCESS_KINDS:
            raise SimHostError(f"unknown process kind {kind!r} ({', '.join(PROCESS_KINDS)})")
        if sm_util is not None and not (0 <= sm_util <= 100 and 0 <= memory_util <= 100):
            raise SimHostError(f"utilization {sm_util}/{memory_util} is not a percentage")
        line = f"{index} {pid} {memory_used} {kind}"
        if sm_util is not None or mig is not None:
            line += f" {-1 if sm_util is None else sm_util} {-1 if sm_util is None else memory_util}"
        if mig is not None:
            line += f" {mig[0]} {mig[1]}"
        self._append("processes", line)

    def stop_process(self, index: int, pid: int | None = None) -> None:
        """Process ``pid`` (every process when None) is gone from GPU ``index``; its memory is freed."""
        self._check_index(index)
        path = os.path.join(self.control_dir, "processes")
        with open(path) as fh:
            lines = fh.readlines()
        kept = [
            line
            for line in lines
            if not (line.split()[:1] == [str(index)] and (pid is None or line.split()[1:2] == [str(pid)]))
        ]
        self._write(path, "".join(kept))

    def set_compute_mode(self, index: int, mode: int) -> None:
        """A container ran ``nvidia-smi -c MODE`` (nvmlComputeMode_t: 0 DEFAULT, 2 PROHIBITED, 3 EXCLUSIVE_PROCESS)."""
        current = self.settings(index)
        self._set_settings(index, mode, current[1], current[2])

    def set_application_clocks(self, index: int, graphics_mhz: int, memory_mhz: int) -> None:
        """A container ran ``nvidia-smi -ac MEM,GRAPHICS``."""
        current = self.settings(index)
        self._set_settings(index, current[0], graphics_mhz, memory_mhz)

    def settings(self, index: int) -> tuple[int, int, int]:
        """GPU ``index``'s (compute mode, application graphics clock, application memory clock) now,
        as the library reports them: what a test reads back after the sidecar reset them."""
        self._check_index(index)
        out = (0, DEFAULT_APP_GRAPHICS_MHZ, DEFAULT_APP_MEMORY_MHZ)
        try:
            with open(os.path.join(self.control_dir, "settings")) as fh:
                for line in fh:
                    parts = line.split()
                    if len(parts) == 4 and parts[0] == str(index):
                        out = (int(parts[1]), int(parts[2]), int(parts[3]))
        except FileNotFoundError:
            pass
        return out

    def _set_settings(self, index: int, mode: int, graphics: int, memory: int) -> None:
        path = os.path.join(self.control_dir, "settings")
        try:
            with open(path) as fh:
                lines = [line for line in fh if line.split()[:1] != [str(index)]]
        except FileNotFoundError:
            lines = []
        self._write(path, "".join(lines) + f"{index} {mode} {graphics} {memory}\n")

    def inject_ecc(self, index: int, double_bit: bool = True) -> None:
        """Raise a double-bit (or single-bit) ECC error event on GPU ``index``."""
        self._check_index(index)
        self._append("events", f"{index} 0 -1 -1 {'dbe' if double_bit else 'sbe'}")

    # ---- kernel device events (what NETLINK_KOBJECT_UEVENT would carry) --------------------------

    def emit_uevent(self, props: dict[str, str]) -> None:
        """Append one kernel-format uevent message for the daemon's uevent source to read."""
        self._append("uevents", uevents.format_message(props).decode())

    def _pci_uevent(self, index: int, action: str, driver: bool) -> None:
        gpu = next(g for g in self.spec.gpus if g.index == index)
        props = {
            "ACTION": action,
            "DEVPATH": f"/devices/pci0000:00/{gpu.pci_bus_id}",
            "SUBSYSTEM": "pci",
            "PCI_ID": f"{gpu.pci_device_id & 0xFFFF:04X}:{gpu.pci_device_id >> 16:04X}",
            "PCI_SLOT_NAME": gpu.pci_bus_id,
        }
        if driver:
            props["DRIVER"] = "nvidia"
        self.emit_uevent(props)

    def _absent(self) -> list[int]:
        try:
            with open(os.path.join(self.control_dir, "absent")) as fh:
                return [int(x) for x in fh.read().split()]
        except FileNotFoundError:
            return []

    def unbind(self, index: int) -> None:
        """GPU ``index``'s PCI function leaves the nvidia driver: NVML stops enumerating it (the
        others are renumbered) and an ``unbind`` uevent is sent, as ``echo BUS > .../unbind`` does."""
        self._check_index(index)
        self._write(os.path.join(self.control_dir, "absent"), "".join(f"{i}\n" for i in {*self._absent(), index}))
        self._pci_uevent(index, "unbind", driver=False)

    def bind(self, index: int) -> None:
        """GPU ``index`` is bound to the nvidia driver again (a ``bind`` uevent follows)."""
        self._check_index(index)
        self._write(os.path.join(self.control_dir, "absent"), "".join(f"{i}\n" for i in self._absent() if i != index))
        self._pci_uevent(index, "bind", driver=True)

    def unload_driver(self) -> None:
        """``rmmod nvidia``: every NVML call fails DRIVER_NOT_LOADED until ``load_driver``."""
        self._append("fail", f"* * {NVML_ERROR_DRIVER_NOT_LOADED}")
        self.emit_uevent({"ACTION": "remove", "DEVPATH": "/module/nvidia", "SUBSYSTEM": "module"})

    def load_driver(self) -> None:
        """``modprobe nvidia`` after ``unload_driver``."""
        path = os.path.join(self.control_dir, "fail")
        with open(path) as fh:
            kept = [line for line in fh if line.strip() != f"* * {NVML_ERROR_DRIVER_NOT_LOADED}"]
        self._write(path, "".join(kept))
        self.emit_uevent({"ACTION": "add", "DEVPATH": "/module/nvidia", "SUBSYSTEM": "module"})

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        """Turn MIG mode on (no MIG devices yet) or off for GPU ``index``. Takes effect at the next
        nvmlInit, as a real mode change takes effect at the GPU reset it needs; the reset is
        announced as a PCI ``change`` uevent."""
        self._check_index(index)
        if next(g for g in self.spec.gpus if g.index == index).mig is None:
            raise SimHostError(f"GPU {index} of simulated host '{self.spec.name}' is not MIG-capable")
        gpus = tuple(
            replace(g, mig=enabled, mig_devices=g.mig_devices if enabled else ()) if g.index == index else g
            for g in self.spec.gpus
        )
        self.spec = replace(self.spec, gpus=gpus)
        self._write(self.state_path, render_state(self.spec, self.control_dir))
        self._pci_uevent(index, "change", driver=True)

    def clear(self) -> None:
        """Drop injected failures, usage and processes; events already delivered stay delivered."""
        self._write(os.path.join(self.control_dir, "fail"), "")
        self._write(os.path.join(self.control_dir, "usage"), "")
        self._write(os.path.join(self.control_dir, "processes"), "")
