"""The test harness's fork server (isolator/testing/forkserver.py): a daemon forked from it must look,
to the tests, like the `python -m isolator ...` process it replaces: the same exit status and output
for the same argv, its own environment and working directory, signals that reach it and only it,
and a wait that times out like subprocess's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import pytest

from isolator.testing import forkserver
from isolator.testing.sidecar import running_sidecar

PYTHON_M = [sys.executable, "-m", "isolator"]


def _both(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> list[tuple[int, str]]:
    """(exit status, output) of ``argv`` forked from the fork server and exec'd, in that order."""
    out = []
    for fork in ("1", "0"):
        with tempfile.TemporaryFile("w+") as log:
            environ = {**os.environ, **(env or {}), forkserver.ENV: fork}
            saved = os.environ.get(forkserver.ENV)
            os.environ[forkserver.ENV] = fork
            try:
                proc = forkserver.spawn(argv, environ, log.fileno(), log.fileno(), cwd)
            finally:
                if saved is None:
                    os.environ.pop(forkserver.ENV)
                else:
                    os.environ[forkserver.ENV] = saved
            assert isinstance(proc, forkserver.ForkedDaemon) == (fork == "1")
            status = proc.wait(timeout=60)
            log.seek(0)
            out.append((status, log.read()))
    return out


@pytest.mark.parametrize(
    "args, status",
    [
        (["--version"], 0),
        (["serve", "--bogus"], 2),
        (["serve", "--socket", "/tmp/x.sock", "--work-dir", "/nonexistent/x", "--cgroup-version", "v9"], 78),
    ],
)
def test_a_forked_command_exits_and_writes_as_the_execd_one(args, status):
    forked, execd = _both(PYTHON_M + args)
    assert forked == execd
    assert forked[0] == status and forked[1]


def test_the_forked_process_gets_its_own_environment_and_working_directory(tmp_path, monkeypatch):
    # GPU_ISOLATOR_SOCKET (issue 26) is read from the environment: the refusal names it.
    forked, execd = _both([*PYTHON_M, "gpus", "--json"], env={"GPU_ISOLATOR_SOCKET": "/nonexistent/absent.sock"})
    assert forked == execd
    assert forked[0] != 0 and "/nonexistent/absent.sock" in forked[1]
    # A relative --dir and --config are written under the working directory (without --config,
    # install-unit wrote the host's /etc/gpu-isolator/config.toml).
    for fork in ("1", "0"):
        cwd = tmp_path / fork
        cwd.mkdir()
        monkeypatch.setenv(forkserver.ENV, fork)
        argv = [*PYTHON_M, "install-unit", "--dir", "units", "--config", "etc/config.toml"]
        proc = forkserver.spawn(argv, dict(os.environ), 1, 2, str(cwd))
        assert proc.wait(timeout=60) == 0
        assert (cwd / "units" / "gpu-isolator.service").is_file() and (cwd / "etc" / "config.toml").is_file()


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_forked_daemon_is_signalled_waited_for_and_times_out_like_a_child():
    with running_sidecar("single", "v1") as sidecar:
        proc = sidecar.proc
        assert isinstance(proc, forkserver.ForkedDaemon)
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        # The test worker is among the daemon's ancestors (Isolate never moves a sidecar's ancestor).
        with open(f"/proc/{proc.pid}/stat") as fh:
            server = int(fh.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{server}/stat") as fh:
            assert int(fh.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert proc.poll() == -signal.SIGKILL
        proc.kill()  # a signal after the exit reaches nobody (the pidfd names the dead process only)


def test_run_captures_a_commands_output_and_status_as_subprocess_run_does(monkeypatch):
    argv = [*PYTHON_M, "serve", "--bogus"]
    forked = forkserver.run(argv)
    execd = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert (forked.returncode, forked.stdout, forked.stderr) == (execd.returncode, execd.stdout, execd.stderr)
    assert forked.returncode == 2 and "--bogus" in forked.stderr
    version = forkserver.run([*PYTHON_M, "--version"])
    assert version.returncode == 0 and version.stdout.startswith("gpu-isolator ")
