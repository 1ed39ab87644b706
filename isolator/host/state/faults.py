"""The store's failures as typed errors: an SQLite or OS error turned into the StateError that says why."""

from __future__ import annotations

import errno
import os
import sqlite3

from isolator.errors import StateCorrupt, StateError, StateReadOnly, StateStorageFull

# SQLite primary result codes (sqlite3.h); the extended code's low byte is the primary one.
_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14
_SQLITE_NOTADB = 26


def sqlite_error(op: str, path: str, directory: str, exc: sqlite3.Error) -> StateError:
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    cause = f"{exc} ({getattr(exc, 'sqlite_errorname', type(exc).__name__)})"
    if code == _SQLITE_FULL or (code == _SQLITE_IOERR and _disk_full(directory)):
        return StateStorageFull(op=op, path=path, cause=f"{cause}; the disk holding it is full")
    if code == _SQLITE_READONLY or (code in (_SQLITE_CANTOPEN, _SQLITE_IOERR) and _read_only(directory)):
        # SQLite says only "unable to open database file"; say why, so the operator knows what to fix.
        return StateReadOnly(op=op, path=path, cause=f"{cause}; '{directory}' is read-only")
    if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return StateCorrupt(op=op, path=path, cause=cause)
    return StateError(op=op, path=path, cause=cause)


def os_error(op: str, path: str, exc: OSError) -> StateError:
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
