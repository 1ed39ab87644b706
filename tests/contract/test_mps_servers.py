"""MPS servers and clients as the real control daemon of driver 580 has them (docs/gpu-host-results.md,
"MPS control daemon on driver 580"), held against the stand-in daemon with real client processes
(isolator/simhost/mpscontrol.py, mpsclient.py) and against FakeMps's in-memory clients: limits a
client cannot lift, per-server values, one server per uid with other users queued, -multiuser-server,
FAULT and its recovery, terminate_client."""

from __future__ import annotations

import grp
import json
import os
import select
import subprocess
import sys

import paths
import pytest

from isolator.host.mps import MpsControl
from isolator.simhost import mpscontrol, mpsmodel
from isolator.testing.mesoshome import wait_for
from isolator.testing.mps import FakeMps

UUID = "GPU-11111111-2222-3333-4444-555555555555"
NOBODY = 65534
TIMEOUT = 30.0


class StandInClient:
    """``python -m isolator.simhost.mpsclient`` run as ``uid`` with ``env`` (its CUDA_MPS_* variables)."""

    def __init__(self, pipe: str, uid: int, env: dict[str, str]) -> None:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
        environ.update(env)
        environ.setdefault("CUDA_MPS_PIPE_DIRECTORY", pipe)
        if environ["CUDA_MPS_PIPE_DIRECTORY"] == "":
            del environ["CUDA_MPS_PIPE_DIRECTORY"]
        prefix = (
            []
            if uid == 0
            else ["setpriv", f"--reuid={uid}", f"--regid={grp.getgrnam('nogroup').gr_gid}", "--clear-groups"]
        )
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "isolator.simhost.mpsclient"],
            env=environ,
            cwd=paths.ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid
        self.lines: list[dict] = []

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return False
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            return False
        self.lines.append(json.loads(line))
        return True

    def result(self) -> dict:
        """Its first line: what it got (or its refusal); waits for it."""
        wait_for("the client's first line", lambda: self.lines or self._read(1.0), TIMEOUT)
        return self.lines[0]

    def waiting(self) -> bool:
        """No first line yet while it is alive (a pending client blocks in cuInit)."""
        self._read(0.3)
        return not self.lines and self.proc.poll() is None

    def events(self, count: int) -> list[dict]:
        wait_for(
            f"{count} events", lambda: len(self.lines) > count or (self._read(1.0) and len(self.lines) > count), TIMEOUT
        )
        return self.lines[1:]

    def exit(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=TIMEOUT)
        self.proc.stdout.close()  # type: ignore[union-attr]


class FakeSide:
    """FakeMps's clients in the same shape (pids of our choosing)."""

    def __init__(self, fake: FakeMps) -> None:
        self.fake = fake
        self.pids = iter(range(900, 10000))

    def client(self, uid: int = 0, env: dict[str, str] | None = None):
        return _FakeHandle(self.fake.connect(UUID, next(self.pids), uid, env))

    def command(self, text: str) -> str:
        return self.fake.command(UUID, text)

    def settle(self, predicate, what: str):
        value = predicate()
        assert value, what
        return value


class _FakeHandle:
    def __init__(self, client) -> None:
        self.client = client
        self.pid = client.pid

    def result(self) -> dict:
        if self.client.outcome == "refused":
            code = mpsmodel.CUDA_ERROR_MPS_SERVER_NOT_READY
            return {"mps": True, "code": code, "error": "CUDA_ERROR_MPS_SERVER_NOT_READY"}
        assert self.client.server, "attached"
        return {
            "mps": True,
            "server": self.client.server,
            "active_thread_percentage": self.client.threads,
            "pinned_mem_limit_mib": None if self.client.pinned is None else self.client.pinned >> 20,
        }

    def waiting(self) -> bool:
        return not self.client.server and self.client.outcome == "pending"

    def events(self, count: int) -> list[dict]:
        said = [line for line in self.client.said if not line.startswith("READY")]
        out = []
        for line in said:
            word, _, code = line.partition(" ")
            out.append(
                {
                    "event": {"FAULT": "fault", "TERMINATED": "terminated"}.get(word, "server gone"),
                    "code": int(code or 0),
                }
            )
        assert len(out) >= count, out
        return out

    def exit(self) -> None:
        self.client.exit()


class StandInSide:
    def __init__(self, control: MpsControl) -> None:
        self.control = control
        self.clients: list[StandInClient] = []

    def client(self, uid: int = 0, env: dict[str, str] | None = None) -> StandInClient:
        client = StandInClient(self.control.pipe_dir(UUID), uid, dict(env or {}))
        self.clients.append(client)
        return client

    def command(self, text: str) -> str:
        return self.control.command(UUID, text)

    def settle(self, predicate, what: str):
        return wait_for(what, predicate, TIMEOUT)


def _start(request, short_tmp, multiuser: bool = False):
    if request.param == "fake":
        fake = FakeMps()
        fake.start(UUID, multiuser=multiuser)
        return FakeSide(fake), lambda: fake.stop(UUID)
    os.chmod(short_tmp, 0o755)  # other users' clients reach the pipe directory (0755, as the sidecar makes it)
    exe = mpscontrol.install(os.path.join(short_tmp, "bin", "nvidia-cuda-mps-control"))
    control = MpsControl(exe, os.path.join(short_tmp, "mps"))
    os.makedirs(os.path.join(short_tmp, "mps"), mode=0o755)
    control.start(UUID, multiuser=multiuser)
    side = StandInSide(control)

    def stop() -> None:
        for client in side.clients:
            client.exit()
        control.stop(UUID)

    return side, stop


@pytest.fixture(params=["stand-in", "fake"])
def mps(request, short_tmp):
    side, stop = _start(request, short_tmp)
    yield side
    stop()


@pytest.fixture(params=["stand-in", "fake"])
def multiuser_mps(request, short_tmp):
    if request.param == "stand-in" and os.geteuid() != 0:
        pytest.skip("needs root: the real daemon takes -multiuser-server from root only, and so does the stand-in")
    side, stop = _start(request, short_tmp, multiuser=True)
    yield side
    stop()


def _servers(mps) -> list[int]:
    return [int(line) for line in mps.command("get_server_list").split()]


def test_the_first_client_starts_a_server_with_the_defaults_and_cannot_lift_them(mps):
    assert mps.command("set_default_active_thread_percentage 25") == "25.0"
    assert mps.command("set_default_device_pinned_mem_limit 0 2G") == ""
    assert mps.command("get_server_list") == "" and mps.command("ps") == "Server not found"
    unset = mps.client()
    got = unset.result()
    assert (got["mps"], got["active_thread_percentage"], got["pinned_mem_limit_mib"]) == (True, 25.0, 2048)
    (server,) = _servers(mps)
    assert got["server"] == server
    raised = mps.client(env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G"})
    assert (raised.result()["active_thread_percentage"], raised.result()["pinned_mem_limit_mib"]) == (25.0, 2048)
    tighter = mps.client(env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G"})
    assert (tighter.result()["active_thread_percentage"], tighter.result()["pinned_mem_limit_mib"]) == (10.0, 1024)
    assert _servers(mps) == [server], "one server for one uid"
    assert mps.command(f"get_server_status {server}") == "ACTIVE"
    assert mps.command(f"get_active_thread_percentage {server}") == "25.0"
    assert mps.command(f"get_device_pinned_mem_limit {server} 0") == "2G"
    assert mps.command(f"get_client_list {server}").split() == sorted(str(c.pid) for c in (unset, raised, tighter))
    ps = mps.command("ps").splitlines()
    assert ps[0] == "PID       ID        SERVER         DEVICE                    NAMESPACE      COMMAND"
    assert [line.split()[0] for line in ps[1:]] == sorted(str(c.pid) for c in (unset, raised, tighter))
    assert all(line.split()[2] == str(server) and line.split()[3] == UUID[:22] for line in ps[1:])
    unset.exit()
    mps.settle(lambda: str(unset.pid) not in mps.command(f"get_client_list {server}").split(), "the client's exit seen")
    assert _servers(mps) == [server], "the server stays after a client exits"


def test_per_server_values_reach_new_clients_and_a_new_default_does_not_reach_a_running_server(mps):
    mps.command("set_default_active_thread_percentage 25")
    mps.command("set_default_device_pinned_mem_limit 0 2G")
    holder = mps.client()
    server = holder.result()["server"]
    assert mps.command("set_default_active_thread_percentage 40") == "40.0"
    assert mps.command(f"get_active_thread_percentage {server}") == "25.0"
    assert mps.client().result()["active_thread_percentage"] == 25.0
    assert mps.command(f"set_active_thread_percentage {server} 50") == "50.0"
    assert mps.command(f"set_active_thread_percentage {server} 150") == "50.0", "a bad value echoes the one in force"
    assert mps.command(f"get_active_thread_percentage {server}") == "50.0"
    assert mps.command("get_default_active_thread_percentage") == "40.0"
    got = mps.client(env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}).result()
    assert got["active_thread_percentage"] == 50.0
    assert mps.command(f"set_device_pinned_mem_limit {server} 0 3G") == ""
    assert mps.command(f"get_device_pinned_mem_limit {server} 0") == "3G"
    assert mps.command("get_default_device_pinned_mem_limit 0") == "2G"
    assert mps.client().result()["pinned_mem_limit_mib"] == 3072
    assert mps.command("get_server_status") == "A server PID is required"


def test_a_second_users_client_waits_until_the_first_users_clients_are_gone(mps, request):
    if isinstance(mps, StandInSide) and os.geteuid() != 0:
        pytest.skip("needs root: the stand-in's clients of another uid run through setpriv")
    mps.command("set_default_active_thread_percentage 40")
    root = mps.client(uid=0)
    first = root.result()["server"]
    other = mps.client(uid=NOBODY)
    mps.settle(lambda: other.waiting(), "the other user's client to wait")
    assert other.waiting(), "queued, silently, while root's client holds the server"
    assert _servers(mps) == [first]
    assert mps.command(f"get_client_list {first}").split() == [str(root.pid)]
    root.exit()
    got = other.result()
    assert got["server"] != first and got["active_thread_percentage"] == 40.0
    assert _servers(mps) == [got["server"]]
    if isinstance(mps, StandInSide):
        with open(f"/proc/{got['server']}/status") as fh:
            uid = next(line for line in fh if line.startswith("Uid:")).split()[1]
        assert int(uid) == NOBODY, "the server runs as its user"
    other.exit()
    again = mps.client(uid=0).result()
    assert again["server"] not in (first, got["server"]), "an idle other user's server gives way at once"


def test_start_server_uid_starts_that_users_server_before_any_client(mps):
    mps.command("set_default_active_thread_percentage 30")
    assert mps.command("start_server -uid 0") == ""
    (server,) = _servers(mps)
    assert mps.command(f"get_active_thread_percentage {server}") == "30.0"
    assert mps.command(f"get_client_list {server}") == ""
    assert mps.client().result()["server"] == server
    assert mps.command("start_server -uid 0") == "" and _servers(mps) == [server]


def test_a_multiuser_server_serves_every_user(multiuser_mps):
    mps = multiuser_mps
    root = mps.client(uid=0).result()
    other = mps.client(uid=NOBODY).result()
    assert root["server"] == other["server"] and _servers(mps) == [root["server"]]


def test_a_fault_fails_every_client_refuses_new_ones_until_they_exited_then_the_same_server_is_active(mps):
    bystander, culprit = mps.client(), mps.client()
    server = bystander.result()["server"]
    assert culprit.result()["server"] == server
    assert mps.command(f"sim_fault {server}") == ""
    for client in (bystander, culprit):
        assert client.events(1)[0]["code"] == 700
    assert mps.command(f"get_server_status {server}") == "FAULT"
    assert mps.command("get_server_list") == str(server)
    refused = mps.client().result()
    assert refused["code"] == 807 and "server" not in refused
    culprit.exit()
    mps.settle(lambda: mps.command(f"get_client_list {server}") == str(bystander.pid), "the culprit's exit seen")
    assert mps.command(f"get_server_status {server}") == "FAULT", "until every affected client has exited"
    assert mps.client().result()["code"] == 807
    bystander.exit()
    mps.settle(lambda: mps.command(f"get_server_status {server}") == "ACTIVE", "the server back")
    assert mps.client().result()["server"] == server, "the same server, no new one"


def test_terminate_client_ends_that_client_only(mps):
    kept, ended = mps.client(), mps.client()
    server = kept.result()["server"]
    ended.result()
    assert mps.command(f"terminate_client {server} {ended.pid}") == ""
    assert ended.events(1)[0]["event"] == "terminated"
    mps.settle(lambda: mps.command(f"get_client_list {server}") == str(kept.pid), "the terminated client gone")
    assert not kept.events(0)


def test_a_client_without_a_daemon_runs_without_mps_on_the_whole_gpu(short_tmp):
    got = StandInClient(os.path.join(short_tmp, "nowhere"), 0, {})
    try:
        record = got.result()
        assert (record["mps"], record["active_thread_percentage"], record["pinned_mem_limit_mib"]) == (
            False,
            100.0,
            None,
        )
    finally:
        got.exit()


def test_settings_from_another_user_are_refused_as_the_binary_says():
    fake = FakeMps()
    fake.start(UUID)
    reply = fake.command(UUID, "set_default_active_thread_percentage 5", peer_uid=NOBODY)
    assert reply.startswith(f"Insufficient privileges for UID {NOBODY}.")
    assert fake.command(UUID, "get_default_active_thread_percentage") == "100.0"
    assert fake.command(UUID, "sim_fault 1", peer_uid=NOBODY).startswith("Insufficient privileges")


def test_the_sm_count_of_a_percentage_is_whole_tpcs_as_measured():
    from isolator.simhost.mpsclient import sm_count

    assert [sm_count(p, 132) for p in (10, 25, 40, 50, 100)] == [12, 32, 52, 66, 132]


@pytest.fixture
def stand_in(short_tmp):
    side, stop = _start(type("Param", (), {"param": "stand-in"})(), short_tmp)
    yield side
    stop()


def test_a_client_told_zero_seconds_reports_and_exits(stand_in):
    pipe = stand_in.control.pipe_dir(UUID)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
    out = subprocess.run(
        [sys.executable, "-m", "isolator.simhost.mpsclient", "--seconds", "0"],
        env={**env, "CUDA_MPS_PIPE_DIRECTORY": pipe},
        cwd=paths.ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 0 and json.loads(out.stdout)["mps"] is True, out
