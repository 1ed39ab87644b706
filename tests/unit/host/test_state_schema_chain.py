"""The state schema is one chain: 7 is the operator's maintenance drains (core/maintenance.py), 8 the
shares of GPUs (docs/sharing.md). A store as each older schema left it migrates to the newest in one
open, keeps its records and its marks, and takes what the newer schemas hold."""

from __future__ import annotations

import os
import sqlite3

import pytest

from isolator.errors import GpuAlreadyHeld
from isolator.host.state import DB_FILE, MIN_SCHEMA, SCHEMA_VERSION, TABLES_AFTER_2, StateStore, backup_path
from isolator.model import ContainerId, ContainerRecord, Holding, MaintenanceMark, Share

A, B, C = ContainerId("a"), ContainerId("b"), ContainerId("c")
# The table each schema after 2 added (schema 3 + i added TABLES_AFTER_2[i]).
INTRODUCED = {3 + i: table for i, table in enumerate(TABLES_AFTER_2)}
SHARE_TRIGGERS = ("whole_gpu_not_while_shared", "share_not_while_whole_gpu_held")


def _rewind(directory: str, version: int) -> None:
    """Make the store what schema ``version`` left: the newer tables (and the shares' trigger on
    ``allocation``, which outlives its table) gone, the user_version set back."""
    drops = "".join(f"DROP TABLE {INTRODUCED[v]};" for v in sorted(INTRODUCED, reverse=True) if v > version)
    if version < 8:
        drops += "DROP TRIGGER IF EXISTS whole_gpu_not_while_shared;"
    db = sqlite3.connect(os.path.join(directory, DB_FILE))
    try:
        db.executescript(drops + f"PRAGMA user_version={version};")
    finally:
        db.close()


def _schema(directory: str) -> tuple[int, set[str], set[str]]:
    db = sqlite3.connect(os.path.join(directory, DB_FILE))
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        triggers = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
        return version, tables, triggers
    finally:
        db.close()


def test_the_chain_adds_maintenance_shares_drain_history_users_cuts_and_mps_ends_from_7_to_12():
    assert SCHEMA_VERSION == 12
    assert (INTRODUCED[7], INTRODUCED[8], INTRODUCED[9], INTRODUCED[10], INTRODUCED[11], INTRODUCED[12]) == (
        "gpu_maintenance",
        "share_allocation",
        "gpu_maintenance_history",
        "share_user",
        "share_cut",
        "mps_ended",
    )
    assert MIN_SCHEMA == 2, "the migrations are additive: a rollback past them still starts"


@pytest.mark.parametrize("version", range(2, SCHEMA_VERSION))
def test_a_store_at_each_older_schema_migrates_to_the_newest_and_keeps_what_it_held(tmp_path, version):
    directory = str(tmp_path)
    with StateStore(directory) as store:
        store.record(ContainerRecord(A, Holding(frozenset({1})), state="isolated"))
        store.set_maintenance(MaintenanceMark("GPU-5", "fan replaced", 10.0, "uid 0"))
    _rewind(directory, version)
    assert _schema(directory)[0] == version
    with StateStore(directory) as store:
        assert store.holders() == {1: A} and store.get(A).state == "isolated"
        # Schema 7's drains survive a migration from 7; older stores had none to keep.
        assert list(store.maintenance()) == (["GPU-5"] if version >= 7 else [])
        store.set_maintenance(MaintenanceMark("GPU-6", "bad fan", 11.0, "uid 0"))
        store.record(ContainerRecord(B, Holding(share=Share(3, 2, "mps"))))
        with pytest.raises(GpuAlreadyHeld):
            store.record(ContainerRecord(C, Holding(frozenset({3}))))  # never whole while shared: the trigger is back
    after, tables, triggers = _schema(directory)
    assert after == SCHEMA_VERSION
    assert set(TABLES_AFTER_2) <= tables and set(SHARE_TRIGGERS) <= triggers
    assert os.path.exists(backup_path(directory, version))
    with StateStore(directory) as store:
        assert store.share_holders() == {B: (3, 2, "mps")}
        assert store.get(B).holding.shared == {3} and store.get(C) is None
        assert sorted(store.maintenance()) == (["GPU-5", "GPU-6"] if version >= 7 else ["GPU-6"])


def test_a_schema_7_store_with_drains_and_holders_gains_only_the_shares(tmp_path):
    directory = str(tmp_path)
    with StateStore(directory) as store:
        store.record(ContainerRecord(A, Holding(frozenset({1}))))
        store.set_maintenance(MaintenanceMark("GPU-2", "ECC page retirement", 5.0, "uid 0, pid 42"))
    _rewind(directory, 7)
    _version, tables, triggers = _schema(directory)
    assert "gpu_maintenance" in tables and "share_allocation" not in tables
    assert not set(SHARE_TRIGGERS) & triggers
    with StateStore(directory) as store:
        assert store.maintenance()["GPU-2"] == MaintenanceMark("GPU-2", "ECC page retirement", 5.0, "uid 0, pid 42")
        assert store.share_holders() == {}
    assert _schema(directory)[0] == SCHEMA_VERSION
