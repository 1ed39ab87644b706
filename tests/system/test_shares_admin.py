"""gpu_shares in the admin views, the CLI's tables and the metrics (docs/sharing.md), in-process over
the shipped fakes: gpus shows each shared GPU's shares, holders, mode and MPS daemon; containers and
describe show a sharer's shares; the exporter has per-GPU shares and MPS daemon series."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import generate_latest

from isolator.cli.main import render
from isolator.exporters.metrics import Metrics
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.shares import parse_shared_gpus
from isolator.rpc import isolator_pb2 as pb
from isolator.testing import Rig, fake_service
from isolator.transport.client import to_dict
from isolator.transport.convert import container_info_to_proto, description_to_proto, gpu_info_to_proto

NOW = 1_800_000_000.0


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def shares(n: float) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpu_shares", n),))


@pytest.fixture
def rig() -> Rig:
    rig = fake_service("dgx-1")
    # c holds 2 shares: a time-sliced GPU (under MPS every sharer holds one).
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:time-slice,5:2:mps"))
    rig.restart()
    rig.service.prepare(cid("a"), shares(1))  # GPU 4
    rig.service.prepare(cid("b"), shares(1))  # GPU 5
    rig.service.prepare(cid("c"), shares(2))  # GPU 4
    rig.service.prepare(cid("w"), ContainerConfig(resources=(Resource("gpus", 1.0),)))
    return rig


def test_list_gpus_shows_shares_holders_mode_and_the_mps_daemon(rig: Rig) -> None:
    by_index = {g.index: g for g in rig.service.list_gpus().gpus}
    g4, g5 = by_index[4], by_index[5]
    assert (g4.shares_total, g4.shares_held, g4.share_mode, g4.mps_state) == (4, 3, "time-slice", "")
    assert g4.share_holders == (("a", 1), ("c", 2)) and g4.holder == ""
    assert (g5.shares_total, g5.shares_held, g5.share_mode, g5.mps_state) == (2, 1, "mps", "running")
    assert by_index[6].shares_total == 0 and by_index[6].share_holders == ()
    rig.service.cleanup(cid("b"))
    g5 = {g.index: g for g in rig.service.list_gpus().gpus}[5]
    assert (g5.shares_total, g5.shares_held, g5.share_holders) == (2, 0, ())


def test_containers_and_describe_show_a_sharers_shares(rig: Rig) -> None:
    infos = {str(c.container_id): c for c in rig.service.list_containers()}
    c = infos["c"]
    assert (c.shares, c.shares_total, c.share_mode, c.share_gpu_index) == (2, 4, "time-slice", 4)
    assert c.gpu_minors == () and c.share_gpu_uuid == rig.service.core.gpus[c.share_gpu_minor].uuid
    assert infos["w"].shares == 0
    described = rig.service.describe_container(cid("c"))
    assert [g.index for g in described.gpus] == [4]
    assert described.rules_agree


def test_the_tables_show_shares(rig: Rig) -> None:
    listed = rig.service.list_gpus()
    data = to_dict(pb.ListGpusResponse(driver_version="550", gpus=[gpu_info_to_proto(g) for g in listed.gpus]))
    table = render("gpus", data, NOW)
    row4 = next(line for line in table.splitlines() if line.split()[:2] == ["4", "4"])
    assert "3/4 time-slice" in row4 and "a:1,c:2" in row4
    row5 = next(line for line in table.splitlines() if line.split()[:2] == ["5", "5"])
    assert "1/2 mps (running)" in row5 and "b:1" in row5
    assert "SHARES" in table.splitlines()[1]

    containers = to_dict(
        pb.ListContainersResponse(containers=[container_info_to_proto(c) for c in rig.service.list_containers()])
    )
    rows = {line.split()[0]: line for line in render("containers", containers, NOW).splitlines()[1:]}
    assert "2/4 of [4]" in rows["c"] and "1/2 of [5]" in rows["b"] and "1 [" in rows["w"]

    described = to_dict(description_to_proto(rig.service.describe_container(cid("c"))))
    text = render("describe", described, NOW)
    assert "Shares:" in text and "2 of the 4 shares of GPU 4" in text and "time-slice)" in text


def test_metrics_export_shares_and_the_mps_daemon(rig: Rig) -> None:
    text = generate_latest(Metrics(rig.service).registry).decode()
    uuid4, uuid5 = rig.service.core.gpus[4].uuid, rig.service.core.gpus[5].uuid
    assert f'gpu_isolator_gpu_shares{{UUID="{uuid4}",gpu="4",minor="4",mode="time-slice"}} 4.0' in text
    assert f'gpu_isolator_gpu_shares_held{{UUID="{uuid4}",gpu="4",minor="4",mode="time-slice"}} 3.0' in text
    assert f'gpu_isolator_mps_daemon_up{{UUID="{uuid5}",gpu="5",minor="5",state="running"}} 1.0' in text
    assert f'gpu_isolator_gpu_shares_held{{UUID="{uuid5}",gpu="5",minor="5",mode="mps"}} 1.0' in text
    assert 'gpu_isolator_container_gpu_shares{container_id="c"} 2.0' in text
    rig.mps.kill(uuid5)
    rig.mps.faults.fail_at("start")
    rig.service.supervise_mps()
    text = generate_latest(Metrics(rig.service).registry).decode()
    assert f'gpu_isolator_mps_daemon_up{{UUID="{uuid5}",gpu="5",minor="5",state="failed"}} 0.0' in text


def test_the_dcgm_job_mapping_lists_every_sharer_in_its_gpus_file(rig: Rig, tmp_path) -> None:
    from isolator.exporters.jobmap import JobMapping

    wanted = JobMapping(str(tmp_path), rig.service, rig.inventory).wanted()
    assert wanted["4"] == ["a", "c"] and wanted["5"] == ["b"]
    (whole,) = rig.store.holders()  # w's GPU (dgx-1: minor == index)
    assert [k for k, v in wanted.items() if v] == sorted({"4", "5", str(whole)})
    assert wanted[str(whole)] == ["w"]
