"""The daemon on a simulated host, seen through the admin CLI: a subprocess daemon, asked by the CLI's
``main`` in this process (the CLI as its own process is tested in test_cli.py and test_packaging.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from hostexpect import gpus_json, topology_json

from isolator.cli import main as cli
from isolator.simhost.host import HOSTS_DIR, load_host, shipped_hosts
from isolator.simhost.sim import SimulatedHost
from isolator.testing import forkserver
from isolator.testing.cgroupfs import TEST_PARENT, unique_name
from isolator.testing.sidecar import wait_for_listener


def _cli(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return forkserver.run([sys.executable, "-m", "isolator", *argv], timeout=timeout)


def _ask(*argv: str) -> subprocess.CompletedProcess[str]:
    """``gpu-isolator ARGV`` run by the CLI's ``main`` in this process: its exit code and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return subprocess.CompletedProcess(["gpu-isolator", *argv], rc, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _daemon(work: str, *flags: str, prepare: Callable[[SimulatedHost], None] | None = None) -> Iterator[str]:
    """Serve with ``flags``; ``prepare`` may steer the simulated host before the daemon reads it."""
    sock = os.path.join(work, "s.sock")
    if prepare is not None:
        name = flags[flags.index("--simulate") + 1]
        prepare(SimulatedHost(name, os.path.join(work, "simhost")).setup())
    flags = ("--cgroups-root", unique_name(TEST_PARENT), *flags)  # one daemon per cgroups root (issue 33)
    proc = subprocess.Popen(
        [sys.executable, "-m", "isolator", "serve", "--socket", sock, "--work-dir", work, *flags],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        try:
            wait_for_listener(sock, proc, time.monotonic() + 30)
            with grpc.insecure_channel("unix:" + sock) as ch:
                grpc.channel_ready_future(ch).result(timeout=30)
        except (RuntimeError, grpc.FutureTimeoutError):
            proc.kill()
            pytest.fail(f"the daemon did not start: {proc.communicate()[1]}")
        yield sock
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()


def _json(command: str, sock: str) -> dict:
    result = _ask(command, "--json", "--socket", sock)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _steer(work: str, name: str) -> SimulatedHost:
    """The running daemon's simulated host, for steering only (nothing is rewritten)."""
    return SimulatedHost(name, os.path.join(work, "simhost"))


def _wait_for(predicate: Callable[[], bool], what: str, deadline: float = 60.0) -> None:
    end = time.monotonic() + deadline
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.1)


@pytest.mark.parametrize("name", shipped_hosts())
def test_daemon_on_each_shipped_host_reports_exactly_that_host(short_tmp, name):
    spec = load_host(name)
    with _daemon(short_tmp, "--simulate", name) as sock:
        gpus = _json("gpus", sock)
        topology = _json("topology", sock)
    assert gpus["driver_version"] == spec.driver_version
    assert gpus["gpus"] == gpus_json(spec)
    assert topology == topology_json(spec)


def test_injected_xid_marks_the_gpu_unhealthy_in_gpus_and_an_ignored_one_does_not(short_tmp):
    with _daemon(short_tmp, "--simulate", "dgx-1") as sock:
        host = _steer(short_tmp, "dgx-1")
        host.inject_xid(2, 31)  # GPU memory page fault: an application error, in the ignored list
        host.inject_xid(1, 79)  # GPU has fallen off the bus
        _wait_for(lambda: not _json("gpus", sock)["gpus"][1]["healthy"], "GPU 1 to turn unhealthy")
        listed = _json("gpus", sock)["gpus"]
        table = _ask("gpus", "--socket", sock).stdout
    assert listed[1]["last_xid"] == "79" and listed[1]["last_xid_time"].endswith("Z")
    assert listed[1]["health_reason"] == "XID 79"
    assert [g["healthy"] for g in listed] == [True, False, True, True, True, True, True, True]
    row = next(line for line in table.splitlines() if line.startswith("1 "))
    assert "UNHEALTHY: XID 79 at " in row


def test_ignored_xids_flag_changes_what_marks_a_gpu_unhealthy(short_tmp):
    with _daemon(short_tmp, "--simulate", "single", "--ignored-xids", "79") as sock:
        host = _steer(short_tmp, "single")
        host.inject_xid(0, 79)
        host.inject_xid(0, 13)  # not ignored any more: the flag replaces the default list
        _wait_for(lambda: not _json("gpus", sock)["gpus"][0]["healthy"], "GPU 0 to turn unhealthy")
        assert _json("gpus", sock)["gpus"][0]["last_xid"] == "13"


def test_gpu_whose_queries_fail_is_listed_degraded_while_the_others_are_healthy(short_tmp):
    def prepare(host: SimulatedHost) -> None:
        host.fail_gpu(3, "nvmlDeviceGetMemoryInfo")

    with _daemon(short_tmp, "--simulate", "dgx-a100", prepare=prepare) as sock:
        listed = _json("gpus", sock)["gpus"]
        table = _ask("gpus", "--socket", sock).stdout
    assert [g["index"] for g in listed] == list(range(8))
    assert [g["healthy"] for g in listed] == [True, True, True, False, True, True, True, True]
    assert listed[3]["health_reason"].startswith("degraded: failed to query memory of GPU 3")
    assert "UNHEALTHY: degraded" in table


def test_nvidia_gpu_devices_restrict_the_gpus_managed(short_tmp):
    with _daemon(
        short_tmp, "--simulate", "workstation-4", "--nvidia-gpu-devices", "1,3", "--resources", "cpus:4;gpus:2"
    ) as sock:
        listed = _json("gpus", sock)["gpus"]
        topology = _json("topology", sock)
    assert [(g["index"], g["minor"]) for g in listed] == [(1, 3), (3, 1)]
    assert topology["links"] == [{"a": 1, "b": 3, "kind": "SYS", "nvlink_lanes": 0}]


def test_gpus_0_opts_out_and_lists_nothing(short_tmp):
    with _daemon(short_tmp, "--simulate", "dgx-1", "--resources", "cpus:4;gpus:0") as sock:
        assert _json("gpus", sock)["gpus"] == []


def test_topology_table_is_the_nvidia_smi_matrix_with_numa_affinity(short_tmp):
    with _daemon(short_tmp, "--simulate", "workstation-4") as sock:
        table = _ask("topology", "--socket", sock).stdout.splitlines()
    assert table[0].split() == ["GPU0", "GPU1", "GPU2", "GPU3", "CPU", "Affinity", "NUMA", "Affinity"]
    assert table[1].split() == ["GPU0", "X", "PIX", "SYS", "SYS", "0-15,32-47", "0"]
    assert table[4].split() == ["GPU3", "SYS", "SYS", "PHB", "X", "16-31,48-63", "1"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--simulate", "dgx-1", "--nvidia-gpu-devices", "0,0", "--resources", "gpus:2"), "contains duplicates"),
        (("--simulate", "single", "--nvidia-gpu-devices", "0,1", "--resources", "gpus:2"), "greater than the number"),
        (("--simulate", "dgx-1", "--resources", "gpus:2"), "cannot be set without also setting '--nvidia-gpu-devices'"),
        (("--simulate", "dgx-9"), "no shipped host of that name"),
        (
            ("--nvml-library", "/nonexistent/libnvidia-ml.so.1", "--nvidia-gpu-devices", "0", "--resources", "gpus:1"),
            "gpus requested but NVML not found: failed to load NVML '/nonexistent/libnvidia-ml.so.1'",
        ),
    ],
)
def test_daemon_refuses_bad_gpu_flags_with_one_line(short_tmp, flags, expected):
    result = _cli("serve", "--socket", os.path.join(short_tmp, "s.sock"), "--work-dir", short_tmp, *flags)
    # 4: the GPUs the node is configured with are not there; 78 (EX_CONFIG): the flags cannot work
    # (README "Running the sidecar").
    unavailable = "NVML not found" in expected or "greater than the number" in expected
    assert result.returncode == (4 if unavailable else 78), result.stderr
    assert expected in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if " INFO " not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr


def test_daemon_refuses_a_malformed_host_file_naming_line_and_reason(short_tmp):
    bad = os.path.join(short_tmp, "bad.toml")
    with open(os.path.join(HOSTS_DIR, "dgx-1.toml")) as fh:
        text = fh.read()
    # GPU 1 now claims one lane to GPU 5, which still claims two back.
    assert "nvlink = { 0 = 1, 2 = 2, 3 = 1, 5 = 2 }" in text
    text = text.replace("nvlink = { 0 = 1, 2 = 2, 3 = 1, 5 = 2 }", "nvlink = { 0 = 1, 2 = 2, 3 = 1, 5 = 1 }")
    with open(bad, "w") as fh:
        fh.write(text)
    result = _cli("serve", "--socket", os.path.join(short_tmp, "s.sock"), "--work-dir", short_tmp, "--simulate", bad)
    assert result.returncode == 78  # EX_CONFIG: a host file is configuration
    assert f"failed to load host file '{bad}': line " in result.stderr
    assert "(gpu[1].nvlink): asymmetric link: GPU 1 has 1 lane(s) to GPU 5, but GPU 5 has 2 back" in result.stderr


def test_xid_and_ecc_marks_survive_a_restart_of_the_sidecar_until_the_gpu_is_reset(short_tmp):
    """A GPU taken out of service stays out after a restart (the marks are in the state store);
    the existing way back (a reset: unbind and bind) still brings it back, and that is kept too."""
    with _daemon(short_tmp, "--simulate", "dgx-1") as sock:
        host = _steer(short_tmp, "dgx-1")
        host.inject_xid(1, 79)  # GPU has fallen off the bus
        host.inject_ecc(4)  # a double-bit ECC error
        _wait_for(lambda: [g["healthy"] for g in _json("gpus", sock)["gpus"]][1:5:3] == [False, False], "the marks")
    with _daemon(short_tmp, "--simulate", "dgx-1") as sock:
        listed = _json("gpus", sock)["gpus"]
        assert [g["healthy"] for g in listed] == [True, False, True, True, False, True, True, True], listed
        assert listed[1]["health_reason"] == "XID 79" and listed[1]["last_xid"] == "79"
        # A reset of GPU 1 clears its mark, as without a restart; GPU 4's stays.
        host = _steer(short_tmp, "dgx-1")
        host.unbind(1)
        host.bind(1)
        _wait_for(lambda: _json("gpus", sock)["gpus"][1]["healthy"], "GPU 1 to be healthy after its reset")
    with _daemon(short_tmp, "--simulate", "dgx-1") as sock:
        assert [g["healthy"] for g in _json("gpus", sock)["gpus"]] == [True] * 4 + [False] + [True] * 3
