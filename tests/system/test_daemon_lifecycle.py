"""The daemon as an operator meets it (issue 26): its exit codes, one daemon per state directory,
SIGHUP, and the lines it logs at start. Real daemon processes and real signals."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from isolator.cli.main import EXIT_CONFIG, EXIT_WORK_DIR_HELD
from isolator.model import Holding
from isolator.testing.cgroupfs import TEST_PARENT, unique_name
from isolator.testing.sidecar import Sidecar


def _serve(work: str, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "isolator", "serve", "--socket", os.path.join(work, "s.sock"), "--work-dir", work]
    argv += ["--volume-root", os.path.join(work, "volumes"), "--mode", "standalone", *flags]
    argv += ["--cgroups-root", unique_name(TEST_PARENT)]  # one daemon per cgroups root (issue 33)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def test_exit_config_is_sysexits_ex_config():
    assert EXIT_CONFIG == 78  # EX_CONFIG in sysexits.h; the unit's RestartPreventExitStatus names it


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('modee = "mesos"\n', "unknown key 'modee'"),
        ("[[[\n", "failed to parse config file"),
        ('cgroup_version = "v3"\n', "invalid config file"),
    ],
    ids=["typo", "unparsable", "bad-value"],
)
def test_a_config_error_exits_with_ex_config_and_one_line(short_tmp, text, expected):
    """systemd restarts a unit that exits 1 forever; a config error does not heal by itself, so it
    has its own exit code, which the unit lists in RestartPreventExitStatus."""
    config = os.path.join(short_tmp, "config.toml")
    with open(config, "w") as fh:
        fh.write(text)
    result = _serve(short_tmp, "--config", config)
    assert result.returncode == EXIT_CONFIG, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_a_runtime_failure_is_not_a_config_error(short_tmp):
    """A socket path that is a regular file is the machine's state, not the configuration's: exit 1."""
    taken = os.path.join(short_tmp, "taken")
    open(taken, "w").close()
    result = _serve(short_tmp, "--resources", "gpus:0", "--socket", taken)
    assert result.returncode == 1, result.stderr


def _sidecar(work: str, *extra: str) -> Sidecar:
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return Sidecar(work=work, host="single", cgroup_version="v1", cgroups_root=root, extra=extra)


def _health(socket_path: str) -> int:
    import grpc

    from isolator.rpc import isolator_pb2 as pb
    from isolator.rpc import isolator_pb2_grpc as pb_grpc

    with grpc.insecure_channel("unix:" + socket_path) as channel:
        return len(pb_grpc.AdminStub(channel).Health(pb.HealthRequest(), timeout=30).checks)


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_second_daemon_on_the_same_work_dir_refuses_naming_the_holder_and_a_killed_one_holds_nothing(short_tmp):
    """Before issue 26 a second serve on the same --work-dir (another socket) started and served the
    same SQLite state: two reapers, two auditors, GPUs booked under each other."""
    first = _sidecar(short_tmp).start()
    try:
        assert first.proc is not None
        other = os.path.join(short_tmp, "other.sock")
        argv = [*first.argv(), "--socket", other]
        second = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert second.returncode == EXIT_WORK_DIR_HELD, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"work directory '{short_tmp}'" in lines[0] and f"gpu-isolator pid {first.proc.pid} holds it" in lines[0]
        assert not os.path.exists(other) and not os.path.exists(other + ".bridge")
        assert _health(first.socket) > 0  # the first one goes on serving, its sockets untouched

        first.kill()  # SIGKILL: the kernel drops the flock with the process, no stale lock
        third = _sidecar(short_tmp).start()
        try:
            assert _health(third.socket) > 0
        finally:
            third.stop()
    finally:
        first.stop()


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_gpu_taken_under_the_sidecar_is_failed_precondition_naming_the_holder(short_tmp):
    """Another writer of the state (here: the store opened beside the daemon) books the GPU the
    allocator counts free. Before issue 26 Prepare said ALREADY_EXISTS, as if the caller had asked
    for something that exists."""
    from isolator.host.state import StateStore
    from isolator.model import ContainerId, ContainerRecord
    from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id

    sidecar = _sidecar(short_tmp).start()
    try:
        store = StateStore(os.path.join(short_tmp, "state"))
        try:
            store.record(ContainerRecord(ContainerId.from_chain(["x2"]), Holding(frozenset({0})), mode="standalone"))
        finally:
            store.close()
        isolator = GrpcIsolator(sidecar.socket)
        try:
            with pytest.raises(HookFailed) as failed:
                isolator.prepare(container_id("x1"), Containerizer(isolator, short_tmp).config(gpus=1, image=False))
        finally:
            isolator.close()
        assert failed.value.code == "FAILED_PRECONDITION", failed.value
        assert "GPU 0 for container x1: it is already held by x2" in failed.value.message
    finally:
        sidecar.stop()


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_the_running_version_is_in_the_start_up_log_health_and_gpus(short_tmp):
    """Before issue 26 the running daemon's version was visible nowhere."""
    import socket

    import grpc

    from isolator import __version__
    from isolator.rpc import isolator_pb2 as pb
    from isolator.rpc import isolator_pb2_grpc as pb_grpc

    sidecar = _sidecar(short_tmp).start()
    try:
        with grpc.insecure_channel(sidecar.address) as channel:
            admin = pb_grpc.AdminStub(channel)
            health = admin.Health(pb.HealthRequest(), timeout=30)
            gpus = admin.ListGpus(pb.ListGpusRequest(), timeout=30)
        assert (health.version, health.mode, health.hostname) == (__version__, "standalone", socket.gethostname())
        assert gpus.sidecar_version == __version__
        expected = (
            f"gpu-isolator {__version__} started on host {socket.gethostname()}: mode standalone,"
            f" cgroup v1, 1 GPU(s) [0], work dir {short_tmp}"
        )
        assert expected in sidecar.log(), sidecar.log()
    finally:
        sidecar.stop()


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_restart_does_not_claim_to_create_cgroups_that_already_existed(short_tmp):
    """Before issue 26 every restart logged "devices cgroup ... created with everything denied" for
    each recorded container, whose cgroup existed and was not written."""
    from isolator.testing.mesos import Containerizer, GrpcIsolator, container_id

    sidecar = _sidecar(short_tmp).start()
    try:
        isolator = GrpcIsolator(sidecar.socket)
        try:
            isolator.prepare(container_id("kept"), Containerizer(isolator, short_tmp).config(gpus=1, image=False))
        finally:
            isolator.close()
        assert sidecar.terminate() == 0
        first = sidecar.log()
        assert "container kept: devices cgroup" in first and "created with everything denied" in first
        with open(sidecar.log_path) as fh:
            offset = len(fh.read())
        sidecar.start()
        with open(sidecar.log_path) as fh:
            second = fh.read()[offset:]
        assert "serving on" in second, second
        assert "created with everything denied" not in second and "now denies everything" not in second, second
    finally:
        sidecar.stop()


def _wait_for_log(sidecar: Sidecar, text: str, offset: int = 0, budget: float = 60) -> str:
    """The log after ``offset`` once it holds ``text``; fails if the daemon exits or the budget runs out."""
    import time

    deadline = time.monotonic() + budget
    while True:
        with open(sidecar.log_path) as fh:
            log = fh.read()[offset:]
        if text in log:
            return log
        assert sidecar.proc is not None and sidecar.proc.poll() is None, f"the daemon exited: {log}"
        assert time.monotonic() < deadline, f"no {text!r} in the log within {budget} s: {log}"
        time.sleep(0.05)


def _log_size(sidecar: Sidecar) -> int:
    with open(sidecar.log_path) as fh:
        return len(fh.read())


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_sighup_reloads_the_reloadable_settings_logs_the_rest_and_keeps_serving(short_tmp):
    """Before issue 26 SIGHUP killed the daemon (exit 129, no log line, sockets left behind)."""
    import signal

    from system.test_security import NOBODY, call_as, nogroup

    os.chmod(short_tmp, 0o755)  # nobody may reach the socket; the gate decides
    config = os.path.join(short_tmp, "config.toml")
    with open(config, "w") as fh:
        fh.write('allowed_uids = [0]\nlog_level = "info"\n')
    sidecar = _sidecar(short_tmp, "--config", config, "--socket-mode", "0660", "--socket-group", "nogroup")
    sidecar.start()
    try:
        assert sidecar.proc is not None
        assert call_as(NOBODY, nogroup(), sidecar.socket)["code"] == "PERMISSION_DENIED"

        with open(config, "w") as fh:
            # uids and gids change together: both reach the gate (the gid is one nobody does not have).
            fh.write(
                f'allowed_uids = [0, {NOBODY}]\nallowed_gids = [4242]\nlog_level = "debug"\naudit_interval = 60\n'
                "max_workers = 8\n"
            )
        offset = _log_size(sidecar)
        sidecar.proc.send_signal(signal.SIGHUP)
        log = _wait_for_log(sidecar, "SIGHUP: reloaded", offset)
        log = _wait_for_log(sidecar, "cannot change while serving", offset)
        for change in (
            "log_level info -> debug",
            "audit_interval 300 -> 60",
            f"allowed_uids 0 -> 0,{NOBODY}",
            "allowed_gids none -> 4242",
        ):
            assert change in log, log
        assert "max_workers changed but cannot change while serving" in log, log
        assert call_as(NOBODY, nogroup(), sidecar.socket)["code"] == "OK"  # the new allow-list holds

        with open(config, "w") as fh:
            fh.write("[[[\n")
        offset = _log_size(sidecar)
        sidecar.proc.send_signal(signal.SIGHUP)
        log = _wait_for_log(sidecar, "SIGHUP: failed to reload", offset)
        assert "failed to parse config file" in log and "keeping every current setting" in log, log
        assert call_as(NOBODY, nogroup(), sidecar.socket)["code"] == "OK"  # still the last good settings
        assert sidecar.terminate() == 0
    finally:
        sidecar.stop()


def test_reload_difference_splits_what_can_change_while_serving_from_what_needs_a_restart():
    from dataclasses import replace

    from isolator.daemon.config import Config
    from isolator.daemon.reload import RELOADABLE, difference

    old = Config()
    new = replace(old, log_level="debug", ignored_xids=(13,), mode="standalone", socket="/x", config_file="/c")
    changed, restart = difference(old, new)
    assert changed == {"log_level": ("info", "debug"), "ignored_xids": (old.ignored_xids, (13,))}
    assert restart == ["mode", "socket"]  # config_file is where the settings come from, not one of them
    assert set(RELOADABLE) <= {f for f in Config.__dataclass_fields__}
    assert difference(old, replace(old)) == ({}, [])
