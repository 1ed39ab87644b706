"""The shipped alert rules and Grafana dashboard: promtool accepts the rules and their unit tests
(where promtool is installed: Debian's ``prometheus`` package), and every metric and label they name
is one a real daemon exports (scraped from a sidecar on the simulated DGX A100)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from importlib.resources import files

import grpc
import paths
import pytest

from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import running_sidecar

RULES = str(files("isolator").joinpath("data/prometheus-rules.yml"))
DASHBOARD = str(files("isolator").joinpath("data/grafana-dashboard.json"))
RULES_TEST = os.path.join(paths.DATA, "prometheus-rules-test.yml")
# Series and labels Prometheus itself adds to every scrape target, not the daemon.
SCRAPE_SERIES = {"up"}
TARGET_LABELS = {"job", "instance"}


def _admin_gpus(sidecar) -> list:
    with grpc.insecure_channel(sidecar.address) as ch:
        return list(pb_grpc.AdminStub(ch).ListGpus(pb.ListGpusRequest(), timeout=30).gpus)


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("[promtool] not installed: apt-get install prometheus (Debian) provides it; rules NOT checked")
    return path


def rule_exprs(path: str = RULES) -> list[str]:
    """The ``expr`` of every rule, folded (``>-``) ones joined, read without a YAML library."""
    with open(path) as fh:
        lines = fh.read().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)expr:\s*(.*)$", line)
        if not m:
            continue
        indent, value = len(m.group(1)), m.group(2).strip()
        if value in (">-", ">", "|", "|-"):
            parts = []
            for nxt in lines[i + 1 :]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                parts.append(nxt.strip())
            value = " ".join(p for p in parts if p)
        out.append(value)
    return out


def dashboard_exprs(path: str = DASHBOARD) -> list[str]:
    with open(path) as fh:
        dashboard = json.load(fh)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return exprs


def selectors(expr: str) -> list[tuple[str, list[str]]]:
    """(metric, label names) of every series selector in a PromQL expression."""
    out = []
    for m in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", expr):
        name, body = m.group(1), m.group(2) or ""
        if not (name.startswith(("gpu_isolator_", "process_")) or name in SCRAPE_SERIES):
            continue
        labels = re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", body)
        out.append((name, labels))
    return out


def test_rules_and_dashboard_name_metrics_at_all():
    # So that the scrape test below cannot pass on files it failed to read.
    assert len(rule_exprs()) == 11
    assert len(dashboard_exprs()) >= 14
    names = {n for e in rule_exprs() + dashboard_exprs() for n, _ in selectors(e)}
    assert {"gpu_isolator_gpu_healthy", "gpu_isolator_health_check", "gpu_isolator_errors_total"} <= names
    assert "gpu_isolator_reconciliation_repairs_total" in names and "process_start_time_seconds" in names


def test_dashboard_is_a_grafana_dashboard_grafana_can_lay_out():
    with open(DASHBOARD) as fh:
        dashboard = json.load(fh)
    assert dashboard["uid"] == "gpu-isolator" and isinstance(dashboard["schemaVersion"], int)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "instance"}
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            # Every query follows the sidecar picker, so one node can be looked at alone.
            assert 'instance=~"$instance"' in t["expr"], t["expr"]


def test_promtool_accepts_the_rules():
    result = subprocess.run([_promtool(), "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 11 rules found" in result.stdout


def test_promtool_unit_tests_fire_each_alert_on_trouble_and_not_on_a_healthy_sidecar():
    result = subprocess.run(
        [_promtool(), "test", "rules", os.path.basename(RULES_TEST)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(RULES_TEST),
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_every_metric_and_label_the_rules_and_dashboard_name_is_exported_by_a_real_daemon(short_tmp):
    from system.test_metrics import _UnixHTTP, series

    path = os.path.join(short_tmp, "metrics.sock")
    # The DGX A100 has GPUs whole and in MIG mode, so the MIG families have series too; GPU 6 shared
    # in mps mode gives the MPS families theirs (the restarts counter is exported at 0 from the start).
    extra = ("--metrics-address", f"unix:{path}", "--shared-gpus", "6:2:mps")
    with running_sidecar("dgx-a100", "v1", extra=extra) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        try:
            isolator.prepare(container_id("a1"), containerizer.config(gpus=1, image=False))
            with pytest.raises(HookFailed):  # an error, so that gpu_isolator_errors_total has series
                isolator.prepare(container_id("a1"), containerizer.config(gpus=1, image=False))
            # A GPU out of service both ways, so that the per-GPU age series have one each.
            isolator.prepare(container_id("leaves"), containerizer.config(gpus=1, image=False))
            held = next(g for g in _admin_gpus(sidecar) if g.holder == "leaves")
            sidecar.sim.start_process(held.index, 4321)
            isolator.cleanup(container_id("leaves"))
            with grpc.insecure_channel(sidecar.address) as ch:
                admin = pb_grpc.AdminStub(ch)
                admin.MaintenanceDrain(pb.MaintenanceDrainRequest(gpu="7", reason="alerting test"), timeout=30)
            samples = series(_UnixHTTP(path))
        finally:
            isolator.cleanup(container_id("a1"))
            isolator.close()
    exported: dict[str, set[str]] = {}
    for name, labels, _ in samples:
        exported.setdefault(name, set()).update(labels)
    missing = []
    for expr in rule_exprs() + dashboard_exprs():
        for name, labels in selectors(expr):
            if name in SCRAPE_SERIES:
                continue
            if name not in exported:
                missing.append(f"{name} (in {expr})")
                continue
            unknown = set(labels) - exported[name] - TARGET_LABELS
            if unknown:
                missing.append(f"{name} has no label {sorted(unknown)} (in {expr})")
    assert not missing, "\n".join(missing)
