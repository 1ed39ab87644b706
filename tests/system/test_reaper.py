"""isolator/testing/reaper.py: what the real-agent harness runs the agent under.

Each test runs the reaper as a real process with a small shell command below it and reads /proc,
as the agent's destroys depend on: who an orphan's parent becomes, and whether it is reaped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

REAPER = [sys.executable, "-m", "isolator.testing.reaper", "--"]


def _ppid(pid: int) -> int | None:
    """The parent of ``pid``, or None once it is gone (reaped); a zombie still has one."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _until(what: str, predicate: object, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(procs: list[subprocess.Popen[str]], script: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*REAPER, "sh", "-c", script], stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    return proc


# The command's child starts a grandchild and exits: the grandchild is an orphan, as a task's process
# is when Mesos kills its executor. It prints the grandchild's pid and its own.
ORPHANING = "sh -c 'sleep 300 & echo $! $$'; exec sleep 300"


def _orphan(proc: subprocess.Popen[str]) -> tuple[int, int]:
    assert proc.stdout is not None
    orphan, parent = proc.stdout.readline().split()
    return int(orphan), int(parent)


def test_an_orphan_below_the_command_becomes_the_reapers_child_and_is_reaped_when_it_exits(
    started: list[subprocess.Popen[str]],
) -> None:
    proc = _start(started, ORPHANING)
    orphan, parent = _orphan(proc)
    try:
        _until("the orphan's first parent to exit", lambda: _ppid(orphan) != parent)
        assert _ppid(orphan) == proc.pid, "orphaned below the reaper, yet not its child"
        os.kill(orphan, signal.SIGKILL)
        _until("the killed orphan to be reaped", lambda: _ppid(orphan) is None)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)
    assert proc.poll() is None, "the reaper left while its command still runs"


def test_without_the_reaper_the_same_orphan_goes_to_another_parent(started: list[subprocess.Popen[str]]) -> None:
    # The control: the re-parenting above is the reaper's doing.
    proc = subprocess.Popen(["sh", "-c", ORPHANING], stdout=subprocess.PIPE, text=True)
    started.append(proc)
    orphan, parent = _orphan(proc)
    try:
        _until("the orphan's first parent to exit", lambda: _ppid(orphan) != parent)
        assert _ppid(orphan) not in (None, proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)


@pytest.mark.parametrize(("script", "code"), [("exit 0", 0), ("exit 3", 3), ("kill -TERM $$", 128 + 15)])
def test_it_exits_as_its_command_does(script: str, code: int) -> None:
    assert subprocess.run([*REAPER, "sh", "-c", script], check=False).returncode == code


def test_it_exits_when_its_command_does_and_leaves_running_orphans_running(
    started: list[subprocess.Popen[str]],
) -> None:
    # As when the agent is stopped and its executors keep running: the reaper must not wait for them.
    proc = _start(started, "sleep 300 & echo $!")
    assert proc.stdout is not None
    orphan = int(proc.stdout.readline())
    try:
        assert proc.wait(timeout=20) == 0
        assert _state(orphan) not in (None, "Z"), "the orphan did not survive its reaper"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)


def test_a_sigterm_reaches_the_command(started: list[subprocess.Popen[str]]) -> None:
    proc = _start(started, "trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.05; done")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "got-term"
    assert proc.wait(timeout=20) == 7


def test_a_sigkilled_reaper_takes_its_command_with_it(started: list[subprocess.Popen[str]]) -> None:
    proc = _start(started, "echo $$; exec sleep 300")
    assert proc.stdout is not None
    command = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    try:
        _until("the command to end with its reaper", lambda: _state(command) in (None, "Z"))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(command, signal.SIGKILL)


def test_a_command_that_cannot_run_exits_127_with_its_name() -> None:
    result = subprocess.run([*REAPER, "/nonexistent/agent"], capture_output=True, text=True, check=False)
    assert result.returncode == 127
    assert "/nonexistent/agent" in result.stderr


def test_no_command_is_a_usage_error() -> None:
    result = subprocess.run(REAPER, capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "usage" in result.stderr
