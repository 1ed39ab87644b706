#!/usr/bin/env python3
"""Recovery: time from the daemon's process start to SERVING with N recorded containers, and the
Recover call Mesos makes after an agent restart, on a simulated host in mesos mode.

The state store is filled beforehand through isolator.host.state.StateStore with records whose cgroups do
not exist (the containers are gone with the old agent): a few hold one GPU each, the rest none, so
the records agree with the host's GPU count. At start the daemon loads the store and books every
recorded GPU (isolator.core.recovery.Recovery.restore) before it serves; its fixed start cost (imports, simulated
host, NVML) is measured with 0 records in the same run and subtracted.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from isolator.devicerule import DeviceRule  # noqa: E402
from isolator.host.state import ContainerRecord, StateStore  # noqa: E402
from isolator.model import CgroupVersion, ContainerId, Holding, Mode, RecordState  # noqa: E402
from isolator.rpc import isolator_pb2 as pb  # noqa: E402
from isolator.rpc import isolator_pb2_grpc as pb_grpc  # noqa: E402

HOST = "dgx-1"
HOST_GPUS = 8
HOLDING = 4  # records that hold one GPU each; the rest hold none
# Reconnect quickly: gRPC's default backoff (1 s) would be measured instead of the daemon.
FAST_RETRY = [
    ("grpc.initial_reconnect_backoff_ms", 2),
    ("grpc.min_reconnect_backoff_ms", 2),
    ("grpc.max_reconnect_backoff_ms", 5),
]


def populate(state_dir: str, count: int, cgroups_root: str) -> list[ContainerId]:
    """``count`` records as an agent that ran them would have left them, with their Mesos cgroups
    (the containers survived the restart, as Recover then says; a record whose cgroup is gone is
    released by the daemon's first reconciliation, in mesos mode before READY)."""
    from isolator.testing.cgroupfs import cgroup_mount

    ids = [ContainerId.parse(f"recovered-{i:05d}") for i in range(count)]
    from isolator.policy.devices import MESOS_DEFAULT_WHITELIST

    parent = os.path.join(cgroup_mount("v1"), cgroups_root)
    whitelist = [str(rule) for rule in MESOS_DEFAULT_WHITELIST]
    for cid in ids:
        # What Mesos's cgroups/devices isolator leaves: deny all, then its default whitelist.
        cgroup = os.path.join(parent, cid.value)
        os.makedirs(cgroup)
        with open(os.path.join(cgroup, "devices.deny"), "w") as fh:
            fh.write("a")
        for rule in whitelist:
            with open(os.path.join(cgroup, "devices.allow"), "w") as fh:
                fh.write(rule)
    with StateStore(state_dir, durable=False) as store:
        for i, cid in enumerate(ids):
            store.record(
                ContainerRecord(
                    cid,
                    Holding(frozenset({i}) if i < min(HOLDING, HOST_GPUS) else frozenset()),
                    mode=Mode.MESOS,
                    cgroup=os.path.join(parent, cid.value),
                    cgroup_version=1,
                    state=RecordState.ISOLATED,
                    rules=(DeviceRule.parse("c 195:255 rw"),),
                )
            )
    return ids


def _start_to_serving(argv: list[str], socket: str, log_path: str) -> tuple[subprocess.Popen[str], float]:
    with open(log_path, "a") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=log, text=True)
    with grpc.insecure_channel("unix:" + socket, options=FAST_RETRY) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                with open(log_path) as fh:
                    raise RuntimeError(f"the daemon exited {proc.returncode}: {fh.read()[-2000:]}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1, wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return proc, time.perf_counter() - started
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the daemon did not start serving within 120 s")
            time.sleep(0.002)


def _recover_call(socket: str, ids: list[ContainerId]) -> tuple[float, int]:
    """Mesos hands every container back as running; seconds for the call and how many it kept."""
    request = pb.RecoverRequest(states=[pb.ContainerState(container_id=pb.ContainerID(value=c.value)) for c in ids])
    with grpc.insecure_channel("unix:" + socket, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.IsolatorStub(channel)
        started = time.perf_counter()
        reply = stub.Recover(request, timeout=300)
        return time.perf_counter() - started, reply.recovered


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(
    counts: tuple[int, ...] = (100, 1_000, 10_000),
    repeats: int = 3,
    recover_call: bool = True,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Median seconds to SERVING per count (and for 0 records), their excess over 0, and Recover."""
    from isolator.testing.sidecar import Sidecar

    out: dict[str, Any] = {"host": HOST, "mode": "mesos", "cgroup_version": "v1", "repeats": repeats, "counts": {}}
    tmp = tempfile.mkdtemp(prefix="gi-bench-rec-", dir="/tmp")
    try:
        rows: dict[int, dict[str, list[float]]] = {}
        for r in range(repeats):
            for count in (0, *counts):
                log(f"recovery: {count} records, run {r + 1}/{repeats}")
                work = os.path.join(tmp, f"n{count}")
                os.makedirs(work, exist_ok=True)
                root = f"gpu-isolator-test/recovery-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                side = Sidecar(
                    work=work, host=HOST, cgroup_version=CgroupVersion.V1, cgroups_root=root, extra=("--mode", "mesos")
                )
                state_dir = os.path.join(work, "state")
                shutil.rmtree(state_dir, ignore_errors=True)
                ids = populate(state_dir, count, root)
                proc, seconds = _start_to_serving(side.argv(), side.socket, os.path.join(work, "daemon.log"))
                row = rows.setdefault(count, {"serving_s": [], "recover_call_s": []})
                row["serving_s"].append(seconds)
                try:
                    if recover_call and count:
                        call_s, kept = _recover_call(side.socket, ids)
                        if kept != count:
                            raise RuntimeError(f"Recover kept {kept} of {count} containers")
                        row["recover_call_s"].append(call_s)
                finally:
                    _stop(proc)
                    from isolator.testing.cgroupfs import cgroup_mount, remove_cgroup_tree

                    remove_cgroup_tree(os.path.join(cgroup_mount("v1"), root))
        base = statistics.median(rows[0]["serving_s"])
        out["start_to_serving_0_s"] = base
        for count in counts:
            serving = statistics.median(rows[count]["serving_s"])
            entry: dict[str, Any] = {
                "start_to_serving_s": serving,
                "over_empty_s": serving - base,
                "ratio_to_empty": serving / base,
            }
            if rows[count]["recover_call_s"]:
                entry["recover_call_s"] = statistics.median(rows[count]["recover_call_s"])
            out["counts"][str(count)] = entry
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(measure(repeats=1, log=print), indent=2))
