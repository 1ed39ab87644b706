"""The MPS control daemons of the shared GPUs in mps mode (docs/sharing.md): one per GPU while it has
sharers, started before its first sharer launches, restarted when found dead, stopped after its last
sharer (before the handover check, which would see its server as a process on the GPU).

One job, a lock of its own; the edge (isolator/host/mps.py) is called under that lock only, never
under the booking lock. The GPU's compute mode is set to EXCLUSIVE_PROCESS before its daemon starts,
as MPS wants (one MPS server owns the GPU), and set back when the start fails; the handover check sets
it back after the last sharer. Before a sharer's client can start, the daemon holds one share's limits
(set and read back) and its sharers' uid's server runs ("Limits a task cannot lift", docs/sharing.md).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from isolator.core.absent import NoMpsDaemons
from isolator.core.ports import GpuInventory, MpsDaemons
from isolator.crashpoints import crashpoint
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

_LIMIT = re.compile(r"^(\d+)([KMGT]?)$", re.IGNORECASE)
_UNITS = {"": 1 << 20, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class MpsLimitsNotSet(FailedPrecondition):
    msg_fmt = (
        "the MPS control daemon of GPU {gpu} did not take {what}: asked {asked}, it answers {answer!r}"
        " (a sharer is not started without limits it cannot lift)"
    )


@dataclass(frozen=True)
class ServerPlan:
    """What a GPU's MPS daemon must hold before a sharer's client can start (docs/sharing.md,
    "Limits a task cannot lift"): every server's active thread percentage and pinned device memory
    (MiB on device 0, the only GPU the daemon sees; 0: no limit, the GPU's memory unknown), one
    share's worth, and the uid whose server is started at once (None: none started: -multiuser-server
    or the sharers' uid not known)."""

    percent: int
    pinned_mib: int
    uid: int | None = None
    multiuser: bool = False

    @classmethod
    def of(cls, shared: sharing.SharedGpu, memory_bytes: int, uid: int | None) -> ServerPlan:
        percent, mib = sharing.limits(1, shared.shares, memory_bytes)
        return cls(percent, mib, 0 if shared.multiuser else uid, shared.multiuser)


def limit_bytes(answer: str) -> int | None:
    """A pinned memory limit as the daemon answers it (``2G``, ``2048M``; a bare number is MiB),
    in bytes; None when the answer is not one (nothing set: the real daemon prints nothing)."""
    m = _LIMIT.match(answer.strip())
    return int(m.group(1)) * _UNITS[m.group(2).upper()] if m else None


def _percent(answer: str) -> float | None:
    try:
        return float(answer)
    except ValueError:
        return None


class Mps:
    def __init__(
        self,
        daemons: MpsDaemons | None,
        inventory: GpuInventory,
        default_compute_mode: int = 0,
        keep_compute_mode: bool = False,
    ) -> None:
        # No nvidia-cuda-mps-control: a null object that refuses to start one (core/absent.py).
        self.daemons: MpsDaemons = daemons if daemons is not None else NoMpsDaemons()
        self.inventory = inventory
        # The compute mode a failed start sets back (the handover check's, --default-compute-mode).
        self.default_compute_mode = default_compute_mode
        # Never touch the GPU's compute mode (GI_GPU_KEEP_SETTINGS=1 on a lent GPU, tests/system/
        # test_gpu_mps.py). Default off: without EXCLUSIVE_PROCESS a process that ignores the pipe
        # directory gets a plain context, the whole GPU, beside MPS (measured on driver 580).
        self.keep_compute_mode = keep_compute_mode
        self._lock = threading.Lock()
        self._state: dict[int, str] = {}  # minor -> RUNNING, STOPPED or "failed: <why>"
        # uuid -> (the daemon's pid, the plan it was set to): a daemon this sidecar did not set up (adopted
        # at start, or started again behind its back) is set up before it serves a sharer.
        self._configured: dict[str, tuple[int | None, ServerPlan]] = {}
        self.restarts: Counter[int] = Counter()  # daemons found dead and started again, by minor
        # minor -> what get_server_status said of the GPU's servers in FAULT, as the last pass saw
        # them (Volta and later: a fatal fault in one client; every client must exit, then ACTIVE).
        self._faults: dict[int, str] = {}
        # Minors whose daemon was set up for sharers and not stopped since (a failed try, a pass cut
        # short by its death, keeps it): a start there is a restart.
        self._serving: set[int] = set()
        # Called under the lock, before a daemon found dead is started again or one found without its
        # limits is set again: (minor, why), the GPU's sharers' clients lost. The core records them
        # there and ends them once the daemon is set up, so that a sidecar killed before the pass is
        # over still ends them after its restart (the daemon it adopts then holds its limits and shows
        # nothing wrong). It must not raise.
        self.on_lost: Callable[[int, str], None] = lambda minor, why: None

    def pipe_dir(self, gpu: Gpu) -> str:
        return self.daemons.pipe_dir(gpu.uuid)

    def ensure(
        self,
        gpu: Gpu,
        plan: ServerPlan,
        under_sharers: bool = False,
        verify: bool = False,
        served: Callable[[], None] | None = None,
    ) -> bool:
        """The GPU's daemon runs with ``plan``'s limits set and read back when this returns (started
        if it did not; True then), or an error says why it cannot (fail closed: a sharer is never
        launched without its MPS daemon and its limits). A failed start leaves no daemon and the GPU
        back in the default compute mode.

        A start is a **restart** when the GPU had sharers behind a daemon that is gone (the daemon was
        running as this sidecar last saw it, or ``under_sharers``, the supervise pass, finds sharers
        on a GPU this sidecar never started a daemon for: recovered at start): counted, and
        ``on_lost`` told before it starts, whether or not the start then succeeds (its server died
        with the daemon: every client failed, and the new daemon had no limits until set; measured,
        docs/gpu-host-results.md). ``verify``: read a running daemon's
        limits back even when this sidecar set them already (a root sharer can reach its privileged
        commands through the pipe directory), and set them again where they differ. ``served``: called
        under the lock once the daemon runs with its limits (a Prepare's sharer is no longer spared
        from a loss found after that: its client may come at any time)."""
        daemons = self.daemons
        daemons.pipe_dir(gpu.uuid)  # without nvidia-cuda-mps-control this refuses before the compute mode is set
        with self._lock:
            if daemons.alive(gpu.uuid):
                try:
                    self._check_users_mode(gpu, plan)
                    adopted = self._configured.get(gpu.uuid) != (daemons.pid(gpu.uuid), plan)
                    if adopted or verify:
                        # A daemon adopted at start, started behind the sidecar's back, or whose limits a
                        # root sharer changed: what it holds now is read before it is set.
                        drift = self._drift(gpu, plan)
                        if drift:
                            self._lose(gpu, drift, adopted)
                        if drift or adopted:
                            self._configure(gpu, plan)
                except IsolatorError as exc:
                    self._state[gpu.minor] = f"failed: {exc.message}"
                    raise
                self._state[gpu.minor] = RUNNING
                self._serving.add(gpu.minor)
                if served is not None:
                    served()
                return False
            # Set up for sharers and gone; or, at a pass, never seen by this sidecar (its sharers recovered
            # at start). Not after a stop or a failed first start: the GPU's first sharer's Prepare starts it.
            # (A first Prepare of a GPU racing the first pass after a start is taken for a restart and
            # ended: fail closed, a task lost, never a client without limits.)
            restart = gpu.minor in self._serving or (under_sharers and gpu.minor not in self._state)
            self._configured.pop(gpu.uuid, None)
            if restart:
                # Lost before the start, which cannot bring their clients back: recorded first (on_lost).
                self.on_lost(
                    gpu.minor,
                    f"its MPS control daemon on GPU {gpu.index} ({gpu.uuid}) was found dead and is started again"
                    " (its server died with it: every client of the GPU failed, and a new daemon holds no"
                    " limits until they are set)",
                )
            exclusive = False
            try:
                if not self.keep_compute_mode:
                    exclusive = True
                    for step in self.inventory.reset_settings(gpu.index, EXCLUSIVE_PROCESS):
                        if step.setting == "compute mode" and step.error:
                            raise FailedPrecondition(
                                f"failed to set the compute mode of GPU {gpu.index} ({gpu.uuid}) to EXCLUSIVE_PROCESS"
                                f" for MPS (nvidia-smi -c EXCLUSIVE_PROCESS): {step.error}"
                            )
                pid = daemons.start(gpu.uuid, multiuser=plan.multiuser)
                try:
                    self._configure(gpu, plan)
                except IsolatorError:
                    self._quit(gpu)
                    raise
            except IsolatorError as exc:
                self._state[gpu.minor] = f"failed: {exc.message}"
                if exclusive:
                    self._restore_compute_mode(gpu)
                raise
            self._state[gpu.minor] = RUNNING
            self._serving.add(gpu.minor)
            if restart:
                self.restarts[gpu.minor] += 1
                crashpoint("mps.restarted")  # its sharers' end is on disk; the core has not taken it yet
            if served is not None:
                served()
        if restart:
            LOG.error("GPU %d (%s): its MPS control daemon was gone; started it again", gpu.index, gpu.uuid)
        LOG.warning(
            "GPU %d (minor %d, %s): MPS control daemon %d started (%d%% of threads, %s pinned memory per server%s)",
            gpu.index,
            gpu.minor,
            gpu.uuid,
            pid,
            plan.percent,
            f"{plan.pinned_mib} MiB" if plan.pinned_mib else "no limit on",
            ", multi-user" if plan.multiuser else f", server of uid {plan.uid}" if plan.uid is not None else "",
        )
        return True

    def _check_users_mode(self, gpu: Gpu, plan: ServerPlan) -> None:
        """A running daemon serves users as it was started (-multiuser-server or not): one that
        differs from the flags (a restart that switched it under sharers) takes no new sharer until
        its last sharer leaves and it is stopped (fail closed: another user's sharer would wait on it,
        or share a server the operator no longer chose)."""
        running = self.daemons.multiuser(gpu.uuid)
        if running is not None and running != plan.multiuser:
            said = "with" if running else "without"
            raise FailedPrecondition(
                f"the MPS control daemon of GPU {gpu.index} ({gpu.uuid}) runs {said} -multiuser-server, which"
                f" --shared-gpus no longer asks; it keeps its mode until the GPU's last sharer leaves"
            )

    def _configure(self, gpu: Gpu, plan: ServerPlan) -> None:
        """Set the daemon's defaults (for every server it starts from now on) and read them back; read
        each server already running and set its values per server where they differ (a running server
        keeps the values it started with, measured); then start the server of ``plan.uid`` (so that,
        under EXCLUSIVE_PROCESS, it holds the GPU before any client can open it directly), which starts
        with the defaults just set (measured: "Active Threads Percentage set to 25.0"). The daemon
        answers a bad percentage with the old value and exit 0, so every value is compared, never
        assumed."""
        command = functools.partial(self.daemons.command, gpu.uuid)
        name = f"{gpu.index} ({gpu.uuid})"
        self._expect_percent(name, "set_default_active_thread_percentage", command, f" {plan.percent}", plan.percent)
        self._expect_percent(name, "get_default_active_thread_percentage", command, "", plan.percent)
        if plan.pinned_mib:
            # Device 0: the daemon sees only this GPU (CUDA_VISIBLE_DEVICES=<its UUID>).
            command(f"set_default_device_pinned_mem_limit 0 {plan.pinned_mib}M")
            self._expect_limit(name, "get_default_device_pinned_mem_limit 0", command, plan.pinned_mib)
        for server in command("get_server_list").split():
            if not server.isdigit():
                raise MpsLimitsNotSet(gpu=name, what="get_server_list", asked="server pids", answer=server)
            threads = _percent(command(f"get_active_thread_percentage {server}"))
            if threads != float(plan.percent):
                self._expect_percent(
                    name, f"set_active_thread_percentage {server}", command, f" {plan.percent}", plan.percent
                )
            if plan.pinned_mib:
                current = limit_bytes(command(f"get_device_pinned_mem_limit {server} 0"))
                if current != plan.pinned_mib << 20:
                    command(f"set_device_pinned_mem_limit {server} 0 {plan.pinned_mib}M")
                    self._expect_limit(name, f"get_device_pinned_mem_limit {server} 0", command, plan.pinned_mib)
        if plan.uid is not None:
            command(f"start_server -uid {plan.uid}")
        self._configured[gpu.uuid] = (self.daemons.pid(gpu.uuid), plan)

    @staticmethod
    def _expect_percent(name: str, text: str, command: Callable[[str], str], arg: str, percent: int) -> None:
        answer = command(text + arg)
        if _percent(answer) != float(percent):
            raise MpsLimitsNotSet(gpu=name, what=text, asked=f"{percent}%", answer=answer)

    @staticmethod
    def _expect_limit(name: str, text: str, command: Callable[[str], str], mib: int) -> None:
        answer = command(text)
        if limit_bytes(answer) != mib << 20:
            raise MpsLimitsNotSet(gpu=name, what=text, asked=f"{mib}M", answer=answer)

    def _quit(self, gpu: Gpu) -> None:
        try:
            self.daemons.stop(gpu.uuid)
        except IsolatorError as exc:
            LOG.error(
                "GPU %d (%s): failed to stop its half-set-up MPS control daemon: %s", gpu.index, gpu.uuid, exc.message
            )

    def _restore_compute_mode(self, gpu: Gpu) -> None:
        """A failed start sets the compute mode back (no daemon runs, so no one could use the GPU in
        EXCLUSIVE_PROCESS but the first process to open it)."""
        for step in self.inventory.reset_settings(gpu.index, self.default_compute_mode):
            if step.setting == "compute mode" and step.error:
                LOG.error(
                    "GPU %d (%s): failed to set its compute mode back after a failed MPS start: %s",
                    gpu.index,
                    gpu.uuid,
                    step.error,
                )

    def stop(self, gpu: Gpu, idle: Callable[[], bool]) -> None:
        """Stop the GPU's daemon when ``idle()`` still says no sharer holds it (asked under this lock,
        so a Prepare that booked a share meanwhile keeps it: its ``ensure`` waits here). A failure is
        logged; the handover check then sees whatever still runs on the GPU and keeps it out."""
        with self._lock:
            if not idle():
                return
            try:
                self._configured.pop(gpu.uuid, None)
                self._serving.discard(gpu.minor)  # no sharer left to lose
                self.daemons.stop(gpu.uuid)
                self._state[gpu.minor] = STOPPED
            except IsolatorError as exc:
                self._state[gpu.minor] = f"failed: {exc.message}"
                LOG.error("GPU %d (%s): failed to stop its MPS control daemon: %s", gpu.index, gpu.uuid, exc.message)
                return
        LOG.warning(
            "GPU %d (minor %d, %s): MPS control daemon stopped (no sharer left)", gpu.index, gpu.minor, gpu.uuid
        )

    def supervise(self, wanted: list[tuple[Gpu, ServerPlan]], idle: list[Gpu], is_idle: Callable[[int], bool]) -> None:
        """The periodic pass: each GPU of ``wanted`` (in mps mode, with sharers) has a live daemon set
        to its plan, restarted when found dead; each of ``idle`` (every other GPU) has none, stopped if
        it has (and ``is_idle(minor)`` still says no sharer holds it)."""
        for gpu, plan in wanted:
            try:
                self.ensure(gpu, plan, under_sharers=True, verify=True)
            except IsolatorError as exc:
                LOG.error(
                    "GPU %d (%s): MPS control daemon down and not restarted: %s", gpu.index, gpu.uuid, exc.message
                )
                continue
            self._watch_servers(gpu)
        for gpu in idle:
            with self._lock:
                self._faults.pop(gpu.minor, None)  # no sharer left: nobody to end, its daemon stops
                self._serving.discard(gpu.minor)  # nor to lose: its next start is a first one
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
            with self._lock:  # stop() sets STOPPED under it once the daemon is gone
                stopped = self._state.get(gpu.minor) == STOPPED
            if stopped:
                # Its last sharer's Cleanup stopped it after ensure() released the lock: no server to read.
                LOG.info("GPU %d (%s): its MPS control daemon was stopped during the pass", gpu.index, gpu.uuid)
                with self._lock:
                    self._faults.pop(gpu.minor, None)  # no sharer left to end (as an idle GPU in the pass)
                return
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

    def _drift(self, gpu: Gpu, plan: ServerPlan) -> list[str]:
        """What of ``plan`` the running daemon no longer holds (its defaults, each server's values), as
        it answers now; an answer that cannot be read counts as changed (set again, then read back)."""
        command = functools.partial(self.daemons.command, gpu.uuid)
        drift = []
        if _percent(command("get_default_active_thread_percentage")) != float(plan.percent):
            drift.append("default active thread percentage")
        if plan.pinned_mib and limit_bytes(command("get_default_device_pinned_mem_limit 0")) != plan.pinned_mib << 20:
            drift.append("default pinned memory limit")
        for server in command("get_server_list").split():
            if _percent(command(f"get_active_thread_percentage {server}")) != float(plan.percent):
                drift.append(f"server {server}'s active thread percentage")
            if plan.pinned_mib and (
                limit_bytes(command(f"get_device_pinned_mem_limit {server} 0")) != plan.pinned_mib << 20
            ):
                drift.append(f"server {server}'s pinned memory limit")
        return drift

    def _lose(self, gpu: Gpu, drift: list[str], adopted: bool) -> None:
        """A running daemon found without its limits: any client that connected meanwhile runs without
        them for as long as it lives (a running client keeps what it got, measured), so the GPU's
        sharers are lost as after a restart (``on_lost``). Called under the lock."""
        how = (
            "adopted without the limits this sidecar sets (a daemon not set up by it, or one whose set-up a"
            " crash cut short)"
            if adopted
            else "had its limits changed behind the sidecar's back (a sharer running as root reaches its control"
            " commands through the pipe directory)"
        )
        LOG.error("GPU %d (%s): its MPS control daemon %s: %s; set again", gpu.index, gpu.uuid, how, "; ".join(drift))
        self.on_lost(
            gpu.minor,
            f"its MPS control daemon on GPU {gpu.index} ({gpu.uuid}) {how}: {', '.join(drift)} (a client that"
            " connected meanwhile keeps what it got)",
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
