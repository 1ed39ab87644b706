"""What an operator running dcgm-exporter beside the sidecar expects of its metrics (issue 33 item 11):
a suggested port that is not dcgm-exporter's 9400, ``:PORT`` meaning every interface as for Go
exporters, and dcgm-exporter's ``modelName`` and ``pci_bus_id`` labels beside ``UUID`` on every
per-GPU series, in its format, so that the two join."""

from __future__ import annotations

import http.client
import os
import re
import socket

import paths
from prometheus_client import generate_latest

from isolator.exporters.metrics import Metrics, MetricsServer, parse_address
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.testing import fake_service

DOCS = os.path.join(paths.ROOT, "docs")
README = os.path.join(paths.ROOT, "README.md")
DCGM_EXPORTER_PORT = 9400
SUGGESTED_PORT = 9416  # isolator.exporters.metrics.SUGGESTED_PORT, which docs/metrics.md explains
# dcgm-exporter's pci_bus_id, as NVML's nvmlDeviceGetPciInfo busId: 8-digit domain, upper-case hex.
DCGM_BUS_ID = re.compile(r"^[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]$")


def _per_gpu_samples(text: str) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        m = re.match(r"^(gpu_isolator_gpu_\w+)\{(.*)\} ", line)
        if m:
            out.setdefault(m.group(1), []).append(dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))))
    return out


def test_the_suggested_metrics_port_is_not_dcgm_exporters():
    from isolator.exporters import metrics

    assert metrics.SUGGESTED_PORT == SUGGESTED_PORT != DCGM_EXPORTER_PORT
    suggested = []
    for path in [README] + [os.path.join(DOCS, n) for n in sorted(os.listdir(DOCS)) if n.endswith(".md")]:
        with open(path) as fh:
            text = fh.read()
        for m in re.finditer(r"--metrics-address[ =`]+([^\s`]+)", text):
            suggested.append((os.path.basename(path), m.group(1)))
    ports = {v.rsplit(":", 1)[-1] for _p, v in suggested if not v.startswith("unix:")}
    assert str(SUGGESTED_PORT) in ports, suggested
    assert str(DCGM_EXPORTER_PORT) not in ports, [s for s in suggested if str(DCGM_EXPORTER_PORT) in s[1]]
    with open(os.path.join(DOCS, "metrics.md")) as fh:
        assert f"`{SUGGESTED_PORT}`" in fh.read(), "docs/metrics.md says why this port"


def test_colon_port_means_every_interface_as_for_go_exporters_and_a_bare_port_localhost():
    assert parse_address(f":{SUGGESTED_PORT}") == ("tcp", ("", SUGGESTED_PORT))
    assert parse_address(str(SUGGESTED_PORT)) == ("tcp", ("127.0.0.1", SUGGESTED_PORT))
    assert parse_address(f"0.0.0.0:{SUGGESTED_PORT}") == ("tcp", ("0.0.0.0", SUGGESTED_PORT))


def test_a_colon_port_server_binds_the_wildcard_and_answers_on_loopback():
    server = MetricsServer(":0", Metrics()).start()
    try:
        assert server._server is not None
        host, port = server._server.server_address[:2]
        assert host in ("::", "0.0.0.0"), host
        assert server.address in (f"[::]:{port}", f"0.0.0.0:{port}")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # IPv4 reaches it too
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200 and b"gpu_isolator_build_info" in response.read()
        conn.close()
        if socket.has_ipv6 and host == "::":
            conn = http.client.HTTPConnection("::1", port, timeout=10)
            conn.request("GET", "/metrics")
            assert conn.getresponse().status == 200
            conn.close()
    finally:
        server.stop()


def test_dcgm_bus_id_is_nvmls_form():
    from isolator.exporters.metrics import dcgm_bus_id

    assert dcgm_bus_id("0000:0b:00.0") == "00000000:0B:00.0"
    assert dcgm_bus_id("0001:1a:00.1") == "00000001:1A:00.1"
    assert dcgm_bus_id("") == ""


def test_every_per_gpu_series_carries_dcgm_exporters_identity_labels():
    rig = fake_service("dgx-1")
    rig.service.prepare(ContainerId("a"), ContainerConfig(resources=(Resource("gpus", 8.0),)))
    rig.inventory.start_process(3, 33)
    rig.service.cleanup(ContainerId("a"))  # GPU 3 drains, so that every per-GPU family has a series
    gpus = {g.uuid: g for g in rig.service.list_gpus().gpus}
    families = _per_gpu_samples(generate_latest(Metrics(rig.service).registry).decode())
    assert {
        "gpu_isolator_gpu_healthy",
        "gpu_isolator_gpu_held_for_handover",
        "gpu_isolator_gpu_held_for_handover_seconds",
    } <= set(families)
    for name, samples in families.items():
        for labels in samples:
            g = gpus[labels["UUID"]]
            assert labels["modelName"] == g.name == "Tesla V100-SXM2-16GB", name
            assert DCGM_BUS_ID.match(labels["pci_bus_id"]), (name, labels)
            assert labels["pci_bus_id"].lower().endswith(g.pci_bus_id.split(":", 1)[1]), (name, labels)


def test_gpus_out_of_service_both_ways_have_an_alert_and_a_dashboard_panel():
    from system.test_alerting import dashboard_exprs, rule_exprs, selectors

    ruled = {name for expr in rule_exprs() for name, _ in selectors(expr)}
    assert "gpu_isolator_gpu_drained_seconds" in ruled, "an operator's maintenance drain alerts"
    assert "gpu_isolator_gpu_held_for_handover_seconds" in ruled, "a GPU the handover check keeps out alerts"
    shown = {name for expr in dashboard_exprs() for name, _ in selectors(expr)}
    assert {"gpu_isolator_gpus_drained", "gpu_isolator_gpus_held_for_handover"} <= shown
    assert {"gpu_isolator_gpu_drained_seconds", "gpu_isolator_gpu_held_for_handover_seconds"} <= shown
