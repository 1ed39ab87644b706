"""The MPS control edge (isolator/host/mps.py) against the simulated host's stand-in
nvidia-cuda-mps-control (isolator/simhost/mpscontrol.py), and the shipped FakeMps against the same
contract: start, answer control commands, liveness, a kill behind our back, stop."""

from __future__ import annotations

import os
import signal
import time

import pytest

from isolator.host.mps import PID_FILE, MpsControl, MpsError
from isolator.simhost import mpscontrol
from isolator.testing.mps import FakeMps

UUID = "GPU-11111111-2222-3333-4444-555555555555"


@pytest.fixture(params=["stand-in", "fake"])
def daemons(request, short_tmp):
    if request.param == "fake":
        yield FakeMps()
        return
    exe = mpscontrol.install(os.path.join(short_tmp, "bin", "nvidia-cuda-mps-control"))
    real = MpsControl(exe, os.path.join(short_tmp, "mps"))
    yield real
    real.stop(UUID)


def _kill(daemons, uuid: str) -> None:
    if isinstance(daemons, FakeMps):
        daemons.kill(uuid)
        return
    pid = daemons.pid(uuid)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while daemons.pid(uuid) is not None:  # reaped by init: its /proc entry goes
        assert time.monotonic() < deadline, "the killed daemon is still there"
        time.sleep(0.02)


def test_start_answer_kill_restart_and_stop(daemons):
    assert not daemons.alive(UUID)
    assert daemons.pid(UUID) is None and daemons.multiuser(UUID) is None
    pid = daemons.start(UUID)
    assert pid > 0 and daemons.alive(UUID) and daemons.pid(UUID) == pid
    assert daemons.multiuser(UUID) is False
    daemons.command(UUID, "set_default_active_thread_percentage 25")
    with pytest.raises(MpsError, match="already running"):
        daemons.start(UUID)
    _kill(daemons, UUID)
    assert not daemons.alive(UUID)
    with pytest.raises(MpsError):
        daemons.command(UUID, "get_server_list")
    multiuser = os.geteuid() == 0  # -multiuser-server is root's only, for the stand-in as for the real one
    assert daemons.start(UUID, multiuser=multiuser) != pid
    assert daemons.alive(UUID) and daemons.multiuser(UUID) is multiuser
    daemons.stop(UUID)
    assert not daemons.alive(UUID)
    daemons.stop(UUID)  # nothing to stop: no-op
    assert daemons.pipe_dir(UUID).endswith(f"{UUID}/pipe")


def test_the_stand_in_is_started_as_the_real_one_and_logs_what_it_was_told(short_tmp):
    exe = mpscontrol.install(os.path.join(short_tmp, "bin", "nvidia-cuda-mps-control"))
    control = MpsControl(exe, os.path.join(short_tmp, "mps"))
    try:
        pid = control.start(UUID)
        pipe, log = control.pipe_dir(UUID), control.log_dir(UUID)
        assert oct(os.stat(pipe).st_mode & 0o777) == "0o755"
        with open(os.path.join(pipe, PID_FILE)) as fh:
            assert int(fh.read()) == pid
        with open(f"/proc/{pid}/status") as fh:
            ppid = int(next(line for line in fh if line.startswith("PPid:")).split()[1])
        assert ppid != os.getpid() and os.getsid(pid) != os.getsid(0), "a daemon in a session of its own"
        assert control.command(UUID, "get_default_active_thread_percentage") == "100.0"
        assert control.command(UUID, "set_default_active_thread_percentage 25") == "25.0"
        assert control.command(UUID, "get_default_active_thread_percentage") == "25.0"
        control.command(UUID, "set_default_device_pinned_mem_limit 0 20480M")
        assert control.command(UUID, "get_default_device_pinned_mem_limit 0") == "20480M"
        assert control.command(UUID, "get_server_list") == ""
        assert control.command(UUID, "frobnicate") == 'Unknown command "frobnicate"'
        control.stop(UUID)
        assert control.pid(UUID) is None and not os.path.exists(os.path.join(pipe, "control"))
        with open(os.path.join(log, "control.log")) as fh:
            text = fh.read()
        assert f"Startup: CUDA_VISIBLE_DEVICES={UUID}" in text
        for line in ("Control: set_default_active_thread_percentage 25", "Control: frobnicate", "Control: quit"):
            assert line in text, text
        assert text.rstrip().endswith("Shutdown")
    finally:
        control.stop(UUID)


def test_the_stand_in_answers_bad_input_as_the_real_daemon_does(short_tmp):
    """What the real control daemon of driver 580 answered (docs/gpu-host-results.md, the MPS probe):
    a bad percentage is no error, the old value is echoed; an unset pinned limit prints nothing; the
    daemon survives all of it."""
    exe = mpscontrol.install(os.path.join(short_tmp, "bin", "nvidia-cuda-mps-control"))
    control = MpsControl(exe, os.path.join(short_tmp, "mps"))
    try:
        pid = control.start(UUID)
        assert control.command(UUID, "get_default_device_pinned_mem_limit 0") == ""
        assert control.command(UUID, "set_default_active_thread_percentage 25") == "25.0"
        for bad in ("abc", "0", "150", "-5", "nan"):
            assert control.command(UUID, f"set_default_active_thread_percentage {bad}") == "25.0", bad
        assert control.command(UUID, "set_default_active_thread_percentage 100") == "100.0"
        assert control.pid(UUID) == pid, "the daemon is still the one started"
    finally:
        control.stop(UUID)


def test_a_stale_pid_file_naming_another_process_is_not_a_daemon(short_tmp):
    exe = mpscontrol.install(os.path.join(short_tmp, "bin", "nvidia-cuda-mps-control"))
    control = MpsControl(exe, os.path.join(short_tmp, "mps"))
    os.makedirs(control.pipe_dir(UUID))
    with open(os.path.join(control.pipe_dir(UUID), PID_FILE), "w") as fh:
        fh.write(f"{os.getpid()}\n")  # this test's own pid: alive, but no MPS control daemon
    assert control.pid(UUID) is None and not control.alive(UUID)
    control.stop(UUID)  # and never killed


def test_a_missing_executable_is_a_clear_error(short_tmp):
    control = MpsControl(os.path.join(short_tmp, "no-such-binary"), os.path.join(short_tmp, "mps"))
    with pytest.raises(MpsError, match="failed to start the MPS control daemon of GPU"):
        control.start(UUID)


def test_the_stand_in_answers_the_other_measured_commands_as_the_real_daemon_did(short_tmp):
    """The rest of the real run's table (docs/gpu-host-results.md, "1. Start, help and the control
    commands"): a bare pinned limit is MiB, any device key is taken and a UUID is a key of its own,
    the client priority, ``ps`` and ``get_server_status`` without a server or a pid."""
    exe = mpscontrol.install(os.path.join(short_tmp, "bin", "nvidia-cuda-mps-control"))
    control = MpsControl(exe, os.path.join(short_tmp, "mps"))
    try:
        control.start(UUID)
        assert control.command(UUID, "set_default_device_pinned_mem_limit 0 2G") == ""
        assert control.command(UUID, "get_default_device_pinned_mem_limit 0") == "2G"
        assert control.command(UUID, f"get_default_device_pinned_mem_limit {UUID}") == ""
        assert control.command(UUID, "set_default_device_pinned_mem_limit 0 2") == ""
        assert control.command(UUID, "get_default_device_pinned_mem_limit 0") == "2M"
        assert control.command(UUID, "set_default_device_pinned_mem_limit 7 1G") == ""
        assert control.command(UUID, "get_default_device_pinned_mem_limit 7") == "1G"
        assert control.command(UUID, "get_default_client_priority") == "0"
        assert control.command(UUID, "ps") == "Server not found"
        assert control.command(UUID, "get_server_status") == "A server PID is required"
        assert control.command(UUID, "no_such_command") == 'Unknown command "no_such_command"'
        with pytest.raises(MpsError, match="An instance of this daemon is already running"):
            control.start(UUID)
        with open(os.path.join(control.log_dir(UUID), "control.log")) as fh:
            assert "No default pinned memory limit set for the device!" in fh.read()
    finally:
        control.stop(UUID)
    with pytest.raises(MpsError, match="Cannot find MPS control daemon process"):
        control.command(UUID, "get_server_list")
