"""Pure decisions of the handover check (docs/handover.md): may a released GPU be handed out again?

No I/O and no clock of its own: the core gathers what NVML reports (``Occupancy``, ``ResetStep``)
and the clock's monotonic time, and acts on the answers.
"""

from __future__ import annotations

from collections.abc import Iterable

from isolator.model import Occupancy, ResetStep

MIB = 1 << 20


def busy_reason(occupancy: Occupancy, threshold_bytes: int) -> str | None:
    """Why the GPU is not free yet (processes on it, or memory in use at or over the threshold), or
    None when it is. A process counts whatever memory it holds: a hung context holds the GPU."""
    parts = []
    if occupancy.processes:
        listed = ", ".join(
            f"{p.pid} ({p.kind}, {p.used_memory // MIB} MiB)" for p in sorted(occupancy.processes, key=lambda p: p.pid)
        )
        parts.append(f"processes still run on it: {listed}")
    if occupancy.memory_used >= threshold_bytes:
        parts.append(
            f"{occupancy.memory_used // MIB} MiB of memory in use (the threshold is {threshold_bytes // MIB} MiB)"
        )
    return "; ".join(parts) or None


def reset_reason(steps: Iterable[ResetStep]) -> str | None:
    """Why the resets keep the GPU out, or None.

    Only the compute mode: a GPU left PROHIBITED refuses every CUDA context and EXCLUSIVE_PROCESS
    refuses a second process, so the next container would not get the GPU it asked for (fail
    closed). Application clocks change speed, not what runs; their failed reset (NO_PERMISSION,
    NOT_SUPPORTED on many boards) is reported, not enforced.
    """
    for step in steps:
        if step.setting == "compute mode" and step.error:
            return f"its compute mode ({step.before}) could not be reset: {step.error}"
    return None


def timed_out(since_mono: float, now_mono: float, timeout_s: float) -> bool:
    """Drained for ``timeout_s`` or longer (0: never)."""
    return timeout_s > 0 and now_mono - since_mono >= timeout_s
