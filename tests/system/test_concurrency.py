"""Many callers at once: 64 clients doing whole container cycles against one sidecar, and a flood.

Each client has its own channel (its own connection through the gate) and runs Prepare, Isolate of
a real process, a kernel probe of its own cgroup, Update, Status, Cleanup. A shared ledger catches
any GPU handed to two containers at once; at the end the invariants of tests/invariants.py hold
and nothing is left. The flood shows that requests in flight are bounded: the excess is refused
with RESOURCE_EXHAUSTED at once instead of queueing without limit.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from invariants import Observer, probe_grants, proc_status, quick_sidecar

from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing.mesos import GrpcIsolator, HookFailed, container_id

pytestmark = [pytest.mark.root]

VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]
CLIENTS = 64
CYCLES = 2
GPUS = 8


class Ledger:
    """Which client holds which GPU, as the clients learn it from Status."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holder: dict[int, str] = {}
        self.problems: list[str] = []

    def take(self, name: str, minors: frozenset[int]) -> None:
        with self._lock:
            for m in minors:
                if m in self.holder:
                    self.problems.append(f"GPU {m} given to {name} while {self.holder[m]} holds it")
                self.holder[m] = name

    def give_back(self, name: str, minors: frozenset[int]) -> None:
        with self._lock:
            for m in minors:
                if self.holder.get(m) == name:
                    del self.holder[m]


def minors_by_uuid(address: str) -> dict[str, int]:
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.AdminStub(ch).ListGpus(pb.ListGpusRequest(), timeout=30)
    return {g.uuid: g.minor for g in reply.gpus}


@pytest.mark.parametrize("version", VERSIONS)
def test_64_clients_cycling_containers_never_share_a_gpu_and_leave_nothing_behind(version):
    with quick_sidecar("dgx-1", version) as sidecar:
        uuids = minors_by_uuid(sidecar.address)
        ledger = Ledger()
        errors: list[str] = []

        def client(n: int) -> int:
            rng = random.Random(n)
            isolator = GrpcIsolator(sidecar.socket, timeout=120)
            stub = pb_grpc.IsolatorStub(grpc.insecure_channel(sidecar.address))
            done = 0
            try:
                for cycle in range(CYCLES):
                    name = f"k{n}-{cycle}"
                    cid = container_id(name)
                    want = rng.randrange(3)
                    for _attempt in range(200):
                        try:
                            isolator.prepare(cid, {"resources": [gpu_resource(want)]})
                            break
                        except HookFailed as exc:
                            if exc.code != "RESOURCE_EXHAUSTED":
                                raise
                            want = max(0, want - 1) if rng.random() < 0.2 else want
                            time.sleep(rng.uniform(0.005, 0.05))
                    status = stub.Status(pb.StatusRequest(container_id=pb.ContainerID(value=name)), timeout=60)
                    held = frozenset(uuids[u] for u in status.gpu_uuids)
                    assert len(held) == want, (name, held, want)
                    ledger.take(name, held)
                    proc = subprocess.Popen(["sleep", "600"])
                    try:
                        isolator.isolate(cid, proc.pid)
                        granted = probe_grants(sidecar.cgroup_parent + "/" + name, sidecar.dev_root, range(GPUS))
                        if granted != held:
                            errors.append(f"{name}: holds {sorted(held)}, kernel grants {sorted(granted)}")
                        # Give back before the shrink: the released GPU may go to another client
                        # before Update returns.
                        ledger.give_back(name, held)
                        try:
                            isolator.update(cid, max(0, want - 1))  # shrink always succeeds
                        except HookFailed as exc:
                            errors.append(f"{name}: shrink failed: {exc}")
                        status = stub.Status(pb.StatusRequest(container_id=pb.ContainerID(value=name)), timeout=60)
                        held = frozenset(uuids[u] for u in status.gpu_uuids)
                        ledger.take(name, held)
                    finally:
                        proc.kill()
                        proc.wait()
                    ledger.give_back(name, held)
                    isolator.cleanup(cid)
                    done += 1
            finally:
                isolator.close()
            return done

        with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
            completed = sum(pool.map(client, range(CLIENTS)))
        assert completed == CLIENTS * CYCLES
        assert not ledger.problems, ledger.problems
        assert not errors, errors
        observer = Observer(sidecar, GPUS)
        assert observer.problems() == []
        assert sidecar.terminate() == 0, sidecar.log()
        assert observer.leftovers() == []


def gpu_resource(n: int) -> dict[str, object]:
    return {"name": "gpus", "type": "SCALAR", "scalar": {"value": n}, "role": "*"}


@pytest.mark.cgroup_v1
@pytest.mark.xdist_group("measures")  # reads a process's memory or threads: its own worker, one at a time
def test_a_flood_of_calls_beyond_the_in_flight_limit_gets_resource_exhausted_and_memory_stays_bounded():
    limit = 4
    with quick_sidecar("dgx-1", "v1", extra=("--max-concurrent-rpcs", str(limit), "--max-workers", "1")) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        isolator.prepare(container_id("watched"), {"resources": [gpu_resource(1)]})
        status = pb.StatusRequest(container_id=pb.ContainerID(value="watched"))
        watch = pb.WatchRequest(container_id=pb.ContainerID(value="watched"))
        assert sidecar.proc is not None

        def wave(channel: grpc.Channel, request: object, calls: int, timeout: float) -> list[str]:
            stub = pb_grpc.IsolatorStub(channel)
            method = stub.Status if isinstance(request, pb.StatusRequest) else stub.Watch
            futures = [method.future(request, timeout=timeout) for _ in range(calls)]
            out = []
            for f in futures:
                try:
                    f.result()
                    out.append("OK")
                except grpc.RpcError as exc:
                    out.append(exc.code().name)
            return out

        with grpc.insecure_channel(sidecar.address) as ch:
            first = wave(ch, status, 64, 10)
            before = proc_status(sidecar.proc.pid, "VmRSS")
            refused = 0
            for _ in range(3):
                # One worker, four calls admitted at once: the rest are refused at once, not queued.
                codes = wave(ch, status, 600, 10)
                assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, set(codes)
                refused += codes.count("RESOURCE_EXHAUSTED")
            # Open Watch calls hold no slot and no worker: none is refused; each waits to its deadline
            # (DEADLINE_EXCEEDED when its first check waited too long for the one worker, which on a
            # loaded machine is most of them, so the count of OK is only asked to exceed what the
            # four slots could have held open at once).
            watched = wave(ch, watch, 600, 2)
            assert set(watched) <= {"OK", "DEADLINE_EXCEEDED"} and watched.count("OK") > 2 * limit, watched
            after = proc_status(sidecar.proc.pid, "VmRSS")
        assert refused > 0 and first.count("OK") >= limit, (refused, first)
        # 1800 calls over the limit later, the daemon has not grown with them (a queue would hold them all).
        assert after - before < 32 * 1024, (before, after)
        isolator.cleanup(container_id("watched"))
        isolator.close()
