#!/usr/bin/env python3
"""Hook latency and the daemon's footprint: a full container cycle over gRPC, in-process, and the raw
cgroup syscalls it rests on, on a simulated host with real cgroups under ``gpu-isolator-test/``.

A cycle is prepare (1 GPU) -> isolate(pid) -> the client moves its pid back to the parent (as a
container's exit empties its cgroup) -> cleanup. Every client owns one long-lived ``sleep`` child that
it moves into each new cgroup. Needs root and the cgroup hierarchy asked for; creates and removes
only cgroups below its own ``gpu-isolator-test/<unique>`` parent.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from isolator.cgroups import bpf, bpfprog  # noqa: E402
from isolator.cgroups.detect import read_mounts  # noqa: E402
from isolator.host.devices import HostDevices  # noqa: E402
from isolator.model import CgroupVersion  # noqa: E402
from isolator.policy.devices import DeviceRule, container_rules  # noqa: E402
from isolator.policy.request import Request  # noqa: E402
from isolator.testing.cgroupfs import TEST_PARENT, cgroup_mount  # noqa: E402

HOST_GPUS = 64  # one GPU per client even at 64 clients; the fake NVML's limit (fakenvml.c MAX_GPUS)


# ---- the simulated host and the cgroups ----------------------------------------------------------


def write_host(path: str, gpus: int = HOST_GPUS) -> str:
    """A PCIe host of ``gpus`` GPUs on two sockets, so that every concurrent client can hold one.

    None of the shipped hosts has more than 16 GPUs; 64 clients on them would measure refusals.
    """
    lines = [
        f'name = "bench-{gpus}"',
        f'description = "Benchmark host: {gpus} PCIe GPUs on 2 sockets"',
        'driver_version = "535.104.05"',
        'cuda_driver_version = "12.2"',
        '[[numa]]\nnode = 0\ncpus = "0-31"',
        '[[numa]]\nnode = 1\ncpus = "32-63"',
    ]
    for i in range(gpus):
        lines.append(
            f'[[gpu]]\nindex = {i}\nminor = {i}\nname = "NVIDIA A100-PCIE-40GB"\n'
            f'pci_bus_id = "0000:{16 + i:02x}:00.0"\nmemory_mib = 40960\nnuma_node = {i * 2 // gpus}\n'
            "pci_device_id = 0x20f110de"
        )
    with open(path, "w") as fh:
        fh.write("\n\n".join(lines) + "\n")
    return path


def available_versions() -> list[str]:
    mounts = read_mounts("/proc/self/mounts")
    return [v for v, m in (("v1", mounts.v1_devices), ("v2", mounts.v2)) if m is not None]


def remove_tree(path: str) -> None:
    """Kill what is left below ``path`` (only our sleepers can be there) and rmdir bottom-up."""
    if not os.path.isdir(path):
        return
    for root, _dirs, _files in sorted(os.walk(path), key=lambda t: -t[0].count("/")):
        with contextlib.suppress(OSError), open(os.path.join(root, "cgroup.procs")) as fh:
            for line in fh:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(line), 9)
        for _ in range(100):
            try:
                os.rmdir(root)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)


@contextlib.contextmanager
def test_parent(version: str) -> Iterator[tuple[str, str]]:
    """(absolute path, path relative to the mount) of a fresh ``gpu-isolator-test/bench-<unique>``."""
    relative = f"{TEST_PARENT}/bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path = os.path.join(cgroup_mount(version), relative)
    os.makedirs(path)
    try:
        yield path, relative
    finally:
        remove_tree(path)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class Sleepers:
    """Long-lived ``sleep`` children, one per client, parked in ``parent`` between cycles."""

    def __init__(self, count: int, parent: str) -> None:
        self.parent = parent
        self.procs = [subprocess.Popen(["sleep", "infinity"]) for _ in range(count)]
        for proc in self.procs:
            self.park(proc.pid)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def park(self, pid: int) -> None:
        _write(os.path.join(self.parent, "cgroup.procs"), str(pid))

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def one_gpu_rules(dev_root: str, minor: int = 0) -> tuple[DeviceRule, ...]:
    """The rules the service grants a 1-GPU container on the simulated host (same pure function)."""
    return container_rules(HostDevices(dev_root).control_devices(), [minor])


# ---- statistics ----------------------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def summarize(samples: list[float], wall: float) -> dict[str, float]:
    return {
        "cycles": len(samples),
        "p50_ms": percentile(samples, 50) * 1000,
        "p99_ms": percentile(samples, 99) * 1000,
        "per_s": len(samples) / wall if wall > 0 else 0.0,
    }


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over repeated runs (runs are independent; so are their medians)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# ---- the raw floor: the syscalls alone -------------------------------------------------------------


def raw_cycles(version: str, cycles: int, dev_root: str) -> dict[str, float]:
    """mkdir, deny all + allow the rules (v1) or load and attach one program (v2), move a pid in,
    move it back, rmdir: what any isolator must do, with nothing decided at run time."""
    rules = one_gpu_rules(dev_root)
    lines = [str(r) for r in rules]
    insns = bpfprog.build_bytes(rules)
    samples: list[float] = []
    with test_parent(version) as (parent, _rel):
        sleepers = Sleepers(1, parent)
        pid = str(sleepers.pids[0])
        try:
            started = time.perf_counter()
            for i in range(cycles):
                t0 = time.perf_counter()
                path = os.path.join(parent, f"raw-{i}")
                os.mkdir(path)
                if CgroupVersion(version) is CgroupVersion.V1:
                    _write(os.path.join(path, "devices.deny"), "a")
                    for line in lines:
                        _write(os.path.join(path, "devices.allow"), line)
                else:
                    cgroup_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
                    prog_fd = bpf.prog_load(insns, "gpu_isolator")
                    bpf.prog_attach(cgroup_fd, prog_fd)
                    os.close(prog_fd)
                    os.close(cgroup_fd)
                _write(os.path.join(path, "cgroup.procs"), pid)
                _write(os.path.join(parent, "cgroup.procs"), pid)
                os.rmdir(path)
                samples.append(time.perf_counter() - t0)
            wall = time.perf_counter() - started
        finally:
            sleepers.close()
    return summarize(samples, wall)


# ---- in-process: the service without gRPC -----------------------------------------------------------


@contextlib.contextmanager
def in_process_service(version: str, host_file: str, relative_root: str, work: str) -> Iterator[Any]:
    """IsolatorService from the composition root, logging at info to a file as the daemon does."""
    from isolator.daemon.config import Config
    from isolator.daemon.main import build_service
    from isolator.model import Mode

    config = Config(
        socket=os.path.join(work, "s.sock"),
        work_dir=os.path.join(work, "work"),
        volume_root=os.path.join(work, "volumes"),
        simulate=host_file,
        mode=Mode.STANDALONE,
        cgroup_version=CgroupVersion(version),
        cgroups_root=relative_root,
    )
    handler = logging.FileHandler(os.path.join(work, "in-process.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("isolator")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    service = build_service(config)
    try:
        yield service
    finally:
        service.close()
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        handler.close()


def in_process_cycles(version: str, cycles: int, host_file: str, work: str, warmup: int = 5) -> dict[str, float]:
    from isolator.model import ContainerConfig, ContainerId, Resource

    config = ContainerConfig(resources=(Resource("gpus", 1.0),))
    samples: list[float] = []
    phases: dict[str, list[float]] = {"prepare": [], "isolate": [], "cleanup": []}
    with test_parent(version) as (parent, relative):
        sleepers = Sleepers(1, parent)
        pid = sleepers.pids[0]
        try:
            with in_process_service(version, host_file, relative, work) as service:
                started = 0.0
                for i in range(warmup + cycles):
                    if i == warmup:
                        started = time.perf_counter()
                    cid = ContainerId.parse(f"inproc-{i}")
                    t0 = time.perf_counter()
                    service.prepare(cid, config)
                    t1 = time.perf_counter()
                    service.isolate(cid, pid)
                    t2 = time.perf_counter()
                    sleepers.park(pid)
                    t3 = time.perf_counter()
                    service.cleanup(cid)
                    t4 = time.perf_counter()
                    if i >= warmup:
                        samples.append(t4 - t0)
                        phases["prepare"].append(t1 - t0)
                        phases["isolate"].append(t2 - t1)
                        phases["cleanup"].append(t4 - t3)
                wall = time.perf_counter() - started
                decisions = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    with service.core.booking.lock:  # Booking is the books' one owner (issue 34)
                        holding = service.core.booking.book("bench", Request(gpus=1))
                        decisions.append(time.perf_counter() - t0)
                        service.core.booking.free("bench", holding)
        finally:
            sleepers.close()
    out = summarize(samples, wall)
    for phase, values in phases.items():
        out[f"{phase}_p50_ms"] = statistics.median(values) * 1000
    # The topology policy's 1-GPU choice weighs every remaining pair: it grows with the host.
    out["allocator_1gpu_ms"] = statistics.median(decisions) * 1000
    return out


def durable_commit_ms(directory: str, commits: int = 100) -> float:
    """Median milliseconds of one durable state-store transaction (WAL, synchronous=FULL: an
    fsync), on the filesystem the daemon's state lives on. A cycle makes three."""
    from isolator.host.state import ContainerRecord, StateStore
    from isolator.model import ContainerId

    samples = []
    with StateStore(tempfile.mkdtemp(prefix="state-", dir=directory)) as store:
        for i in range(commits):
            cid = ContainerId.parse(f"commit-{i}")
            t0 = time.perf_counter()
            store.record(ContainerRecord(cid))
            samples.append(time.perf_counter() - t0)
            store.remove(cid)
    return statistics.median(samples) * 1000


# ---- over gRPC: the real daemon --------------------------------------------------------------------


class Client:
    """One caller with its own channel and its own sleeper."""

    def __init__(self, socket_path: str, name: str) -> None:
        import grpc

        from isolator.rpc import isolator_pb2 as pb
        from isolator.rpc import isolator_pb2_grpc as pb_grpc

        self.pb = pb
        self.name = name
        self.channel = grpc.insecure_channel("unix:" + socket_path)
        self.stub = pb_grpc.IsolatorStub(self.channel)
        self.config = pb.ContainerConfig(
            resources=[pb.Resource(name="gpus", type=pb.Value.SCALAR, scalar=pb.Value.Scalar(value=1.0), role="*")]
        )

    def cycle(self, i: int, pid: int, park: Callable[[int], None]) -> None:
        pb = self.pb
        cid = pb.ContainerID(value=f"{self.name}-{i}")
        self.stub.Prepare(pb.PrepareRequest(container_id=cid, container_config=self.config), timeout=60)
        self.stub.Isolate(pb.IsolateRequest(container_id=cid, pid=pid), timeout=60)
        park(pid)
        self.stub.Cleanup(pb.CleanupRequest(container_id=cid), timeout=60)

    def close(self) -> None:
        self.channel.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (/proc/<pid>/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(
    socket_path: str,
    sleepers: Sleepers,
    clients: int,
    cycles_each: int,
    tag: str,
    warmup: int = 2,
    daemon_pid: int | None = None,
) -> dict:
    """``clients`` threads, each running ``cycles_each`` cycles after a warm-up, started together.

    With ``daemon_pid``, also the cores the daemon and this client process kept busy meanwhile.
    """
    # Container IDs are never reused (as Mesos's UUIDs): the sidecar refuses a Prepare of an ID it
    # cleaned up (docs/reliability.md, "Stale hooks"), and the drives of one round share a daemon.
    run = uuid.uuid4().hex[:8]
    callers = [Client(socket_path, f"{tag}-{run}-c{k}") for k in range(clients)]
    samples: list[list[float]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(clients + 1)
    done = threading.Barrier(clients + 1)

    def work(k: int) -> None:
        pid = sleepers.pids[k]
        try:
            for i in range(warmup):
                callers[k].cycle(-1 - i, pid, sleepers.park)
        except BaseException as exc:  # reported after the run
            errors.append(exc)
        barrier.wait()
        try:
            if not errors:
                for i in range(cycles_each):
                    t0 = time.perf_counter()
                    callers[k].cycle(i, pid, sleepers.park)
                    samples[k].append(time.perf_counter() - t0)
        except BaseException as exc:
            errors.append(exc)
        done.wait()

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    daemon_cpu = cpu_seconds(daemon_pid) if daemon_pid else 0.0
    client_cpu = time.process_time()
    done.wait()
    wall = time.perf_counter() - started
    daemon_cpu = cpu_seconds(daemon_pid) - daemon_cpu if daemon_pid else 0.0
    client_cpu = time.process_time() - client_cpu
    for t in threads:
        t.join()
    for c in callers:
        c.close()
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed; first: {errors[0]!r}")
    out = summarize([s for per in samples for s in per], wall)
    if daemon_pid:
        out["daemon_cores"] = daemon_cpu / wall
        out["client_cores"] = client_cpu / wall
    return out


def proc_status(pid: int, key: str) -> int:
    """A number from /proc/<pid>/status: ``Threads``, or a size in KiB such as ``VmRSS``, ``VmHWM``."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} for pid {pid}")


def daemon_rss_kib(pid: int) -> int:
    return proc_status(pid, "VmRSS")


@contextlib.contextmanager
def daemon(version: str, host_file: str) -> Iterator[tuple[Any, Sleepers]]:
    """The real daemon (isolator/testing/sidecar.py) and 64 sleepers parked in its cgroups root."""
    from isolator.testing.sidecar import running_sidecar

    with running_sidecar(host_file, version) as side:
        os.makedirs(side.cgroup_parent, exist_ok=True)
        sleepers = Sleepers(HOST_GPUS, side.cgroup_parent)
        try:
            yield side, sleepers
        finally:
            sleepers.close()


# ---- the part -------------------------------------------------------------------------------------


@dataclass
class Sizes:
    repeats: int = 3
    raw_cycles: int = 400
    in_process_cycles: int = 200
    grpc_cycles: dict[int, int] | None = None  # clients -> cycles per client per run
    footprint_cycles: int = 10_000

    def grpc(self) -> dict[int, int]:
        return self.grpc_cycles or {1: 200, 8: 40, 64: 6}


def hooks(versions: list[str], sizes: Sizes, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Per cgroup version: raw floor, in-process and gRPC (per client count), each the median of
    ``sizes.repeats`` runs, and the ratios taken within each run."""
    out: dict[str, Any] = {"host_gpus": HOST_GPUS, "repeats": sizes.repeats, "cores": os.cpu_count()}
    tmp = tempfile.mkdtemp(prefix="gi-bench-hooks-", dir="/tmp")
    try:
        host_file = write_host(os.path.join(tmp, "bench-host.toml"))
        from isolator.simhost.sim import SimulatedHost

        host = SimulatedHost(host_file, os.path.join(tmp, "floorhost")).setup()
        for version in versions:
            runs: dict[str, list[dict[str, float]]] = {}
            for r in range(sizes.repeats):
                log(f"hooks {version}: run {r + 1}/{sizes.repeats}")
                raw = raw_cycles(version, sizes.raw_cycles, host.dev_root)
                work = tempfile.mkdtemp(prefix="inproc-", dir=tmp)
                inproc = in_process_cycles(version, sizes.in_process_cycles, host_file, work)
                runs.setdefault("raw", []).append(raw)
                runs.setdefault("in_process", []).append(inproc)
                with daemon(version, host_file) as (side, sleepers):
                    for clients, each in sorted(sizes.grpc().items()):
                        g = drive(side.socket, sleepers, clients, each, f"r{r}", daemon_pid=side.proc.pid)
                        g["p99_over_raw_p99"] = g["p99_ms"] / raw["p99_ms"]
                        g["p50_over_raw_p50"] = g["p50_ms"] / raw["p50_ms"]
                        g["p50_over_in_process_p50"] = g["p50_ms"] / inproc["p50_ms"]
                        g["p99_over_in_process_p99"] = g["p99_ms"] / inproc["p99_ms"]
                        runs.setdefault(f"grpc_{clients}", []).append(g)
                inproc["p50_over_raw_p50"] = inproc["p50_ms"] / raw["p50_ms"]
                inproc["p99_over_raw_p99"] = inproc["p99_ms"] / raw["p99_ms"]
            out[version] = {name: median_of(rs) for name, rs in runs.items()}
            out[version]["state_commit_ms"] = durable_commit_ms(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def footprint(
    version: str, cycles: int, clients: int = 8, log: Callable[[str], None] = lambda s: None
) -> dict[str, Any]:
    """The daemon's RSS idle (after start and one cycle per client) and after ``cycles`` cycles,
    sampled every tenth of the way, so that growth is seen as a slope rather than one difference."""
    tmp = tempfile.mkdtemp(prefix="gi-bench-rss-", dir="/tmp")
    try:
        host_file = write_host(os.path.join(tmp, "bench-host.toml"))
        with daemon(version, host_file) as (side, sleepers):
            assert side.proc is not None
            pid = side.proc.pid
            time.sleep(0.5)
            started = daemon_rss_kib(pid)
            drive(side.socket, sleepers, clients, 1, "idle", warmup=0)
            idle = daemon_rss_kib(pid)
            steps = 10
            per_step = max(1, cycles // steps // clients)
            series = [idle]
            done = 0
            for s in range(steps):
                log(f"footprint: {done:,}/{cycles:,} cycles, RSS {series[-1] / 1024:.1f} MiB")
                drive(side.socket, sleepers, clients, per_step, f"s{s}", warmup=0)
                done += per_step * clients
                series.append(daemon_rss_kib(pid))
        half = len(series) // 2
        return {
            "cgroup_version": version,
            "cycles": done,
            "rss_at_start_mib": started / 1024,
            "rss_idle_mib": idle / 1024,
            "rss_after_cycles_mib": series[-1] / 1024,
            "rss_series_mib": [round(x / 1024, 2) for x in series],
            # Growth over the second half of the run, after allocator caches and gRPC pools settle.
            "growth_second_half_mib": (series[-1] - series[half]) / 1024,
            "growth_total_mib": (series[-1] - idle) / 1024,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    import json

    quick = Sizes(repeats=1, raw_cycles=50, in_process_cycles=30, grpc_cycles={1: 20, 8: 5, 64: 1})
    print(json.dumps(hooks(available_versions(), quick, log=print), indent=2))
