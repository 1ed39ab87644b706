"""Test daemons started by fork from a process that has already imported the daemon.

A `python -m isolator serve` start spends about 0.35 s of CPU before it reads its first flag: the
interpreter, gRPC's extension, protobuf and Python building the package's ~90 dataclasses. The test
suite starts a few hundred daemons, so on a 2-core machine that alone is about a minute of its wall
time. Here one process per test worker (the fork server) imports all of that once; each daemon is
then a fork of it that sets its own argv, environment, working directory and stdout/stderr and runs
the same entry point `python -m isolator` runs (`isolator.cli.main.main`), exiting the same way.

What differs from an exec'd daemon, and where that path is tested instead: the daemon's parent is the
fork server (a child of the test worker, so the worker is still among its ancestors) and its
/proc/<pid>/cmdline is the fork server's. Starting the interpreter and importing the package is
tested where that is the point: tests/system/test_startup.py, test_daemon_lifecycle.py, test_systemd.py
and test_packaging.py exec the daemon and the installed scripts.

The fork server is single-threaded (forking a process with threads leaves their locks held in the
child); it imports gRPC but makes no channel or server, so gRPC's core has nothing to carry across the
fork. Each child is reaped by the fork server, which reports its exit status; the test holds a pidfd
(opened by the fork server before it could reap the child) so that a signal never reaches a process
that reused the pid. `GPU_ISOLATOR_TEST_FORK=0` makes `spawn` exec the daemon as before.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

# What a daemon imports before it serves (`python -X importtime -m isolator serve ...`), imported once
# here; none of these reads the environment or the machine when imported.
PRELOAD = (
    "grpc",
    "grpc.aio",
    "grpc_health.v1.health",
    "isolator.cli.main",
    "isolator.daemon.main",
    "isolator.daemon.config",
    "isolator.transport.server",
    "isolator.core.service",
    "isolator.cgroups.v1",
    "isolator.cgroups.v2",
    "isolator.gpu.nvml",
    "isolator.simhost.sim",
    "isolator.simhost.driver",
    "volumes.manager",
    "grpc._server",
    "concurrent.futures.thread",
    "isolator.daemon.crashpoints",
    "isolator.daemon.logfmt",
    "isolator.daemon.sdnotify",
    "isolator.daemon.workdir",
    "isolator.host.cpus",
    "isolator.host.devices",
    "isolator.host.rootfs",
    "isolator.host.system",
    # Imported while the daemon builds its service and exporters (prometheus_client, with email,
    # http.server and urllib.request: about 30 ms of CPU per daemon). prometheus_client reads
    # PROMETHEUS_MULTIPROC_DIR when imported, which no test sets.
    "isolator.exporters.metrics",
    "isolator.daemon.ownership",
    "isolator.cgroups.cpuset",
    "isolator.core.healthmarks",
)
MAX_MESSAGE = 1 << 20
ENV = "GPU_ISOLATOR_TEST_FORK"


class ForkedDaemon:
    """The part of subprocess.Popen the test harness uses, for a daemon the fork server started."""

    def __init__(self, server: ForkServer, pid: int, pidfd: int, args: Sequence[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._pidfd = pidfd

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.status(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            status = self._server.status(self.pid, timeout=timeout)
            if status is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = status
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._pidfd)


class ForkServer:
    """The test worker's end: one fork server process, started on first use."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        # CPU seconds (user + system) of the daemons reaped so far, for a per-test CPU count: they are
        # the fork server's children, so they never appear in the worker's RUSAGE_CHILDREN.
        self.children_cpu = 0.0
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "isolator.testing.forkserver", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()

    def spawn(self, argv: Sequence[str], env: dict[str, str], stdout: int, stderr: int, cwd: str) -> ForkedDaemon:
        if list(argv[1:3]) != ["-m", "isolator"]:
            raise ValueError(f"the fork server runs `python -m isolator ...` only, not {argv[:3]}")
        request = json.dumps({"argv": list(argv[3:]), "env": env, "cwd": cwd}).encode()
        with self._lock:
            socket.send_fds(self._sock, [request], [stdout, stderr])
            while True:
                message, fds = self._receive(block=True)
                if "pid" in message:
                    return ForkedDaemon(self, int(message["pid"]), fds[0], argv)

    def status(self, pid: int, timeout: float | None) -> int | None:
        """The exit status of ``pid`` once the fork server reaped it; None if not within ``timeout``.
        Waits in slices outside the lock, so that other threads can spawn and wait meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                while self._receive(block=False)[0]:
                    pass
                if pid in self._exits:
                    return int(self._exits.pop(pid))
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                return None
            select.select([self._sock], [], [], left)

    def _receive(self, block: bool) -> tuple[dict[str, float], list[int]]:
        """One message (the caller holds the lock); exit reports are filed as they come."""
        flags = 0 if block else socket.MSG_DONTWAIT
        try:
            data, fds = _recv(self._sock, 1, flags)
        except BlockingIOError:
            return {}, []
        if not data:
            raise RuntimeError(f"the test fork server exited ({self._proc.poll()})")
        message = json.loads(data)
        if "exit" in message:
            self._exits[message["exit"]] = message["status"]
            self.children_cpu += message["cpu"]
        return message, fds

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)


def _recv(sock: socket.socket, maxfds: int, flags: int = 0) -> tuple[bytes, list[int]]:
    """One message and the descriptors passed with it (Python 3.11's socket.recv_fds drops ``flags``)."""
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_LEN(maxfds * fds.itemsize), flags)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


_server: ForkServer | None = None
_server_lock = threading.Lock()


def spawn(
    argv: Sequence[str], env: dict[str, str], stdout: int, stderr: int, cwd: str | None = None
) -> ForkedDaemon | subprocess.Popen[str]:
    """A daemon running ``argv``: ``python -m isolator ...`` is forked from this worker's fork server;
    any other command (a wrapper such as the systemd sandbox's), or any where GPU_ISOLATOR_TEST_FORK=0,
    is exec'd as before. A ForkedDaemon or a subprocess.Popen."""
    global _server
    cwd = cwd or os.getcwd()
    if os.environ.get(ENV, "1") == "0" or list(argv[1:3]) != ["-m", "isolator"]:
        return subprocess.Popen(list(argv), stdout=stdout, stderr=stderr, env=env, cwd=cwd, text=True)
    with _server_lock:
        if _server is None:
            _server = ForkServer()
            import atexit

            atexit.register(_server.close)
        server = _server
    return server.spawn(argv, env, stdout, stderr, cwd)


def run(argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)`` for a
    ``python -m isolator ...`` command, forked from the fork server (a CLI command's output and
    exit status, as the exec'd command's: tests/system/test_forkserver.py)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = spawn(argv, dict(os.environ), out.fileno(), err.fileno())
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(list(argv), status, out.read(), err.read())


# ---- the fork server itself ---------------------------------------------------------------------


def _serve(sock: socket.socket) -> tuple[list[str], dict[str, str], str, list[int]] | None:
    """Fork a daemon per request until the test worker goes away. Returns only in a forked child,
    with what it is to run."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        try:
            readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 4096):
                    pass
            _reap(sock)
        if sock.fileno() in readable:
            data, fds = _recv(sock, 2)
            if not data:
                return None
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                sock.close()
                return request["argv"], request["env"], request["cwd"], fds
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd])
            os.close(pidfd)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        cpu = usage.ru_utime + usage.ru_stime
        with contextlib.suppress(OSError):
            sock.send(json.dumps({"exit": pid, "status": code, "cpu": cpu}).encode())


def _child(argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> None:
    """In the forked daemon: what `python -m isolator ARGV` would have been given."""
    stdout, stderr = fds
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in (devnull, stdout, stderr):
        if fd > 2:
            os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [os.path.join(os.path.dirname(os.path.dirname(__file__)), "__main__.py"), *argv]


def main() -> None:
    import importlib

    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        importlib.import_module(name)
    job = _serve(sock)
    if job is None:
        return
    _child(*job)
    from isolator.cli.main import main as cli_main

    sys.exit(cli_main())


if __name__ == "__main__":
    main()
