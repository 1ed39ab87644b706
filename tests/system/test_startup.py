"""Start-up fails closed: a GPU node without usable NVML, or with fewer GPUs than configured, does not
serve (exit 4) unless the operator said the node has no GPUs; every executable answers --version."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from isolator import __version__
from isolator.simhost.sim import SimulatedHost
from isolator.testing.cgroupfs import TEST_PARENT, unique_name

NVML_ERROR_DRIVER_NOT_LOADED = 9


def _serve(work: str, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "isolator", "serve", "--socket", os.path.join(work, "s.sock"), "--work-dir", work]
    argv += ["--volume-root", os.path.join(work, "volumes"), "--mode", "standalone", *flags]
    argv += ["--cgroups-root", unique_name(TEST_PARENT)]  # one daemon per cgroups root (issue 33)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if " INFO " not in line and " WARNING " not in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_no_nvml_under_auto_discovery_stops_the_start_with_exit_4(short_tmp):
    result = _serve(short_tmp, "--nvml-library", "/nonexistent/libnvidia-ml.so.1")
    assert result.returncode == 4, result.stderr
    line = _one_line(result.stderr)
    assert "no usable NVML (failed to load NVML '/nonexistent/libnvidia-ml.so.1'" in line
    assert "--resources gpus:0" in line
    assert not os.path.exists(os.path.join(short_tmp, "s.sock"))


@pytest.mark.root
def test_nvml_that_fails_to_initialise_on_a_simulated_host_stops_the_start(short_tmp):
    host = SimulatedHost("dgx-1", os.path.join(short_tmp, "simhost")).setup()
    host.fail_gpu(None, "nvmlInit", NVML_ERROR_DRIVER_NOT_LOADED)
    result = _serve(short_tmp, "--simulate", "dgx-1")
    assert result.returncode == 4, result.stderr
    assert "no usable NVML" in _one_line(result.stderr)


def test_fewer_gpus_than_configured_stops_the_start_with_exit_4(short_tmp):
    result = _serve(short_tmp, "--simulate", "single", "--nvidia-gpu-devices", "0,1", "--resources", "gpus:2")
    assert result.returncode == 4, result.stderr
    assert "greater than the number of GPUs available" in _one_line(result.stderr)


def test_the_explicit_opt_out_starts_without_nvml(short_tmp):
    """gpus:0 is the operator saying "no GPUs here": NVML is not even loaded, the daemon serves."""
    argv = [sys.executable, "-m", "isolator", "serve", "--socket", os.path.join(short_tmp, "s.sock")]
    argv += ["--work-dir", short_tmp, "--volume-root", os.path.join(short_tmp, "v"), "--mode", "standalone"]
    argv += ["--nvml-library", "/nonexistent/libnvidia-ml.so.1", "--resources", "cpus:2;gpus:0"]
    argv += ["--cgroups-root", unique_name(TEST_PARENT)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        start = time.monotonic()
        while not os.path.exists(os.path.join(short_tmp, "s.sock")):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() - start < 120, "the socket never appeared"
            time.sleep(0.05)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "GPU discovery is off" in err


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "isolator", "--version"],
        [sys.executable, "-m", "isolator.bridge", "--version"],
    ],
)
def test_version_on_the_daemon_and_the_bridge(argv):
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(__version__)


def test_installed_bridge_executables_answer_version_and_help(tmp_path):
    from isolator.bridge.command import install

    paths = install(str(tmp_path / "bin"))
    for path in paths:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        # Each names itself: `gpu-isolator-prepare 0.1.0`, the launcher `gpu-isolator-bridge 0.1.0`.
        assert result.returncode == 0 and result.stdout == f"{os.path.basename(path)} {__version__}\n", result
    helped = subprocess.run([paths[1], "--help"], capture_output=True, text=True, timeout=30)
    assert helped.returncode == 0
    assert "python -m isolator.bridge install" in helped.stdout and "modules.json" in helped.stdout


@pytest.mark.parametrize(
    ("flags", "code", "expected"),
    [
        (("--nvml-library", "/nonexistent/libnvidia-ml.so.1"), 4, "no usable NVML"),
        (("--simulate", "single", "--metrics-address", "localhost:http"), 78, "--metrics-address"),
    ],
    ids=["no-nvml", "bad-metrics-address"],
)
def test_with_json_logs_the_line_saying_why_the_start_failed_is_json_too(short_tmp, flags, code, expected):
    """A log shipper parsing --log-format json must not lose the one line that matters most."""
    import json

    result = _serve(short_tmp, "--log-format", "json", *flags)
    assert result.returncode == code, result.stderr
    entries = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]  # all JSON
    assert entries[-1]["level"] == "critical" and expected in entries[-1]["message"], entries[-1]
