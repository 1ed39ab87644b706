"""The state store's MIG records: durable, one holder per MIG device, never with its GPU held whole."""

from __future__ import annotations

import os
import sqlite3

import pytest

from isolator.errors import GpuAlreadyHeld
from isolator.host.state import DB_FILE, SCHEMA_VERSION, TABLES_AFTER_2, StateStore
from isolator.model import ContainerId, ContainerRecord, Holding

A, B = ContainerId("a"), ContainerId("b")


def test_mig_devices_are_recorded_and_survive_reopening(tmp_path):
    with StateStore(str(tmp_path)) as store:
        store.record(ContainerRecord(A, Holding(mig=frozenset({("MIG-1", 0), ("MIG-2", 3)}))))
    with StateStore(str(tmp_path)) as store:
        rec = store.get(A)
        assert rec is not None and rec.holding.mig_uuids == {"MIG-1", "MIG-2"} and rec.holding.mig_parents == {0, 3}
        assert store.load()[A].holding.mig == rec.holding.mig
        assert store.mig_holders() == {"MIG-1": (A, 0), "MIG-2": (A, 3)}
        store.remove(A)
        assert store.mig_holders() == {} and store.check() == "ok"


def test_a_mig_device_has_one_holder(tmp_path):
    with StateStore(str(tmp_path)) as store:
        store.record(ContainerRecord(A, Holding(mig=frozenset({("MIG-1", 0)}))))
        with pytest.raises(GpuAlreadyHeld, match="MIG-1 for container b: it is already held by a"):
            store.record(ContainerRecord(B, Holding(mig=frozenset({("MIG-1", 0)}))))
        assert B not in store.load()


def test_a_gpu_is_never_held_whole_and_through_its_mig_devices(tmp_path):
    with StateStore(str(tmp_path)) as store:
        store.record(ContainerRecord(A, Holding(mig=frozenset({("MIG-1", 0)}))))
        with pytest.raises(GpuAlreadyHeld, match="GPU 0 for container b: it is already held by a"):
            store.record(ContainerRecord(B, Holding(frozenset({0}))))
        store.record(ContainerRecord(B, Holding(frozenset({1}))))
        with pytest.raises(GpuAlreadyHeld, match=r"1 \(parent of MIG-9\)"):
            store.record(ContainerRecord(ContainerId("c"), Holding(mig=frozenset({("MIG-9", 1)}))))
        # Another MIG device of the same parent is fine.
        store.record(ContainerRecord(ContainerId("d"), Holding(mig=frozenset({("MIG-2", 0)}))))


def test_a_version_1_store_is_upgraded_in_place(tmp_path):
    path = os.path.join(tmp_path, DB_FILE)
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE container (key TEXT PRIMARY KEY, mode TEXT NOT NULL, cgroup TEXT NOT NULL,
            cgroup_version INTEGER NOT NULL, volume_version TEXT NOT NULL, state TEXT NOT NULL,
            created REAL NOT NULL, rules TEXT NOT NULL) WITHOUT ROWID;
        CREATE TABLE allocation (minor INTEGER PRIMARY KEY, container TEXT NOT NULL
            REFERENCES container (key) ON DELETE CASCADE);
        INSERT INTO container VALUES ('["a"]', 'mesos', '/c', 1, '', 'isolated', 1.0, '');
        INSERT INTO allocation VALUES (2, '["a"]');
        PRAGMA user_version=1;
        """
    )
    db.close()
    with StateStore(str(tmp_path)) as store:
        assert store.get(A) == ContainerRecord(A, Holding(frozenset({2})), "mesos", "/c", 1, "", "isolated", 1.0, ())
        store.record(ContainerRecord(B, Holding(mig=frozenset({("MIG-1", 0)}))))
        with pytest.raises(GpuAlreadyHeld):
            store.record(ContainerRecord(ContainerId("c"), Holding(mig=frozenset({("MIG-2", 2)}))))
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 2
    db.close()


def test_a_version_2_store_gains_the_cpuset_table_and_keeps_everything(tmp_path):
    with StateStore(str(tmp_path)) as store:
        store.record(ContainerRecord(A, Holding(frozenset({2}), mig=frozenset({("MIG-1", 0)})), created=1.0))
    db = sqlite3.connect(os.path.join(tmp_path, DB_FILE))
    db.executescript("".join(f"DROP TABLE {t};" for t in TABLES_AFTER_2) + "PRAGMA user_version=2;")  # as 2 left it
    db.close()
    with StateStore(str(tmp_path)) as store:
        rec = store.get(A)
        assert rec is not None and rec.holding.gpus == frozenset({2}) and rec.holding.mig == frozenset({("MIG-1", 0)})
        assert (rec.cpus, rec.mems) == ("", "")
        assert store.set_cpuset(A, "0-3", "0").cpus == "0-3"
