"""What the MPS tests share: a control command to a (stand-in or real) ``nvidia-cuda-mps-control``,
a poll until something holds, and a teardown of clients and containers."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any

from isolator.testing.mesos import GrpcIsolator, HookFailed, container_id


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


def end(procs: Iterable[subprocess.Popen[str]], isolator: GrpcIsolator, names: str) -> None:
    """A test's teardown: its client processes killed and reaped, each named container cleaned up
    (one never prepared, or already gone, is no error here), then the isolator client closed."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    for name in names:
        try:
            isolator.cleanup(container_id(name))
        except HookFailed:
            pass
    isolator.close()
