"""The health marks that outlive the sidecar (isolator/core/healthmarks.py), over the shipped fakes."""

from __future__ import annotations

import logging

from isolator.core.healthmarks import HealthMarks, lasting_mark, to_restore
from isolator.model import GpuHealth, HealthMark
from isolator.testing import FakeInventory, FakeStore

LASTING = ("xid", "ecc")


def _rig(host: str = "dgx-1") -> tuple[FakeInventory, FakeStore, HealthMarks]:
    inventory, store = FakeInventory.of_host(host), FakeStore()
    return inventory, store, HealthMarks(inventory, store, LASTING)


def _uuid(inventory: FakeInventory, index: int) -> str:
    return next(r.gpu.uuid for r in inventory.records if r.gpu.index == index)


def test_a_kept_mark_makes_its_gpu_unhealthy_again_at_start():
    inventory, store, marks = _rig()
    uuid = _uuid(inventory, 3)
    store.put_health_mark(HealthMark(uuid, "ecc", "double-bit ECC error", 0, 12.5))
    marks.start()
    health = inventory.records[3].health
    assert (health.healthy, health.reason, health.source, health.last_xid_time) == (
        False,
        "double-bit ECC error",
        "ecc",
        12.5,
    )
    assert 3 not in inventory.healthy()
    assert all(r.health.healthy for r in inventory.records if r.gpu.index != 3)


def test_a_mark_of_a_gpu_not_managed_now_waits_in_the_store():
    inventory, store, marks = _rig()
    absent = HealthMark("GPU-not-here", "xid", "XID 79", 79, 1.0)
    store.put_health_mark(absent)
    marks.start()
    assert all(r.health.healthy for r in inventory.records)
    assert store.health_marks() == [absent]


def test_an_xid_after_start_is_kept_and_a_reset_forgets_it():
    inventory, store, marks = _rig()
    marks.start()
    inventory.xid(1, 79, when=7.0)
    assert store.health_marks() == [HealthMark(_uuid(inventory, 1), "xid", "XID 79", 79, 7.0)]
    inventory.reset(1)
    assert store.health_marks() == []


def test_a_passing_reason_is_not_kept():
    inventory, store, marks = _rig()
    marks.start()
    inventory.mark_unhealthy(0, "NVML does not answer", source="nvml")
    inventory.mark_unhealthy(2, "no longer enumerated by NVML", source="absent")
    assert store.health_marks() == []


def test_a_store_that_fails_keeps_the_mark_in_memory_and_logs_it(caplog):
    inventory, store, marks = _rig()
    marks.start()
    store.faults.fail_at("put_health_mark")
    with caplog.at_level(logging.ERROR, logger="isolator.core.healthmarks"):
        inventory.xid(0, 48)
    assert not inventory.records[0].health.healthy
    assert store.health_marks() == []
    assert "failed to record the health of GPU 0" in caplog.text


def test_restoring_matches_marks_to_gpus_by_uuid_not_by_index():
    inventory = FakeInventory.of_host("dgx-1")
    records = inventory.records
    mark = HealthMark(records[5].gpu.uuid, "xid", "XID 79", 79, 0.0)
    assert to_restore([mark, HealthMark("GPU-gone", "xid", "XID 79", 79, 0.0)], records) == [(5, mark)]


def test_only_a_lasting_source_makes_a_mark():
    assert lasting_mark("GPU-a", GpuHealth(), LASTING) is None
    assert lasting_mark("GPU-a", GpuHealth(False, "gone", source="absent"), LASTING) is None
    assert lasting_mark("GPU-a", GpuHealth(False, "XID 13", 13, 2.0, "xid"), LASTING) == HealthMark(
        "GPU-a", "xid", "XID 13", 13, 2.0
    )
