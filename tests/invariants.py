"""What must hold of a sidecar on a simulated host, checked from outside: the kernel, the state file, the disk.

The kernel is asked the honest way: a probe process joins a container's cgroup and opens every GPU
node (a simulated node answers ENXIO when the cgroup lets it through, EPERM when it does not), so
v1 whitelists and v2 eBPF programs are judged by what they do. Records are read from the SQLite
file read-only. Also ``CrashableSidecar``: a ``Sidecar`` that starts with an environment (the crash
point) and waits for readiness without gRPC's reconnect backoff.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from isolator.cgroups import bpf
from isolator.daemon.crashpoints import ENV
from isolator.errors import BpfError
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing import forkserver
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import TEST_PARENT, Sidecar
from isolator.transport.server import socket_is_live

# Joins each cgroup in turn (the kernel judges an open by the cgroup the process is in at that
# moment) and opens every node there: one process for all of a check's cgroups.
PROBE = """
import errno, json, os, sys
dev_root, cgroups, names = sys.argv[1], sys.argv[2].split("\\n"), sys.argv[3:]
report = {}
for cgroup in cgroups:
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as fh:
        fh.write(str(os.getpid()))
    out = report[cgroup] = {}
    for name in names:
        try:
            os.close(os.open(os.path.join(dev_root, name), os.O_RDWR))
            out[name] = "OK"
        except OSError as exc:
            out[name] = errno.errorcode[exc.errno]
print(json.dumps(report))
"""


def scrape_unix(path: str) -> dict[str, float]:
    """The daemon's Prometheus metrics on the unix socket ``path``, as {series: value}."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(path)
        conn.sendall(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    assert head.split()[1] == b"200", head
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def watch_checks(metrics_path: str, outcome: str = "ok") -> int:
    """How many times the daemon has checked a Watch (its first check, then one per change)."""
    series = f'gpu_isolator_hook_duration_seconds_count{{hook="Watch",outcome="{outcome}"}}'
    return int(scrape_unix(metrics_path).get(series, 0))


def proc_status(pid: int, key: str) -> int:
    """A number from /proc/<pid>/status: ``Threads``, or a size in KiB such as ``VmRSS``, ``VmHWM``."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def probe_grants(cgroup: str, dev_root: str, minors: range) -> frozenset[int]:
    """GPU minors a process in ``cgroup`` may open, by trying each node."""
    return probe_each([cgroup], dev_root, minors)[cgroup]


def probe_each(cgroups: list[str], dev_root: str, minors: range) -> dict[str, frozenset[int]]:
    """Per cgroup, the GPU minors a process in it may open: one probe process visits them in turn."""
    if not cgroups:
        return {}
    names = [f"nvidia{m}" for m in minors]
    out = subprocess.run(
        ["/usr/bin/python3", "-I", "-S", "-c", PROBE, dev_root, "\n".join(cgroups), *names],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        raise AssertionError(f"probe in {cgroups} failed: {out.stderr}")
    report = json.loads(out.stdout)
    granted = {}
    for cgroup in cgroups:
        opens = report[cgroup]
        unexpected = {n: e for n, e in opens.items() if e not in ("ENXIO", "EPERM")}
        assert not unexpected, f"probe in '{cgroup}': unexpected results {unexpected}"
        granted[cgroup] = frozenset(m for m in minors if opens[f"nvidia{m}"] == "ENXIO")
    return granted


def read_records(work: str) -> dict[str, frozenset[int]]:
    """Top-level container value -> recorded GPU minors, from the state file (read-only)."""
    path = os.path.join(work, "state", "allocations.sqlite3")
    if not os.path.exists(path):
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        held: dict[str, set[int]] = {}
        for minor, key in db.execute("SELECT minor, container FROM allocation"):
            held.setdefault(key, set()).add(minor)
        out = {}
        for (key,) in db.execute("SELECT key FROM container"):
            chain = json.loads(key)
            out[".".join(chain)] = frozenset(held.get(key, ()))
        return out
    finally:
        db.close()


def attached_programs(cgroup: str) -> tuple[int, ...]:
    fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return bpf.prog_query(fd, cgroup)
    finally:
        os.close(fd)


def program_exists(prog_id: int) -> bool:
    try:
        fd = bpf.prog_fd_by_id(prog_id)
    except BpfError as exc:
        cause = exc.__cause__
        if isinstance(cause, OSError) and cause.errno == errno.ENOENT:
            return False
        raise
    os.close(fd)
    return True


@dataclass
class Observer:
    """Checks one sidecar's invariants; remembers every eBPF program it saw on our cgroups."""

    sidecar: Sidecar
    gpus: int
    programs: set[int] = field(default_factory=set)

    def cgroups(self) -> dict[str, str]:
        parent = self.sidecar.cgroup_parent
        if not os.path.isdir(parent):
            return {}
        return {
            name: os.path.join(parent, name)
            for name in sorted(os.listdir(parent))
            if os.path.isdir(os.path.join(parent, name))
        }

    def problems(self) -> list[str]:
        """Every violation of: no GPU granted to two containers; kernel grants == records for every
        recorded container (so no record lacks its rules); an unrecorded cgroup grants nothing."""
        out = []
        records = read_records(self.sidecar.work)
        owner: dict[int, str] = {}
        cgroups = self.cgroups()
        grants = probe_each(list(cgroups.values()), self.sidecar.dev_root, range(self.gpus))
        for name, path in cgroups.items():
            if self.sidecar.cgroup_version == "v2":
                self.programs.update(attached_programs(path))
            granted = grants[path]
            for minor in granted:
                if minor in owner:
                    out.append(f"GPU {minor} is granted to both {owner[minor]} and {name}")
                owner[minor] = name
            recorded = records.get(name)
            if recorded is None and granted:
                out.append(f"cgroup {name} has no record but the kernel grants GPUs {sorted(granted)}")
            elif recorded is not None and granted != recorded:
                out.append(f"container {name}: recorded GPUs {sorted(recorded)}, kernel grants {sorted(granted)}")
        for name, recorded in records.items():
            if name not in cgroups:
                out.append(f"container {name} records GPUs {sorted(recorded)} but has no cgroup (no rules)")
        return out

    def leftovers(self, timeout: float = 60.0) -> list[str]:
        """What is left of ours once every container is cleaned up (empty when nothing is)."""
        work = self.sidecar.work
        out = []
        if records := read_records(work):
            out.append(f"state entries left: {sorted(records)}")
        if cgroups := self.cgroups():
            out.append(f"cgroups left: {sorted(cgroups)}")
        checkpoints = [os.path.join(r, f) for r, _d, files in os.walk(os.path.join(work, "devices")) for f in files]
        if checkpoints:
            out.append(f"v2 checkpoints left: {checkpoints}")
        volume_root = os.path.join(work, "volumes")
        users_root = os.path.join(volume_root, ".users")
        users = [os.path.join(r, f) for r, _d, files in os.walk(users_root) for f in files]
        if users:
            out.append(f"volume users left: {users}")
        if os.path.isdir(volume_root):
            temp = [n for n in os.listdir(volume_root) if ".tmp-" in n or ".trash-" in n]
            if temp:
                out.append(f"temporary volume directories left: {temp}")
        # Programs are freed once their cgroup is released, which the kernel does asynchronously.
        deadline = time.monotonic() + timeout
        alive = set(self.programs)
        while alive and time.monotonic() < deadline:
            alive = {p for p in alive if program_exists(p)}
            if alive:
                time.sleep(0.1)
        if alive:
            out.append(f"eBPF programs still loaded: {sorted(alive)}")
        return out


class CrashableSidecar(Sidecar):
    """A Sidecar started with extra environment (the crash point), ready as soon as it answers."""

    env: dict[str, str] = {}  # replaced per start, never mutated

    def start(self, timeout: float = 60) -> CrashableSidecar:
        self.log_path = os.path.join(self.work, "sidecar.log")
        if self._log is None:
            self._log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        log = self._log.fileno()  # type: ignore[attr-defined]
        self.proc = forkserver.spawn(self.argv(), {**os.environ, **self.env}, log, log)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the sidecar exited {self.proc.returncode}: {self.log()}")
            if self.ready():
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar did not start: {self.log()}")
            time.sleep(0.02)

    def ready(self) -> bool:
        with contextlib.suppress(OSError):
            if socket_is_live(self.socket):
                with grpc.insecure_channel(self.address) as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
                    return reply.status == health_pb2.HealthCheckResponse.SERVING
        return False

    def died(self, timeout: float = 10.0) -> int | None:
        """The exit status if the daemon is dead or dies within ``timeout``; None if it lives on."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


@contextlib.contextmanager
def quick_sidecar(
    host: str = "dgx-1", cgroup_version: str = "v1", extra: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Iterator[CrashableSidecar]:
    """``running_sidecar`` with the quick readiness wait; removes its work dir and cgroups after.
    ``env``: the first start's extra environment (a crash point), so that no start is spent without it."""
    work = tempfile.mkdtemp(prefix="gi-", dir="/tmp")
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sidecar = CrashableSidecar(work=work, host=host, cgroup_version=cgroup_version, cgroups_root=root, extra=extra)
    sidecar.env = env or {}
    try:
        yield sidecar.start()
    finally:
        sidecar.stop()
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class Recovered:
    """A sidecar restarted after a SIGKILL at a crash point, recovered as the agent does."""

    isolator: GrpcIsolator  # reconnected to the restarted daemon
    containerizer: Containerizer
    admin: pb_grpc.AdminStub
    listed: list[str]  # the containers the sidecar lists after recovery


@contextlib.contextmanager
def killed_and_recovered(
    host: str, cgroup_version: str, point: str, config: Any, extra: tuple[str, ...] = (), update: Any = None
) -> Iterator[Recovered]:
    """The crash tests' common part: container "crashy" prepared (``config(containerizer)``), updated
    (``update(isolator, crashy)``, when given) and cleaned up with the daemon set to die at ``point``;
    the daemon must die there. It is started again
    and Recover called, as the agent does; then the records and the kernel must agree (the
    consistency health check), and a "crashy" still listed has rules that agree with its record.
    The caller checks what is particular to its resource (nothing lost, nothing granted twice)."""
    with quick_sidecar(host, cgroup_version, extra=extra, env={ENV: f"{point}:1"}) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        crashy = container_id("crashy")
        try:
            isolator.prepare(crashy, config(containerizer))
            if update is not None:
                update(isolator, crashy)
            isolator.cleanup(crashy)
        except HookFailed:
            pass
        assert sidecar.died(timeout=10) is not None, f"the daemon did not die at {point}"
        sidecar.env = {}
        sidecar.start()
        isolator.__init__(sidecar.socket)
        isolator.recover([], [])
        channel = grpc.insecure_channel(sidecar.address)
        admin = pb_grpc.AdminStub(channel)
        try:
            health = {c.name: (c.ok, c.detail) for c in admin.Health(pb.HealthRequest(), timeout=10).checks}
            assert health["consistency"][0], health["consistency"][1]
            listed = [c.id for c in admin.ListContainers(pb.ListContainersRequest(), timeout=10).containers]
            if "crashy" in listed:
                described = admin.DescribeContainer(
                    pb.DescribeContainerRequest(container_id=pb.ContainerID(value="crashy")), timeout=10
                )
                assert described.rules_agree, described
            yield Recovered(isolator, containerizer, admin, listed)
        finally:
            channel.close()
            isolator.close()
