"""The durable record of which container holds which GPUs, and what the sidecar did for it.

An SQLite file under the state directory given to the constructor (WAL, synchronous=FULL). Each
write is atomic and durable when its call returns. Writes that arrive while another commit is
being fsynced are committed together (group commit): one transaction, one fsync, each write in a
savepoint of its own so that one refused write fails alone. Reads use a second connection and never
wait for a commit. It refuses to record a GPU twice (a primary key on the GPU minor), so a bug above
cannot double-allocate. It decides nothing: allocation and reconciliation live elsewhere.

Schema versions (``PRAGMA user_version``) only move forward, and each store also records the oldest
schema a sidecar must know to read and write it (``schema_meta.min_schema``), so that a rollback can
start: an older sidecar opens a newer store whose changes were additive (and logs that it does), and
refuses one that needs more, naming the version and the backup an upgrade keeps of the store as it was
(``<file>.schema-<old>.bak``). docs/operations.md, "Rolling back".
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from isolator.crashpoints import crashpoint
from isolator.devicerule import DeviceRule
from isolator.errors import (
    ContainerAlreadyRecorded,
    ContainerNotRecorded,
    GpuAlreadyHeld,
    InvalidArgument,
    RuleParseError,
    StateCorrupt,
    StateError,
    StateIncompatible,
    StateReadOnly,
    StateStorageFull,
)
from isolator.model import ContainerId, ContainerRecord, DrainRecord, EndedDrain, HealthMark, MaintenanceMark
from isolator.policy.devices import parse_rules

LOG = logging.getLogger(__name__)

T = TypeVar("T")

DB_FILE = "allocations.sqlite3"
SCHEMA_VERSION = 9
# The oldest schema whose sidecar reads and writes a store of SCHEMA_VERSION correctly. An additive
# migration (new tables or columns that an older sidecar may ignore: rows tied to a container by
# ON DELETE CASCADE, columns with defaults; and newer code that copes with rows an older sidecar
# wrote without them, as after a rollback and a new upgrade) leaves it alone, so a rollback past it
# still starts; a migration that changes what existing rows mean, or that older writes would break,
# raises it to its own SCHEMA_VERSION. 2: MIG devices as units (a schema-1 sidecar would not see
# their holders). A new migration: bump SCHEMA_VERSION, add an `if version <= <previous>:` step.
MIN_SCHEMA = 2
# The tables schemas after 2 added, newest last (tests rewind a store to schema 2 by dropping them).
TABLES_AFTER_2 = (
    "schema_meta",
    "cpuset",
    "drain",
    "gpu_health_mark",
    "gpu_maintenance",
    "share_allocation",
    "gpu_maintenance_history",
)
STATES = ("prepared", "isolated", "orphan")
CGROUP_VERSIONS = (1, 2)

# SQLite primary result codes (sqlite3.h); the extended code's low byte is the primary one.
_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14
_SQLITE_NOTADB = 26

_SCHEMA = """
CREATE TABLE container (
    key            TEXT PRIMARY KEY,  -- the ID chain as JSON: unambiguous even if IDs contain '.'
    mode           TEXT NOT NULL,
    cgroup         TEXT NOT NULL,
    cgroup_version INTEGER NOT NULL CHECK (cgroup_version IN (1, 2)),
    volume_version TEXT NOT NULL,
    state          TEXT NOT NULL CHECK (state IN ('prepared', 'isolated', 'orphan')),
    created        REAL NOT NULL,
    rules          TEXT NOT NULL
) WITHOUT ROWID;
-- One row per held GPU. The primary key is the isolation invariant: a GPU has at most one holder.
CREATE TABLE allocation (
    minor     INTEGER PRIMARY KEY CHECK (minor >= 0),
    container TEXT NOT NULL REFERENCES container (key) ON DELETE CASCADE
);
CREATE INDEX allocation_by_container ON allocation (container);
"""
# Version 2: MIG devices as units. The primary key gives a MIG device at most one holder; the
# triggers keep a GPU from being held whole and through its MIG devices at once (docs/mig.md).
_SCHEMA_V2 = """
CREATE TABLE mig_allocation (
    uuid         TEXT PRIMARY KEY CHECK (uuid LIKE 'MIG-%'),
    parent_minor INTEGER NOT NULL CHECK (parent_minor >= 0),
    container    TEXT NOT NULL REFERENCES container (key) ON DELETE CASCADE
) WITHOUT ROWID;
CREATE INDEX mig_allocation_by_container ON mig_allocation (container);
CREATE INDEX mig_allocation_by_parent ON mig_allocation (parent_minor);
CREATE TRIGGER whole_gpu_not_while_mig_held BEFORE INSERT ON allocation
WHEN EXISTS (SELECT 1 FROM mig_allocation WHERE parent_minor = NEW.minor)
BEGIN SELECT RAISE(ABORT, 'mig-conflict: GPU has MIG devices held'); END;
CREATE TRIGGER mig_not_while_whole_gpu_held BEFORE INSERT ON mig_allocation
WHEN EXISTS (SELECT 1 FROM allocation WHERE minor = NEW.parent_minor)
BEGIN SELECT RAISE(ABORT, 'mig-conflict: parent GPU is held whole'); END;
"""
# Version 4: the cpuset a container is held to under --cpu-affinity enforce (docs/affinity.md);
# no row when none is enforced. Written before the cpuset is, like the GPUs before their rules. Additive.
_SCHEMA_V4 = """
CREATE TABLE cpuset (
    container TEXT PRIMARY KEY REFERENCES container (key) ON DELETE CASCADE,
    cpus      TEXT NOT NULL CHECK (cpus != ''),
    mems      TEXT NOT NULL CHECK (mems != '')
) WITHOUT ROWID;
"""


# Version 3: the compatibility record above (rollback, docs/operations.md). Additive.
_SCHEMA_V3 = """
CREATE TABLE schema_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
"""


def backup_path(directory: str, version: int) -> str:
    """Where an upgrade keeps the store as it was at schema ``version`` before migrating it."""
    return os.path.join(directory, f"{DB_FILE}.schema-{version}.bak")


# Version 5: GPUs kept out by the handover check (docs/handover.md), so a restart keeps them out
# and keeps their drain clock. Not tied to a container: the container is gone when a GPU drains. Additive.
_SCHEMA_V5 = """
CREATE TABLE drain (
    minor       INTEGER PRIMARY KEY CHECK (minor >= 0),
    since       REAL NOT NULL,
    since_mono  REAL NOT NULL,
    reason      TEXT NOT NULL,
    pids        TEXT NOT NULL,  -- JSON list
    memory_used INTEGER NOT NULL,
    timed_out   INTEGER NOT NULL CHECK (timed_out IN (0, 1))
) WITHOUT ROWID;
"""


# Version 6: XID and double-bit ECC marks, by GPU UUID, so that a GPU taken out of service stays out
# after a restart of the sidecar, until it is reset (isolator/gpu/nvml.py RESET_CLEARS). Additive.
_SCHEMA_V6 = """
CREATE TABLE gpu_health_mark (
    uuid   TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    reason TEXT NOT NULL,
    xid    INTEGER NOT NULL,
    at     REAL NOT NULL
) WITHOUT ROWID;
"""


# Version 7: GPUs an operator drained for maintenance (gpu-isolator drain, docs/operations.md), by
# UUID (a re-enumeration may renumber them), so that a restart or a crash keeps them out. Additive:
# an older sidecar ignores the table (and so hands the GPUs out: the rollback note in operations.md).
_SCHEMA_V7 = """
CREATE TABLE gpu_maintenance (
    uuid   TEXT PRIMARY KEY CHECK (uuid <> ''),
    reason TEXT NOT NULL CHECK (reason <> ''),
    since  REAL NOT NULL,
    by     TEXT NOT NULL
) WITHOUT ROWID;
"""


# Version 8: shares of a GPU (docs/sharing.md), one row per holder. A GPU is never both held whole
# and shared: the triggers refuse either while the other is recorded. Additive, and safe to roll back
# past: a sidecar of schema 7 or older does not see the sharers, so at start it revokes their GPU
# (their record grants none: it fails closed) and its whole-GPU inserts of that GPU meet the trigger.
# The trigger on ``allocation`` outlives a dropped ``share_allocation`` (tests rewind stores so),
# hence IF NOT EXISTS.
_SCHEMA_V8 = """
CREATE TABLE share_allocation (
    container TEXT PRIMARY KEY REFERENCES container (key) ON DELETE CASCADE,
    minor     INTEGER NOT NULL CHECK (minor >= 0),
    shares    INTEGER NOT NULL CHECK (shares >= 1),
    mode      TEXT NOT NULL CHECK (mode IN ('time-slice', 'mps'))
) WITHOUT ROWID;
CREATE INDEX share_allocation_by_minor ON share_allocation (minor);
CREATE TRIGGER IF NOT EXISTS whole_gpu_not_while_shared BEFORE INSERT ON allocation
WHEN EXISTS (SELECT 1 FROM share_allocation WHERE minor = NEW.minor)
BEGIN SELECT RAISE(ABORT, 'share-conflict: GPU has shares held'); END;
CREATE TRIGGER share_not_while_whole_gpu_held BEFORE INSERT ON share_allocation
WHEN EXISTS (SELECT 1 FROM allocation WHERE minor = NEW.minor)
BEGIN SELECT RAISE(ABORT, 'share-conflict: GPU is held whole'); END;
"""


# Version 9: maintenance drains an operator ended, kept as the audit trail (gpu-isolator drain-history):
# the drain's reason, start and caller, and its end's time, caller and reason. Additive: an older
# sidecar ignores the table (its undrains then leave no history). IF NOT EXISTS: tests rewind a
# store to an older schema by dropping only the tables that schema lacked, and this one may stay.
_SCHEMA_V9 = """
CREATE TABLE IF NOT EXISTS gpu_maintenance_history (
    uuid       TEXT NOT NULL CHECK (uuid <> ''),
    reason     TEXT NOT NULL CHECK (reason <> ''),
    since      REAL NOT NULL,
    by         TEXT NOT NULL,
    ended      REAL NOT NULL,
    ended_by   TEXT NOT NULL,
    end_reason TEXT NOT NULL
);
"""


def _rules_text(rules: Iterable[DeviceRule]) -> str:
    """A record's rules as stored: one rule a line in the kernel's syntax (the format of every schema version)."""
    return "\n".join(map(str, rules))


def _key(cid: ContainerId) -> str:
    return json.dumps(list(cid.chain()), separators=(",", ":"), ensure_ascii=False)


def _container_id(key: str) -> ContainerId:
    return ContainerId.from_chain(json.loads(key))


class StateStore:
    """Container -> GPUs and metadata, durable across kill -9 and power loss once a call returns.

    Thread-safe (one lock around one connection). Every method is one transaction: it either
    happens completely or not at all, and a failure raises a typed StateError naming the file.
    """

    def __init__(self, directory: str, *, durable: bool = True) -> None:
        self.directory = directory
        self.path = os.path.join(directory, DB_FILE)
        self._lock = threading.Lock()  # the write connection; whoever holds it commits for everyone queued
        self._read_lock = threading.Lock()
        self._queue: list[_Write] = []
        self._queue_lock = threading.Lock()
        self.commits = 0  # transactions committed (each one fsync), for tests and the benchmark
        self.writes = 0  # writes committed; writes / commits is the group-commit factor
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise _os_error("create state directory", directory, exc) from exc
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
        except sqlite3.Error as exc:
            raise self._error("open", exc) from exc
        try:
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise StateError(op="open", path=self.path, cause=f"journal mode is {mode!r}, WAL is required")
            # FULL: the WAL is fsynced at every commit, so a returned call survives power loss too.
            self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'OFF'}")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            check = self._db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise StateCorrupt(op="check", path=self.path, cause=check)
        except sqlite3.Error as exc:
            self._db.close()
            raise self._error("open", exc) from exc
        except StateError:
            self._db.close()
            raise
        try:
            self._reader = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
            self._reader.execute("PRAGMA foreign_keys=ON")
        except sqlite3.Error as exc:
            self._db.close()
            raise self._error("open", exc) from exc

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            self._check_newer(version)
            return
        if version < 0:
            raise StateCorrupt(
                op="open", path=self.path, cause=f"schema version {version}; this sidecar knows {SCHEMA_VERSION}"
            )
        if version:
            self._backup(version)
        self._db.execute("BEGIN IMMEDIATE")
        try:
            if version == 0:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self._db.execute(statement)
            if version <= 1:
                for statement in _split_sql(_SCHEMA_V2):
                    self._db.execute(statement)
            if version <= 2:
                self._db.execute(_SCHEMA_V3)
            if version <= 3:
                for statement in _split_sql(_SCHEMA_V4):
                    self._db.execute(statement)
            if version <= 4:
                for statement in _split_sql(_SCHEMA_V5):
                    self._db.execute(statement)
            if version <= 5:
                for statement in _split_sql(_SCHEMA_V6):
                    self._db.execute(statement)
            if version <= 6:
                for statement in _split_sql(_SCHEMA_V7):
                    self._db.execute(statement)
            if version <= 7:
                for statement in _split_sql(_SCHEMA_V8):
                    self._db.execute(statement)
            if version <= 8:
                for statement in _split_sql(_SCHEMA_V9):
                    self._db.execute(statement)
            self._db.execute("INSERT OR REPLACE INTO schema_meta VALUES ('min_schema', ?)", (MIN_SCHEMA,))
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        if version:
            LOG.info("state '%s': schema %d migrated to %d", self.path, version, SCHEMA_VERSION)

    def _check_newer(self, version: int) -> None:
        """A store a newer sidecar wrote: used as it is when its changes were additive, else refused."""
        try:
            row = self._db.execute("SELECT value FROM schema_meta WHERE key = 'min_schema'").fetchone()
        except sqlite3.OperationalError:
            row = None  # no compatibility record: nothing says this sidecar may write it
        needed = int(row[0]) if row else version
        if needed > SCHEMA_VERSION:
            prefix, suffix = DB_FILE + ".schema-", ".bak"
            kept = [n[len(prefix) : -len(suffix)] for n in os.listdir(self.directory) if n.startswith(prefix)]
            readable = [int(v) for v in kept if v.isdigit() and int(v) <= SCHEMA_VERSION]
            restore = (
                f"restore '{backup_path(self.directory, max(readable))}' over '{self.path}' (the copy the upgrade kept"
                if readable
                else f"restore a backup of '{self.path}' taken before the upgrade (none is kept here"
            )
            raise StateIncompatible(
                op="open",
                path=self.path,
                cause=f"schema {version} was written by a newer sidecar and needs a sidecar that knows schema"
                f" {needed} or later (this one knows {SCHEMA_VERSION}): run that version, or, with the sidecar"
                f" stopped, {restore}; containers started since are not in it, the next start rebuilds their records)",
            )
        LOG.warning(
            "state '%s' has schema %d, written by a newer sidecar; this one knows %d and the store needs"
            " schema %d or later: using it as it is (its additions are kept and not used)",
            self.path,
            version,
            SCHEMA_VERSION,
            needed,
        )

    def _backup(self, version: int) -> None:
        """Copy the store (consistent, through SQLite's backup API) before a migration changes it."""
        path = backup_path(self.directory, version)
        tmp = path + ".tmp"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            copy = sqlite3.connect(tmp)
            try:
                self._db.backup(copy)
            finally:
                copy.close()
            os.chmod(tmp, 0o600)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            raise _os_error("back up the state before migrating it to", path, exc) from exc
        LOG.info("state '%s': kept a copy at schema %d in '%s' before migrating", self.path, version, path)

    # ---- writes -------------------------------------------------------------------------------

    def record(self, rec: ContainerRecord) -> None:
        """Record a new container with its GPUs; refused if it or any of its GPUs is already held."""
        _validate(rec)

        def write(db: sqlite3.Connection) -> None:
            try:
                db.execute(
                    "INSERT INTO container VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        _key(rec.container_id),
                        rec.mode,
                        rec.cgroup,
                        rec.cgroup_version,
                        rec.volume_version,
                        rec.state,
                        rec.created,
                        _rules_text(rec.rules),
                    ),
                )
            except sqlite3.IntegrityError as exc:
                raise ContainerAlreadyRecorded(container=str(rec.container_id)) from exc
            self._insert_gpus(db, rec.container_id, rec.gpus)
            self._insert_mig(db, rec.container_id, rec.mig)
            self._insert_shares(db, rec)
            self._put_cpuset(db, rec.container_id, rec.cpus, rec.mems)

        self._write("record container", write)

    def set_cpuset(self, cid: ContainerId, cpus: str, mems: str) -> ContainerRecord:
        """Record the cpuset the container is held to ("" and "": none is enforced)."""

        def write(db: sqlite3.Connection) -> ContainerRecord:
            self._require(db, cid)
            db.execute("DELETE FROM cpuset WHERE container = ?", (_key(cid),))
            self._put_cpuset(db, cid, cpus, mems)
            return self._read(db, cid)

        return self._write("record cpuset", write)

    def add_gpus(self, cid: ContainerId, minors: Iterable[int]) -> ContainerRecord:
        """Grow: add GPUs to what the container holds (never replace them)."""
        want = frozenset(minors)

        def write(db: sqlite3.Connection) -> ContainerRecord:
            self._require(db, cid)
            self._insert_gpus(db, cid, want)
            return self._read(db, cid)

        return self._write("add GPUs", write)

    def remove_gpus(self, cid: ContainerId, minors: Iterable[int]) -> ContainerRecord:
        """Shrink: release GPUs the container holds; releasing one it does not hold is refused."""
        want = frozenset(minors)

        def write(db: sqlite3.Connection) -> ContainerRecord:
            rec = self._read(db, cid)
            stray = sorted(want - rec.gpus)
            if stray:
                raise InvalidArgument(f"container {cid} does not hold GPUs {stray} (it holds {sorted(rec.gpus)})")
            db.executemany("DELETE FROM allocation WHERE minor = ?", [(m,) for m in sorted(want)])
            return replace(rec, gpus=rec.gpus - want)

        return self._write("remove GPUs", write)

    def update(
        self,
        cid: ContainerId,
        *,
        state: str | None = None,
        rules: tuple[DeviceRule, ...] | None = None,
        volume_version: str | None = None,
        cgroup: str | None = None,
    ) -> ContainerRecord:
        """Change a container's metadata (not its GPUs)."""
        text = None if rules is None else _rules_text(rules)
        changes = {"state": state, "rules": text, "volume_version": volume_version, "cgroup": cgroup}
        changes = {k: v for k, v in changes.items() if v is not None}
        if state is not None and state not in STATES:
            raise InvalidArgument(f"unknown container state {state!r} (known: {', '.join(STATES)})")

        def write(db: sqlite3.Connection) -> ContainerRecord:
            self._require(db, cid)
            if changes:
                assignments = ", ".join(f"{name} = ?" for name in changes)  # names are ours, not input
                db.execute(f"UPDATE container SET {assignments} WHERE key = ?", (*changes.values(), _key(cid)))
            return self._read(db, cid)

        return self._write("update container", write)

    def remove(self, cid: ContainerId) -> ContainerRecord:
        """Forget a container and release its GPUs; returns what it held."""

        def write(db: sqlite3.Connection) -> ContainerRecord:
            rec = self._read(db, cid)
            db.execute("DELETE FROM container WHERE key = ?", (_key(cid),))
            return rec

        return self._write("remove container", write)

    def set_drain(self, rec: DrainRecord) -> None:
        """Record (or replace) GPU ``rec.minor``'s drain row."""
        if isinstance(rec.minor, bool) or not isinstance(rec.minor, int) or rec.minor < 0:
            raise InvalidArgument(f"GPU minor {rec.minor!r} is not a non-negative integer")
        row = (
            rec.minor,
            rec.since,
            rec.since_mono,
            rec.reason,
            json.dumps(list(rec.pids)),
            rec.memory_used,
            int(rec.timed_out),
        )

        def write(db: sqlite3.Connection) -> None:
            db.execute("INSERT OR REPLACE INTO drain VALUES (?, ?, ?, ?, ?, ?, ?)", row)

        self._write("record drain", write)

    def clear_drain(self, minor: int) -> None:
        def write(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM drain WHERE minor = ?", (minor,))

        self._write("clear drain", write)

    # ---- reads ----------------------------------------------------------------------------------

    def drains(self) -> dict[int, DrainRecord]:
        with self._reading("read drains") as db:
            rows = db.execute("SELECT minor, since, since_mono, reason, pids, memory_used, timed_out FROM drain")
            return {
                m: DrainRecord(m, since, mono, reason, tuple(json.loads(pids)), used, bool(timed_out))
                for m, since, mono, reason, pids, used, timed_out in rows
            }

    def put_health_mark(self, mark: HealthMark) -> None:
        """Remember (or replace) a GPU's XID/ECC mark."""

        def write(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT OR REPLACE INTO gpu_health_mark VALUES (?, ?, ?, ?, ?)",
                (mark.uuid, mark.source, mark.reason, int(mark.xid), float(mark.at)),
            )

        self._write("record GPU health", write)

    def drop_health_mark(self, uuid: str) -> None:
        """Forget a GPU's mark (it was reset and is healthy again); nothing if it had none."""
        self._write("clear GPU health", lambda db: db.execute("DELETE FROM gpu_health_mark WHERE uuid = ?", (uuid,)))

    def health_marks(self) -> list[HealthMark]:
        with self._reading("read GPU health") as db:
            return [HealthMark(*row) for row in db.execute("SELECT uuid, source, reason, xid, at FROM gpu_health_mark")]

    def set_maintenance(self, mark: MaintenanceMark) -> None:
        """Record (or replace) a GPU's maintenance drain."""
        if not mark.uuid or not mark.reason:
            raise InvalidArgument("a maintenance drain needs a GPU UUID and a reason")
        row = (mark.uuid, mark.reason, float(mark.since), mark.by)

        def write(db: sqlite3.Connection) -> None:
            db.execute("INSERT OR REPLACE INTO gpu_maintenance VALUES (?, ?, ?, ?)", row)

        self._write("record maintenance drain", write)

    def clear_maintenance(self, uuid: str) -> None:
        """End a GPU's maintenance drain; nothing if it had none."""

        def write(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM gpu_maintenance WHERE uuid = ?", (uuid,))

        self._write("clear maintenance drain", write)

    def end_maintenance(self, ended: EndedDrain) -> None:
        """End a GPU's maintenance drain and keep it in the history, in one transaction."""
        if not ended.uuid or not ended.reason:
            raise InvalidArgument("an ended drain needs a GPU UUID and its reason")
        row = (ended.uuid, ended.reason, float(ended.since), ended.by, float(ended.ended))

        def write(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM gpu_maintenance WHERE uuid = ?", (ended.uuid,))
            db.execute(
                "INSERT INTO gpu_maintenance_history VALUES (?, ?, ?, ?, ?, ?, ?)",
                (*row, ended.ended_by, ended.end_reason),
            )

        self._write("end maintenance drain", write)

    def maintenance_history(self) -> list[EndedDrain]:
        """The ended maintenance drains, oldest end first."""
        with self._reading("read maintenance history") as db:
            rows = db.execute(
                "SELECT uuid, reason, since, by, ended, ended_by, end_reason FROM gpu_maintenance_history"
                " ORDER BY ended, rowid"
            )
            return [EndedDrain(*row) for row in rows]

    def maintenance(self) -> dict[str, MaintenanceMark]:
        """GPU UUID -> its maintenance drain."""
        with self._reading("read maintenance drains") as db:
            rows = db.execute("SELECT uuid, reason, since, by FROM gpu_maintenance")
            return {u: MaintenanceMark(u, reason, since, by) for u, reason, since, by in rows}

    def mig_holders(self) -> dict[str, tuple[ContainerId, int]]:
        """MIG UUID -> (the container that holds it, its parent GPU's minor)."""
        with self._reading("read MIG allocations") as db:
            rows = db.execute("SELECT uuid, parent_minor, container FROM mig_allocation")
            return {u: (_container_id(k), m) for u, m, k in rows}

    def get(self, cid: ContainerId) -> ContainerRecord | None:
        with self._reading("read container") as db:
            try:
                return self._read(db, cid)
            except ContainerNotRecorded:
                return None

    def load(self) -> dict[ContainerId, ContainerRecord]:
        """Every recorded container: two indexed scans, whatever the count."""
        with self._reading("load state") as db:
            held: dict[str, set[int]] = {}
            for minor, key in db.execute("SELECT minor, container FROM allocation"):
                held.setdefault(key, set()).add(minor)
            migs: dict[str, set[tuple[str, int]]] = {}
            for uuid, parent, key in db.execute("SELECT uuid, parent_minor, container FROM mig_allocation"):
                migs.setdefault(key, set()).add((uuid, parent))
            cpusets = {k: (c, m) for k, c, m in db.execute("SELECT container, cpus, mems FROM cpuset")}
            shared = {
                k: {"share_gpu": m, "shares": n, "share_mode": mode}
                for k, m, n, mode in db.execute("SELECT container, minor, shares, mode FROM share_allocation")
            }
            out: dict[ContainerId, ContainerRecord] = {}
            for row in db.execute("SELECT * FROM container"):
                rec = self._row(row, frozenset(held.get(row[0], ())), frozenset(migs.get(row[0], ())))
                if row[0] in shared:
                    rec = replace(rec, **shared[row[0]])
                cpus, mems = cpusets.get(row[0], ("", ""))
                out[rec.container_id] = replace(rec, cpus=cpus, mems=mems) if cpus else rec
            return out

    def holders(self) -> dict[int, ContainerId]:
        """GPU minor -> the container that holds it."""
        with self._reading("read allocations") as db:
            return {m: _container_id(k) for m, k in db.execute("SELECT minor, container FROM allocation")}

    def check(self) -> str:
        """SQLite's integrity_check plus foreign-key check: "ok" or what is wrong."""
        with self._reading("check state") as db:
            result = "; ".join(r[0] for r in db.execute("PRAGMA integrity_check"))
            dangling = db.execute("PRAGMA foreign_key_check").fetchall()
            return result if not dangling else f"{result}; {len(dangling)} allocations without a container"

    def close(self) -> None:
        with self._lock, self._read_lock:
            self._db.close()
            self._reader.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------------

    @contextmanager
    def _reading(self, op: str) -> Iterator[sqlite3.Connection]:
        """A read transaction on the read connection: a snapshot of every commit that has returned."""
        with self._read_lock:
            try:
                self._reader.execute("BEGIN")
            except sqlite3.Error as exc:
                raise self._error(op, exc) from exc
            try:
                yield self._reader
                self._reader.execute("COMMIT")
            except BaseException as exc:
                self._rollback(self._reader)
                if isinstance(exc, sqlite3.Error):
                    raise self._error(op, exc) from exc
                raise

    def _write(self, op: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in a transaction that is committed (fsynced) before this returns.

        Group commit: the write is queued; whoever holds the write connection takes every queued
        write, runs each in a savepoint (a refused one rolls back alone and gets its own error),
        and commits them with one fsync. A failed commit fails every write in it, and none happened.
        """
        item = _Write(op, fn)
        with self._queue_lock:
            self._queue.append(item)
        with self._lock:
            if not item.done:
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                self._commit(batch)
        if item.error is not None:
            raise item.error
        return item.result

    def _commit(self, batch: list[_Write]) -> None:
        db = self._db
        try:
            try:
                # IMMEDIATE takes the write lock up front, so a second sidecar on the same file waits
                # (busy timeout) rather than failing halfway through.
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self._error(batch[0].op, exc) from exc
            for i, item in enumerate(batch):
                db.execute(f"SAVEPOINT w{i}")
                try:
                    item.result = item.fn(db)
                    db.execute(f"RELEASE w{i}")
                except Exception as exc:
                    db.execute(f"ROLLBACK TO w{i}")
                    db.execute(f"RELEASE w{i}")
                    item.error = self._error(item.op, exc) if isinstance(exc, sqlite3.Error) else exc
            crashpoint("state.commit")
            try:
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                raise self._error(batch[0].op, exc) from exc
            self.commits += 1
            self.writes += sum(1 for item in batch if item.error is None)
        except BaseException as exc:
            self._rollback(db)
            for item in batch:
                item.result, item.error = None, exc
        finally:
            for item in batch:
                item.done = True

    def _rollback(self, db: sqlite3.Connection) -> None:
        try:
            if db.in_transaction:
                db.execute("ROLLBACK")
        except sqlite3.Error as exc:  # the original error is the one to report
            LOG.error("state: rollback of %s failed: %s", self.path, exc)

    def _insert_gpus(self, db: sqlite3.Connection, cid: ContainerId, minors: frozenset[int]) -> None:
        for minor in sorted(minors):
            if isinstance(minor, bool) or not isinstance(minor, int) or minor < 0:
                raise InvalidArgument(f"GPU minor {minor!r} is not a non-negative integer")
            try:
                db.execute("INSERT INTO allocation VALUES (?, ?)", (minor, _key(cid)))
            except sqlite3.IntegrityError as exc:
                row = db.execute("SELECT container FROM allocation WHERE minor = ?", (minor,)).fetchone()
                if row is None:  # the trigger: MIG devices of this GPU are held
                    row = db.execute(
                        "SELECT container FROM mig_allocation WHERE parent_minor = ? ORDER BY uuid", (minor,)
                    ).fetchone()
                if row is None:  # the trigger: shares of this GPU are held
                    row = db.execute(
                        "SELECT container FROM share_allocation WHERE minor = ? ORDER BY container", (minor,)
                    ).fetchone()
                holder = str(_container_id(row[0])) if row else "?"
                LOG.error("state: refused GPU %d for %s: already held by %s", minor, cid, holder)
                raise GpuAlreadyHeld(gpu=minor, container=str(cid), holder=holder) from exc

    def _insert_mig(self, db: sqlite3.Connection, cid: ContainerId, mig: frozenset[tuple[str, int]]) -> None:
        for uuid, parent in sorted(mig):
            if not isinstance(uuid, str) or not uuid.startswith("MIG-") or isinstance(parent, bool):
                raise InvalidArgument(f"MIG device {uuid!r} is not a MIG UUID with a parent GPU minor")
            if not isinstance(parent, int) or parent < 0:
                raise InvalidArgument(f"parent GPU minor {parent!r} of {uuid} is not a non-negative integer")
            try:
                db.execute("INSERT INTO mig_allocation VALUES (?, ?, ?)", (uuid, parent, _key(cid)))
            except sqlite3.IntegrityError as exc:
                if "mig-conflict" in str(exc):
                    raise GpuAlreadyHeld(
                        gpu=f"{parent} (parent of {uuid})", container=str(cid), holder="a whole-GPU holder"
                    ) from exc
                row = db.execute("SELECT container FROM mig_allocation WHERE uuid = ?", (uuid,)).fetchone()
                holder = str(_container_id(row[0])) if row else "?"
                LOG.error("state: refused MIG device %s for %s: already held by %s", uuid, cid, holder)
                raise GpuAlreadyHeld(gpu=uuid, container=str(cid), holder=holder) from exc

    def _insert_shares(self, db: sqlite3.Connection, rec: ContainerRecord) -> None:
        if not rec.shares:
            return
        minor, n = rec.share_gpu, rec.shares
        if isinstance(minor, bool) or not isinstance(minor, int) or minor < 0:
            raise InvalidArgument(f"shared GPU minor {minor!r} is not a non-negative integer")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"share count {n!r} of GPU {minor} is not a positive integer")
        if rec.share_mode not in ("time-slice", "mps"):
            raise InvalidArgument(f"unknown sharing mode {rec.share_mode!r} of GPU {minor}")
        try:
            db.execute(
                "INSERT INTO share_allocation VALUES (?, ?, ?, ?)", (_key(rec.container_id), minor, n, rec.share_mode)
            )
        except sqlite3.IntegrityError as exc:
            row = db.execute("SELECT container FROM allocation WHERE minor = ?", (minor,)).fetchone()
            holder = str(_container_id(row[0])) if row else "?"
            raise GpuAlreadyHeld(gpu=f"{minor} (shared)", container=str(rec.container_id), holder=holder) from exc

    def _shares_of(self, db: sqlite3.Connection, key: str) -> dict[str, Any]:
        row = db.execute("SELECT minor, shares, mode FROM share_allocation WHERE container = ?", (key,)).fetchone()
        return {} if row is None else {"share_gpu": row[0], "shares": row[1], "share_mode": row[2]}

    def share_holders(self) -> dict[ContainerId, tuple[int, int, str]]:
        """Container -> (shared GPU minor, shares, mode) of every share holder."""
        with self._reading("read share allocations") as db:
            rows = db.execute("SELECT container, minor, shares, mode FROM share_allocation")
            return {_container_id(k): (m, n, mode) for k, m, n, mode in rows}

    def _require(self, db: sqlite3.Connection, cid: ContainerId) -> None:
        if db.execute("SELECT 1 FROM container WHERE key = ?", (_key(cid),)).fetchone() is None:
            raise ContainerNotRecorded(container=str(cid))

    def _read(self, db: sqlite3.Connection, cid: ContainerId) -> ContainerRecord:
        key = _key(cid)
        row = db.execute("SELECT * FROM container WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise ContainerNotRecorded(container=str(cid))
        gpus = frozenset(m for (m,) in db.execute("SELECT minor FROM allocation WHERE container = ?", (key,)))
        mig = frozenset(
            (u, m) for u, m in db.execute("SELECT uuid, parent_minor FROM mig_allocation WHERE container = ?", (key,))
        )
        cpuset = db.execute("SELECT cpus, mems FROM cpuset WHERE container = ?", (key,)).fetchone()
        rec = replace(self._row(row, gpus, mig), **self._shares_of(db, key))
        return replace(rec, cpus=cpuset[0], mems=cpuset[1]) if cpuset else rec

    def _put_cpuset(self, db: sqlite3.Connection, cid: ContainerId, cpus: str, mems: str) -> None:
        if bool(cpus) != bool(mems):
            raise InvalidArgument(f"container {cid}: a cpuset needs both CPUs ({cpus!r}) and memory nodes ({mems!r})")
        if cpus:
            db.execute("INSERT INTO cpuset VALUES (?, ?, ?)", (_key(cid), cpus, mems))

    def _row(self, row: tuple, gpus: frozenset[int], mig: frozenset[tuple[str, int]] = frozenset()) -> ContainerRecord:
        key, mode, cgroup, version, volume, state, created, rules = row
        try:
            cid = _container_id(key)
        except (ValueError, TypeError) as exc:
            raise StateCorrupt(op="read", path=self.path, cause=f"bad container key {key!r}: {exc}") from exc
        try:
            parsed = parse_rules(rules.splitlines())  # parsed here, once: the core sees DeviceRules only
        except RuleParseError as exc:
            raise StateCorrupt(op="read", path=self.path, cause=f"container {cid}: {exc.message}") from exc
        return ContainerRecord(cid, gpus, mode, cgroup, version, volume, state, created, parsed, mig)

    def _error(self, op: str, exc: sqlite3.Error) -> StateError:
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        cause = f"{exc} ({getattr(exc, 'sqlite_errorname', type(exc).__name__)})"
        if code == _SQLITE_FULL or (code == _SQLITE_IOERR and _disk_full(self.directory)):
            return StateStorageFull(op=op, path=self.path, cause=f"{cause}; the disk holding it is full")
        if code == _SQLITE_READONLY or (code in (_SQLITE_CANTOPEN, _SQLITE_IOERR) and _read_only(self.directory)):
            # SQLite says only "unable to open database file"; say why, so the operator knows what to fix.
            return StateReadOnly(op=op, path=self.path, cause=f"{cause}; '{self.directory}' is read-only")
        if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            return StateCorrupt(op=op, path=self.path, cause=cause)
        return StateError(op=op, path=self.path, cause=cause)


def _split_sql(script: str) -> list[str]:
    """Statements of a script whose triggers contain ';' inside BEGIN ... END."""
    out: list[str] = []
    current = ""
    for part in script.split(";"):
        current += part + ";"
        if sqlite3.complete_statement(current):
            if current.strip(" \n;"):
                out.append(current.strip())
            current = ""
    return out


@dataclass
class _Write:
    op: str
    fn: Callable[[sqlite3.Connection], Any]
    done: bool = False
    result: Any = None
    error: BaseException | None = field(default=None)


def _validate(rec: ContainerRecord) -> None:
    if rec.state not in STATES:
        raise InvalidArgument(f"unknown container state {rec.state!r} (known: {', '.join(STATES)})")
    if rec.cgroup_version not in CGROUP_VERSIONS:
        raise InvalidArgument(f"cgroup version must be 1 or 2, not {rec.cgroup_version!r}")


def _os_error(op: str, path: str, exc: OSError) -> StateError:
    cause = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StateStorageFull(op=op, path=path, cause=cause)
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return StateReadOnly(op=op, path=path, cause=cause)
    return StateError(op=op, path=path, cause=cause)


def _disk_full(directory: str) -> bool:
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail == 0 or st.f_favail == 0


def _read_only(directory: str) -> bool:
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return bool(st.f_flag & os.ST_RDONLY) or not os.access(directory, os.W_OK)
