"""Deliberate crashes for the crash-consistency tests: SIGKILL at the n-th pass of a named point.

Off unless the daemon starts with ``GPU_ISOLATOR_CRASH_AT=<point>:<n>`` (or ``*:<n>``, any point);
then the process kills itself with SIGKILL the n-th time it passes that point: no cleanup, no
finally blocks, exactly as an OOM kill or power cut would leave things. The points themselves are
named in ``isolator.crashpoints``; this module only arms them.
"""

from __future__ import annotations

import os
import signal

from isolator.crashpoints import POINTS, arm

ENV = "GPU_ISOLATOR_CRASH_AT"

__all__ = ["ENV", "POINTS", "arm_from_environment"]


def _parse(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    point, _, n = value.rpartition(":")
    if point != "*" and point not in POINTS:
        raise ValueError(f"{ENV}={value!r}: unknown point {point!r} (known: {', '.join(POINTS)})")
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"{ENV}={value!r}: expected '<point>:<n>' with n >= 1")
    return point, int(n)


def _sigkill(name: str, passes: int) -> None:
    os.write(2, f"crash point {name} pass {passes}: SIGKILL\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


def arm_from_environment(environ: dict[str, str] | None = None) -> None:
    """Arm the crash point the environment names, if any (the daemon calls this once at start)."""
    target = _parse((os.environ if environ is None else environ).get(ENV))
    if target is not None:
        arm(*target, _sigkill)
