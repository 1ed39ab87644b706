"""Deliberate crashes for the crash-consistency tests: SIGKILL at the n-th pass of a named point.

Off unless the daemon starts with ``GPU_ISOLATOR_CRASH_AT=<point>:<n>`` (or ``*:<n>``, any point);
then the process kills itself with SIGKILL the n-th time it passes that point: no cleanup, no
finally blocks, exactly as an OOM kill or power cut would leave things. Decides nothing else.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "GPU_ISOLATOR_CRASH_AT"

# Every point the code passes, so that a test can aim at each of them (tests/test_crash.py).
POINTS = (
    "prepare.recorded",  # GPUs recorded, cgroup not yet made
    "prepare.cgroup",  # cgroup made (deny-all), GPU rules not yet applied
    "prepare.applied",  # rules applied, launch info (volume) not yet built
    "prepare.volume",  # volume acquired, its version not yet recorded
    "isolate.placed",  # pid in the cgroup, state not yet 'isolated'
    "update.grown",  # extra GPUs recorded, not yet granted
    "update.revoked",  # GPUs revoked, record not yet shrunk
    "apply.kernel",  # kernel rules changed, recorded rules not yet updated
    "cleanup.cgroup",  # cgroup removed, record not yet removed
    "cleanup.record",  # record removed, volume user not yet released
    "recover.action",  # one recovery action done, the next not yet
    "state.commit",  # a state transaction written, COMMIT not yet issued
    "v1.write",  # one devices.allow/deny write of a diff done, the next not yet
    "v2.checkpoint",  # v2 rules checkpointed, program not yet attached
    "v2.attach",  # v2 program attached, the one it replaced not yet detached
    "handover.pending",  # released GPUs out of the pool, their handover check not yet run (docs/handover.md)
)


def _parse(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    point, _, n = value.rpartition(":")
    if point != "*" and point not in POINTS:
        raise ValueError(f"{ENV}={value!r}: unknown point {point!r} (known: {', '.join(POINTS)})")
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"{ENV}={value!r}: expected '<point>:<n>' with n >= 1")
    return point, int(n)


_target = _parse(os.environ.get(ENV))
_passes = 0
_lock = threading.Lock()


def crashpoint(name: str) -> None:
    """Die here, now, if this is the pass the environment asked for."""
    global _passes
    if _target is None or (_target[0] != "*" and _target[0] != name):
        return
    with _lock:
        _passes += 1
        if _passes != _target[1]:
            return
        os.write(2, f"crash point {name} pass {_passes}: SIGKILL\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
