"""The durable record of which container holds which GPUs, and what the sidecar did for it.

An SQLite file under the state directory given to the constructor (WAL, synchronous=FULL). Each
write is atomic and durable when its call returns (a ``lazy`` one against the sidecar's death only:
see ``update``). Writes that arrive while another commit is
being fsynced are committed together (group commit): one transaction, one fsync, each write in a
savepoint of its own so that one refused write fails alone. Reads use a second connection and never
wait for a commit. It refuses to record a GPU twice (a primary key on the GPU minor), so a bug above
cannot double-allocate. It decides nothing: allocation and reconciliation live elsewhere. The schema
and its migrations are in schema.py, the rows of a record in rows.py, the GPUs' marks in marks.py.
"""

from __future__ import annotations

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
from isolator.errors import ContainerAlreadyRecorded, ContainerNotRecorded, InvalidArgument, StateCorrupt, StateError
from isolator.host.state import rows
from isolator.host.state.faults import os_error, sqlite_error
from isolator.host.state.marks import Marks
from isolator.host.state.schema import DB_FILE, STATES, migrate
from isolator.model import ContainerId, ContainerRecord, Holding, RecordState

LOG = logging.getLogger("isolator.host.state")  # the name operators know from the logs (docs/operations.md)

T = TypeVar("T")


class StateStore(Marks):
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
        self.lazy_commits = 0  # transactions of lazy writes only, committed without an fsync
        self._durable = durable
        self._lazy_now = False  # the write connection's synchronous level is NORMAL (else FULL or OFF)
        self.writes = 0  # writes committed; writes / commits is the group-commit factor
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise os_error("create state directory", directory, exc) from exc
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
            migrate(self._db, self.path, self.directory)
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

    # ---- writes -------------------------------------------------------------------------------

    def record(self, rec: ContainerRecord) -> None:
        """Record a new container with its GPUs; refused if it or any of its GPUs is already held."""
        rows.validate(rec)

        def write(db: sqlite3.Connection) -> None:
            try:
                db.execute(
                    "INSERT INTO container VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        rows.cid_key(rec.container_id),
                        rec.mode,
                        rec.cgroup,
                        rec.cgroup_version,
                        rec.volume_version,
                        rec.state,
                        rec.created,
                        rows.rules_text(rec.rules),
                    ),
                )
            except sqlite3.IntegrityError as exc:
                raise ContainerAlreadyRecorded(container=str(rec.container_id)) from exc
            rows.insert_holding(db, rec.container_id, rec.holding)
            rows.put_cpuset(db, rec.container_id, rec.cpus, rec.mems)

        self._write("record container", write)

    def set_cpuset(self, cid: ContainerId, cpus: str, mems: str) -> ContainerRecord:
        """Record the cpuset the container is held to ("" and "": none is enforced)."""

        def write(db: sqlite3.Connection) -> ContainerRecord:
            rows.require(db, cid)
            db.execute("DELETE FROM cpuset WHERE container = ?", (rows.cid_key(cid),))
            rows.put_cpuset(db, cid, cpus, mems)
            return rows.read(db, self.path, cid)

        return self._write("record cpuset", write)

    def add_gpus(self, cid: ContainerId, minors: Iterable[int]) -> ContainerRecord:
        """Grow: add GPUs to what the container holds (never replace them)."""
        want = frozenset(minors)

        def write(db: sqlite3.Connection) -> ContainerRecord:
            rows.require(db, cid)
            rows.insert_gpus(db, cid, want)
            return rows.read(db, self.path, cid)

        return self._write("add GPUs", write)

    def remove_gpus(self, cid: ContainerId, minors: Iterable[int]) -> ContainerRecord:
        """Shrink: release GPUs the container holds; releasing one it does not hold is refused."""
        want = frozenset(minors)

        def write(db: sqlite3.Connection) -> ContainerRecord:
            rec = rows.read(db, self.path, cid)
            held = rec.holding.gpus
            stray = sorted(want - held)
            if stray:
                raise InvalidArgument(f"container {cid} does not hold GPUs {stray} (it holds {sorted(held)})")
            db.executemany("DELETE FROM allocation WHERE minor = ?", [(m,) for m in sorted(want)])
            return replace(rec, holding=rec.holding.with_gpus(held - want))

        return self._write("remove GPUs", write)

    def set_holding(self, cid: ContainerId, holding: Holding) -> ContainerRecord:
        """An update's change of what ``cid`` holds (its shares, its MIG units), whole: its rows
        replaced in one transaction, refused like ``record`` for anything another container holds."""

        def write(db: sqlite3.Connection) -> ContainerRecord:
            rows.require(db, cid)
            key = rows.cid_key(cid)
            for table in ("allocation", "mig_allocation", "share_allocation", "share_user", "share_cut"):  # ours
                db.execute(f"DELETE FROM {table} WHERE container = ?", (key,))
            if holding.share is None:
                db.execute("DELETE FROM mps_ended WHERE container = ?", (key,))  # its end goes with its last share
            rows.insert_holding(db, cid, holding)
            return rows.read(db, self.path, cid)

        return self._write("set holding", write)

    def update(
        self,
        cid: ContainerId,
        *,
        state: RecordState | None = None,
        rules: tuple[DeviceRule, ...] | None = None,
        volume_version: str | None = None,
        cgroup: str | None = None,
        lazy: bool = False,
    ) -> ContainerRecord:
        """Change a container's metadata (not its GPUs). ``lazy``: committed without an fsync of its
        own (the port's ``update``): it survives the sidecar's death, and the machine's once a later
        commit (or a checkpoint) has synced the WAL."""
        text = None if rules is None else rows.rules_text(rules)
        changes = {"state": state, "rules": text, "volume_version": volume_version, "cgroup": cgroup}
        changes = {k: v for k, v in changes.items() if v is not None}
        if state is not None and state not in STATES:
            raise InvalidArgument(f"unknown container state {state!r} (known: {', '.join(STATES)})")

        def write(db: sqlite3.Connection) -> ContainerRecord:
            rows.require(db, cid)
            if changes:
                assignments = ", ".join(f"{name} = ?" for name in changes)  # names are ours, not input
                db.execute(f"UPDATE container SET {assignments} WHERE key = ?", (*changes.values(), rows.cid_key(cid)))
            return rows.read(db, self.path, cid)

        return self._write("update container", write, lazy=lazy)

    def remove(self, cid: ContainerId) -> ContainerRecord:
        """Forget a container and release its GPUs; returns what it held."""

        def write(db: sqlite3.Connection) -> ContainerRecord:
            rec = rows.read(db, self.path, cid)
            db.execute("DELETE FROM container WHERE key = ?", (rows.cid_key(cid),))
            return rec

        return self._write("remove container", write)

    def mig_holders(self) -> dict[str, tuple[ContainerId, int]]:
        """MIG UUID -> (the container that holds it, its parent GPU's minor)."""
        with self._reading("read MIG allocations") as db:
            found = db.execute("SELECT uuid, parent_minor, container FROM mig_allocation")
            return {u: (rows.cid_of(k), m) for u, m, k in found}

    def get(self, cid: ContainerId) -> ContainerRecord | None:
        with self._reading("read container") as db:
            try:
                return rows.read(db, self.path, cid)
            except ContainerNotRecorded:
                return None

    def has(self, cid: ContainerId) -> bool:
        with self._reading("read container") as db:
            return db.execute("SELECT 1 FROM container WHERE key = ?", (rows.cid_key(cid),)).fetchone() is not None

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
            shared = {k: rows.share_of(*share) for k, *share in db.execute(rows.SHARES)}
            out: dict[ContainerId, ContainerRecord] = {}
            for row in db.execute("SELECT * FROM container"):
                key = row[0]
                holding = Holding(frozenset(held.get(key, ())), frozenset(migs.get(key, ())), shared.get(key))
                rec = rows.record_of(self.path, row, holding)
                cpus, mems = cpusets.get(row[0], ("", ""))
                out[rec.container_id] = replace(rec, cpus=cpus, mems=mems) if cpus else rec
            return out

    def holders(self) -> dict[int, ContainerId]:
        """GPU minor -> the container that holds it."""
        with self._reading("read allocations") as db:
            return {m: rows.cid_of(k) for m, k in db.execute("SELECT minor, container FROM allocation")}

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

    def _write(self, op: str, fn: Callable[[sqlite3.Connection], T], *, lazy: bool = False) -> T:
        """Run ``fn`` in a transaction that is committed (fsynced) before this returns.

        Group commit: the write is queued; whoever holds the write connection takes every queued
        write, runs each in a savepoint (a refused one rolls back alone and gets its own error),
        and commits them with one fsync. A failed commit fails every write in it, and none happened.
        """
        item = _Write(op, fn, lazy)
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
            # A batch of lazy writes only is committed without an fsync (WAL, synchronous=NORMAL:
            # written to the WAL file, so a killed sidecar loses none of it); any other write in the
            # batch makes it FULL, which syncs the lazy ones with it.
            lazy = self._durable and all(item.lazy for item in batch)
            if lazy != self._lazy_now:
                try:
                    db.execute(f"PRAGMA synchronous={'NORMAL' if lazy else 'FULL'}")
                except sqlite3.Error as exc:
                    raise self._error(batch[0].op, exc) from exc
                self._lazy_now = lazy
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
            if lazy:
                self.lazy_commits += 1
            else:
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

    def _shares_of(self, db: sqlite3.Connection, key: str) -> dict[str, Any]:
        row = db.execute("SELECT minor, shares, mode FROM share_allocation WHERE container = ?", (key,)).fetchone()
        return {} if row is None else {"share_gpu": row[0], "shares": row[1], "share_mode": row[2]}

    def end_mps_sharers(self, ends: dict[ContainerId, str]) -> None:
        """Record sharers ended because their GPU's MPS server or daemon was lost (container -> why), in
        one transaction: each stays ended until its Cleanup, which takes the row with its record (a
        shrink to no share takes it too). A container no longer recorded is passed over; a sharer
        already ended keeps its first reason."""
        if not ends:
            return
        batch = [
            (rows.cid_key(cid), why, rows.cid_key(cid))
            for cid, why in sorted(ends.items(), key=lambda kv: kv[0].chain())
        ]

        def write(db: sqlite3.Connection) -> None:
            db.executemany(
                "INSERT OR IGNORE INTO mps_ended SELECT ?, ? WHERE EXISTS (SELECT 1 FROM container WHERE key = ?)",
                batch,
            )

        self._write("record ended sharers", write)

    def mps_ended(self) -> dict[ContainerId, str]:
        """The sharers recorded as ended by a lost MPS server or daemon (container -> why)."""
        with self._reading("read ended sharers") as db:
            return {rows.cid_of(k): why for k, why in db.execute("SELECT container, why FROM mps_ended")}

    def share_holders(self) -> dict[ContainerId, tuple[int, int, str]]:
        """Container -> (shared GPU minor, shares, mode) of every share holder."""
        with self._reading("read share allocations") as db:
            found = db.execute("SELECT container, minor, shares, mode FROM share_allocation")
            return {rows.cid_of(k): (m, n, mode) for k, m, n, mode in found}

    def _error(self, op: str, exc: sqlite3.Error) -> StateError:
        return sqlite_error(op, self.path, self.directory, exc)


@dataclass
class _Write:
    op: str
    fn: Callable[[sqlite3.Connection], Any]
    lazy: bool = False
    done: bool = False
    result: Any = None
    error: BaseException | None = field(default=None)
