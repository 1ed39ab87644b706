"""An operator's maintenance drain at the edges (issue 33 item 7; the core's tests are in
tests/unit/core/test_maintenance.py, the stores' in tests/contract/test_contracts.py): the metrics, the state
store's schema 7 migration, and a real daemon through the CLI, across a SIGKILL."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys

import pytest
from prometheus_client import generate_latest

from isolator.exporters.metrics import Metrics
from isolator.host.state import DB_FILE, SCHEMA_VERSION, TABLES_AFTER_2, StateStore
from isolator.model import ContainerId, ContainerRecord, Holding, MaintenanceMark
from isolator.testing import fake_service
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import running_sidecar

OPERATOR = "uid 0, pid 4242"


def test_metrics_export_every_gpus_maintenance_state_with_dcgm_labels():
    rig = fake_service("dgx-1")
    metrics = Metrics(rig.service)
    before = generate_latest(metrics.registry).decode()
    assert "gpu_isolator_gpus_drained 0.0" in before
    assert len(re.findall(r"^gpu_isolator_gpu_drained\{.*\} 0\.0$", before, re.M)) == 8, "at 0 from the start"
    rig.service.maintenance_drain("3", "x", OPERATOR)
    text = generate_latest(metrics.registry).decode()
    assert "gpu_isolator_gpus_drained 1.0" in text
    on = re.findall(r"^gpu_isolator_gpu_drained\{(.*)\} 1\.0$", text, re.M)
    assert len(on) == 1 and 'gpu="3"' in on[0] and 'modelName="Tesla V100-SXM2-16GB"' in on[0]
    assert re.search(r'pci_bus_id="00000000:[0-9A-F]{2}:00\.0"', on[0])
    ages = re.findall(r"^gpu_isolator_gpu_drained_seconds\{(.*)\} ", text, re.M)
    assert len(ages) == 1 and 'gpu="3"' in ages[0]


# ---- the state store: the schema migration ---------------------------------------------------------


def test_a_schema_6_store_gains_the_maintenance_table_and_keeps_its_records(tmp_path):
    assert SCHEMA_VERSION >= 7 and TABLES_AFTER_2[7 - 3] == "gpu_maintenance"  # schema 7 added it
    with StateStore(str(tmp_path)) as s:
        s.record(ContainerRecord(ContainerId("a"), Holding(frozenset({1}))))
    db = sqlite3.connect(os.path.join(str(tmp_path), DB_FILE))
    # As schema 6 left it: neither the maintenance table of 7 nor the shares of 8.
    db.executescript(
        "DROP TABLE share_allocation; DROP TRIGGER whole_gpu_not_while_shared;"
        " DROP TABLE gpu_maintenance; PRAGMA user_version=6;"
    )
    db.close()
    with StateStore(str(tmp_path)) as s:
        assert s.holders() == {1: ContainerId("a")} and s.maintenance() == {}
        s.set_maintenance(MaintenanceMark("GPU-1", "x", 1.0, "uid 0"))
    with StateStore(str(tmp_path)) as s:
        assert list(s.maintenance()) == ["GPU-1"]


# ---- a real daemon, through the CLI -------------------------------------------------------------


def _cli(socket: str, *args: str) -> tuple[int, str, str]:
    result = subprocess.run(
        [sys.executable, "-m", "isolator", *args, "--socket", socket],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.returncode, result.stdout, result.stderr


@pytest.mark.cgroup_v1
def test_drain_and_undrain_on_a_real_daemon_survive_a_sigkill_and_show_in_every_view():
    with running_sidecar("dgx-1", "v1") as sidecar:
        containerizer = Containerizer(GrpcIsolator(sidecar.socket), sidecar.work)
        rc, out, err = _cli(sidecar.socket, "drain", "3", "--reason", "board swap OPS-12")
        assert rc == 0, err
        assert "drained for maintenance: no new grants of it: board swap OPS-12" in out
        rc, _out, err = _cli(sidecar.socket, "drain", "4")
        assert rc == 2 and "--reason" in err, "the reason is required"
        # SIGKILL: nothing is flushed at exit; the drain was recorded before it counted.
        assert re.search(r"INFO isolator\.core\.maintenance: .*GPU 3 .*drained for maintenance", sidecar.log())
        sidecar.kill()
        sidecar.start()
        rc, out, _ = _cli(sidecar.socket, "gpus")
        assert rc == 0 and "DRAINED" in out and re.search(r"^3 .* yes ", out, re.M)
        assert re.search(r"GPU 3: since .* by uid 0, pid \d+: board swap OPS-12", out), out
        rc, out, _ = _cli(sidecar.socket, "gpus", "--json")
        drained = [g for g in json.loads(out)["gpus"] if g.get("maintenance")]
        assert [g["index"] for g in drained] == [3] and drained[0]["maintenance_reason"] == "board swap OPS-12"
        rc, out, _ = _cli(sidecar.socket, "health")
        assert rc == 0 and "GPU 3 drained for maintenance" in out
        with pytest.raises(HookFailed) as refused:
            containerizer.start(container_id("eight"), containerizer.config(gpus=8, image=False))
        assert "drained for maintenance: GPU 3" in str(refused.value)
        rc, out, err = _cli(sidecar.socket, "undrain", "3")
        assert rc == 0 and "back in service" in out, err
        containerizer.start(container_id("eight"), containerizer.config(gpus=8, image=False))
        containerizer.destroy(container_id("eight"))
        assert re.search(r"INFO isolator\.core\.maintenance: .*GPU 3 .* is back in service", sidecar.log())
        assert not re.search(r"(ERROR|WARNING) .*maintenance", sidecar.log()), "a drain is an operator's decision"
