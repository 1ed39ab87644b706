"""Hostile pids given to Isolate (issue 33, defect 4): a thread that is not its process's leader, a
zombie, pid 0 and 1, pids past the kernel's limit, a pid gone before the call. Each answers a clear
typed error with its own code on both routes (gRPC and the command-module bridge), never INTERNAL,
and moves nothing. Real daemon, real processes and threads, real cgroups."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import paths
import pytest

from isolator.testing.cgroupfs import TEST_PARENT
from isolator.testing.mesos import BridgeIsolator, Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import Sidecar

pytestmark = [pytest.mark.root, pytest.mark.cgroup_v1]


# One daemon for the module, on one xdist worker (tests/conftest.py).
SHARED_FIXTURES = ("sidecar",)


@pytest.fixture(scope="module")
def sidecar() -> Iterator[Sidecar]:
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="gi-pid-", dir="/tmp")
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    running = Sidecar(work=work, host="single", cgroup_version="v1", cgroups_root=root).start()
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(work, ignore_errors=True)


def _isolator(sidecar: Sidecar, route: str) -> GrpcIsolator | BridgeIsolator:
    from isolator.bridge.command import install

    if route == "grpc":
        return GrpcIsolator(sidecar.socket)
    bridge_dir = os.path.join(sidecar.work, "bridge")
    if not os.path.isdir(bridge_dir):
        install(bridge_dir, sidecar.bridge_socket)
    return BridgeIsolator(bridge_dir, sidecar.work)


ROUTES = ["grpc", "bridge"]


def _refused(sidecar: Sidecar, route: str, pid: int) -> HookFailed:
    isolator = _isolator(sidecar, route)
    name = f"{route}-{uuid.uuid4().hex[:6]}"
    cid = container_id(name)
    isolator.prepare(cid, Containerizer(isolator, sidecar.work).config(gpus=0, image=False))
    try:
        with pytest.raises(HookFailed) as refused:
            isolator.isolate(cid, pid)
        assert refused.value.code != "INTERNAL", refused.value
        assert "Errno" not in refused.value.message, refused.value
        return refused.value
    finally:
        isolator.cleanup(cid)
        if isinstance(isolator, GrpcIsolator):
            isolator.close()


def _cgroups_of(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as fh:
        return fh.read()


@pytest.mark.parametrize("route", ROUTES)
def test_a_thread_that_is_not_its_process_leader_is_invalid_argument_naming_the_process(sidecar, route):
    """Before issue 33: INTERNAL, '[Errno 2] ...'."""
    code = (
        "import sys, threading\n"
        "stop = threading.Event()\n"
        "t = threading.Thread(target=stop.wait)\n"
        "t.start()\n"
        "print(t.native_id, flush=True)\n"
        "sys.stdin.read()\n"
        "stop.set()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        tid = int(child.stdout.readline())
        assert tid != child.pid
        where = _cgroups_of(child.pid)
        error = _refused(sidecar, route, tid)
        assert error.code == "INVALID_ARGUMENT", error
        assert f"pid {tid} is a thread of process {child.pid}" in error.message, error
        assert _cgroups_of(child.pid) == where  # nothing moved
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("route", ROUTES)
def test_a_zombie_is_failed_precondition_saying_it_has_exited(sidecar, route):
    child = subprocess.Popen(["true"])
    try:
        # Exited, not reaped: a zombie until wait().
        for _ in range(2000):
            with open(f"/proc/{child.pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            os.sched_yield()
        error = _refused(sidecar, route, child.pid)
        assert error.code == "FAILED_PRECONDITION", error
        assert f"pid {child.pid} has exited" in error.message and "zombie" in error.message, error
    finally:
        child.wait()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("pid", [0, 1, 4194305, 2**31, 2**63 - 1])
def test_pid_0_1_and_pids_past_the_kernel_limit_are_invalid_argument(sidecar, route, pid):
    error = _refused(sidecar, route, pid)
    assert error.code == "INVALID_ARGUMENT", error
    assert f"pid {pid}" in error.message, error


@pytest.mark.parametrize("route", ROUTES)
def test_a_pid_gone_before_the_call_is_failed_precondition(sidecar, route):
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: the number names nothing (until reused)
    error = _refused(sidecar, route, child.pid)
    assert error.code == "FAILED_PRECONDITION", error
    assert f"pid {child.pid} does not exist" in error.message, error


@pytest.mark.parametrize("route", ROUTES)
def test_a_pid_sent_from_another_pid_namespace_is_invalid_argument(sidecar, route):
    """A caller in a pid namespace of its own (``unshare --pid``) sends its child's pid as it sees
    it (2, which is kthreadd here); before issue 33 the sidecar read it as its own pid 2."""
    name = f"ns-{route}-{uuid.uuid4().hex[:6]}"
    isolator = _isolator(sidecar, route)
    isolator.prepare(container_id(name), Containerizer(isolator, sidecar.work).config(gpus=0, image=False))
    code = (
        "import json, subprocess, sys\n"
        "from isolator.testing.mesos import BridgeIsolator, GrpcIsolator, HookFailed, container_id\n"
        "child = subprocess.Popen(['sleep', '600'])\n"
        f"isolator = GrpcIsolator({sidecar.socket!r}) if {route!r} == 'grpc'"
        f" else BridgeIsolator({os.path.join(sidecar.work, 'bridge')!r}, {sidecar.work!r})\n"
        "try:\n"
        f"    isolator.isolate(container_id({name!r}), child.pid)\n"
        "    print(json.dumps({'pid': child.pid, 'code': 'OK', 'message': ''}))\n"
        "except HookFailed as exc:\n"
        "    print(json.dumps({'pid': child.pid, 'code': exc.code, 'message': exc.message}))\n"
        "finally:\n"
        "    child.kill()\n"
    )
    try:
        result = subprocess.run(
            ["unshare", "--pid", "--fork", sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=paths.ROOT,
        )
        assert result.returncode == 0, result.stderr
        import json

        answer = json.loads(result.stdout.strip().splitlines()[-1])
        assert answer["pid"] == 2, answer  # the namespace's second process
        assert answer["code"] == "INVALID_ARGUMENT", answer
        assert "in another pid namespace" in answer["message"], answer
    finally:
        isolator.cleanup(container_id(name))
        if isinstance(isolator, GrpcIsolator):
            isolator.close()
