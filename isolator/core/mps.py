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
# get_server_status's answers (measured on driver 580, docs/gpu-host-results.md).
ACTIVE = "ACTIVE"
FAULT = "FAULT"


class Mps:
    def __init__(self, daemons: MpsDaemons | None, inventory: GpuInventory) -> None:
        # No nvidia-cuda-mps-control: a null object that refuses to start one (core/absent.py).
        self.daemons: MpsDaemons = daemons if daemons is not None else NoMpsDaemons()
        self.inventory = inventory
        self._lock = threading.Lock()
        self._state: dict[int, str] = {}  # minor -> RUNNING, STOPPED or "failed: <why>"
        self.restarts: Counter[int] = Counter()  # daemons found dead and started again, by minor
        # minor -> what get_server_status said of the GPU's servers in FAULT, as the last pass saw
        # them (Volta and later: a fatal fault in one client; every client must exit, then ACTIVE).
        self._faults: dict[int, str] = {}

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
                continue
            self._watch_servers(gpu)
        for gpu in idle:
            with self._lock:
                self._faults.pop(gpu.minor, None)  # no sharer left: nobody to end, its daemon stops
            if self.daemons.alive(gpu.uuid):
                self.stop(gpu, functools.partial(is_idle, gpu.minor))

    def _watch_servers(self, gpu: Gpu) -> None:
        """Ask the GPU's daemon for its servers' state (``get_server_list``, ``get_server_status
        PID``): FAULT on any of them faults the GPU; none in FAULT (or no server) clears it. An answer
        that cannot be read changes nothing (a fault is never cleared on a guess)."""
        try:
            listing = self.daemons.command(gpu.uuid, "get_server_list")
            pids = [int(word) for word in listing.split()]
            states = {pid: self.daemons.command(gpu.uuid, f"get_server_status {pid}").strip() for pid in pids}
        except (IsolatorError, ValueError) as exc:
            LOG.error("GPU %d (%s): cannot read its MPS servers' state, fault state kept: %s", gpu.index, gpu.uuid, exc)
            return
        faulted = sorted(pid for pid, state in states.items() if state == FAULT)
        odd = {pid: state for pid, state in states.items() if state not in (ACTIVE, FAULT)}
        if odd:  # a server gone between the two questions answers "Server not found"
            LOG.warning("GPU %d (%s): MPS servers answered %s", gpu.index, gpu.uuid, odd)
        detail = f"MPS server {', '.join(map(str, faulted))} in FAULT" if faulted else ""
        with self._lock:
            was = self._faults.get(gpu.minor, "")
            if detail:
                self._faults[gpu.minor] = detail
            else:
                self._faults.pop(gpu.minor, None)
        if detail and not was:
            LOG.error(
                "GPU %d (%s): %s: a fatal GPU fault in one of its clients; every sharer of the GPU ends,"
                " new sharers are kept off it until the server is ACTIVE again",
                gpu.index,
                gpu.uuid,
                detail,
            )
        elif was and not detail:
            LOG.warning(
                "GPU %d (%s): its MPS server is ACTIVE again after a FAULT; new sharers may come", gpu.index, gpu.uuid
            )

    def faults(self) -> dict[int, str]:
        """The GPUs whose MPS server was in FAULT at the last pass (minor -> which server)."""
        with self._lock:
            return dict(self._faults)

    def end_clients(self, gpu: Gpu, pids: frozenset[int]) -> list[int]:
        """End the MPS clients among ``pids`` (a sharer's processes) the way NVIDIA says is safe:
        ``terminate_client <server PID> <client PID>`` stops a client's outstanding GPU work on its
        server, where killing a client that did not synchronise "can leave the MPS server and other
        MPS clients in an undefined state". Returns the clients terminated; failures are logged (the
        caller goes on: its container ends either way)."""
        ended: list[int] = []
        if not pids:
            return ended
        try:
            for server in [int(w) for w in self.daemons.command(gpu.uuid, "get_server_list").split()]:
                listed = self.daemons.command(gpu.uuid, f"get_client_list {server}").split()
                for client in sorted({int(w) for w in listed if w.isdigit()} & pids):
                    self.daemons.command(gpu.uuid, f"terminate_client {server} {client}")
                    ended.append(client)
        except (IsolatorError, ValueError) as exc:
            LOG.error("GPU %d (%s): failed to end MPS clients %s: %s", gpu.index, gpu.uuid, sorted(pids), exc)
        if ended:
            LOG.warning("GPU %d (%s): MPS clients %s terminated (terminate_client)", gpu.index, gpu.uuid, ended)
        return ended

    def check(self, wanted: list[Gpu]) -> tuple[bool, str]:
        """``gpu-isolator health``'s ``mps`` check: each GPU of ``wanted`` (in mps mode, with sharers)
        has its daemon running, as the last start or supervise pass found it; one down (gone and not
        started again, or never started) fails it, named with why."""
        if not wanted:
            return True, "no GPU shared in mps mode has sharers"
        down, up = [], []
        with self._lock:
            states = {g.minor: self._state.get(g.minor, "") for g in wanted}
            faults = dict(self._faults)
        for gpu in wanted:
            state = states[gpu.minor]
            name = f"GPU {gpu.index} ({gpu.uuid})"
            if state != RUNNING:
                down.append(f"{name}: its MPS control daemon is down ({state or 'not started'}) under its sharers")
            elif gpu.minor in faults:
                down.append(
                    f"{name}: {faults[gpu.minor]} (its sharers end; new ones are kept off until it is ACTIVE again)"
                )
            else:
                up.append(f"GPU {gpu.index}")
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
