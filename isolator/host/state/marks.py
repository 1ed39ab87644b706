"""The store's marks on GPUs, apart from any container: handover drains, XID/ECC health marks and
maintenance drains. Each is one row a GPU, kept across restarts; deciding on them is the core's job."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

from isolator.errors import InvalidArgument
from isolator.model import DrainRecord, EndedDrain, HealthMark, MaintenanceMark

T = TypeVar("T")


class Marks:
    """The mark tables' reads and writes, over the store's transactions (``StateStore`` provides them)."""

    def _write(self, op: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        raise NotImplementedError

    def _reading(self, op: str) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

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
