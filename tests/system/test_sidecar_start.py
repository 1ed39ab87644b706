"""The test daemons' start wait (isolator/testing/sidecar.py): it returns once the socket accepts, so the
gRPC channel opened next connects at its first attempt instead of waiting out its reconnect back-off."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from isolator.testing.sidecar import wait_for_listener
from isolator.transport.server import socket_is_live

# Binds and listens on argv[1] once a line arrives on stdin, then holds the socket until stdin closes.
LISTENER = """
import socket, sys
sys.stdin.readline()
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(1)
print("listening", flush=True)
sys.stdin.read()
"""


def test_the_wait_returns_once_the_socket_accepts_and_not_before(short_tmp):
    path = os.path.join(short_tmp, "s.sock")
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        with pytest.raises(RuntimeError, match="did not listen"):
            wait_for_listener(path, proc, time.monotonic())  # nothing bound yet: the deadline ends it
        proc.stdin.write("go\n")
        proc.stdin.flush()
        wait_for_listener(path, proc, time.monotonic() + 60)
        assert socket_is_live(path)
        assert proc.stdout.readline().strip() == "listening"
    finally:
        proc.kill()
        proc.wait()


def test_a_socket_file_nobody_listens_on_is_not_taken_for_a_started_daemon(short_tmp):
    path = os.path.join(short_tmp, "s.sock")
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(path)  # what a killed daemon leaves behind: the file, no listener
    proc = subprocess.Popen(["sleep", "600"])
    try:
        with pytest.raises(RuntimeError, match="did not listen"):
            wait_for_listener(path, proc, time.monotonic() + 0.2)
    finally:
        proc.kill()
        proc.wait()


def test_a_daemon_that_exits_before_listening_is_reported_with_its_log(short_tmp):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(RuntimeError, match=r"exited 3 before listening .*the log"):
        wait_for_listener(os.path.join(short_tmp, "s.sock"), proc, time.monotonic() + 60, lambda: "the log")
