"""The state store (store.py): every name the other layers import from ``isolator.host.state``."""

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
