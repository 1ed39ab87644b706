"""Named crash points: where a deliberate crash may be asked for, and the call that marks one.

The core and the edges call ``crashpoint(name)`` at each point; it does nothing unless the daemon
armed it (``isolator.daemon.crashpoints``, from ``GPU_ISOLATOR_CRASH_AT``). No I/O here: what
"crash" means (a SIGKILL of the process) is the daemon's to decide.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# Every point the code passes, so that a test can aim at each of them (tests/system/test_crash.py).
POINTS = (
    "prepare.recorded",  # GPUs recorded, cgroup not yet made
    "prepare.cgroup",  # cgroup made (deny-all), GPU rules not yet applied
    "prepare.applied",  # rules applied, launch info (volume) not yet built
    "prepare.volume",  # volume acquired, its version not yet recorded
    "isolate.placed",  # pid in the cgroup, state not yet 'isolated'
    "update.grown",  # a grow recorded (GPUs, MIG units, shares), not yet granted
    "update.revoked",  # GPUs revoked, record not yet shrunk
    "update.recorded",  # a shrink recorded (GPUs, MIG units, shares), the books not yet freed
    "apply.kernel",  # kernel rules changed, recorded rules not yet updated
    "cleanup.cgroup",  # cgroup removed, record not yet removed
    "cleanup.record",  # record removed, volume user not yet released
    "recover.action",  # one recovery action done, the next not yet
    "state.commit",  # a state transaction written, COMMIT not yet issued
    "v1.write",  # one devices.allow/deny write of a diff done, the next not yet
    "v2.checkpoint",  # v2 rules checkpointed, program not yet attached
    "v2.attach",  # v2 program attached, the one it replaced not yet detached
    "handover.pending",  # released GPUs out of the pool, their handover check not yet run (docs/handover.md)
    "cpuset.recorded",  # a cpuset recorded (prepare, update), not yet written (--cpu-affinity enforce)
    "mps.launching",  # an MPS control daemon's launch recorded, the daemon not yet started (host/mps.py)
    "mps.spawned",  # an MPS control daemon started, its identity not yet recorded
    "mps.restarted",  # a daemon found dead started again and set up, its sharers not yet ended (core/mps.py)
)


_target: tuple[str, int] | None = None
_die: Callable[[str, int], None] | None = None
_passes = 0
_lock = threading.Lock()


def arm(point: str, n: int, die: Callable[[str, int], None]) -> None:
    """Call ``die(name, pass)`` the ``n``-th time ``point`` (or any point, for ``*``) is passed."""
    global _target, _die, _passes
    if point != "*" and point not in POINTS:
        raise ValueError(f"unknown crash point {point!r} (known: {', '.join(POINTS)})")
    if n < 1:
        raise ValueError(f"crash point pass {n} must be at least 1")
    with _lock:
        _target, _die, _passes = (point, n), die, 0


def disarm() -> None:
    """No point armed any more (an in-process test that armed one)."""
    global _target, _die, _passes
    with _lock:
        _target, _die, _passes = None, None, 0


def crashpoint(name: str) -> None:
    """Die here, now, if this is the pass the daemon was armed for."""
    global _passes
    target = _target
    if target is None or (target[0] != "*" and target[0] != name):
        return
    with _lock:
        _passes += 1
        if _passes != target[1] or _die is None:
            return
        _die(name, _passes)
