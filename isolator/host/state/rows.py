"""A container record as rows: the ``container`` row and the rows of what it holds, written and read
back in one transaction of the store's. The row <-> record mapping lives here and nowhere else."""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterable
from dataclasses import replace

from isolator.devicerule import DeviceRule
from isolator.errors import (
    ContainerNotRecorded,
    GpuAlreadyHeld,
    InvalidArgument,
    RuleParseError,
    StateCorrupt,
)
from isolator.host.state.schema import CGROUP_VERSIONS, STATES
from isolator.model import ContainerId, ContainerRecord, Holding, Mode, RecordState, Share, ShareMode
from isolator.policy.devices import parse_rules

LOG = logging.getLogger("isolator.host.state")
MODES = tuple(ShareMode)


def rules_text(rules: Iterable[DeviceRule]) -> str:
    """A record's rules as stored: one rule a line in the kernel's syntax (the format of every schema version)."""
    return "\n".join(map(str, rules))


def cid_key(cid: ContainerId) -> str:
    return json.dumps(list(cid.chain()), separators=(",", ":"), ensure_ascii=False)


def cid_of(text: str) -> ContainerId:
    return ContainerId.from_chain(json.loads(text))


def validate(rec: ContainerRecord) -> None:
    if rec.state not in STATES:
        raise InvalidArgument(f"unknown container state {rec.state!r} (known: {', '.join(STATES)})")
    if rec.cgroup_version not in CGROUP_VERSIONS:
        raise InvalidArgument(f"cgroup version must be 1 or 2, not {rec.cgroup_version!r}")


def insert_gpus(db: sqlite3.Connection, cid: ContainerId, minors: frozenset[int]) -> None:
    for minor in sorted(minors):
        if isinstance(minor, bool) or not isinstance(minor, int) or minor < 0:
            raise InvalidArgument(f"GPU minor {minor!r} is not a non-negative integer")
        try:
            db.execute("INSERT INTO allocation VALUES (?, ?)", (minor, cid_key(cid)))
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
            holder = str(cid_of(row[0])) if row else "?"
            LOG.error("state: refused GPU %d for %s: already held by %s", minor, cid, holder)
            raise GpuAlreadyHeld(gpu=minor, container=str(cid), holder=holder) from exc


def insert_mig(db: sqlite3.Connection, cid: ContainerId, mig: frozenset[tuple[str, int]]) -> None:
    for uuid, parent in sorted(mig):
        if not isinstance(uuid, str) or not uuid.startswith("MIG-") or isinstance(parent, bool):
            raise InvalidArgument(f"MIG device {uuid!r} is not a MIG UUID with a parent GPU minor")
        if not isinstance(parent, int) or parent < 0:
            raise InvalidArgument(f"parent GPU minor {parent!r} of {uuid} is not a non-negative integer")
        try:
            db.execute("INSERT INTO mig_allocation VALUES (?, ?, ?)", (uuid, parent, cid_key(cid)))
        except sqlite3.IntegrityError as exc:
            if "mig-conflict" in str(exc):
                raise GpuAlreadyHeld(
                    gpu=f"{parent} (parent of {uuid})", container=str(cid), holder="a whole-GPU holder"
                ) from exc
            row = db.execute("SELECT container FROM mig_allocation WHERE uuid = ?", (uuid,)).fetchone()
            holder = str(cid_of(row[0])) if row else "?"
            LOG.error("state: refused MIG device %s for %s: already held by %s", uuid, cid, holder)
            raise GpuAlreadyHeld(gpu=uuid, container=str(cid), holder=holder) from exc


def insert_holding(db: sqlite3.Connection, cid: ContainerId, holding: Holding) -> None:
    """The rows of what ``cid`` holds: a row per whole GPU, per MIG unit, and one for its shares."""
    insert_gpus(db, cid, holding.gpus)
    insert_mig(db, cid, holding.mig)
    if holding.share is not None:
        insert_share(db, cid, holding.share)


def insert_share(db: sqlite3.Connection, cid: ContainerId, share: Share) -> None:
    minor, n = share.gpu, share.count
    if isinstance(minor, bool) or not isinstance(minor, int) or minor < 0:
        raise InvalidArgument(f"shared GPU minor {minor!r} is not a non-negative integer")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument(f"share count {n!r} of GPU {minor} is not a positive integer")
    if share.mode not in MODES:
        raise InvalidArgument(f"unknown sharing mode {share.mode!r} of GPU {minor}")
    uid = share.uid
    if uid is not None and (isinstance(uid, bool) or not isinstance(uid, int) or uid < 0):
        raise InvalidArgument(f"uid {uid!r} of a sharer of GPU {minor} is not a non-negative integer")
    cut = share.cut
    if cut is not None and (isinstance(cut, bool) or not isinstance(cut, int) or cut < 1):
        raise InvalidArgument(f"cut {cut!r} of shared GPU {minor} is not a positive integer")
    try:
        db.execute("INSERT INTO share_allocation VALUES (?, ?, ?, ?)", (cid_key(cid), minor, n, str(share.mode)))
        if uid is None:
            db.execute("DELETE FROM share_user WHERE container = ?", (cid_key(cid),))
        else:
            db.execute("INSERT OR REPLACE INTO share_user VALUES (?, ?)", (cid_key(cid), uid))
        if cut is None:
            db.execute("DELETE FROM share_cut WHERE container = ?", (cid_key(cid),))
        else:
            db.execute("INSERT OR REPLACE INTO share_cut VALUES (?, ?)", (cid_key(cid), cut))
    except sqlite3.IntegrityError as exc:
        row = db.execute("SELECT container FROM allocation WHERE minor = ?", (minor,)).fetchone()
        holder = str(cid_of(row[0])) if row else "?"
        raise GpuAlreadyHeld(gpu=f"{minor} (shared)", container=str(cid), holder=holder) from exc


def share_of(minor: int, count: int, mode: str, uid: int | None = None, cut: int | None = None) -> Share:
    return Share(minor, count, ShareMode(mode), uid, cut)


# A share row with its sharer's uid and its GPU's cut (NULL when an older sidecar recorded it).
SHARES = (
    "SELECT s.container, s.minor, s.shares, s.mode, u.uid, c.cut FROM share_allocation s"
    " LEFT JOIN share_user u ON u.container = s.container"
    " LEFT JOIN share_cut c ON c.container = s.container"
)


def shares_of(db: sqlite3.Connection, key: str) -> Share | None:
    row = db.execute(SHARES + " WHERE s.container = ?", (key,)).fetchone()
    return None if row is None else share_of(*row[1:])


def require(db: sqlite3.Connection, cid: ContainerId) -> None:
    if db.execute("SELECT 1 FROM container WHERE key = ?", (cid_key(cid),)).fetchone() is None:
        raise ContainerNotRecorded(container=str(cid))


def read(db: sqlite3.Connection, path: str, cid: ContainerId) -> ContainerRecord:
    key = cid_key(cid)
    row = db.execute("SELECT * FROM container WHERE key = ?", (key,)).fetchone()
    if row is None:
        raise ContainerNotRecorded(container=str(cid))
    gpus = frozenset(m for (m,) in db.execute("SELECT minor FROM allocation WHERE container = ?", (key,)))
    mig = frozenset(
        (u, m) for u, m in db.execute("SELECT uuid, parent_minor FROM mig_allocation WHERE container = ?", (key,))
    )
    cpuset = db.execute("SELECT cpus, mems FROM cpuset WHERE container = ?", (key,)).fetchone()
    rec = record_of(path, row, Holding(gpus, mig, shares_of(db, key)))
    return replace(rec, cpus=cpuset[0], mems=cpuset[1]) if cpuset else rec


def put_cpuset(db: sqlite3.Connection, cid: ContainerId, cpus: str, mems: str) -> None:
    if bool(cpus) != bool(mems):
        raise InvalidArgument(f"container {cid}: a cpuset needs both CPUs ({cpus!r}) and memory nodes ({mems!r})")
    if cpus:
        db.execute("INSERT INTO cpuset VALUES (?, ?, ?)", (cid_key(cid), cpus, mems))


def record_of(path: str, row: tuple, holding: Holding) -> ContainerRecord:
    text, mode, cgroup, version, volume, state, created, rules = row
    try:
        cid = cid_of(text)
    except (ValueError, TypeError) as exc:
        raise StateCorrupt(op="read", path=path, cause=f"bad container key {text!r}: {exc}") from exc
    try:
        parsed = parse_rules(rules.splitlines())  # parsed here, once: the core sees DeviceRules only
    except RuleParseError as exc:
        raise StateCorrupt(op="read", path=path, cause=f"container {cid}: {exc.message}") from exc
    try:
        known_mode, known_state = Mode(mode), RecordState(state)
    except ValueError as exc:
        raise StateCorrupt(op="read", path=path, cause=f"container {cid}: {exc}") from exc
    return ContainerRecord(cid, holding, known_mode, cgroup, version, volume, known_state, created, parsed)
