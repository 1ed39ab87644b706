"""Shares of a GPU in the state store (schema 8): recorded, read back, never beside a whole holder of
the same GPU, gone with their container, and a schema-7 store migrated (every older schema:
tests/unit/host/test_state_schema_chain.py)."""

from __future__ import annotations

import os
import sqlite3

import pytest

from isolator.errors import GpuAlreadyHeld, InvalidArgument
from isolator.host.state import DB_FILE, SCHEMA_VERSION, StateStore
from isolator.model import ContainerId, ContainerRecord, Holding, Share
from isolator.testing.store import FakeStore

A, B, C = ContainerId("a"), ContainerId("b"), ContainerId("c")


def sharer(cid: ContainerId, minor: int = 3, n: int = 1, mode: str = "mps") -> ContainerRecord:
    return ContainerRecord(cid, Holding(share=Share(minor, n, mode)))


def test_shares_are_recorded_and_read_back_by_get_and_load(tmp_path):
    with StateStore(str(tmp_path)) as store:
        store.record(sharer(A, 3, 2, "mps"))
        store.record(sharer(B, 3, 1, "mps"))
        store.record(ContainerRecord(C, Holding(frozenset({1}))))
    with StateStore(str(tmp_path)) as store:
        a = store.get(A)
        assert a is not None and (a.holding.share.gpu, a.holding.shares, a.holding.share.mode) == (3, 2, "mps")
        assert a.holding.shared == {3} and a.holding.gpus == frozenset()
        loaded = store.load()
        assert loaded[B].holding.shared == {3} and loaded[B].holding.shares == 1
        assert loaded[C].holding.shared == frozenset() and loaded[C].holding.shares == 0
        assert store.share_holders() == {A: (3, 2, "mps"), B: (3, 1, "mps")}
        assert store.holders() == {1: C}


@pytest.fixture(params=["sqlite", "fake"])
def store(request, tmp_path):
    """The real store and the shipped fake: the same refusals (as tests/contract/test_contracts.py)."""
    real = StateStore(str(tmp_path)) if request.param == "sqlite" else FakeStore()
    yield real
    real.close()


def test_a_gpu_is_never_recorded_whole_and_shared(store):
    store.record(sharer(A, 3))
    with pytest.raises(GpuAlreadyHeld, match=r"GPU 3 for container b: it is already held by a"):
        store.record(ContainerRecord(B, Holding(frozenset({3}))))
    assert store.get(B) is None
    store.record(ContainerRecord(C, Holding(frozenset({4}))))
    with pytest.raises(GpuAlreadyHeld, match=r"GPU 4 \(shared\) for container b: it is already held by c"):
        store.record(sharer(B, 4))
    assert store.get(B) is None
    with pytest.raises(GpuAlreadyHeld):
        store.add_gpus(C, {3})
    assert store.get(C).holding.gpus == {4}


def test_shares_go_with_their_container(store):
    store.record(sharer(A, 3))
    store.remove(A)
    assert store.share_holders() == {}
    store.record(ContainerRecord(B, Holding(frozenset({3}))))  # the GPU may be held whole again
    assert store.holders() == {3: B}


@pytest.mark.parametrize(
    ("rec", "says"),
    [
        (ContainerRecord(A, Holding(share=Share(-1, 1, "mps"))), "shared GPU minor -1"),
        (ContainerRecord(A, Holding(share=Share(True, 1, "mps"))), "shared GPU minor True"),
        (ContainerRecord(A, Holding(share=Share(1, -2, "mps"))), "share count -2"),
        (ContainerRecord(A, Holding(share=Share(1, 1.5, "mps"))), "share count 1.5"),  # type: ignore[arg-type]
        (ContainerRecord(A, Holding(share=Share(1, 1, "mig"))), "unknown sharing mode 'mig'"),
    ],
)
def test_bad_share_records_are_refused_and_leave_nothing(store, rec, says):
    with pytest.raises(InvalidArgument, match=says):
        store.record(rec)
    assert store.get(A) is None


def test_a_schema_7_store_is_migrated_and_keeps_its_records(tmp_path):
    with StateStore(str(tmp_path)) as store:
        store.record(ContainerRecord(A, Holding(frozenset({1}))))
    db = sqlite3.connect(os.path.join(str(tmp_path), DB_FILE))
    db.executescript("DROP TABLE share_allocation; DROP TRIGGER whole_gpu_not_while_shared; PRAGMA user_version=7;")
    db.close()
    with StateStore(str(tmp_path)) as store:
        assert store.holders() == {1: A}
        store.record(sharer(B, 2))
        assert store.get(B).holding.shared == {2}
    db = sqlite3.connect(os.path.join(str(tmp_path), DB_FILE))
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 8
        assert os.path.exists(os.path.join(str(tmp_path), f"{DB_FILE}.schema-7.bak"))
    finally:
        db.close()


def test_a_sharers_uid_is_recorded_kept_through_a_change_of_count_and_gone_with_it(store):
    """Schema 10 (docs/sharing.md, "Users"): the uid a sharer runs as is booked with its share."""
    store.record(ContainerRecord(A, Holding(share=Share(3, 1, "mps", 1000))))
    store.record(ContainerRecord(B, Holding(share=Share(3, 1, "mps"))))  # unknown: as an older sidecar wrote it
    assert store.get(A).holding.share.uid == 1000 and store.get(B).holding.share.uid is None
    assert store.load()[A].holding.share == Share(3, 1, "mps", 1000)
    store.set_holding(A, Holding(share=Share(3, 2, "time-slice", 1000)))
    assert store.get(A).holding.share.uid == 1000
    store.set_holding(A, Holding())
    store.set_holding(A, Holding(share=Share(3, 1, "mps")))
    assert store.get(A).holding.share.uid is None, "a share let go takes its uid with it"
    for bad in (-1, True, "0"):
        with pytest.raises(InvalidArgument):
            store.record(ContainerRecord(C, Holding(share=Share(3, 1, "mps", bad))))  # type: ignore[arg-type]
    assert store.get(C) is None


def test_a_schema_9_store_gains_share_users_and_its_sharers_have_no_uid(tmp_path):
    with StateStore(str(tmp_path)) as store:
        store.record(ContainerRecord(A, Holding(share=Share(3, 1, "mps", 1000))))
    db = sqlite3.connect(os.path.join(str(tmp_path), DB_FILE))
    db.executescript("DROP TABLE share_user; PRAGMA user_version=9;")
    db.close()
    with StateStore(str(tmp_path)) as store:
        assert store.get(A).holding.share == Share(3, 1, "mps")  # uid None: recorded before schema 10
        store.record(ContainerRecord(B, Holding(share=Share(3, 1, "mps", 7))))
        assert store.get(B).holding.share.uid == 7
    db = sqlite3.connect(os.path.join(str(tmp_path), DB_FILE))
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 10
    db.close()


def test_a_sharers_cut_is_recorded_kept_through_a_change_of_count_and_gone_with_it(tmp_path):
    """Schema 11 (issue 41 item 6): how many ways the GPU was cut when the share was booked."""
    with StateStore(str(tmp_path)) as store:
        store.record(ContainerRecord(A, Holding(share=Share(3, 1, "mps", 1000, 4))))
        store.record(ContainerRecord(B, Holding(share=Share(3, 1, "mps"))))  # unknown: as an older sidecar wrote it
        assert store.get(A).holding.share.cut == 4 and store.get(B).holding.share.cut is None
        assert store.load()[A].holding.share == Share(3, 1, "mps", 1000, 4)
        store.set_holding(A, Holding(share=Share(3, 2, "mps", 1000, 4)))
        assert store.get(A).holding.share.cut == 4
        store.set_holding(A, Holding(share=Share(3, 1, "mps", 1000)))
        assert store.get(A).holding.share.cut is None, "a share booked again without a cut takes none"
        for bad in (0, True, "4"):
            with pytest.raises(InvalidArgument):
                store.record(ContainerRecord(C, Holding(share=Share(3, 1, "mps", 0, bad))))  # type: ignore[arg-type]
        assert store.get(C) is None


def test_sharers_ended_by_a_lost_mps_daemon_are_kept_until_their_record_or_last_share_goes(store):
    store.record(sharer(A))
    store.record(sharer(B))
    store.record(ContainerRecord(C, Holding(frozenset({1}))))
    store.end_mps_sharers({A: "its daemon died", B: "its daemon died", ContainerId("gone"): "never recorded"})
    store.end_mps_sharers({A: "a second reason"})
    assert store.mps_ended() == {A: "its daemon died", B: "its daemon died"}, "the first reason stays"
    store.set_holding(A, Holding(share=Share(3, 2, "mps")))  # a change of count keeps it ended
    store.set_holding(B, Holding())  # an update to no share: its end goes with it
    assert store.mps_ended() == {A: "its daemon died"}
    store.remove(A)
    assert store.mps_ended() == {}
    store.end_mps_sharers({})  # nothing to record is no write


def test_ended_sharers_outlive_a_restart_of_the_store(tmp_path):
    with StateStore(str(tmp_path)) as store:
        store.record(sharer(A))
        store.end_mps_sharers({A: "its MPS server failed"})
    with StateStore(str(tmp_path)) as store:
        assert store.mps_ended() == {A: "its MPS server failed"}
