#!/usr/bin/env python3
"""What the peer-credential gate adds to a call: the same server, reached through the gate or directly.

A sidecar server runs in a child process with a service whose Cleanup returns at once, so the
figure is transport only. The client calls Cleanup through the public socket (the gate checks
SO_PEERCRED and splices) and through the private gRPC socket behind it (root only), alternating
rounds, and reports median and p99 per-call wall time of each, and 16 clients in parallel.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc

from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.transport import peergate

SERVER = """
import signal, sys, threading
from isolator.daemon.config import Config
from isolator.transport.server import SidecarServer
from isolator.transport.settings import ServerSettings
from isolator.testing import StubService
class Quick(StubService):
    def cleanup(self, container_id):
        return None
srv = SidecarServer(ServerSettings(socket=sys.argv[1], bridge_socket=""), Quick())
srv.start()
print("ready", flush=True)
sys.stdin.read()
srv.stop(grace=0)
"""


def timed_calls(address: str, n: int) -> list[float]:
    request = pb.CleanupRequest(container_id=pb.ContainerID(value="bench"))
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.IsolatorStub(ch)
        for _ in range(50):
            stub.Cleanup(request, timeout=10)  # warm the connection
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            stub.Cleanup(request, timeout=10)
            out.append(time.perf_counter() - t0)
    return out


def parallel_rate(address: str, clients: int, per_client: int) -> float:
    def work() -> None:
        timed_calls(address, per_client)

    threads = [threading.Thread(target=work) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return clients * (per_client + 50) / (time.perf_counter() - t0)


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_us": round(statistics.median(ordered) * 1e6, 1),
        "p99_us": round(ordered[int(len(ordered) * 0.99) - 1] * 1e6, 1),
    }


def measure(calls: int = 2000, rounds: int = 3) -> dict[str, object]:
    work = tempfile.mkdtemp(prefix="gi-bench-", dir="/tmp")
    public = os.path.join(work, "s.sock")
    private = os.path.join(peergate.private_dir(public), peergate.ALLOWED_NAME)
    child = subprocess.Popen(
        [sys.executable, "-c", SERVER, public], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        gate: list[float] = []
        direct: list[float] = []
        for _ in range(rounds):
            gate += timed_calls("unix:" + public, calls)
            direct += timed_calls("unix:" + private, calls)
        return {
            "calls": calls * rounds,
            "through_gate": summary(gate),
            "direct": summary(direct),
            "added_median_us": round((statistics.median(gate) - statistics.median(direct)) * 1e6, 1),
            "parallel_16_clients_calls_per_s": {
                "through_gate": round(parallel_rate("unix:" + public, 16, 300)),
                "direct": round(parallel_rate("unix:" + private, 16, 300)),
            },
        }
    finally:
        child.communicate("", timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps(measure(args.calls), indent=1))


if __name__ == "__main__":
    main()
