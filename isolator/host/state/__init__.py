"""The state store: every name the other layers import from ``isolator.host.state``.

    store.py    StateStore: the durable record of which container holds what (SQLite, WAL, group commit)
    rows.py     a container record as rows, written and read
    marks.py    the marks on GPUs apart from any container: handover drains, health marks, maintenance
    schema.py   the tables version by version, and the one-way migrations
    faults.py   SQLite and OS errors as the typed StateError that says why

What a record holds is a ``model.Holding``; the rows map to it and back.
"""

from isolator.host.state.schema import (
    CGROUP_VERSIONS,
    DB_FILE,
    MIN_SCHEMA,
    SCHEMA_VERSION,
    STATES,
    TABLES_AFTER_2,
    backup_path,
)
from isolator.host.state.store import StateStore
from isolator.model import ContainerRecord, HealthMark

__all__ = [
    "CGROUP_VERSIONS",
    "DB_FILE",
    "MIN_SCHEMA",
    "SCHEMA_VERSION",
    "STATES",
    "TABLES_AFTER_2",
    "ContainerRecord",
    "HealthMark",
    "StateStore",
    "backup_path",
]
