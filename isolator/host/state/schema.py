"""The state store's schema: its tables, version by version, and the one-way migrations between them.

Schema versions (``PRAGMA user_version``) only move forward, and each store also records the oldest
schema a sidecar must know to read and write it (``schema_meta.min_schema``), so that a rollback can
start: an older sidecar opens a newer store whose changes were additive (and logs that it does), and
refuses one that needs more, naming the version and the backup an upgrade keeps of the store as it was
(``<file>.schema-<old>.bak``). docs/operations.md, "Rolling back".
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3

from isolator.errors import StateCorrupt, StateIncompatible
from isolator.host.state.faults import os_error
from isolator.model import CgroupVersion, RecordState

LOG = logging.getLogger("isolator.host.state")  # the name operators know from the logs (docs/operations.md)

DB_FILE = "allocations.sqlite3"
SCHEMA_VERSION = 12
# The oldest schema whose sidecar reads and writes a store of SCHEMA_VERSION correctly. An additive
# migration (new tables or columns that an older sidecar may ignore: rows tied to a container by
# ON DELETE CASCADE, columns with defaults; and newer code that copes with rows an older sidecar
# wrote without them, as after a rollback and a new upgrade) leaves it alone, so a rollback past it
# still starts; a migration that changes what existing rows mean, or that older writes would break,
# raises it to its own SCHEMA_VERSION. 2: MIG devices as units (a schema-1 sidecar would not see
# their holders). A new migration: bump SCHEMA_VERSION, add its script to _MIGRATIONS.
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
    "share_user",
    "share_cut",
    "mps_ended",
)
STATES = tuple(RecordState)  # the container table's CHECK names the same three
CGROUP_VERSIONS = tuple(v.number for v in CgroupVersion)

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


# Version 10: the Unix uid each sharer runs as (docs/sharing.md, "Users"): legacy MPS serves one uid
# per GPU at a time, so placement keeps a single-user MPS GPU's sharers to one uid, across restarts.
# A table of its own, not a column of share_allocation, so that an older sidecar's four-value inserts
# still work: additive. A sharer recorded without a row (by an older sidecar) has an unknown uid, and
# no sharer of another uid is placed beside it (fail closed).
_SCHEMA_V10 = """
CREATE TABLE IF NOT EXISTS share_user (
    container TEXT PRIMARY KEY REFERENCES container (key) ON DELETE CASCADE,
    uid       INTEGER NOT NULL CHECK (uid >= 0)
) WITHOUT ROWID;
"""


# Version 11: how many ways each sharer's GPU was cut when its share was booked (issue 41 item 6): a
# restart whose --shared-gpus cuts a GPU with sharers another way stops (exit 78) instead of changing
# what they hold under them. A table of its own, as share_user: additive. A sharer recorded without a
# row (by an older sidecar) has an unknown cut, and its GPU's cut is not checked at start.
_SCHEMA_V11 = """
CREATE TABLE IF NOT EXISTS share_cut (
    container TEXT PRIMARY KEY REFERENCES container (key) ON DELETE CASCADE,
    cut       INTEGER NOT NULL CHECK (cut >= 1)
) WITHOUT ROWID;
"""


# Version 12: the sharers ended because their GPU's MPS server or daemon was lost (docs/sharing.md,
# "Faults"), with why: a sharer once ended stays ended until its Cleanup, across a restart. The rows
# of a daemon found dead are written before it is started again, so a sidecar killed in between
# still ends them (it adopts a daemon that holds its limits again and would see nothing wrong). A
# table of its own, as share_user: additive. An older sidecar ignores it (after a rollback a lost
# sharer whose end was only recorded runs on until its task ends).
_SCHEMA_V12 = """
CREATE TABLE IF NOT EXISTS mps_ended (
    container TEXT PRIMARY KEY REFERENCES container (key) ON DELETE CASCADE,
    why       TEXT NOT NULL CHECK (why <> '')
) WITHOUT ROWID;
"""


# Each migration as (the newest schema it applies to, its script), oldest first: a store at version V
# runs every script whose schema is V or newer, in order.
_MIGRATIONS = (
    (1, _SCHEMA_V2),
    (2, _SCHEMA_V3),
    (3, _SCHEMA_V4),
    (4, _SCHEMA_V5),
    (5, _SCHEMA_V6),
    (6, _SCHEMA_V7),
    (7, _SCHEMA_V8),
    (8, _SCHEMA_V9),
    (9, _SCHEMA_V10),
    (10, _SCHEMA_V11),
    (11, _SCHEMA_V12),
)


def migrate(db: sqlite3.Connection, path: str, directory: str) -> None:
    """Bring the store at ``path`` to SCHEMA_VERSION, backing it up first; a newer one is checked, not changed."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version == SCHEMA_VERSION:
        return
    if version > SCHEMA_VERSION:
        _check_newer(db, path, directory, version)
        return
    if version < 0:
        raise StateCorrupt(op="open", path=path, cause=f"schema version {version}; this sidecar knows {SCHEMA_VERSION}")
    if version:
        _backup(db, path, directory, version)
    db.execute("BEGIN IMMEDIATE")
    try:
        if version == 0:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
        for after, script in _MIGRATIONS:
            if version <= after:
                for statement in split_sql(script):
                    db.execute(statement)
        db.execute("INSERT OR REPLACE INTO schema_meta VALUES ('min_schema', ?)", (MIN_SCHEMA,))
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    if version:
        LOG.info("state '%s': schema %d migrated to %d", path, version, SCHEMA_VERSION)


def _check_newer(db: sqlite3.Connection, path: str, directory: str, version: int) -> None:
    """A store a newer sidecar wrote: used as it is when its changes were additive, else refused."""
    try:
        row = db.execute("SELECT value FROM schema_meta WHERE key = 'min_schema'").fetchone()
    except sqlite3.OperationalError:
        row = None  # no compatibility record: nothing says this sidecar may write it
    needed = int(row[0]) if row else version
    if needed > SCHEMA_VERSION:
        prefix, suffix = DB_FILE + ".schema-", ".bak"
        kept = [n[len(prefix) : -len(suffix)] for n in os.listdir(directory) if n.startswith(prefix)]
        readable = [int(v) for v in kept if v.isdigit() and int(v) <= SCHEMA_VERSION]
        restore = (
            f"restore '{backup_path(directory, max(readable))}' over '{path}' (the copy the upgrade kept"
            if readable
            else f"restore a backup of '{path}' taken before the upgrade (none is kept here"
        )
        raise StateIncompatible(
            op="open",
            path=path,
            cause=f"schema {version} was written by a newer sidecar and needs a sidecar that knows schema"
            f" {needed} or later (this one knows {SCHEMA_VERSION}): run that version, or, with the sidecar"
            f" stopped, {restore}; containers started since are not in it, the next start rebuilds their records)",
        )
    LOG.warning(
        "state '%s' has schema %d, written by a newer sidecar; this one knows %d and the store needs"
        " schema %d or later: using it as it is (its additions are kept and not used)",
        path,
        version,
        SCHEMA_VERSION,
        needed,
    )


def _backup(db: sqlite3.Connection, path: str, directory: str, version: int) -> None:
    """Copy the store (consistent, through SQLite's backup API) before a migration changes it."""
    kept = backup_path(directory, version)
    tmp = kept + ".tmp"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        copy = sqlite3.connect(tmp)
        try:
            db.backup(copy)
        finally:
            copy.close()
        os.chmod(tmp, 0o600)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, kept)
    except OSError as exc:
        raise os_error("back up the state before migrating it to", kept, exc) from exc
    LOG.info("state '%s': kept a copy at schema %d in '%s' before migrating", path, version, kept)


def split_sql(script: str) -> list[str]:
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
