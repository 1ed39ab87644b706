"""The process table's answers stay true while the work behind them is saved (isolator/host/system.py):
the sidecar's pid chain is walked again after an ancestor exits, and only then."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import paths
import pytest

from isolator.host.system import ProcProcesses

ROOT = paths.ROOT

# The "sidecar": answers each line on stdin with its cached chain, a freshly walked one and its parent.
SIDECAR = """
import json, os, sys
from isolator.host.system import ProcProcesses
procs = ProcProcesses()
for _ in sys.stdin:
    print(json.dumps([sorted(procs.sidecar_pids()), sorted(ProcProcesses().sidecar_pids()), os.getppid()]), flush=True)
"""

# Its parent: starts the sidecar on the same pipes, says its pid, and exits on SIGTERM leaving it behind.
LAUNCHER = """
import signal, subprocess, sys
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
signal.sigwait([signal.SIGTERM])
"""


@pytest.fixture
def orphaned_sidecar() -> Iterator[tuple[subprocess.Popen[str], int]]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, SIDECAR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert launcher.stdout is not None
    sidecar = int(launcher.stdout.readline())
    try:
        yield launcher, sidecar
    finally:
        launcher.kill()
        launcher.wait()
        os.kill(sidecar, signal.SIGKILL)  # an orphan by now: whoever adopted it reaps it


def _ask(launcher: subprocess.Popen[str]) -> tuple[list[int], list[int], int]:
    assert launcher.stdin is not None and launcher.stdout is not None
    launcher.stdin.write("?\n")
    launcher.stdin.flush()
    cached, walked, parent = json.loads(launcher.stdout.readline())
    return cached, walked, parent


def test_the_sidecars_pids_drop_an_ancestor_that_exited(orphaned_sidecar) -> None:
    launcher, sidecar = orphaned_sidecar
    cached, walked, parent = _ask(launcher)
    assert parent == launcher.pid and cached == walked
    assert {sidecar, launcher.pid, os.getpid()} <= set(cached)
    assert _ask(launcher)[0] == cached, "nothing exited: the same chain"

    launcher.send_signal(signal.SIGTERM)
    launcher.wait()  # the sidecar was given to a reaper when its parent exited, before this returns
    cached, walked, parent = _ask(launcher)
    assert parent != launcher.pid
    assert launcher.pid not in cached, "a chain kept past its ancestor's exit names a pid that may be reused"
    assert cached == walked and sidecar in cached and parent in cached


def test_the_sidecars_pids_are_walked_where_its_ancestors_cannot_be_watched(tmp_path) -> None:
    # A /proc copy whose chain names pids that do not exist here: no pidfd, so nothing is kept.
    me = os.getpid()
    os.makedirs(tmp_path / str(me))
    (tmp_path / str(me) / "stat").write_text(f"{me} (python) S 4000000 0 0\n")
    procs = ProcProcesses(str(tmp_path))
    assert procs.sidecar_pids() == {me, 4_000_000}
    (tmp_path / str(me) / "stat").write_text(f"{me} (python) S 4000001 0 0\n")
    assert procs.sidecar_pids() == {me, 4_000_001}


def _sys_tree(root, online: str = "0-7") -> None:
    system = root / "devices" / "system"
    (system / "cpu").mkdir(parents=True, exist_ok=True)
    (system / "cpu" / "online").write_text(online + "\n")
    (system / "node").mkdir(exist_ok=True)
    (system / "node" / "online").write_text("0-1\n")
    (system / "node" / "has_memory").write_text("0-1\n")


def test_the_machines_cpus_follow_hotplug_on_every_call(tmp_path) -> None:
    from isolator.host.cpus import SysCpus

    _sys_tree(tmp_path)
    cpus = SysCpus(str(tmp_path))
    assert cpus.machine().cpus == frozenset(range(8))
    _sys_tree(tmp_path, online="0-3")  # CPUs 4-7 taken offline
    (tmp_path / "devices" / "system" / "node" / "has_memory").write_text("1\n")
    machine = cpus.machine()
    assert machine.cpus == frozenset(range(4)) and machine.mems == frozenset({1})


def test_a_hint_for_a_gpu_on_a_memory_node_needs_no_nodes_cpu_list(tmp_path) -> None:
    from isolator.errors import CgroupError
    from isolator.host.cpus import SysCpus
    from isolator.policy.affinity import GpuLocality, decide

    _sys_tree(tmp_path)  # no node<N>/cpulist at all: reading one fails
    machine = SysCpus(str(tmp_path)).machine()
    got = decide([GpuLocality(0, 1, "4-7")], machine)
    assert got is not None and (got.cpus, got.mems) == (frozenset(range(4, 8)), frozenset({1}))
    with pytest.raises(CgroupError, match="cpulist"):
        decide([GpuLocality(0, 5, "4-7")], machine)  # node 5 has no memory: the nodes' CPUs decide
    for n, listed in ((0, "0-3"), (1, "4-7")):
        (tmp_path / "devices" / "system" / "node" / f"node{n}").mkdir()
        (tmp_path / "devices" / "system" / "node" / f"node{n}" / "cpulist").write_text(listed + "\n")
    fallback = decide([GpuLocality(0, 5, "4-7")], SysCpus(str(tmp_path)).machine())
    assert fallback is not None and fallback.mems == frozenset({1})


def test_kernel_files_are_read_in_full_and_a_missing_one_says_so(tmp_path) -> None:
    from isolator.cgroups import base
    from isolator.host import system

    big = tmp_path / "cgroup.procs"
    big.write_text("".join(f"{pid}\n" for pid in range(1, 40_000)))  # > 64 KiB: more than one read(2)
    for read_text in (system.read_text, base.read_text):
        assert read_text(str(big)) == big.read_text()
        with pytest.raises(FileNotFoundError):
            read_text(str(tmp_path / "gone"))
    assert base.read_pids(str(tmp_path)) == tuple(range(1, 40_000))
