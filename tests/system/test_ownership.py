"""One daemon per cgroups root and per socket (issue 33, defect 1): a second ``serve`` with its own
work directory that would share the (hierarchy, cgroups root), the gRPC socket, the bridge socket or a
``unix:`` metrics path with a live daemon refuses with exit 75 naming the holder's pid, and touches
nothing of the first. Real daemons, real flocks, SIGKILL included."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid

import pytest

from isolator.cli.main import EXIT_WORK_DIR_HELD
from isolator.testing.cgroupfs import TEST_PARENT
from isolator.testing.sidecar import Sidecar


def _root() -> str:
    return f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _sidecar(work: str, root: str, *extra: str) -> Sidecar:
    return Sidecar(work=work, host="single", cgroup_version="v1", cgroups_root=root, extra=extra)


def _second(first: Sidecar, work: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """``first``'s command line with another work dir (and whatever ``flags`` override after it)."""
    argv = [*first.argv(), "--work-dir", work, "--volume-root", os.path.join(work, "volumes"), *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def _metrics_answer(path: str) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(path)
        conn.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        return conn.recv(64)


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if " INFO " not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_second_daemon_sharing_the_cgroups_root_or_any_socket_refuses_naming_the_holder(tmp_path):
    """Before issue 33 a second serve with another --work-dir and --socket started beside the
    first, unlinked and re-bound the first's unix: metrics path (and removed it when it stopped),
    and recovered the first's containers into its own state."""
    work = os.path.join("/tmp", f"gi-own-{uuid.uuid4().hex[:6]}")
    os.makedirs(work)
    root = _root()
    metrics = os.path.join(work, "m.sock")
    first = _sidecar(work, root, "--metrics-address", f"unix:{metrics}").start()
    others = []
    try:
        assert first.proc is not None
        pid = f"gpu-isolator pid {first.proc.pid}"

        def other() -> str:
            path = os.path.join("/tmp", f"gi-own-{uuid.uuid4().hex[:6]}")
            os.makedirs(path)
            others.append(path)
            return path

        # The same cgroups root (every socket its own).
        w = other()
        result = _second(first, w, "--socket", os.path.join(w, "s.sock"), "--metrics-address", "")
        assert result.returncode == EXIT_WORK_DIR_HELD, result.stderr
        line = _one_line(result)
        assert f"cgroups root '{root}'" in line and pid in line and "--cgroups-root" in line, line
        assert not os.path.exists(os.path.join(w, "state")), "the refused daemon opened a state"

        # Another cgroups root, the same gRPC socket.
        w = other()
        result = _second(first, w, "--cgroups-root", _root(), "--metrics-address", "")
        assert result.returncode == EXIT_WORK_DIR_HELD, result.stderr
        line = _one_line(result)
        assert f"socket '{first.socket}'" in line and pid in line and "--socket" in line, line

        # Another cgroups root and gRPC socket, the same bridge socket.
        w = other()
        flags = ("--cgroups-root", _root(), "--socket", os.path.join(w, "s.sock"), "--metrics-address", "")
        result = _second(first, w, *flags, "--bridge-socket", first.bridge_socket)
        assert result.returncode == EXIT_WORK_DIR_HELD, result.stderr
        line = _one_line(result)
        assert f"socket '{first.bridge_socket}'" in line and pid in line and "--bridge-socket" in line, line
        assert not os.path.exists(os.path.join(w, "s.sock")), "the refused daemon bound its own socket"

        # Another cgroups root and sockets, the same metrics path.
        w = other()
        result = _second(first, w, "--cgroups-root", _root(), "--socket", os.path.join(w, "s.sock"))
        assert result.returncode == EXIT_WORK_DIR_HELD, result.stderr
        line = _one_line(result)
        assert f"'{metrics}'" in line and pid in line and "--metrics-address" in line, line

        # The first keeps everything it had: its sockets, its metrics path, serving.
        for path in (first.socket, first.bridge_socket, metrics):
            assert os.path.exists(path), path
        assert _metrics_answer(metrics).startswith(b"HTTP/1.0 200"), "the first daemon lost its metrics"

        # SIGKILL: the kernel drops every flock with the process; a new daemon takes all at once.
        first.kill()
        again = _sidecar(work, root, "--metrics-address", f"unix:{metrics}").start()
        try:
            assert _metrics_answer(metrics).startswith(b"HTTP/1.0 200")
        finally:
            again.stop()
    finally:
        first.stop()
        import shutil

        for path in [work, *others]:
            shutil.rmtree(path, ignore_errors=True)


def test_a_pid_lock_names_its_holder_and_the_kernel_drops_it_when_the_holder_is_killed(tmp_path):
    from isolator.errors import OwnershipHeld
    from isolator.host.pidlock import PidLock

    path = str(tmp_path / "x.lock")
    code = (
        "import sys, time\n"
        "from isolator.host.pidlock import PidLock\n"
        f"PidLock.acquire({path!r}, 'thing')\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(OwnershipHeld) as held:
            PidLock.acquire(path, "thing")
        assert held.value.fields["holder"] == f"gpu-isolator pid {holder.pid}"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    PidLock.acquire(path, "thing").release()


def test_a_released_removable_lock_is_never_held_twice(tmp_path):
    """The holder unlinks a removable lock file when it lets go; one who opened the old file just
    before must not believe it holds the lock beside one who locks the new file."""
    import fcntl

    from isolator.errors import OwnershipHeld
    from isolator.host.pidlock import PidLock

    path = str(tmp_path / "x.lock")
    first = PidLock.acquire(path, "thing", removable=True)
    stale = os.open(path, os.O_RDWR)  # a contender that opened the file, not yet locked
    first.release()
    assert not os.path.exists(path)
    second = PidLock.acquire(path, "thing", removable=True)
    try:
        fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the old inode: free, but no longer the lock
        with pytest.raises(OwnershipHeld):
            PidLock.acquire(path, "thing", removable=True)
    finally:
        os.close(stale)
        second.release()


def test_a_sweep_removes_the_lock_files_of_dead_holders_and_leaves_held_ones(tmp_path):
    from isolator.host.pidlock import PidLock, sweep

    held = PidLock.acquire(str(tmp_path / "held.lock"), "held", removable=True)
    code = (
        "import os, signal\n"
        "from isolator.host.pidlock import PidLock\n"
        f"PidLock.acquire({str(tmp_path / 'dead.lock')!r}, 'dead', removable=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["dead.lock", "held.lock"]
    try:
        assert sweep(str(tmp_path)) == 1
        assert os.listdir(tmp_path) == ["held.lock"]
    finally:
        held.release()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("mode", ["mesos", "standalone"])
def test_a_cgroups_root_is_claimed_once_whatever_the_version_and_mode(tmp_path, version, mode):
    """The claim itself, in-process (each claim opens its own file description, so a second one
    conflicts as a second daemon's would): two configs that differ in everything but the
    (hierarchy, root) collide; another root or the other hierarchy does not."""
    from isolator.cgroups.detect import Hierarchy
    from isolator.daemon.config import Config
    from isolator.daemon.ownership import claim
    from isolator.errors import CgroupsRootHeld

    mount = tmp_path / "hierarchy"  # any directory stands for a hierarchy's root: the key is its inode
    mount.mkdir()
    other_mount = tmp_path / "other"
    other_mount.mkdir()
    locks = str(tmp_path / "locks")

    def config(name: str, root: str) -> Config:
        return Config(socket=str(tmp_path / f"{name}.sock"), cgroups_root=root, mode=mode)

    first = claim(config("a", "mesos"), Hierarchy(version, str(mount)), locks)
    try:
        with pytest.raises(CgroupsRootHeld) as held:
            claim(config("b", "/mesos/"), Hierarchy(version, str(mount)), locks)  # the same root, spelt otherwise
        assert f"gpu-isolator pid {os.getpid()} manages it" in held.value.message
        assert not os.path.exists(tmp_path / "b.sock.lock"), "the refused claim kept its socket's lock"
        claim(config("c", "mesos-2"), Hierarchy(version, str(mount)), locks).release()
        claim(config("d", "mesos"), Hierarchy(version, str(other_mount)), locks).release()
    finally:
        first.release()
    claim(config("e", "mesos"), Hierarchy(version, str(mount)), locks).release()


@pytest.mark.root
@pytest.mark.cgroup_v2
def test_one_cgroup2_hierarchy_mounted_at_two_paths_is_one_key(tmp_path):
    """cgroup2 at /sys/fs/cgroup/unified on the host and, in a mount namespace of a pure v2 test, at
    /sys/fs/cgroup: one hierarchy, one lock. Mounted again here in a private mount namespace."""
    from isolator.testing.cgroupfs import hierarchy_mounts

    v2 = hierarchy_mounts()[1]
    assert v2 is not None
    again = tmp_path / "cg2"
    again.mkdir()
    code = (
        "import sys, subprocess\n"
        "from isolator.cgroups.detect import Hierarchy\n"
        "from isolator.daemon.ownership import cgroups_key\n"
        f"subprocess.run(['mount', '--make-rprivate', '/'], check=True)\n"
        f"subprocess.run(['mount', '-t', 'cgroup2', 'none', {str(again)!r}], check=True)\n"
        f"print(cgroups_key(Hierarchy('v2', {v2!r}), 'r'))\n"
        f"print(cgroups_key(Hierarchy('v2', {str(again)!r}), '/r'))\n"
    )
    result = subprocess.run(
        ["unshare", "-m", sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=os.getcwd()
    )
    assert result.returncode == 0, result.stderr
    host, namespaced = result.stdout.split("\n")[:2]
    assert host == namespaced and host.startswith("v2 ")
