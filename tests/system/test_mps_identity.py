"""Who an MPS control daemon is (issue 41 item 5): the edge (isolator/host/mps.py) knows each daemon
from what it started itself, never from the pid file the daemon keeps in its pipe directory, which
the real daemon makes 0666 (docs/gpu-host-results.md, "MPS control daemon on driver 580"): any user
can rewrite it. Run against the simulated host's stand-in, a real process in a session of its own.

Attacks: a sharer rewriting the pid file to a process of its choosing (its own, another GPU's daemon);
a killed daemon; a sidecar killed between launching a daemon and recording it; a stale record whose
pid names another process by now; a daemon we did not start on our pipe directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from isolator import crashpoints
from isolator.host import mps as mpsedge
from isolator.host.mps import PID_FILE, MpsControl, MpsError
from isolator.simhost import mpscontrol

pytestmark = [pytest.mark.root]

A = "GPU-aaaaaaaa-2222-3333-4444-555555555555"
B = "GPU-bbbbbbbb-2222-3333-4444-555555555555"
NOBODY = 65534


@pytest.fixture
def mps(short_tmp):
    exe = mpscontrol.install(os.path.join(short_tmp, "bin", "nvidia-cuda-mps-control"))
    # The stand-in is a script: its daemon runs the interpreter its #! line names (host/mps.py knows).
    control = MpsControl(exe, os.path.join(short_tmp, "mps"))
    yield control
    for uuid in (A, B):
        _kill_daemon_of(control, uuid)


def _daemon_pids(control: MpsControl, uuid: str) -> list[int]:
    """Live stand-in daemons serving ``uuid``'s pipe directory, found the way a test may: their
    environment (the test's own view, independent of the edge)."""
    want = f"CUDA_MPS_PIPE_DIRECTORY={control.pipe_dir(uuid)}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[1] == control.executable.encode() and b"-d" in argv and want in env:
            out.append(int(name))
    return out


def _kill_daemon_of(control: MpsControl, uuid: str) -> None:
    for pid in _daemon_pids(control, uuid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(lambda: _daemon_pids(control, uuid))


def _wait_gone(pids, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pids():
        assert time.monotonic() < deadline, f"still there: {pids()}"
        time.sleep(0.02)


def _decoy(control: MpsControl, uuid: str, user: int | None = NOBODY) -> subprocess.Popen:
    """A sharer's process made to look like the daemon of ``uuid`` in every way its user can: the
    stand-in daemon's interpreter, ``-d`` last on its command line, our pipe directory in its
    environment. Only its uid (it drops to ``user`` once running) and its start differ."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": control.pipe_dir(uuid)}
    drop = (
        f"os.setgroups([]); os.setresgid({user}, {user}, {user}); os.setresuid({user}, {user}, {user}); "
        if user
        else ""
    )
    code = f"import os, sys, time; {drop}print('ready', flush=True); time.sleep(600)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "-d"], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _rewrite_pid_file(control: MpsControl, uuid: str, pid: int) -> None:
    """What any user can do to the real daemon's 0666 pid file."""
    with open(os.path.join(control.pipe_dir(uuid), PID_FILE), "w") as fh:
        fh.write(str(pid))


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_rewritten_pid_file_does_not_make_stop_kill_the_sharers_process(mps, monkeypatch):
    monkeypatch.setattr(mpsedge, "STOP_TIMEOUT_S", 0.5)
    mps.start(A)
    _kill_daemon_of(mps, A)  # the daemon crashed; its pid file stays behind
    decoy = _decoy(mps, A)
    try:
        _rewrite_pid_file(mps, A, decoy.pid)
        assert mps.pid(A) is None and not mps.alive(A)
        mps.stop(A)
        time.sleep(0.2)
        assert decoy.poll() is None, "stop() killed a process the pid file named"
    finally:
        _end(decoy)


def test_a_pid_file_naming_another_gpus_daemon_does_not_make_stop_kill_it(mps, monkeypatch):
    monkeypatch.setattr(mpsedge, "STOP_TIMEOUT_S", 0.5)
    mps.start(A)
    b = mps.start(B)
    _kill_daemon_of(mps, A)
    _rewrite_pid_file(mps, A, b)
    mps.stop(A)
    assert mps.pid(B) == b and mps.alive(B), "GPU B's daemon survives a stop of GPU A"
    assert _daemon_pids(mps, B) == [b]


def test_the_daemon_is_the_one_started_whatever_the_pid_file_says(mps):
    pid = mps.start(A)
    decoy = _decoy(mps, A)
    try:
        _rewrite_pid_file(mps, A, decoy.pid)
        assert mps.pid(A) == pid and mps.alive(A)
        mps.stop(A)
        _wait_gone(lambda: _daemon_pids(mps, A))
        assert decoy.poll() is None
    finally:
        _end(decoy)


def test_a_root_process_named_like_the_daemon_is_not_taken_for_it(mps):
    pid = mps.start(A)
    _kill_daemon_of(mps, A)
    decoy = _decoy(mps, A, user=None)  # root, named nvidia-cuda-mps-control, started after the daemon
    try:
        _rewrite_pid_file(mps, A, decoy.pid)
        assert mps.pid(A) is None and pid != decoy.pid
        fresh = MpsControl(mps.executable, mps.root)
        assert fresh.pid(A) is None and not fresh.alive(A)
        fresh.stop(A)
        assert decoy.poll() is None
    finally:
        _end(decoy)


def test_a_restarted_sidecar_recognises_its_daemon_and_stops_it(mps):
    pid = mps.start(A)
    again = MpsControl(mps.executable, mps.root)
    assert again.pid(A) == pid and again.alive(A)
    again.stop(A)
    _wait_gone(lambda: _daemon_pids(mps, A))
    assert again.pid(A) is None


def test_a_stale_record_whose_pid_names_another_process_is_refused(mps):
    mps.start(A)
    _kill_daemon_of(mps, A)
    decoy = _decoy(mps, A, user=None)
    try:
        record = os.path.join(mps.root, A, mpsedge.RECORD)
        with open(record) as fh:
            facts = json.load(fh)
        facts["pid"] = decoy.pid  # as if the pid had been reused by now: its start time differs
        with open(record, "w") as fh:
            json.dump(facts, fh)
        fresh = MpsControl(mps.executable, mps.root)
        assert fresh.pid(A) is None
        fresh.stop(A)
        assert decoy.poll() is None
        time.sleep(0.1)  # a root look-alike started with the launch would make it ambiguous: refused
        assert fresh.start(A) not in (None, decoy.pid) and fresh.alive(A), "a new daemon starts in its place"
    finally:
        _end(decoy)


class _Died(BaseException):
    """The sidecar's death at a crash point: nothing after it runs, nothing in memory survives."""


@pytest.mark.parametrize("point", ["mps.launching", "mps.spawned"])
def test_a_sidecar_killed_while_starting_a_daemon_recognises_it_after_restart(mps, point):
    def die(name: str, passes: int) -> None:
        raise _Died(name)

    crashpoints.arm(point, 1, die)
    try:
        with pytest.raises(_Died):
            mps.start(A)
    finally:
        crashpoints.disarm()
    decoy = _decoy(mps, A)  # a sharer's look-alike, started after the launch too
    try:
        fresh = MpsControl(mps.executable, mps.root)
        if point == "mps.launching":
            assert fresh.pid(A) is None and not _daemon_pids(mps, A)
            pid = fresh.start(A)
        else:
            (pid,) = _daemon_pids(mps, A)
            assert fresh.pid(A) == pid and fresh.alive(A), "launched, then died: the daemon is adopted"
            with pytest.raises(MpsError, match="already running"):
                fresh.start(A)
        assert _daemon_pids(mps, A) == [pid]
        fresh.stop(A)
        _wait_gone(lambda: _daemon_pids(mps, A))
        assert decoy.poll() is None
    finally:
        _end(decoy)


def test_a_daemon_this_sidecar_did_not_start_is_neither_adopted_nor_killed(mps):
    os.makedirs(mps.pipe_dir(A), exist_ok=True)
    os.makedirs(mps.log_dir(A), exist_ok=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": mps.pipe_dir(A), "CUDA_MPS_LOG_DIRECTORY": mps.log_dir(A)}
    subprocess.run([mps.executable, "-d"], env=env, check=True)
    (foreign,) = _daemon_pids(mps, A)
    assert mps.pid(A) is None and not mps.alive(A)
    mps.stop(A)
    assert _daemon_pids(mps, A) == [foreign]
    with pytest.raises(MpsError, match="already running"):
        mps.start(A)


def test_the_directories_are_ours_and_a_planted_link_is_refused(mps, short_tmp):
    elsewhere = os.path.join(short_tmp, "elsewhere")
    os.makedirs(elsewhere)
    os.makedirs(os.path.join(mps.root, A))
    os.symlink(elsewhere, mps.pipe_dir(A))
    with pytest.raises(MpsError, match="not a directory"):
        mps.start(A)
    assert not os.listdir(elsewhere)
    os.unlink(mps.pipe_dir(A))
    mps.start(A)
    for path in (os.path.join(mps.root, A), mps.pipe_dir(A), mps.log_dir(A)):
        st = os.lstat(path)
        assert st.st_uid == 0 and oct(st.st_mode & 0o777) == "0o755", path
    st = os.lstat(os.path.join(mps.root, A, mpsedge.RECORD))
    assert st.st_uid == 0 and oct(st.st_mode & 0o777) == "0o600"
