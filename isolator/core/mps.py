"""The MPS control daemons of the shared GPUs in mps mode (docs/sharing.md): one per GPU while it has
sharers, started before its first sharer launches, restarted when found dead, stopped after its last
sharer (before the handover check, which would see its server as a process on the GPU).

One job, a lock of its own; the edge (isolator/host/mps.py) is called under that lock only, never
under the booking lock. The GPU's compute mode is set to EXCLUSIVE_PROCESS before its daemon starts,
as MPS wants (one MPS server owns the GPU); the handover check sets it back after the last sharer.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable

from isolator.core.absent import NoMpsDaemons
from isolator.core.ports import GpuInventory, MpsDaemons
from isolator.errors import FailedPrecondition, IsolatorError
from isolator.model import COMPUTE_MODES, Gpu
from isolator.policy import shares as sharing

LOG = logging.getLogger(__name__)

EXCLUSIVE_PROCESS = COMPUTE_MODES["EXCLUSIVE_PROCESS"]
# Where an image container finds the pipe directory (CUDA's default CUDA_MPS_PIPE_DIRECTORY).
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"

RUNNING = "running"
STOPPED = "stopped"


class Mps:
    def __init__(self, daemons: MpsDaemons | None, inventory: GpuInventory) -> None:
        # No nvidia-cuda-mps-control: a null object that refuses to start one (core/absent.py).
        self.daemons: MpsDaemons = daemons if daemons is not None else NoMpsDaemons()
        self.inventory = inventory
        self._lock = threading.Lock()
        self._state: dict[int, str] = {}  # minor -> RUNNING, STOPPED or "failed: <why>"
        self.restarts: Counter[int] = Counter()  # daemons found dead and started again, by minor

    def pipe_dir(self, gpu: Gpu) -> str:
        return self.daemons.pipe_dir(gpu.uuid)

    def ensure(self, gpu: Gpu) -> bool:
        """The GPU's daemon runs when this returns (started if it did not; True then), or an error
        says why it cannot (fail closed: a sharer is never launched without its MPS daemon)."""
        daemons = self.daemons
        daemons.pipe_dir(gpu.uuid)  # without nvidia-cuda-mps-control this refuses before the compute mode is set
        with self._lock:
            if daemons.alive(gpu.uuid):
                self._state[gpu.minor] = RUNNING
                return False
            try:
                for step in self.inventory.reset_settings(gpu.index, EXCLUSIVE_PROCESS):
                    if step.setting == "compute mode" and step.error:
                        raise FailedPrecondition(
                            f"failed to set the compute mode of GPU {gpu.index} ({gpu.uuid}) to EXCLUSIVE_PROCESS"
                            f" for MPS (nvidia-smi -c EXCLUSIVE_PROCESS): {step.error}"
                        )
                pid = daemons.start(gpu.uuid)
            except IsolatorError as exc:
                self._state[gpu.minor] = f"failed: {exc.message}"
                raise
            self._state[gpu.minor] = RUNNING
        LOG.warning("GPU %d (minor %d, %s): MPS control daemon %d started", gpu.index, gpu.minor, gpu.uuid, pid)
        return True

    def stop(self, gpu: Gpu, idle: Callable[[], bool]) -> None:
        """Stop the GPU's daemon when ``idle()`` still says no sharer holds it (asked under this lock,
        so a Prepare that booked a share meanwhile keeps it: its ``ensure`` waits here). A failure is
        logged; the handover check then sees whatever still runs on the GPU and keeps it out."""
        with self._lock:
            if not idle():
                return
            try:
                self.daemons.stop(gpu.uuid)
                self._state[gpu.minor] = STOPPED
            except IsolatorError as exc:
                self._state[gpu.minor] = f"failed: {exc.message}"
                LOG.error("GPU %d (%s): failed to stop its MPS control daemon: %s", gpu.index, gpu.uuid, exc.message)
                return
        LOG.warning(
            "GPU %d (minor %d, %s): MPS control daemon stopped (no sharer left)", gpu.index, gpu.minor, gpu.uuid
        )

    def supervise(self, wanted: list[Gpu], idle: list[Gpu], is_idle: Callable[[int], bool]) -> None:
        """The periodic pass: each GPU of ``wanted`` (in mps mode, with sharers) has a live daemon,
        restarted when found dead; each of ``idle`` (every other GPU) has none, stopped if it has
        (and ``is_idle(minor)`` still says no sharer holds it)."""
        for gpu in wanted:
            try:
                if self.ensure(gpu):
                    self.restarts[gpu.minor] += 1
                    LOG.error("GPU %d (%s): its MPS control daemon was gone; started it again", gpu.index, gpu.uuid)
            except IsolatorError as exc:
                LOG.error(
                    "GPU %d (%s): MPS control daemon down and not restarted: %s", gpu.index, gpu.uuid, exc.message
                )
        for gpu in idle:
            if self.daemons.alive(gpu.uuid):
                self.stop(gpu, functools.partial(is_idle, gpu.minor))

    def check(self, wanted: list[Gpu]) -> tuple[bool, str]:
        """``gpu-isolator health``'s ``mps`` check: each GPU of ``wanted`` (in mps mode, with sharers)
        has its daemon running, as the last start or supervise pass found it; one down (gone and not
        started again, or never started) fails it, named with why."""
        if not wanted:
            return True, "no GPU shared in mps mode has sharers"
        down, up = [], []
        with self._lock:
            states = {g.minor: self._state.get(g.minor, "") for g in wanted}
        for gpu in wanted:
            state = states[gpu.minor]
            name = f"GPU {gpu.index} ({gpu.uuid})"
            if state == RUNNING:
                up.append(f"GPU {gpu.index}")
            else:
                down.append(f"{name}: its MPS control daemon is down ({state or 'not started'}) under its sharers")
        if down:
            return False, "; ".join(down)
        restarted = sum(self.restarts[g.minor] for g in wanted)
        return True, f"MPS control daemons running: {', '.join(up)}" + (
            f" ({restarted} found dead and started again)" if restarted else ""
        )

    def state(self, minor: int) -> str:
        """``running``, ``stopped``, ``failed: <why>`` or "" (never started by this sidecar)."""
        with self._lock:
            return self._state.get(minor, "")


def environment(pipe_dir: str, shares: int, total: int, memory_bytes: int) -> tuple[tuple[str, str], ...]:
    """A sharer's MPS client environment: the pipe directory and its limits in proportion to its
    shares (sharing.limits). Under MPS the client sees the server's one GPU as device 0."""
    percent, mib = sharing.limits(shares, total, memory_bytes)
    env = [("CUDA_MPS_PIPE_DIRECTORY", pipe_dir), ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(percent))]
    if mib:
        env.append(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", f"0={mib}M"))
    return tuple(env)
