"""The pure decisions of the handover check (isolator/policy/handover.py); the allocator's draining set is
tested with the allocator (tests/unit/policy/test_allocator.py)."""

from __future__ import annotations

from isolator.model import GpuProcess, Occupancy, ResetStep
from isolator.policy.handover import busy_reason, reset_reason, timed_out

MIB = 1 << 20


def test_a_gpu_is_busy_with_any_process_or_memory_at_the_threshold() -> None:
    assert busy_reason(Occupancy((), 0, 16 << 30), 256 * MIB) is None
    assert busy_reason(Occupancy((), 256 * MIB - 1, 16 << 30), 256 * MIB) is None
    assert busy_reason(Occupancy((), 256 * MIB, 16 << 30), 256 * MIB) == (
        "256 MiB of memory in use (the threshold is 256 MiB)"
    )
    idle_process = Occupancy((GpuProcess(9, 0, "graphics"), GpuProcess(3, 2 * MIB, "compute")), 0, 16 << 30)
    assert busy_reason(idle_process, 256 * MIB) == (
        "processes still run on it: 3 (compute, 2 MiB), 9 (graphics, 0 MiB)"
    ), "a process holding no memory still holds the GPU"
    both = Occupancy((GpuProcess(7, 300 * MIB, "compute"),), 300 * MIB, 16 << 30)
    assert busy_reason(both, 256 * MIB) == (
        "processes still run on it: 7 (compute, 300 MiB); 300 MiB of memory in use (the threshold is 256 MiB)"
    )


def test_only_a_failed_compute_mode_reset_keeps_a_gpu_out() -> None:
    clocks = ResetStep("application clocks", "a", "", False, "Insufficient Permissions", "NO_PERMISSION")
    mode_ok = ResetStep("compute mode", "PROHIBITED", "DEFAULT", True)
    mode_failed = ResetStep("compute mode", "PROHIBITED", "", False, "Not Supported", "NOT_SUPPORTED")
    assert reset_reason([clocks, mode_ok]) is None
    assert reset_reason([clocks, mode_failed]) == "its compute mode (PROHIBITED) could not be reset: Not Supported"


def test_the_drain_timeout_counts_from_since_and_zero_is_never() -> None:
    assert not timed_out(100.0, 159.9, 60.0)
    assert timed_out(100.0, 160.0, 60.0)
    assert not timed_out(100.0, 1e9, 0.0)
    assert timed_out(100.0, 100.5, 0.5), "sub-second timeouts count too"
