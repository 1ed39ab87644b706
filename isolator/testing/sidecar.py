"""A real sidecar daemon on a simulated GPU host, in standalone mode with throwaway test cgroups.

``Sidecar.start(...)`` runs ``gpu-isolator serve`` as a subprocess (the real composition root), waits
until it answers health checks, and ``stop()`` terminates it and removes every cgroup created
under this run's ``gpu-isolator-test/<unique>`` parent, killing leftover processes first — even
when the test failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from isolator.model import CgroupVersion, Mode
from isolator.simhost.sim import SimulatedHost
from isolator.testing import forkserver
from isolator.testing.cgroupfs import TEST_PARENT, cgroup_mount, remove_cgroup_tree
from isolator.transport.server import socket_is_live

__all__ = ["TEST_PARENT", "Sidecar", "cgroup_mount", "running_sidecar", "wait_for_listener"]


@dataclass
class Sidecar:
    work: str
    host: str
    cgroup_version: CgroupVersion
    cgroups_root: str
    extra: tuple[str, ...] = ()
    mode: Mode = Mode.STANDALONE
    proc: subprocess.Popen[str] | forkserver.ForkedDaemon | None = None
    log_path: str = ""
    _log: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Tests name them as the flags do ("v1", "mesos").
        self.cgroup_version = CgroupVersion(self.cgroup_version)
        self.mode = Mode(self.mode)

    @property
    def socket(self) -> str:
        return os.path.join(self.work, "s.sock")

    @property
    def bridge_socket(self) -> str:
        return self.socket + ".bridge"

    @property
    def address(self) -> str:
        return "unix:" + self.socket

    @property
    def sim(self) -> SimulatedHost:
        """The running daemon's simulated host, for steering (inject_xid, fail_gpu, set_usage)."""
        return SimulatedHost(self.host, os.path.join(self.work, "simhost"))

    @property
    def dev_root(self) -> str:
        return os.path.join(self.work, "simhost", "dev")

    @property
    def cgroup_parent(self) -> str:
        return os.path.join(cgroup_mount(self.cgroup_version), self.cgroups_root)

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "isolator",
            "serve",
            "--socket",
            self.socket,
            "--work-dir",
            self.work,
            "--volume-root",
            os.path.join(self.work, "volumes"),
            *(("--simulate", self.host) if self.host else ()),
            "--mode",
            self.mode,
            "--cgroup-version",
            self.cgroup_version,
            "--cgroups-root",
            self.cgroups_root,
            *self.extra,
        ]

    def start(self, timeout: float = 60) -> Sidecar:
        self.log_path = os.path.join(self.work, "sidecar.log")
        log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        self._log = log
        self.proc = forkserver.spawn(self.argv(), dict(os.environ), log.fileno(), log.fileno())
        deadline = time.monotonic() + timeout
        wait_for_listener(self.socket, self.proc, deadline, self.log)
        with grpc.insecure_channel(self.address) as ch:
            # The socket accepts now, so the first connection attempt succeeds: no reconnect back-off.
            # The future is cancelled before the channel closes: an abandoned one keeps a thread
            # polling the channel, which then fails on the closed channel.
            ready = grpc.channel_ready_future(ch)
            try:
                ready.result(timeout=max(deadline - time.monotonic(), 1.0))
            except grpc.FutureTimeoutError:
                raise RuntimeError(f"the sidecar did not start: {self.log()}") from None
            finally:
                ready.cancel()
        return self

    def log(self) -> str:
        with open(self.log_path) as fh:
            return fh.read()[-4000:]

    @contextlib.contextmanager
    def frozen(self, timeout: float = 30) -> Iterator[None]:
        """The daemon stopped (SIGSTOP, by the pid we started) for the block, then continued.

        kill(2) returns before every thread has stopped, and a request sent in that gap could still
        be read and started in time (no stale call): the block starts once each thread is stopped."""
        assert self.proc is not None
        pid = self.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + timeout
            while not all(_thread_state(pid, task) == "T" for task in os.listdir(f"/proc/{pid}/task")):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the sidecar (pid {pid}) did not stop within {timeout:g} s")
                time.sleep(0.01)
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: a crash, nothing cleaned."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def terminate(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.wait()

    @property
    def cpuset_parents(self) -> list[str]:
        """Where the daemon's cpusets go (--cpu-affinity, docs/affinity.md): its root in the cpuset
        hierarchy (standalone) and the root beside it (mesos mode); none without a cpuset hierarchy."""
        from isolator.cgroups.cpuset import MESOS_CPUSET_SUFFIX, find_cpuset

        found = find_cpuset()
        if found is None:
            return []
        base = os.path.join(found[1], self.cgroups_root)
        return [base, base.rstrip("/") + MESOS_CPUSET_SUFFIX]

    def stop(self) -> None:
        self.terminate()
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
        remove_cgroup_tree(self.cgroup_parent)
        for parent in self.cpuset_parents:
            if parent != self.cgroup_parent and f"/{TEST_PARENT}/" in parent:
                remove_cgroup_tree(parent)


def _thread_state(pid: int, task: str) -> str:
    """A thread's state letter from /proc (``T``: stopped by a signal); "T" for one that is gone."""
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "T"


def wait_for_listener(
    path: str,
    proc: subprocess.Popen[str] | forkserver.ForkedDaemon,
    deadline: float,
    log: Callable[[], str] = lambda: "",
) -> None:
    """Until a connect to the Unix socket ``path`` succeeds, the process exits, or ``deadline`` passes.

    A gRPC channel opened before the socket exists fails its first attempt and then waits out its
    reconnect back-off (a second or so); connecting by hand first costs one poll interval instead.
    """
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited {proc.returncode} before listening on {path}: {log()}")
        with contextlib.suppress(OSError):  # bound but not yet listening, or a stale file being replaced
            if socket_is_live(path):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the daemon did not listen on {path} in time: {log()}")
        time.sleep(0.01)  # a poll interval, not a wait for time to pass


@contextlib.contextmanager
def running_sidecar(
    host: str = "dgx-1",
    cgroup_version: CgroupVersion | str = CgroupVersion.V1,
    extra: tuple[str, ...] = (),
    work: str | None = None,
    parent: str = TEST_PARENT,
) -> Iterator[Sidecar]:
    own = work is None
    work = work or tempfile.mkdtemp(prefix="gi-", dir="/tmp")
    root = f"{parent}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    version = CgroupVersion(cgroup_version)
    sidecar = Sidecar(work=work, host=host, cgroup_version=version, cgroups_root=root, extra=extra)
    try:
        yield sidecar.start()
    finally:
        sidecar.stop()
        if own:
            shutil.rmtree(work, ignore_errors=True)
