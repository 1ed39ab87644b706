#!/usr/bin/env python3
"""`make demo`: start the sidecar, ask it whether it serves, and stop it.

It grows with the project: once the simulated GPU host and the hooks exist, it drives containers
through them. Everything it makes lives in a temporary directory that is removed at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    tmp = tempfile.mkdtemp(prefix="gi-demo-", dir="/tmp")
    sock = os.path.join(tmp, "isolator.sock")
    cmd = [sys.executable, "-m", "isolator", "serve", "--socket", sock, "--work-dir", tmp]
    print("$ gpu-isolator serve --socket", sock)
    proc = subprocess.Popen(cmd)
    try:
        with grpc.insecure_channel("unix:" + sock) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            print("health:", health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
