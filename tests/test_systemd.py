"""systemd: the daemon speaks the notify protocol to a real NOTIFY_SOCKET listener (a unix datagram
socket here, as systemd's), and the shipped unit installs with one command and passes
``systemd-analyze verify``."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from isolator.cli import unit_text
from isolator.sdnotify import Notifier


def _messages(sock: socket.socket, until: float) -> list[str]:
    out: list[str] = []
    while time.monotonic() < until:
        sock.settimeout(max(0.01, until - time.monotonic()))
        try:
            out.append(sock.recv(4096).decode())
        except TimeoutError:
            break
    return out


@pytest.mark.root
@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_the_daemon_sends_ready_after_it_serves_then_watchdog_pings_then_stopping(short_tmp, abstract):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = os.path.join(short_tmp, "notify") if not abstract else f"@gi-notify-{os.getpid()}"
    listener.bind(name if not abstract else "\0" + name[1:])
    sock_path = os.path.join(short_tmp, "s.sock")
    env = dict(os.environ, NOTIFY_SOCKET=name, WATCHDOG_USEC="200000")
    argv = [sys.executable, "-m", "isolator", "serve", "--socket", sock_path, "--work-dir", short_tmp]
    argv += ["--volume-root", os.path.join(short_tmp, "v"), "--simulate", "single", "--mode", "standalone"]
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        listener.settimeout(60)
        first = listener.recv(4096).decode().split("\n")
        assert first[0] == "READY=1", first
        assert f"MAINPID={proc.pid}" in first and f"STATUS=serving on {sock_path}" in first
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(sock_path)  # ready means serving: the socket already accepts
        probe.close()
        pings = _messages(listener, time.monotonic() + 1.0)
        assert pings.count("WATCHDOG=1") >= 4, pings  # every 0.1 s for a 0.2 s watchdog
        proc.send_signal(signal.SIGTERM)
        rest = _messages(listener, time.monotonic() + 10)
        assert any(m.startswith("STOPPING=1") for m in rest), rest
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        listener.close()


def test_no_watchdog_for_another_pid_and_nothing_outside_systemd():
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_s is None
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000"}).watchdog_s == 30.0
    quiet = Notifier({})
    assert not quiet.enabled and quiet.ready("x") is False and quiet.watchdog_s is None


def test_the_unit_is_notify_with_a_watchdog_and_hardening():
    text = unit_text("/usr/bin/gpu-isolator", "/etc/gpu-isolator/config.toml")
    lines = set(text.splitlines())
    for expected in (
        "Type=notify",
        "ExecStart=/usr/bin/gpu-isolator serve --config /etc/gpu-isolator/config.toml",
        "WatchdogSec=30s",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "RuntimeDirectory=gpu-isolator",
        "StateDirectory=gpu-isolator",
    ):
        assert expected in lines, expected
    assert any(line.startswith("ReadWritePaths=") and "/run/mesos" in line for line in lines)
    assert "@EXEC@" not in text and "@CONFIG@" not in text


def test_install_unit_is_one_command_and_systemd_accepts_the_result(tmp_path):
    units, config = tmp_path / "units", tmp_path / "etc" / "config.toml"
    result = subprocess.run(
        [sys.executable, "-m", "isolator", "install-unit", "--dir", str(units), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    unit = units / "gpu-isolator.service"
    assert f"--config {config}" in unit.read_text() and "@EXEC@" not in unit.read_text()
    assert 'mode = "mesos"' in config.read_text()
    assert "systemctl daemon-reload && systemctl enable --now gpu-isolator" in result.stdout
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: the unit was written but not verified")
    verified = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verified.returncode == 0, verified.stderr
    assert "gpu-isolator.service" not in verified.stderr, verified.stderr


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_ready_comes_after_the_first_reconciliation_in_mesos_mode(short_tmp, monkeypatch):
    """A container destroyed while the sidecar was down has its GPUs back before READY=1 (without
    waiting for the reaper's first interval)."""
    import uuid

    import grpc

    from isolator.devices import MESOS_DEFAULT_WHITELIST
    from isolator.rpc import isolator_pb2 as pb
    from isolator.rpc import isolator_pb2_grpc as pb_grpc
    from isolator.testing.cgroupfs import TEST_PARENT
    from isolator.testing.mesos import Containerizer, GrpcIsolator, container_id
    from isolator.testing.sidecar import Sidecar

    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    flags = ("--mode", "mesos", "--reap-interval", "3600")
    first = Sidecar(work=short_tmp, host="dgx-1", cgroup_version="v1", cgroups_root=root, extra=flags)
    first.start()
    try:
        cgroup = os.path.join(first.cgroup_parent, "gone")
        os.makedirs(cgroup)
        for rule in ("a", *map(str, MESOS_DEFAULT_WHITELIST)):
            with open(os.path.join(cgroup, "devices.deny" if rule == "a" else "devices.allow"), "w") as fh:
                fh.write(rule)
        isolator = GrpcIsolator(first.socket)
        isolator.prepare(container_id("gone"), Containerizer(isolator, short_tmp).config(gpus=2, image=False))
        isolator.close()
        first.kill()
        os.rmdir(cgroup)  # the agent destroyed it while the sidecar was down

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        listener.bind(os.path.join(short_tmp, "notify"))
        listener.settimeout(60)
        monkeypatch.setenv("NOTIFY_SOCKET", os.path.join(short_tmp, "notify"))
        second = Sidecar(work=short_tmp, host="dgx-1", cgroup_version="v1", cgroups_root=root, extra=flags)
        second.log_path = os.path.join(short_tmp, "second.log")
        second.proc = subprocess.Popen(second.argv(), stderr=open(second.log_path, "w"), text=True)  # noqa: SIM115
        try:
            assert listener.recv(4096).decode().startswith("READY=1")
            with grpc.insecure_channel(second.address) as channel:
                admin = pb_grpc.AdminStub(channel)
                assert list(admin.ListContainers(pb.ListContainersRequest(), timeout=10).containers) == []
                assert all(g.holder == "" for g in admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus)
        finally:
            second.terminate()
            listener.close()
    finally:
        first.stop()
