"""Rollback across a state-schema change: a store records the oldest schema a sidecar must know to
read and write it (``schema_meta.min_schema``). Additive changes leave it alone, so an older sidecar
opens a newer store (and says so); others raise it, and the older sidecar refuses, naming the version
it needs and the backup taken before the upgrade (docs/operations.md, "Rolling back")."""

from __future__ import annotations

import logging
import os
import sqlite3

import pytest

from isolator.errors import StateError, StateIncompatible
from isolator.host.state import DB_FILE, MIN_SCHEMA, SCHEMA_VERSION, TABLES_AFTER_2, StateStore, backup_path
from isolator.model import ContainerId, ContainerRecord, Holding

A, B = ContainerId("a"), ContainerId("b")


def _store_with_a(directory: str) -> None:
    with StateStore(directory) as store:
        store.record(ContainerRecord(A, Holding(frozenset({1})), state="isolated"))


def _raw(directory: str, script: str) -> None:
    db = sqlite3.connect(os.path.join(directory, DB_FILE))
    db.executescript(script)
    db.close()


def _user_version(directory: str) -> int:
    db = sqlite3.connect(os.path.join(directory, DB_FILE))
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def test_an_older_sidecar_opens_and_writes_a_newer_store_whose_changes_were_additive(tmp_path, caplog):
    directory = str(tmp_path)
    _store_with_a(directory)
    newer = SCHEMA_VERSION + 1
    # What a later additive migration does: a new table tied to the containers, a bumped user_version,
    # min_schema untouched.
    _raw(
        directory,
        f"""
        CREATE TABLE future_note (container TEXT PRIMARY KEY REFERENCES container (key) ON DELETE CASCADE,
                                  note TEXT NOT NULL) WITHOUT ROWID;
        INSERT INTO future_note VALUES ('["a"]', 'kept by the newer sidecar');
        PRAGMA user_version={newer};
        """,
    )
    with caplog.at_level(logging.WARNING, logger="isolator.host.state"), StateStore(directory) as store:
        assert store.get(A).holding.gpus == {1}
        store.record(ContainerRecord(B, Holding(frozenset({2}))))
        store.remove(A)  # the newer table's rows go with it (ON DELETE CASCADE)
    assert f"schema {newer}" in caplog.text and "newer sidecar" in caplog.text
    assert f"needs schema {MIN_SCHEMA} or later" in caplog.text
    assert _user_version(directory) == newer, "an older sidecar must not relabel a newer store"
    db = sqlite3.connect(os.path.join(directory, DB_FILE))
    assert db.execute("SELECT count(*) FROM future_note").fetchone()[0] == 0
    db.close()


def test_a_newer_store_that_needs_a_newer_sidecar_is_refused_naming_the_version_and_how_to_roll_back(tmp_path):
    directory = str(tmp_path)
    _store_with_a(directory)
    newer = SCHEMA_VERSION + 1
    _raw(directory, f"UPDATE schema_meta SET value = {newer} WHERE key = 'min_schema'; PRAGMA user_version={newer};")
    with pytest.raises(StateIncompatible) as info:
        StateStore(directory)
    message = info.value.message
    assert f"schema {newer}" in message and f"needs a sidecar that knows schema {newer} or later" in message
    assert f"this one knows {SCHEMA_VERSION}" in message
    assert "backup" in message and DB_FILE in message
    assert info.value.code == "FAILED_PRECONDITION" and isinstance(info.value, StateError)
    assert _user_version(directory) == newer, "a refused store is left as it was"
    # With the copy an upgrade keeps, the message names the file to restore.
    kept = backup_path(directory, SCHEMA_VERSION)
    open(kept, "wb").close()
    with pytest.raises(StateIncompatible, match=f"restore '{kept}' over"):
        StateStore(directory)


def test_a_newer_store_without_its_compatibility_record_is_refused(tmp_path):
    directory = str(tmp_path)
    _store_with_a(directory)
    _raw(directory, "DROP TABLE schema_meta; PRAGMA user_version=99;")
    with pytest.raises(StateIncompatible, match="schema 99"):
        StateStore(directory)


def test_an_upgrade_keeps_a_copy_of_the_store_as_it_was_before_migrating(tmp_path):
    directory = str(tmp_path)
    _store_with_a(directory)
    old = MIN_SCHEMA  # a store as the previous schema left it: no compatibility record
    _raw(directory, "".join(f"DROP TABLE {t};" for t in TABLES_AFTER_2) + f"PRAGMA user_version={old};")
    with StateStore(directory) as store:
        assert store.get(A).holding.gpus == {1}
        store.record(ContainerRecord(B, Holding(frozenset({2}))))
    assert _user_version(directory) == SCHEMA_VERSION
    backup = backup_path(directory, old)
    assert os.path.basename(backup) == f"{DB_FILE}.schema-{old}.bak"
    db = sqlite3.connect(backup)
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == old
        assert db.execute("SELECT key FROM container").fetchall() == [('["a"]',)]
    finally:
        db.close()
    assert oct(os.stat(backup).st_mode & 0o777) == "0o600"


def test_a_fresh_store_records_the_oldest_schema_that_can_use_it(tmp_path):
    StateStore(str(tmp_path)).close()
    db = sqlite3.connect(os.path.join(tmp_path, DB_FILE))
    assert db.execute("SELECT value FROM schema_meta WHERE key = 'min_schema'").fetchone()[0] == MIN_SCHEMA
    db.close()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".bak")], "nothing to back up in a new store"
