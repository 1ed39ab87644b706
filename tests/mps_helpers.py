"""What the MPS tests share: a control command to a (stand-in or real) ``nvidia-cuda-mps-control``,
and a poll until something holds."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from typing import Any


def control(executable: str, pipe: str, command: str) -> str:
    """``echo COMMAND | nvidia-cuda-mps-control`` for the daemon behind ``pipe``: its answer."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe}
    done = subprocess.run([executable], input=command + "\n", env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def until(predicate: Callable[[], Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
