"""The MPS control daemons' edge: one ``nvidia-cuda-mps-control -d`` per shared GPU in mps mode, its
pipe and log directories under a root of ours, control commands, liveness and stop (docs/sharing.md).

Decides nothing (which GPU needs a daemon is the core's, core/mps.py). The executable and the root
come from the constructor: the driver's ``nvidia-cuda-mps-control`` on a real host, the simulated
host's stand-in (isolator/simhost/mpscontrol.py) under ``--simulate``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time

from isolator.errors import FailedPrecondition

LOG = logging.getLogger(__name__)

# Where the control daemon keeps its pid, inside its pipe directory.
PID_FILE = "nvidia-cuda-mps-control.pid"
COMMAND_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


class MpsError(FailedPrecondition):
    msg_fmt = "failed to {op} the MPS control daemon of GPU {gpu} ('{path}'): {cause}"


class MpsControl:
    """``root``/<GPU UUID>/pipe and /log, made 0755 by us; ``executable`` is nvidia-cuda-mps-control."""

    def __init__(self, executable: str, root: str, proc_root: str = "/proc") -> None:
        self.executable = executable
        self.root = root
        self.proc_root = proc_root

    def pipe_dir(self, uuid: str) -> str:
        return os.path.join(self.root, uuid, "pipe")

    def log_dir(self, uuid: str) -> str:
        return os.path.join(self.root, uuid, "log")

    def _env(self, uuid: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
        env.update(
            CUDA_VISIBLE_DEVICES=uuid,  # the daemon and its servers see this GPU only
            CUDA_MPS_PIPE_DIRECTORY=self.pipe_dir(uuid),
            CUDA_MPS_LOG_DIRECTORY=self.log_dir(uuid),
        )
        return env

    def start(self, uuid: str, multiuser: bool = False) -> int:
        """Start the control daemon of GPU ``uuid``; its pid. The directories are made first.
        ``multiuser``: ``-multiuser-server``, one server for every uid (no isolation between users)."""
        for path in (self.pipe_dir(uuid), self.log_dir(uuid)):
            try:
                os.makedirs(path, mode=0o755, exist_ok=True)
            except OSError as exc:
                raise MpsError(op="make the directories of", gpu=uuid, path=path, cause=exc.strerror) from exc
        try:
            result = subprocess.run(
                [self.executable, "-d", *(["-multiuser-server"] if multiuser else [])],
                env=self._env(uuid),
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(op="start", gpu=uuid, path=self.executable, cause=str(exc)) from exc
        if result.returncode != 0:
            cause = (result.stderr or result.stdout).strip() or f"exit {result.returncode}"
            raise MpsError(op="start", gpu=uuid, path=self.executable, cause=cause)
        pid = self.pid(uuid)
        if pid is None:
            raise MpsError(op="start", gpu=uuid, path=self.executable, cause="it left no pid file")
        return pid

    def command(self, uuid: str, text: str) -> str:
        """Send one control command (``echo text | nvidia-cuda-mps-control``); its answer."""
        try:
            result = subprocess.run(
                [self.executable],
                env=self._env(uuid),
                input=text + "\n",
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(op=f"send '{text}' to", gpu=uuid, path=self.executable, cause=str(exc)) from exc
        if result.returncode != 0:
            cause = (result.stderr or result.stdout).strip() or f"exit {result.returncode}"
            raise MpsError(op=f"send '{text}' to", gpu=uuid, path=self.executable, cause=cause)
        return result.stdout.strip()

    def pid(self, uuid: str) -> int | None:
        """The control daemon's pid when its pid file names a live process, else None."""
        try:
            with open(os.path.join(self.pipe_dir(uuid), PID_FILE)) as fh:
                pid = int(fh.read().strip())
        except (OSError, ValueError):
            return None
        # A pid file outlives a killed daemon, and its number may name another process by now.
        try:
            with open(os.path.join(self.proc_root, str(pid), "cmdline"), "rb") as fh:
                cmdline = fh.read()
        except OSError:
            return None
        return pid if b"mps-control" in cmdline or b"mpscontrol" in cmdline else None

    def multiuser(self, uuid: str) -> bool | None:
        """Whether the running daemon was started with -multiuser-server (its command line, as
        ``ps -o args`` shows it); None when none runs."""
        pid = self.pid(uuid)
        if pid is None:
            return None
        try:
            with open(os.path.join(self.proc_root, str(pid), "cmdline"), "rb") as fh:
                args = fh.read().split(b"\0")
        except OSError:
            return None
        return any(a in (b"-multiuser-server", b"-M", b"--multiuser-server") for a in args)

    def alive(self, uuid: str) -> bool:
        """Its process lives and it answers a control command."""
        if self.pid(uuid) is None:
            return False
        try:
            self.command(uuid, "get_server_list")
        except MpsError as exc:
            LOG.warning("MPS control daemon of GPU %s does not answer: %s", uuid, exc.message)
            return False
        return True

    def stop(self, uuid: str) -> None:
        """``quit``, then SIGKILL if it is still there after STOP_TIMEOUT_S. Nothing to stop: no-op."""
        pid = self.pid(uuid)
        if pid is None:
            return
        with contextlib.suppress(MpsError):
            self.command(uuid, "quit")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.pid(uuid) == pid and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.pid(uuid) == pid:
            LOG.error("MPS control daemon %d of GPU %s did not quit; killing it", pid, uuid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
