"""The durable allocation store: round trips, the one-holder-per-GPU rule, kill -9 at any instant,
10,000 records, and typed errors on a full or read-only disk."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

import paths
import pytest

from isolator.devicerule import DeviceRule
from isolator.errors import (
    ContainerAlreadyRecorded,
    ContainerNotRecorded,
    GpuAlreadyHeld,
    InvalidArgument,
    StateCorrupt,
    StateIncompatible,
    StateReadOnly,
    StateStorageFull,
)
from isolator.host.state import DB_FILE, ContainerRecord, StateStore
from isolator.model import ContainerId, Holding

REPO = paths.ROOT


def cid(value: str, parent: ContainerId | None = None) -> ContainerId:
    return ContainerId.parse(value, parent)


@pytest.fixture
def store(tmp_path) -> Iterator[StateStore]:
    with StateStore(str(tmp_path / "state")) as s:
        yield s


def test_a_record_round_trips_with_all_its_metadata(tmp_path):
    parent = cid("exec-1")
    rec = ContainerRecord(
        cid("task.with.dots", parent),
        Holding(frozenset({3, 1})),
        mode="standalone",
        cgroup="/sys/fs/cgroup/mesos/exec-1",
        cgroup_version=2,
        volume_version="550.54.14",
        state="isolated",
        created=1700000000.5,
        rules=(DeviceRule.char(195, 1, "rw"), DeviceRule.char(195, 3, "rw")),
    )
    with StateStore(str(tmp_path)) as s:
        s.record(rec)
    with StateStore(str(tmp_path)) as s:
        assert s.get(rec.container_id) == rec
        assert s.load() == {rec.container_id: rec}
        assert s.holders() == {1: rec.container_id, 3: rec.container_id}


def test_rules_are_stored_as_the_kernel_prints_them_and_read_back_as_device_rules(tmp_path):
    # The on-disk format is unchanged (one rule a line, kernel syntax): a record an older sidecar
    # wrote reads back structured, parsed once here; a record written now reads the same in SQL.
    with StateStore(str(tmp_path)) as s:
        s.record(
            ContainerRecord(cid("new"), Holding(frozenset({0})), rules=(DeviceRule.char(195, 0), DeviceRule.parse("a")))
        )
    raw = sqlite3.connect(str(tmp_path / DB_FILE))
    with raw:
        raw.execute(
            "INSERT INTO container VALUES (?, 'mesos', '/c', 1, '', 'isolated', 1.0, ?)",
            ('["old"]', "c *:* m\nc 195:255 rw\nc 195:1 rwm\n"),
        )
        raw.execute("INSERT INTO container VALUES (?, 'mesos', '/c', 1, '', 'prepared', 1.0, '')", ('["none"]',))
    assert raw.execute("SELECT rules FROM container WHERE key = ?", ('["new"]',)).fetchone() == (
        "c 195:0 rwm\na *:* rwm",
    )
    raw.close()
    with StateStore(str(tmp_path)) as s:
        assert s.get(cid("old")).rules == (  # type: ignore[union-attr]
            DeviceRule("c", None, None, "m"),
            DeviceRule.char(195, 255, "rw"),
            DeviceRule.char(195, 1),
        )
        assert s.get(cid("none")).rules == ()  # type: ignore[union-attr]
        assert s.load()[cid("new")].rules == (DeviceRule.char(195, 0), DeviceRule("a", None, None))


def test_a_record_whose_rules_do_not_parse_is_corrupt_not_an_empty_grant(tmp_path):
    with StateStore(str(tmp_path)):
        pass
    raw = sqlite3.connect(str(tmp_path / DB_FILE))
    with raw:
        raw.execute("INSERT INTO container VALUES ('[\"a\"]', 'mesos', '/c', 1, '', 'isolated', 1.0, 'c 195:x rw')")
    raw.close()
    with StateStore(str(tmp_path)) as s, pytest.raises(StateCorrupt, match=r"container a: invalid device rule"):
        s.get(cid("a"))


def test_a_gpu_is_never_recorded_for_two_containers(store):
    store.record(ContainerRecord(cid("a"), Holding(frozenset({0, 1}))))
    with pytest.raises(GpuAlreadyHeld, match="GPU 1 for container b: it is already held by a"):
        store.record(ContainerRecord(cid("b"), Holding(frozenset({1, 2}))))
    assert store.get(cid("b")) is None  # the whole record was rolled back, GPU 2 included
    assert store.holders() == {0: cid("a"), 1: cid("a")}


def test_growing_into_a_held_gpu_is_refused_and_changes_nothing(store):
    store.record(ContainerRecord(cid("a"), Holding(frozenset({0}))))
    store.record(ContainerRecord(cid("b"), Holding(frozenset({1}))))
    with pytest.raises(GpuAlreadyHeld):
        store.add_gpus(cid("b"), {2, 0})
    assert store.get(cid("b")).holding.gpus == {1}


def test_the_database_itself_refuses_a_second_holder(store):
    # Even a bug that bypasses the store's methods cannot give a GPU two holders.
    store.record(ContainerRecord(cid("a"), Holding(frozenset({4}))))
    store.record(ContainerRecord(cid("b")))
    raw = sqlite3.connect(store.path)
    with pytest.raises(sqlite3.IntegrityError):
        raw.execute("""INSERT INTO allocation VALUES (4, '["b"]')""")
    raw.close()


def test_growing_adds_to_what_is_held_and_shrinking_releases_only_the_named_gpus(store):
    store.record(ContainerRecord(cid("a"), Holding(frozenset({0}))))
    assert store.add_gpus(cid("a"), {2, 3}).holding.gpus == {0, 2, 3}
    assert store.remove_gpus(cid("a"), {2}).holding.gpus == {0, 3}
    with pytest.raises(InvalidArgument, match=r"does not hold GPUs \[5\]"):
        store.remove_gpus(cid("a"), {5, 0})
    assert store.get(cid("a")).holding.gpus == {0, 3}


def test_removing_a_container_releases_its_gpus(store):
    store.record(ContainerRecord(cid("a"), Holding(frozenset({0, 1}))))
    assert store.remove(cid("a")).holding.gpus == {0, 1}
    store.record(ContainerRecord(cid("b"), Holding(frozenset({0, 1}))))
    with pytest.raises(ContainerNotRecorded):
        store.remove(cid("a"))


def test_recording_a_container_twice_is_refused(store):
    store.record(ContainerRecord(cid("a")))
    with pytest.raises(ContainerAlreadyRecorded):
        store.record(ContainerRecord(cid("a"), Holding(frozenset({1}))))
    assert store.holders() == {}


def test_metadata_updates_keep_the_gpus_and_refuse_unknown_states(store):
    store.record(ContainerRecord(cid("a"), Holding(frozenset({2}))))
    rec = store.update(cid("a"), state="orphan", rules=(DeviceRule.char(195, 2),))
    assert (rec.state, rec.rules, rec.holding.gpus) == ("orphan", (DeviceRule.char(195, 2),), {2})
    with pytest.raises(InvalidArgument, match="unknown container state 'gone'"):
        store.update(cid("a"), state="gone")
    with pytest.raises(ContainerNotRecorded):
        store.update(cid("b"), state="isolated")


@pytest.mark.parametrize("minor", [-1, "3", True])
def test_bad_gpu_minors_are_refused(store, minor):
    with pytest.raises(InvalidArgument):
        store.record(ContainerRecord(cid("a"), Holding(frozenset({minor}))))
    assert store.get(cid("a")) is None


def test_ten_thousand_records_load_intact(tmp_path):
    directory = str(tmp_path)
    with StateStore(directory, durable=False) as s:
        for i in range(10_000):
            s.record(ContainerRecord(cid(f"c{i}"), Holding(frozenset({i}) if i % 2 else frozenset()), state="isolated"))
    with StateStore(directory) as s:
        loaded = s.load()
    assert len(loaded) == 10_000
    assert loaded[cid("c9999")].holding.gpus == {9999}
    assert sum(len(r.holding.gpus) for r in loaded.values()) == 5_000


def test_a_file_that_is_not_a_database_is_reported_as_corrupt(tmp_path):
    (tmp_path / DB_FILE).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StateCorrupt, match=f"failed to open '{tmp_path / DB_FILE}'"):
        StateStore(str(tmp_path))


def test_a_newer_schema_that_needs_a_newer_sidecar_is_refused_rather_than_misread(tmp_path):
    StateStore(str(tmp_path)).close()
    raw = sqlite3.connect(str(tmp_path / DB_FILE))
    raw.execute("UPDATE schema_meta SET value = 99 WHERE key = 'min_schema'")
    raw.execute("PRAGMA user_version=99")
    raw.commit()
    raw.close()
    with pytest.raises(StateIncompatible, match="schema 99 was written by a newer sidecar"):
        StateStore(str(tmp_path))


# ---- kill -9 ----------------------------------------------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import sys
    from isolator.model import ContainerId, Holding
    from isolator.host.state import ContainerRecord, StateStore
    store = StateStore(sys.argv[1])
    i = int(sys.argv[2])
    while True:
        # Four containers live at a time, two GPUs each, cycling through eight GPUs; every fourth
        # step shrinks and grows one of them. Each line on stdout is a committed step.
        pair = {2 * (i % 4), 2 * (i % 4) + 1}
        holder = store.holders().get(max(pair))
        if holder is not None:
            store.remove(holder)
        store.record(ContainerRecord(ContainerId.parse(f"c{i}"), Holding(frozenset(pair)), state="isolated"))
        if i % 4 == 3:
            store.remove_gpus(ContainerId.parse(f"c{i}"), {min(pair)})
            store.add_gpus(ContainerId.parse(f"c{i}"), {min(pair)})
        print(i, flush=True)
        i += 1
    """
)


def test_state_survives_kill_9_at_any_instant_with_no_gpu_held_twice(tmp_path):
    directory = str(tmp_path / "state")
    rng = random.Random(20240611)
    env = {**os.environ, "PYTHONPATH": REPO}
    start = 0
    for _ in range(4):
        child = subprocess.Popen(
            [sys.executable, "-c", _WRITER, directory, str(start)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert child.stdout is not None
        stop_after = rng.randint(5, 60)
        last = None
        for _, line in zip(range(stop_after), child.stdout, strict=False):
            last = int(line)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        # The writer ran on between our last read and the kill: every line it printed before dying
        # is an acknowledged commit, so the last one printed is the one that must be there.
        for line in child.stdout:
            last = int(line)
        child.stdout.close()
        assert last is not None, "the writer committed nothing"
        with StateStore(directory) as s:
            assert s.check() == "ok"
            records = s.load()
            held = [m for r in records.values() for m in r.holding.gpus]
            assert len(held) == len(set(held))  # no GPU held twice
            assert set(held) <= set(range(8))
            # Every acknowledged commit is there; at most the one in flight is beyond it.
            assert records[cid(f"c{last}")].holding.gpus == {2 * (last % 4), 2 * (last % 4) + 1}
            live = sorted(int(k.value[1:]) for k in records)
            assert live[-1] in (last, last + 1)
            assert all(r.state == "isolated" for r in records.values())
        start = live[-1] + 1  # the next writer carries on from what survived


# ---- full and read-only disks (a small tmpfs made for the test) --------------------------------------


@contextmanager
def tmpfs(size: str) -> Iterator[str]:
    mountpoint = tempfile.mkdtemp(prefix="gi-state-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", mountpoint], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", mountpoint], check=False)
        os.rmdir(mountpoint)


@pytest.mark.root
def test_a_full_disk_gives_a_typed_error_and_loses_nothing_committed():
    with tmpfs("256k") as mnt:
        directory = os.path.join(mnt, "state")
        with StateStore(directory) as s:
            written = 0
            with pytest.raises(StateStorageFull, match=f"failed to record container '{directory}/{DB_FILE}'"):
                for i in range(10_000):
                    s.record(
                        ContainerRecord(cid(f"c{i}"), Holding(frozenset({i})), rules=(DeviceRule.char(195, 0),) * 200)
                    )
                    written += 1
            assert written > 0
            err_code = StateStorageFull.code
            assert err_code == "RESOURCE_EXHAUSTED"
        with StateStore(directory) as s:
            loaded = s.load()
            assert s.check() == "ok"
        assert len(loaded) == written
        assert cid(f"c{written}") not in loaded


@pytest.mark.root
def test_a_read_only_disk_gives_a_typed_error():
    with tmpfs("1m") as mnt:
        directory = os.path.join(mnt, "state")
        with StateStore(directory) as s:
            s.record(ContainerRecord(cid("a"), Holding(frozenset({0}))))
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
        with pytest.raises(StateReadOnly, match="failed to"), StateStore(directory) as s:
            s.record(ContainerRecord(cid("b"), Holding(frozenset({1}))))


@pytest.mark.root
def test_a_state_directory_that_cannot_be_created_on_a_read_only_disk_is_a_typed_error():
    with tmpfs("1m") as mnt:
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
        with pytest.raises(StateReadOnly, match="failed to create state directory"):
            StateStore(os.path.join(mnt, "state"))


# ---- group commit ---------------------------------------------------------------------------------


def _staged_writers(store: StateStore, writes: list) -> list:
    """Start one thread per write while the write connection is held, so that all of them queue and
    the next holder commits them together; returns each write's outcome (result or exception)."""
    import threading
    import time

    outcomes: list = [None] * len(writes)

    def run(i: int) -> None:
        try:
            outcomes[i] = writes[i]()
        except Exception as exc:
            outcomes[i] = exc

    with store._lock:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(writes))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(store._queue) < len(writes) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(store._queue) == len(writes), "every writer queued behind the commit in progress"
    for t in threads:
        t.join(60)
    return outcomes


def test_concurrent_writes_share_one_commit_and_each_is_durable(tmp_path):
    directory = str(tmp_path / "state")
    store = StateStore(directory)
    commits_before = store.commits
    outcomes = _staged_writers(
        store, [lambda i=i: store.record(ContainerRecord(cid(f"c{i}"), Holding(frozenset({i})))) for i in range(8)]
    )
    assert outcomes == [None] * 8
    assert store.commits - commits_before == 1, "eight writes, one transaction, one fsync"
    store.close()
    with StateStore(directory) as again:
        assert again.holders() == {i: cid(f"c{i}") for i in range(8)}


def test_a_refused_write_in_a_shared_commit_fails_alone(tmp_path):
    store = StateStore(str(tmp_path / "state"))
    store.record(ContainerRecord(cid("old"), Holding(frozenset({5}))))
    outcomes = _staged_writers(
        store,
        [
            lambda: store.record(ContainerRecord(cid("a"), Holding(frozenset({0})))),
            lambda: store.record(ContainerRecord(cid("b"), Holding(frozenset({0, 1})))),  # GPU 0: a got it first
            lambda: store.add_gpus(cid("old"), [5]),  # already its own
            lambda: store.remove(cid("nobody")),
            lambda: store.record(ContainerRecord(cid("c"), Holding(frozenset({2})))),
        ],
    )
    assert outcomes[0] is None and outcomes[4] is None
    assert isinstance(outcomes[1], GpuAlreadyHeld) and isinstance(outcomes[2], GpuAlreadyHeld)
    assert isinstance(outcomes[3], ContainerNotRecorded)
    assert store.holders() == {0: cid("a"), 2: cid("c"), 5: cid("old")}, "b's GPU 1 was rolled back with it"
    assert store.get(cid("b")) is None
    store.close()


def test_a_version_2_store_gains_the_health_marks_and_keeps_its_records(tmp_path):
    from isolator.host.state import TABLES_AFTER_2, HealthMark

    with StateStore(str(tmp_path)) as store:
        store.record(ContainerRecord(ContainerId("a"), Holding(frozenset({1}))))
    db = sqlite3.connect(os.path.join(str(tmp_path), "allocations.sqlite3"))
    db.executescript("".join(f"DROP TABLE {t};" for t in TABLES_AFTER_2) + "PRAGMA user_version=2;")
    db.close()
    with StateStore(str(tmp_path)) as store:
        assert store.holders() == {1: ContainerId("a")}
        assert store.health_marks() == []
        store.put_health_mark(HealthMark("GPU-1", "xid", "XID 79", 79, 5.0))
        store.put_health_mark(HealthMark("GPU-1", "ecc", "double-bit ECC error", 0, 6.0))
        store.put_health_mark(HealthMark("GPU-2", "xid", "XID 48", 48, 7.0))
        store.drop_health_mark("GPU-2")
        store.drop_health_mark("GPU-9")
    with StateStore(str(tmp_path)) as store:
        assert store.health_marks() == [HealthMark("GPU-1", "ecc", "double-bit ECC error", 0, 6.0)]


# ---- lazy writes (Isolate's mark, issue 45) ---------------------------------------------------------

_LAZY_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from isolator.model import ContainerId, Holding
    from isolator.host.state import ContainerRecord, StateStore
    store = StateStore(sys.argv[1])
    store.record(ContainerRecord(ContainerId.parse("a"), Holding(frozenset({1}))))
    store.update(ContainerId.parse("a"), state="isolated", lazy=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no later commit
    """
)


def test_a_lazy_update_survives_its_writers_sigkill(tmp_path):
    directory = str(tmp_path / "state")
    env = {**os.environ, "PYTHONPATH": REPO}
    child = subprocess.run([sys.executable, "-c", _LAZY_WRITER, directory], env=env, timeout=60, check=False)
    assert child.returncode == -signal.SIGKILL
    with StateStore(directory) as s:
        assert s.get(cid("a")).state == "isolated"


def test_a_lazy_update_alone_skips_the_fsync_and_the_next_write_is_synced_again(store):
    def level() -> int:  # the write connection's: 1 NORMAL (no fsync at commit), 2 FULL
        return store._db.execute("PRAGMA synchronous").fetchone()[0]

    store.record(ContainerRecord(cid("a"), Holding(frozenset({1}))))
    assert (store.commits, store.lazy_commits, level()) == (1, 0, 2)
    store.update(cid("a"), state="isolated", lazy=True)
    assert (store.commits, store.lazy_commits, level()) == (1, 1, 1)
    store.update(cid("a"), volume_version="535")
    assert (store.commits, store.lazy_commits, level()) == (2, 1, 2)
    assert store.get(cid("a")).state == "isolated"


def test_a_store_that_never_syncs_stays_so_after_a_lazy_write(tmp_path):
    with StateStore(str(tmp_path / "state"), durable=False) as s:
        s.record(ContainerRecord(cid("a"), Holding(frozenset({1}))))
        s.update(cid("a"), state="isolated", lazy=True)
        s.update(cid("a"), volume_version="535")
        assert s._db.execute("PRAGMA synchronous").fetchone()[0] == 0  # OFF
