#!/usr/bin/env python3
"""Serving under load (issue 17), side by side in one run against one real daemon:

* Health p50/p99 and hook-cycle p99 with no Watch open, then with ``watches`` Watch calls open;
  after cancelling them, how long the daemon's threads and RSS take to return to their baseline;
* RSS at rest and at the peak of 100 concurrent Prepare requests of the largest allowed size, and
  how long it takes to fall back under 100 MiB;
* hook cycles/s at 1, 8 and 64 client threads (bench_hooks.drive);
* an allowed caller's Prepare + Cleanup, over gRPC and over the bridge, while another user holds
  ``idle`` idle connections and ``trickling`` bridge clients sending a byte a second, once as a
  user in the allow-list and once as one outside it.

Needs root and cgroup v1 or v2; creates cgroups only below ``gpu-isolator-test/``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)

import bench_hooks  # noqa: E402

HOG_ALLOWED_UID = 65534  # nobody, put in --allowed-uids
HOG_DENIED_UID = 65533  # a uid outside the allow-list

# Idle gRPC-socket connections and bridge connections trickling a byte a second, held by a hog.
HOG = textwrap.dedent(
    """
    import socket, sys, time
    grpc_path, bridge_path, idle, trickling = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    held, slow = [], []
    for _ in range(idle):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(grpc_path); held.append(s)
        except OSError:
            s.close()
    for _ in range(trickling):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(bridge_path); s.setblocking(False); slow.append(s)
        except OSError:
            s.close()
    print("held", len(held), len(slow), flush=True)
    while True:
        for s in slow:
            try:
                s.send(b"g")
            except OSError:
                pass
        time.sleep(1)
    """
)


def _threads(pid: int) -> int:
    return bench_hooks.proc_status(pid, "Threads")


_status_kib = bench_hooks.proc_status


def _until(predicate: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until ``predicate`` held (polled every 10 ms), or None if it never did."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if predicate():
            return time.perf_counter() - started
        time.sleep(0.01)
    return None


def health_latency(channel: Any, calls: int) -> dict[str, float]:
    from isolator.rpc import isolator_pb2 as pb
    from isolator.rpc import isolator_pb2_grpc as pb_grpc

    admin = pb_grpc.AdminStub(channel)
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        admin.Health(pb.HealthRequest(), timeout=30)
        samples.append(time.perf_counter() - t0)
    return {
        "p50_ms": bench_hooks.percentile(samples, 50) * 1000,
        "p99_ms": bench_hooks.percentile(samples, 99) * 1000,
    }


def own_channel(address: str) -> Any:
    import grpc

    # A connection of its own (gRPC shares one per target in a process by default).
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def watches_part(side: Any, sleepers: Any, watches: int, health_calls: int, cycles: int) -> dict[str, Any]:
    from isolator.rpc import isolator_pb2 as pb
    from isolator.rpc import isolator_pb2_grpc as pb_grpc

    pid = side.proc.pid
    out: dict[str, Any] = {"watches": watches}
    control = own_channel(side.address)
    stub = pb_grpc.IsolatorStub(control)
    watched = pb.ContainerID(value="watched")
    stub.Prepare(pb.PrepareRequest(container_id=watched, container_config=pb.ContainerConfig()), timeout=30)
    health_latency(control, 20)  # warm
    bench_hooks.drive(side.socket, sleepers, 16, 2, "warm")  # every worker thread started
    out["without"] = {
        "health": health_latency(control, health_calls),
        "cycle": bench_hooks.drive(side.socket, sleepers, 1, cycles, "nowatch"),
        "threads": _threads(pid),
        "rss_kib": _status_kib(pid, "VmRSS"),
    }
    channels = [own_channel(side.address) for _ in range(max(1, watches // 100))]
    request = pb.WatchRequest(container_id=watched)
    futures = [pb_grpc.IsolatorStub(channels[i % len(channels)]).Watch.future(request) for i in range(watches)]
    time.sleep(2.0)
    out["open_after_2s"] = sum(not f.done() for f in futures)
    out["with"] = {
        "health": health_latency(control, health_calls),
        "cycle": bench_hooks.drive(side.socket, sleepers, 1, cycles, "watch"),
        "threads": _threads(pid),
        "rss_kib": _status_kib(pid, "VmRSS"),
    }
    base_threads, base_rss = out["without"]["threads"], out["without"]["rss_kib"]
    t0 = time.perf_counter()
    for f in futures:
        f.cancel()
    for ch in channels:
        ch.close()  # the watchers go away with their connections
    cancelled = time.perf_counter() - t0
    back = _until(lambda: _threads(pid) <= base_threads and _status_kib(pid, "VmRSS") <= base_rss + 2048, 10.0)
    out["cancel_s"] = cancelled
    out["back_to_baseline_s"] = None if back is None else back + cancelled
    out["after"] = {"threads": _threads(pid), "rss_kib": _status_kib(pid, "VmRSS")}
    stub.Cleanup(pb.CleanupRequest(container_id=watched), timeout=30)
    control.close()
    w, wo = out["with"], out["without"]
    out["health_p99_ms_with"] = w["health"]["p99_ms"]
    out["cycle_p99_ratio"] = w["cycle"]["p99_ms"] / wo["cycle"]["p99_ms"]
    return out


def largest_config(max_bytes: int) -> Any:
    from isolator.rpc import isolator_pb2 as pb

    config = pb.ContainerConfig(directory="/var/lib/mesos/slaves/S0/frameworks/F0/executors/e/runs/r")
    env = config.docker.manifest.config.Env
    while config.ByteSize() < max_bytes - 4096:
        env.append(f"VAR_{len(env)}=" + "x" * 200)
    return config


def memory_part(side: Any, requests: int, max_bytes: int) -> dict[str, Any]:
    import grpc

    from isolator.rpc import isolator_pb2 as pb
    from isolator.rpc import isolator_pb2_grpc as pb_grpc

    pid = side.proc.pid
    channels = [own_channel(side.address) for _ in range(10)]
    config = largest_config(max_bytes)
    rest = _status_kib(pid, "VmRSS")
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM, the peak RSS, to the current RSS
    futures = [
        pb_grpc.IsolatorStub(channels[i % 10]).Prepare.future(
            pb.PrepareRequest(container_id=pb.ContainerID(value=f"mem-{i}"), container_config=config), timeout=60
        )
        for i in range(requests)
    ]
    codes: dict[str, int] = {}
    for f in futures:
        try:
            f.result()
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        codes[code] = codes.get(code, 0) + 1
    peak = _status_kib(pid, "VmHWM")
    done = time.perf_counter()
    stub = pb_grpc.IsolatorStub(channels[0])
    for i in range(requests):
        stub.Cleanup(pb.CleanupRequest(container_id=pb.ContainerID(value=f"mem-{i}")), timeout=30)
    back = _until(lambda: _status_kib(pid, "VmRSS") < 100 * 1024, 10.0)
    for ch in channels:
        ch.close()
    return {
        "requests": requests,
        "request_bytes": config.ByteSize(),
        "codes": codes,
        "rest_mib": rest / 1024,
        "peak_mib": peak / 1024,
        "after_mib": _status_kib(pid, "VmRSS") / 1024,
        "under_100_mib_after_s": None if back is None else back + (time.perf_counter() - done - back),
    }


def throughput_part(side: Any, sleepers: Any, cycles: dict[int, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for clients, each in cycles.items():
        r = bench_hooks.drive(side.socket, sleepers, clients, each, f"tp{clients}", daemon_pid=side.proc.pid)
        out[str(clients)] = {"per_s": r["per_s"], "p99_ms": r["p99_ms"], "daemon_cores": r.get("daemon_cores")}
    one, many = out.get("1"), out.get(str(max(cycles)))
    out["ratio_64_over_1"] = many["per_s"] / one["per_s"] if one and many else None
    return out


def _bridge_cleanup(work: str, bridge_path: str, value: str) -> tuple[int, float, str]:
    from isolator.bridge import command as bridge

    directory = os.path.join(work, "bin")
    if not os.path.exists(os.path.join(directory, bridge.LAUNCHER)):
        bridge.install(directory, socket_path=bridge_path)
    payload = os.path.join(work, f"{value}.json")
    with open(payload, "w") as fh:
        fh.write(f'{{"container_id": {{"value": "{value}"}}}}')
    t0 = time.perf_counter()
    run = subprocess.run(
        [
            os.path.join(directory, "gpu-isolator-cleanup"),
            payload,
            os.path.join(work, "out"),
            os.path.join(work, "err"),
        ],
        capture_output=True,
        timeout=60,
    )
    err = ""
    if run.returncode and os.path.exists(os.path.join(work, "err")):
        with open(os.path.join(work, "err")) as fh:
            err = fh.read()
    return run.returncode, (time.perf_counter() - t0) * 1000, err


def hog_part(side: Any, idle: int, trickling: int) -> dict[str, Any]:
    import grp

    from isolator.rpc import isolator_pb2 as pb
    from isolator.rpc import isolator_pb2_grpc as pb_grpc

    nogroup = grp.getgrnam("nogroup").gr_gid
    out: dict[str, Any] = {"idle": idle, "trickling": trickling}
    for label, uid in (("allowed", HOG_ALLOWED_UID), ("denied", HOG_DENIED_UID)):
        hog = subprocess.Popen(
            [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={nogroup}",
                "--clear-groups",
                sys.executable,
                "-c",
                HOG,
                side.socket,
                side.bridge_socket,
                str(idle),
                str(trickling),
            ],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert hog.stdout is not None
            held = hog.stdout.readline().split()
            time.sleep(3.0)  # a few bytes trickled on each bridge connection
            channel = own_channel(side.address)
            stub = pb_grpc.IsolatorStub(channel)
            cid = pb.ContainerID(value=f"agent-{label}")
            t0 = time.perf_counter()
            error = ""
            try:
                stub.Prepare(pb.PrepareRequest(container_id=cid, container_config=pb.ContainerConfig()), timeout=30)
                stub.Cleanup(pb.CleanupRequest(container_id=cid), timeout=30)
            except Exception as exc:
                error = repr(exc)
            grpc_ms = (time.perf_counter() - t0) * 1000
            channel.close()
            code, bridge_ms, bridge_err = _bridge_cleanup(side.work, side.bridge_socket, f"bridge-{label}")
            out[label] = {
                "held": held[1:],
                "grpc_ok": not error,
                "grpc_ms": grpc_ms,
                "grpc_error": error,
                "bridge_exit": code,
                "bridge_ms": bridge_ms,
                "bridge_error": bridge_err,
            }
        finally:
            hog.kill()
            hog.wait()
    return out


def load(version: str, sizes: dict[str, Any], log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    from isolator.daemon.config import Config
    from isolator.testing.sidecar import running_sidecar

    max_bytes = Config().max_message_bytes
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        host_file = bench_hooks.write_host(os.path.join(tmp, "host.toml"))
        work = tempfile.mkdtemp(prefix="gi-", dir="/tmp")
        os.chmod(work, 0o755)  # the hogs (other users) reach the sockets; their mode decides the rest
        extra = ("--allowed-uids", f"0,{HOG_ALLOWED_UID}", "--socket-mode", "0660", "--socket-group", "nogroup")
        with running_sidecar(host_file, version, extra=extra, work=work) as side:
            os.makedirs(side.cgroup_parent, exist_ok=True)
            sleepers = bench_hooks.Sleepers(bench_hooks.HOST_GPUS, side.cgroup_parent)
            try:
                out: dict[str, Any] = {"version": version, "max_message_bytes": max_bytes}
                log(f"load {version}: {sizes['watches']} open watches")
                out["watches"] = watches_part(side, sleepers, sizes["watches"], sizes["health_calls"], sizes["cycles"])
                log(f"load {version}: memory, {sizes['memory_requests']} concurrent largest requests")
                out["memory"] = memory_part(side, sizes["memory_requests"], max_bytes)
                log(f"load {version}: cycles/s at {', '.join(map(str, sizes['throughput']))} clients")
                out["throughput"] = throughput_part(side, sleepers, sizes["throughput"])
                log(f"load {version}: another user's {sizes['idle']} idle, {sizes['trickling']} trickling connections")
                out["hogs"] = hog_part(side, sizes["idle"], sizes["trickling"])
                return out
            finally:
                sleepers.close()
