"""The daemon as an operator meets it (issue 26): its exit codes, one daemon per state directory,
SIGHUP, and the lines it logs at start. Real daemon processes and real signals."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from isolator.cli.main import EXIT_CONFIG


def _serve(work: str, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "isolator", "serve", "--socket", os.path.join(work, "s.sock"), "--work-dir", work]
    argv += ["--volume-root", os.path.join(work, "volumes"), "--mode", "standalone", *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def test_exit_config_is_sysexits_ex_config():
    assert EXIT_CONFIG == 78  # EX_CONFIG in sysexits.h; the unit's RestartPreventExitStatus names it


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('modee = "mesos"\n', "unknown key 'modee'"),
        ("[[[\n", "failed to parse config file"),
        ('cgroup_version = "v3"\n', "invalid config file"),
    ],
    ids=["typo", "unparsable", "bad-value"],
)
def test_a_config_error_exits_with_ex_config_and_one_line(short_tmp, text, expected):
    """systemd restarts a unit that exits 1 forever; a config error does not heal by itself, so it
    has its own exit code, which the unit lists in RestartPreventExitStatus."""
    config = os.path.join(short_tmp, "config.toml")
    with open(config, "w") as fh:
        fh.write(text)
    result = _serve(short_tmp, "--config", config)
    assert result.returncode == EXIT_CONFIG, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_a_runtime_failure_is_not_a_config_error(short_tmp):
    """A socket path that is a regular file is the machine's state, not the configuration's: exit 1."""
    taken = os.path.join(short_tmp, "taken")
    open(taken, "w").close()
    result = _serve(short_tmp, "--resources", "gpus:0", "--socket", taken)
    assert result.returncode == 1, result.stderr
