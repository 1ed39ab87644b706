"""The device-node edge: NVIDIA device numbers read under a dev root passed in, and nvidia-uvm loaded.

The uvm and caps majors are dynamic, so they are read, never assumed. It never writes a cgroup.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Sequence

from isolator.errors import DeviceNodeError, UvmLoadError
from isolator.policy.devices import NVIDIA_MAJOR, ControlDevices, DeviceNumber

LOG = logging.getLogger(__name__)

UVM_LOAD_COMMAND = ("nvidia-modprobe", "-u", "-c", "0")


class HostDevices:
    """Reads NVIDIA device numbers under ``dev_root`` and loads nvidia-uvm on request.

    ``uvm_load_command`` is what ``load_uvm`` runs when ``<dev_root>/nvidia-uvm`` is missing: Mesos
    runs ``nvidia-modprobe -u -c 0`` (MESOS-7232), which loads nvidia_uvm and creates the node.
    """

    def __init__(self, dev_root: str, uvm_load_command: Sequence[str] = UVM_LOAD_COMMAND) -> None:
        self.dev_root = dev_root
        self.uvm_load_command = tuple(uvm_load_command)

    def path(self, name: str) -> str:
        return os.path.join(self.dev_root, name)

    def stat_char(self, path: str) -> DeviceNumber:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise DeviceNodeError(path=path, cause=exc.strerror or str(exc)) from exc
        if not stat.S_ISCHR(st.st_mode):
            raise DeviceNodeError(path=path, cause="not a character device")
        return DeviceNumber(os.major(st.st_rdev), os.minor(st.st_rdev), path)

    def control_devices(self, modeset: bool = False) -> ControlDevices:
        """nvidiactl and nvidia-uvm must exist (call ``load_uvm`` first on a real host)."""
        tools_path = self.path("nvidia-uvm-tools")
        tools = self.stat_char(tools_path) if os.path.lexists(tools_path) else None
        return ControlDevices(
            nvidiactl=self.stat_char(self.path("nvidiactl")),
            uvm=self.stat_char(self.path("nvidia-uvm")),
            uvm_tools=tools,
            modeset=self.stat_char(self.path("nvidia-modeset")) if modeset else None,
        )

    def node_path(self, type_: str, major: int, minor: int) -> str | None:
        """The NVIDIA node under the dev root with this number (``nvidia*`` and ``nvidia-caps/*``),
        or None: what an operator lists in the Mesos agent's ``--allowed_devices``, which takes paths."""
        if type_ != "c":
            return None
        candidates = []
        for directory in (self.dev_root, self.path("nvidia-caps")):
            try:
                names = sorted(os.listdir(directory))
            except OSError:
                continue
            candidates += [os.path.join(directory, n) for n in names if n.startswith("nvidia")]
        for path in candidates:
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor):
                return path
        return None

    def caps_major(self) -> int | None:
        """The major of ``<dev_root>/nvidia-caps/nvidia-cap*`` (dynamic), or None without MIG nodes."""
        caps_dir = self.path("nvidia-caps")
        try:
            names = sorted(n for n in os.listdir(caps_dir) if n.startswith("nvidia-cap"))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DeviceNodeError(path=caps_dir, cause=exc.strerror or str(exc)) from exc
        majors = {self.stat_char(os.path.join(caps_dir, n)).major for n in names}
        if len(majors) > 1:
            raise DeviceNodeError(path=caps_dir, cause=f"nodes disagree on the major: {sorted(majors)}")
        return majors.pop() if majors else None

    def nvidia_majors(self) -> tuple[int, ...]:
        """Every NVIDIA character major on this host: 195, nvidia-uvm's and nvidia-caps' (dynamic).
        In mesos mode these are the devices the sidecar decides for; the rest are the agent's."""
        majors = {NVIDIA_MAJOR, *(d.major for d in self.control_devices().numbers())}
        caps = self.caps_major()
        if caps is not None:
            majors.add(caps)
        return tuple(sorted(majors))

    def load_uvm(self) -> bool:
        """Make sure ``<dev_root>/nvidia-uvm`` exists; returns True when the command had to run."""
        node = self.path("nvidia-uvm")
        if os.path.lexists(node):
            return False
        LOG.info("'%s' is missing; running %s", node, " ".join(self.uvm_load_command))
        program = self.uvm_load_command[0]
        if os.sep not in program and shutil.which(program) is None:
            # Looked up first: exec through a PATH with a directory this user may not search fails
            # with EACCES rather than ENOENT, which would hide that the program is simply absent.
            raise UvmLoadError(path=node, cause=f"{program} is not installed (it ships with the NVIDIA driver)")
        try:
            proc = subprocess.run(self.uvm_load_command, capture_output=True, text=True, timeout=60, check=False)
        except FileNotFoundError as exc:
            raise UvmLoadError(
                path=node, cause=f"{self.uvm_load_command[0]} is not installed (it ships with the NVIDIA driver)"
            ) from exc
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UvmLoadError(path=node, cause=f"{' '.join(self.uvm_load_command)}: {exc}") from exc
        if proc.returncode != 0:
            out = (proc.stderr or proc.stdout).strip()[-400:]
            raise UvmLoadError(
                path=node, cause=f"{' '.join(self.uvm_load_command)} exited with {proc.returncode}: {out}"
            )
        if not os.path.lexists(node):
            raise UvmLoadError(path=node, cause=f"{' '.join(self.uvm_load_command)} succeeded but the node is absent")
        return True
