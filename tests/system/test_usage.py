"""What each container's processes use, end to end: a real sidecar on the simulated host, real
processes placed in the containers' real cgroups (v1 devices hierarchy, cgroup v2), the fake NVML's
process list naming their real pids; read back through Usage, `containers`, `describe` and /metrics."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from isolator.cli import main as cli
from isolator.rpc import isolator_pb2 as pb
from isolator.testing.mesos import Containerizer, GrpcIsolator, container_id
from isolator.testing.mesos_json import scalar
from isolator.testing.sidecar import running_sidecar

MIB = 1 << 20
LAYOUTS = [
    pytest.param("v1", marks=[pytest.mark.root, pytest.mark.cgroup_v1]),
    pytest.param("v2", marks=[pytest.mark.root, pytest.mark.cgroup_v2]),
]


def _json(sock: str, *argv: str) -> Any:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([*argv, "--json", "--socket", sock])
    assert rc == 0, err.getvalue()
    return json.loads(out.getvalue())


@contextlib.contextmanager
def sleepers(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _usage(iso: GrpcIsolator, name: str) -> pb.UsageResponse:
    return iso._call("Usage", pb.UsageRequest, {"container_id": container_id(name)})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_containers_memory_is_its_own_processes_and_a_sharer_past_its_slice_is_over(layout, short_tmp):
    with running_sidecar("dgx-1", layout, extra=("--shared-gpus", "4:4"), work=short_tmp) as sc:
        iso = GrpcIsolator(sc.socket)
        c = Containerizer(iso, sc.work)
        shares = c.config(None, image=False)
        shares["resources"] = [*shares["resources"], scalar("gpu_shares", 1.0)]
        try:
            iso.prepare(container_id("whole"), c.config(1, image=False))
            iso.prepare(container_id("s1"), shares)
            iso.prepare(container_id("s2"), shares)
            with sleepers(4) as (w, a, b, stranger):
                iso.isolate(container_id("whole"), w.pid)
                iso.isolate(container_id("s1"), a.pid)
                iso.isolate(container_id("s2"), b.pid)
                listed = {x["id"]: x for x in _json(sc.socket, "containers")["containers"]}
                whole_gpu = listed["whole"]["gpu_indices"][0]
                memory = sc.sim.spec.gpus[4].memory_mib * MIB
                sc.sim.start_process(whole_gpu, w.pid, 300 * MIB, sm_util=35)
                sc.sim.start_process(whole_gpu, stranger.pid, 900 * MIB, sm_util=20)  # outside every container
                sc.sim.start_process(4, a.pid, memory // 4 + MIB, sm_util=10)  # past its quarter
                sc.sim.start_process(4, b.pid, 100 * MIB, sm_util=5)

                (dev,) = _usage(iso, "whole").devices
                assert (dev.kind, dev.memory_used_bytes, dev.sm_utilization_percent, list(dev.pids)) == (
                    "gpu",
                    300 * MIB,
                    35,
                    [w.pid],
                )
                (s1,) = _usage(iso, "s1").devices
                assert (s1.kind, s1.memory_used_bytes, s1.memory_limit_bytes, s1.over) == (
                    "share",
                    memory // 4 + MIB,
                    memory // 4,
                    True,
                )
                assert _usage(iso, "s2").devices[0].over is False
                described = _json(sc.socket, "describe", "s1")["container"]["usage"]
                assert [(d["kind"], d["over"], d["pids"]) for d in described] == [("share", True, [a.pid])]
                listed = {x["id"]: x for x in _json(sc.socket, "containers")["containers"]}
                assert [d["pids"] for d in listed["s2"]["usage"]] == [[b.pid]]
                for p in (w, a, b, stranger):
                    p.kill()
                    p.wait()
                sc.sim.stop_process(whole_gpu)
                sc.sim.stop_process(4)
        finally:
            for name in ("whole", "s1", "s2"):
                iso.cleanup(container_id(name))
            iso.close()
