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
