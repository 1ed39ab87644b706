"""Operator-facing outputs of a running daemon: Prometheus metrics (unix socket and TCP), dcgm-exporter's
HPC job mapping kept exact across a crash, and JSON logs with the container on every hook line."""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import time

import pytest

from isolator.daemon.logfmt import KEYS
from isolator.exporters.metrics import parse_address
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import running_sidecar

pytestmark = [pytest.mark.root, pytest.mark.cgroup_v1]


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def scrape(conn: http.client.HTTPConnection) -> dict[str, float]:
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200
    text = response.read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_metrics_on_a_unix_socket_count_gpus_holdings_hooks_errors_and_volume_builds(short_tmp):
    path = os.path.join(short_tmp, "metrics.sock")
    with running_sidecar("dgx-1", "v1", extra=("--metrics-address", f"unix:{path}")) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        try:
            isolator.prepare(container_id("m1"), containerizer.config(gpus=2, image=True))
            with pytest.raises(HookFailed):
                isolator.prepare(container_id("m1"), containerizer.config(gpus=2, image=False))
            m = scrape(_UnixHTTP(path))
            assert m["gpu_isolator_gpus"] == 8
            assert m["gpu_isolator_gpus_used"] == 2
            assert m["gpu_isolator_gpus_healthy"] == 8
            assert m['gpu_isolator_container_gpus{container_id="m1"}'] == 2
            assert m['gpu_isolator_hook_duration_seconds_count{hook="Prepare",outcome="ok"}'] == 1
            assert m['gpu_isolator_hook_duration_seconds_count{hook="Prepare",outcome="error"}'] == 1
            assert m['gpu_isolator_errors_total{code="ALREADY_EXISTS",hook="Prepare"}'] == 1
            assert m["gpu_isolator_volume_builds_total"] == 1
            sidecar.sim.inject_xid(0, 79)
            _until(lambda: scrape(_UnixHTTP(path))["gpu_isolator_gpus_healthy"] == 7)
            uuid = sidecar.sim.spec.gpus[0].uuid
            healthy = [(lbl, v) for n, lbl, v in series(_UnixHTTP(path)) if n == "gpu_isolator_gpu_healthy"]
            assert [v for lbl, v in healthy if lbl["UUID"] == uuid and lbl["gpu"] == "0"] == [0]
        finally:
            isolator.cleanup(container_id("m1"))
            isolator.close()
    assert not os.path.exists(path), "the metrics socket is removed at stop"


def series(conn: http.client.HTTPConnection) -> list[tuple[str, dict[str, str], float]]:
    """Every sample as (name, labels, value), labels parsed whatever their order."""
    out = []
    for key, value in scrape(conn).items():
        name, _, rest = key.partition("{")
        labels = dict(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', rest))
        out.append((name, labels, value))
    return out


def test_build_info_process_metrics_health_checks_and_the_dcgm_uuid_label(short_tmp):
    from isolator import __version__

    path = os.path.join(short_tmp, "metrics.sock")
    with running_sidecar("dgx-1", "v1", extra=("--metrics-address", f"unix:{path}")) as sidecar:
        samples = series(_UnixHTTP(path))
    values = {(n, tuple(sorted(lbl.items()))): v for n, lbl, v in samples}
    assert values[("gpu_isolator_build_info", (("version", __version__),))] == 1
    # prometheus-client's ProcessCollector on the daemon's own registry: restarts show as a new start time.
    names = {n for n, _, _ in samples}
    for name in ("process_start_time_seconds", "process_resident_memory_bytes", "process_open_fds"):
        assert name in names, name
    start = values[("process_start_time_seconds", ())]
    assert time.time() - 600 < start <= time.time()
    # dcgm-exporter names the GPU UUID label "UUID": the same name lets PromQL join without label_replace.
    healthy = [lbl for n, lbl, _ in samples if n == "gpu_isolator_gpu_healthy"]
    assert len(healthy) == 8 and all(set(lbl) == {"gpu", "UUID", "minor", "modelName", "pci_bus_id"} for lbl in healthy)
    assert {lbl["UUID"] for lbl in healthy} == {g.uuid for g in sidecar.sim.spec.gpus}
    # The sidecar's own health checks (as `gpu-isolator health`), one series per check.
    checks = {lbl["check"]: v for n, lbl, v in samples if n == "gpu_isolator_health_check"}
    assert checks == {"nvml": 1, "cgroups": 1, "state": 1, "consistency": 1, "handover": 1, "maintenance": 1, "mps": 1}


def test_metrics_count_mig_devices_per_resource_and_their_holders(short_tmp):
    path = os.path.join(short_tmp, "metrics.sock")
    with running_sidecar("dgx-a100", "v1", extra=("--metrics-address", f"unix:{path}")) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        config = containerizer.config(gpus=None, image=False)
        config["resources"].append({"name": "mig-1g.5gb", "type": "SCALAR", "scalar": {"value": 2}, "role": "*"})
        try:
            isolator.prepare(container_id("mig2"), config)
            m = scrape(_UnixHTTP(path))
            assert m['gpu_isolator_mig_devices{resource="mig-1g.5gb"}'] == 8
            assert m['gpu_isolator_mig_devices{resource="mig-3g.20gb"}'] == 3
            assert m['gpu_isolator_mig_devices_used{resource="mig-1g.5gb"}'] == 2
            assert m['gpu_isolator_mig_devices_used{resource="mig-3g.20gb"}'] == 0
            assert m['gpu_isolator_container_mig_devices{container_id="mig2"}'] == 2
            assert m['gpu_isolator_container_gpus{container_id="mig2"}'] == 0
            assert m["gpu_isolator_gpus_used"] == 0
        finally:
            isolator.cleanup(container_id("mig2"))
            isolator.close()


def test_gpus_and_gpus_used_count_as_the_agent_counts_its_gpus_resource_not_the_shared_gpus(short_tmp):
    # The agent's gpus (slave/gpus_total, slave/gpus_used) holds the GPUs that are neither shared nor
    # in MIG mode (`gpu-isolator resources`): a shared GPU with sharers is not a used GPU to it.
    path = os.path.join(short_tmp, "metrics.sock")
    extra = ("--metrics-address", f"unix:{path}", "--shared-gpus", "4-7:4:time-slice")
    with running_sidecar("dgx-1", "v1", extra=extra) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        config = containerizer.config(gpus=None, image=False)
        config["resources"].append({"name": "gpu-share-4", "type": "SCALAR", "scalar": {"value": 1}, "role": "*"})
        try:
            isolator.prepare(container_id("s1"), config)
            isolator.prepare(container_id("w1"), containerizer.config(gpus=1, image=False))
            m = scrape(_UnixHTTP(path))
            assert (m["gpu_isolator_gpus"], m["gpu_isolator_gpus_used"]) == (4, 1)
            assert m["gpu_isolator_gpus_healthy"] == 8, "health is every managed GPU's"
        finally:
            for name in ("s1", "w1"):
                isolator.cleanup(container_id(name))
            isolator.close()


def test_metrics_on_localhost_tcp_when_only_a_port_is_given(short_tmp):
    with running_sidecar("single", "v1", extra=("--metrics-address", "0")) as sidecar:
        match = re.search(r"metrics on (127\.0\.0\.1):(\d+)", sidecar.log())
        assert match, sidecar.log()
        m = scrape(http.client.HTTPConnection(match.group(1), int(match.group(2)), timeout=10))
        assert m["gpu_isolator_gpus"] == 1 and m["gpu_isolator_gpus_used"] == 0


@pytest.mark.parametrize("value", ["localhost:http", "unix:relative.sock", "70000", "host:"])
def test_bad_metrics_addresses_are_refused(value):
    from isolator.errors import ConfigError

    with pytest.raises(ConfigError, match="--metrics-address"):
        parse_address(value)


def test_a_bare_port_means_localhost_and_ipv6_is_accepted():
    assert parse_address("9400") == ("tcp", ("127.0.0.1", 9400))
    assert parse_address(":9400") == ("tcp", ("", 9400))  # every interface, as Go exporters read it
    assert parse_address("[::1]:9400") == ("tcp", ("::1", 9400))
    assert parse_address("unix:/run/gi/metrics.sock") == ("unix", "/run/gi/metrics.sock")


def _mapping(directory: str) -> dict[str, list[str]]:
    return {n: open(os.path.join(directory, n)).read().split() for n in sorted(os.listdir(directory))}


def test_job_mapping_lists_each_gpus_containers_and_is_exact_after_a_crash(short_tmp):
    jobs = os.path.join(short_tmp, "jobs")
    work = os.path.join(short_tmp, "w")
    os.makedirs(work)
    with running_sidecar("dgx-a100", "v1", extra=("--job-mapping-dir", jobs), work=work) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        isolator.prepare(container_id("j1"), containerizer.config(gpus=1, image=False))
        isolator.prepare(container_id("j2"), containerizer.config(gpus=2, image=False))
        config = containerizer.config(gpus=None, image=False)
        config["resources"].append({"name": "mig-1g.5gb", "type": "SCALAR", "scalar": {"value": 1}, "role": "*"})
        isolator.prepare(container_id("j3"), config)
        listed = _mapping(jobs)
        # dgx-a100: GPUs 0-3 have MIG devices: one file per GPU instance, as <index>.<instance>.
        migs = {f"{g.index}.{m.gpu_instance}" for g in sidecar.sim.spec.gpus for m in g.mig_devices}
        assert len(migs) == 15 and set(listed) == {str(i) for i in range(8)} | migs
        assert sum(1 for n, ids in listed.items() if ids == ["j1"] and "." not in n) == 1
        assert sum(1 for n, ids in listed.items() if ids == ["j2"] and "." not in n) == 2
        # A MIG unit (the placement's first 1g.5gb: GPU 1, instance 7): its file and its GPU's.
        assert [n for n, ids in listed.items() if ids == ["j3"]] == ["1", "1.7"]
        isolator.cleanup(container_id("j3"))
        isolator.cleanup(container_id("j1"))
        assert sum(1 for ids in _mapping(jobs).values() if ids == ["j1"]) == 0
        before = _mapping(jobs)
        sidecar.kill()  # a crash: nothing cleaned
        isolator.close()
    # While it was down, someone (or a half-written run) left the directory wrong.
    with open(os.path.join(jobs, "5"), "w") as fh:
        fh.write("ghost\n")
    with open(os.path.join(jobs, "12"), "w") as fh:
        fh.write("ghost\n")
    with open(os.path.join(jobs, "README"), "w") as fh:
        fh.write("not ours\n")
    with running_sidecar("dgx-a100", "v1", extra=("--job-mapping-dir", jobs), work=work):
        after = _mapping(jobs)
        assert after.pop("README") == ["not", "ours"]
        assert after == before


def test_json_logs_are_one_object_per_line_with_stable_keys_and_the_container_on_hook_lines(short_tmp):
    with running_sidecar("dgx-1", "v1", extra=("--log-format", "json", "--log-level", "debug")) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        try:
            isolator.prepare(container_id(["outer", "inner"]), containerizer.config(gpus=1, image=True))
        except HookFailed:
            pass  # a nested container without its parent is refused: a hook line all the same
        isolator.prepare(container_id("logged"), containerizer.config(gpus=1, image=True))
        isolator.cleanup(container_id("logged"))
        isolator.close()
        with open(sidecar.log_path) as fh:
            lines = [line for line in fh.read().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all(tuple(e) == KEYS for e in entries)
    hook_lines = [e for e in entries if e["hook"]]
    assert hook_lines and all(e["container_id"] for e in hook_lines)
    assert {e["container_id"] for e in hook_lines} >= {"logged", "outer.inner"}
    assert any(e["hook"] == "Prepare" and e["container_id"] == "logged" for e in entries)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", e["time"]) for e in entries)


def test_serve_refuses_a_bad_metrics_address_with_one_line(short_tmp):
    argv = [sys.executable, "-m", "isolator", "serve", "--socket", os.path.join(short_tmp, "s.sock")]
    argv += ["--work-dir", short_tmp, "--simulate", "single", "--metrics-address", "localhost:http"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 78  # EX_CONFIG
    assert "--metrics-address 'localhost:http'" in result.stderr and "Traceback" not in result.stderr


class Counted:
    """One daemon on the single-GPU host with metrics, the job mapping and JSON logs, shared by the tests
    of refused and bridged calls: each reads the counters' growth over its own calls, and its own log lines."""

    def __init__(self, sidecar, metrics: str, jobs: str) -> None:
        self.sidecar, self.metrics, self.jobs = sidecar, metrics, jobs

    def scrape(self) -> dict[str, float]:
        return scrape(_UnixHTTP(self.metrics))

    def growth(self, before: dict[str, float], series: str) -> float:
        return self.scrape().get(series, 0.0) - before.get(series, 0.0)

    def log_size(self) -> int:
        return os.path.getsize(self.sidecar.log_path)

    def log_since(self, offset: int) -> list[dict]:
        with open(self.sidecar.log_path) as fh:
            fh.seek(offset)
            return [json.loads(line) for line in fh.read().splitlines() if line.strip()]


# Module-scoped: under xdist, their users share one worker, so it starts once (conftest.py).
SHARED_FIXTURES = ("counted",)


@pytest.fixture(scope="module")
def counted():
    import tempfile

    directory = tempfile.mkdtemp(prefix="gi-", dir="/tmp")
    metrics, jobs = os.path.join(directory, "metrics.sock"), os.path.join(directory, "jobs")
    flags = ("--metrics-address", f"unix:{metrics}", "--job-mapping-dir", jobs, "--log-format", "json")
    try:
        with running_sidecar("single", "v1", extra=flags) as sidecar:
            yield Counted(sidecar, metrics, jobs)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


PREPARE_OK = 'gpu_isolator_hook_duration_seconds_count{hook="Prepare",outcome="ok"}'
PREPARE_ERROR = 'gpu_isolator_hook_duration_seconds_count{hook="Prepare",outcome="error"}'
PREPARE_INVALID = 'gpu_isolator_errors_total{code="INVALID_ARGUMENT",hook="Prepare"}'


def test_calls_over_the_command_module_bridge_are_measured_and_mapped_too(counted):
    from isolator.bridge.command import install
    from isolator.testing.mesos import BridgeIsolator

    sidecar, jobs = counted.sidecar, counted.jobs
    bridge_dir = os.path.join(sidecar.work, "bridge")
    install(bridge_dir, sidecar.bridge_socket)
    isolator = BridgeIsolator(bridge_dir, sidecar.work)
    containerizer = Containerizer(isolator, sidecar.work)
    before = counted.scrape()
    isolator.prepare(container_id("bridged"), containerizer.config(gpus=1, image=False))
    assert _mapping(jobs) == {"0": ["bridged"]}
    assert counted.growth(before, PREPARE_OK) == 1
    isolator.cleanup(container_id("bridged"))
    assert _mapping(jobs) == {"0": []}
    isolator.close()


def _bridge_call(path: str, method: bytes, payload: bytes) -> bytes:
    from isolator.transport.bridge import PROTOCOL

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(path)
        conn.sendall(PROTOCOL + b" " + method + b" 10000\n" + payload)
        conn.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_bridge_input_refused_before_the_hook_is_counted_and_logged_with_its_container(counted):
    """An agent whose JSON the bridge cannot take (another Mesos version's shape) fails every call with
    INVALID_ARGUMENT before the hook runs: that must show in gpu_isolator_errors_total and on a log
    line carrying the hook and the container, like every other refusal."""
    before, offset = counted.scrape(), counted.log_size()
    payload = json.dumps({"container_id": {"value": "refused-1"}, "container_config": 5}).encode()
    reply = _bridge_call(counted.sidecar.bridge_socket, b"prepare", payload)
    assert reply.startswith(b"ERROR INVALID_ARGUMENT"), reply
    assert counted.growth(before, PREPARE_INVALID) == 1, counted.scrape()
    assert counted.growth(before, PREPARE_ERROR) == 1, counted.scrape()
    entries = counted.log_since(offset)
    refused = [e for e in entries if "refused" in e["message"]]
    assert refused and all(e["hook"] == "Prepare" and e["container_id"] == "refused-1" for e in refused), refused


def test_grpc_requests_refused_as_malformed_are_counted_too(counted):
    """Bytes that are not the method's message are INVALID_ARGUMENT before the servicer runs; like
    every other answered error they belong in gpu_isolator_errors_total."""
    import grpc

    before = counted.scrape()
    with grpc.insecure_channel(counted.sidecar.address) as channel:
        call = channel.unary_unary("/gpuisolator.v1.Isolator/Prepare")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as caught:
            call(b"\x0a\x05\x0a", timeout=10)  # a length past the end: truncated
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert counted.growth(before, PREPARE_INVALID) == 1, counted.scrape()


def test_job_mapping_temporary_files_left_by_a_crash_mid_write_are_removed_at_start(short_tmp):
    """Each file is written as a temporary file then renamed; a SIGKILL between the two leaves the
    temporary file behind, and nothing else would ever remove it."""
    jobs = os.path.join(short_tmp, "jobs")
    os.makedirs(jobs)
    with open(os.path.join(jobs, ".tmp-k3x9q_1"), "w") as fh:
        fh.write("half-written\n")
    with open(os.path.join(jobs, ".hidden-not-ours"), "w") as fh:
        fh.write("x\n")
    with running_sidecar("single", "v1", extra=("--job-mapping-dir", jobs)):
        assert sorted(os.listdir(jobs)) == [".hidden-not-ours", "0"]


def test_job_mapping_follows_a_mig_mode_change_without_waiting_for_a_hook(short_tmp):
    """Files are named by GPU and by MIG GPU instance: when MIG is turned off on a GPU its instance
    files must go (and dcgm-exporter stop labelling instances that no longer exist) as soon as the
    inventory has read the change, not at the next Prepare or Cleanup."""
    jobs = os.path.join(short_tmp, "jobs")
    with running_sidecar("dgx-a100", "v1", extra=("--job-mapping-dir", jobs)) as sidecar:
        assert any(n.startswith("0.") for n in os.listdir(jobs))
        sidecar.sim.set_mig_mode(0, False)
        _until(lambda: not any(n.startswith("0.") for n in os.listdir(jobs)))
        assert "0" in os.listdir(jobs)


def test_counters_with_known_labels_are_exported_as_zero_before_anything_happens():
    """Prometheus's "avoid missing metrics": a series that appears only on its first repair makes
    rate() and alerts on it blind until then. Both reconciliation kinds are known in advance."""
    from prometheus_client import generate_latest

    from isolator.exporters.metrics import Metrics

    text = generate_latest(Metrics().registry).decode()
    assert 'gpu_isolator_reconciliation_repairs_total{kind="recover"} 0.0' in text
    assert 'gpu_isolator_reconciliation_repairs_total{kind="reap"} 0.0' in text
    assert 'gpu_isolator_reconciliation_repairs_total{kind="audit"} 0.0' in text


@pytest.mark.xdist_group("measures")  # reads a process's memory or threads: its own worker, one at a time
def test_idle_metrics_connections_are_bounded_and_time_out(short_tmp, monkeypatch):
    """The metrics endpoint answers anyone who can connect (on TCP: any local user). Connections that
    send nothing must neither pile up a thread each without bound nor be held forever."""
    import threading

    from isolator.exporters import metrics as metrics_mod

    # Long enough that no held connection times out while the others are still being turned away
    # (on a loaded machine that can take a while), short enough for the test to wait for it.
    monkeypatch.setattr(metrics_mod, "IO_TIMEOUT_S", 3.0)
    path = os.path.join(short_tmp, "m.sock")
    server = metrics_mod.MetricsServer(f"unix:{path}", metrics_mod.Metrics()).start()
    before = threading.active_count()
    idle = []
    try:
        for _ in range(3 * metrics_mod.MAX_CONNECTIONS):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            idle.append(conn)
        # Threads are counted until the server has dealt with every connection, i.e. until those
        # over the cap are closed (readable: nothing is ever sent to them but the end of the stream).
        closed: set[socket.socket] = set()
        deadline = time.monotonic() + 60
        while True:
            assert threading.active_count() - before <= metrics_mod.MAX_CONNECTIONS + 1
            if len(closed) >= 2 * metrics_mod.MAX_CONNECTIONS:
                break
            assert time.monotonic() < deadline, f"only {len(closed)} connections over the cap were closed"
            ready, _, _ = select.select([c for c in idle if c not in closed], [], [], 0.05)
            closed.update(ready)
        held = next(c for c in idle if c not in closed)
        held.settimeout(60)
        assert held.recv(1) == b""  # closed by the server after its timeout
        _until(lambda: threading.active_count() - before <= 1)
        assert "gpu_isolator_volume_builds_total" in str(scrape(_UnixHTTP(path)))
    finally:
        for conn in idle:
            conn.close()
        server.stop()


def test_drift_repaired_by_the_audit_is_counted(short_tmp):
    import grpc

    from isolator.rpc import isolator_pb2 as pb
    from isolator.rpc import isolator_pb2_grpc as pb_grpc

    path = os.path.join(short_tmp, "metrics.sock")
    with running_sidecar("dgx-1", "v1", extra=("--metrics-address", f"unix:{path}")) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        try:
            isolator.prepare(container_id("drifty"), containerizer.config(gpus=1, image=False))
            for minor in range(8):  # every GPU revoked behind the sidecar's back
                with open(os.path.join(sidecar.cgroup_parent, "drifty", "devices.deny"), "w") as fh:
                    fh.write(f"c 195:{minor} rwm")
            with grpc.insecure_channel(sidecar.address) as ch:
                report = pb_grpc.AdminStub(ch).Audit(pb.AuditRequest(), timeout=30)
            assert len(report.repaired) == 1 and report.repairs_total == 1
            assert scrape(_UnixHTTP(path))['gpu_isolator_reconciliation_repairs_total{kind="audit"}'] == 1
        finally:
            isolator.cleanup(container_id("drifty"))
            isolator.close()


# ---- what dcgm-exporter reads from the job mapping (NVIDIA/dcgm-exporter transformation/hpc.go) -----
# Up to 4.5.2-4.8.1 it keeps file names that strconv.Atoi parses and labels every metric, a MIG
# device's included, by its GPU's file. From 4.5.3-4.8.2 (PR #602) it keeps names matching
# ^\d+(\.\d+)?$ (Go: ASCII digits) and labels a MIG device's metrics from <gpu>.<NVML GPU instance ID>
# only, whole-GPU metrics from <gpu>. One line per job; an empty file adds no label.


def _dcgm_hpc_jobs(directory: str, gpu: int, gpu_instance: int | None = None, *, mig_files: bool = True) -> list[str]:
    """The hpc_job values dcgm-exporter gives one metric: a GPU's, or a MIG device's (gpu_instance)."""
    keep = re.compile(r"^[0-9]+(\.[0-9]+)?$" if mig_files else r"^[+-]?[0-9]+$")
    files = {n for n in os.listdir(directory) if keep.match(n) and os.path.isfile(os.path.join(directory, n))}
    key = f"{gpu}.{gpu_instance}" if mig_files and gpu_instance is not None else str(gpu)
    if key not in files:
        return []
    with open(os.path.join(directory, key)) as fh:
        return fh.read().splitlines()


def test_dcgm_exporter_labels_each_mig_device_and_gpu_with_its_holders_from_our_files(short_tmp):
    jobs = os.path.join(short_tmp, "jobs")
    with running_sidecar("dgx-a100", "v1", extra=("--job-mapping-dir", jobs)) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        try:
            isolator.prepare(container_id("whole"), containerizer.config(gpus=1, image=False))
            config = containerizer.config(gpus=None, image=False)
            config["resources"].append({"name": "mig-1g.5gb", "type": "SCALAR", "scalar": {"value": 1}, "role": "*"})
            isolator.prepare(container_id("unit"), config)
            (whole,) = [int(n) for n in os.listdir(jobs) if "." not in n and _mapping(jobs)[n] == ["whole"]]
            (held,) = [n for n in os.listdir(jobs) if "." in n and _mapping(jobs)[n] == ["unit"]]
            gpu, gi = (int(x) for x in held.split("."))
            others = [m.gpu_instance for g in sidecar.sim.spec.gpus if g.index == gpu for m in g.mig_devices]
            others = [i for i in others if i != gi]
            # dcgm-exporter from 4.5.3-4.8.2: each MIG device's metrics carry its own holder only.
            assert _dcgm_hpc_jobs(jobs, gpu, gi) == ["unit"]
            assert others and all(_dcgm_hpc_jobs(jobs, gpu, i) == [] for i in others)
            assert _dcgm_hpc_jobs(jobs, gpu) == ["unit"], "the GPU's own metrics: everyone with work on it"
            assert _dcgm_hpc_jobs(jobs, whole) == ["whole"]
            # Older dcgm-exporter: MIG devices are labelled by their GPU's file, so all of GPU 1's.
            assert all(_dcgm_hpc_jobs(jobs, gpu, i, mig_files=False) == ["unit"] for i in [gi, *others])
        finally:
            for name in ("unit", "whole"):
                isolator.cleanup(container_id(name))
            isolator.close()


def test_job_mapping_leaves_files_alone_whose_names_are_not_ascii_numbers(short_tmp):
    """dcgm-exporter (Go's \\d) reads ASCII digits only: a file named with other digits is not a
    mapping file, so it is somebody else's and stays."""
    jobs = os.path.join(short_tmp, "jobs")
    os.makedirs(jobs)
    for name in ("\u0663", "1.\u0664", "\uff15"):  # Arabic-Indic 3, "1.<Arabic-Indic 4>", fullwidth 5
        with open(os.path.join(jobs, name), "w") as fh:
            fh.write("theirs\n")
    with running_sidecar("single", "v1", extra=("--job-mapping-dir", jobs)):
        left = sorted(os.listdir(jobs))
    assert left == sorted(["0", "\u0663", "1.\u0664", "\uff15"])


def test_draining_gpus_are_exported_with_their_state_and_age():
    from prometheus_client import generate_latest

    from isolator.exporters.metrics import Metrics
    from isolator.model import ContainerConfig, ContainerId, Resource
    from isolator.testing import fake_service

    rig = fake_service("dgx-1")
    rig.service.prepare(ContainerId("a"), ContainerConfig(resources=(Resource("gpus", 8.0),)))
    rig.inventory.start_process(3, 33)
    rig.service.cleanup(ContainerId("a"))
    text = generate_latest(Metrics(rig.service).registry).decode()
    uuid = rig.service.list_gpus().gpus[3].uuid
    assert "gpu_isolator_gpus_held_for_handover 1.0" in text
    gpu3 = f'UUID="{uuid}",gpu="3",minor="3",modelName="Tesla V100-SXM2-16GB",pci_bus_id="00000000:'
    assert re.search(rf'gpu_isolator_gpu_held_for_handover\{{{gpu3}[0-9A-F:.]+",state="draining"\}} 1.0', text)
    assert re.search(r'gpu="2",minor="2",modelName="[^"]+",pci_bus_id="[^"]+",state="free"', text)
    assert f"gpu_isolator_gpu_held_for_handover_seconds{{{gpu3}" in text
    ages = [line for line in text.splitlines() if line.startswith("gpu_isolator_gpu_held_for_handover_seconds{")]
    assert len(ages) == 1 and 'gpu="3"' in ages[0], "only the draining GPU has an age"
