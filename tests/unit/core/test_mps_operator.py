"""What an operator sees of the MPS control daemons (issue 41 item 7): ``health``'s ``mps`` check
fails while a GPU in mps mode has sharers and no daemon behind them, and every daemon found dead and
started again counts in ``gpu_isolator_mps_daemon_restarts_total`` (the alert
GpuIsolatorMpsDaemonRestarted), in-process over the fake service."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import generate_latest

from isolator.exporters.metrics import Metrics
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.shares import parse_shared_gpus
from isolator.testing import Rig, fake_service


def _rig() -> Rig:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4-5:4:mps,6:2"))
    rig.restart()
    return rig


def _share(rig: Rig, name: str) -> int:
    """Prepare a sharer; the minor of its GPU."""
    rig.service.prepare(ContainerId(name), ContainerConfig(resources=(Resource("gpu_shares", 1.0),)))
    share = rig.service.core.store.get(ContainerId(name)).holding.share
    assert share is not None
    return share.gpu


def _mps_check(rig: Rig):
    return next(c for c in rig.service.health() if c.name == "mps")


def _restarts(rig: Rig) -> dict[str, float]:
    text = generate_latest(Metrics(rig.service).registry).decode()
    return {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("gpu_isolator_mps_daemon_restarts_total{")
    }


def test_health_passes_with_no_sharer_and_with_each_daemon_running() -> None:
    rig = _rig()
    assert rig.service.core.mps_wanted() == []
    check = _mps_check(rig)
    assert check.ok and check.detail == "no GPU shared in mps mode has sharers"
    minor = _share(rig, "a")
    assert [g.minor for g in rig.service.core.mps_wanted()] == [minor]
    check = _mps_check(rig)
    assert check.ok and check.detail == f"MPS control daemons running: GPU {rig.service.core.gpus[minor].index}"


def test_health_fails_while_a_sharers_daemon_is_down_and_passes_once_it_is_back() -> None:
    rig = _rig()
    minor = _share(rig, "a")
    gpu = rig.service.core.gpus[minor]
    rig.mps.kill(gpu.uuid)
    rig.mps.faults.fail_at("start")
    rig.service.supervise_mps()  # found dead, not started again
    check = _mps_check(rig)
    assert not check.ok
    assert check.detail.startswith(f"GPU {gpu.index} ({gpu.uuid}): its MPS control daemon is down (failed: ")
    assert "under its sharers" in check.detail
    rig.service.supervise_mps()  # started again at the next pass
    check = _mps_check(rig)
    assert check.ok and "1 found dead and started again" in check.detail


def test_each_daemon_restart_counts_per_gpu_from_zero() -> None:
    rig = _rig()
    uuids = {rig.service.core.gpus[m].uuid: rig.service.core.gpus[m] for m in rig.service.core.gpus}
    series = _restarts(rig)
    in_mps = sorted(g.index for g in uuids.values() if f'UUID="{g.uuid}"' in "".join(series))
    assert in_mps == [4, 5] and set(series.values()) == {0.0}, "every GPU in mps mode, at 0, before any sharer"
    minor = _share(rig, "a")
    gpu = rig.service.core.gpus[minor]
    for _ in range(2):
        rig.mps.kill(gpu.uuid)
        rig.service.supervise_mps()
    key = f'gpu_isolator_mps_daemon_restarts_total{{UUID="{gpu.uuid}",gpu="{gpu.index}",minor="{gpu.minor}"}}'
    after = _restarts(rig)
    assert after[key] == 2.0 and sum(after.values()) == 2.0, after
