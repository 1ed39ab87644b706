"""Crash consistency: a container workload while the sidecar is SIGKILLed inside its hooks, again and again.

The daemon kills itself at the n-th pass of a named crash point (isolator/daemon/crashpoints.py): each
restart aims at the next point in turn (n drawn from a seeded stream), so kills land between every
pair of steps that matter — after the record and before the cgroup, between v1 writes, between a
v2 checkpoint and its attach, inside Recover itself, just before a state COMMIT. After every
restart the driver calls Recover, as the agent does (or, as on the command-module route, never does,
leaving it to the start-up reconciliation), and checks from outside (tests/invariants.py):
no GPU granted to two containers, every recorded container's kernel grants equal its record, no
unrecorded cgroup grants anything. At the end everything is cleaned up and nothing of ours is left.

The number of kills is GPU_ISOLATOR_CRASH_POINTS (default 8 per cgroup version; ``make soak`` runs
500 per version and per route). The seed is GPU_ISOLATOR_CRASH_SEED (default 9), printed on failure.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from invariants import CrashableSidecar, Observer, read_records

from isolator.daemon.crashpoints import ENV, POINTS
from isolator.testing.mesos import GrpcIsolator, HookFailed, container_id, gpu_resource
from isolator.testing.sidecar import TEST_PARENT

pytestmark = [pytest.mark.root, pytest.mark.crash_matrix]

VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]
GPUS = 8  # dgx-1
MAX_LIVE = 5
# A restart whose crash point is not reached within this many operations moves on to the next point.
MAX_OPS_PER_RUN = 40
DEFAULT_POINTS = 8


class Crashed(Exception):
    """The daemon died (SIGKILL from its crash point) during a call."""


@dataclass
class Container:
    name: str
    image: bool
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class Driver:
    """Plays the agent: random container operations, and after each crash restart + Recover + checks."""

    sidecar: CrashableSidecar
    rng: random.Random
    points: tuple[str, ...]
    live: dict[str, Container] = field(default_factory=dict)
    kills: Counter[str] = field(default_factory=Counter)
    misses: int = 0
    serial: int = 0
    isolator: GrpcIsolator | None = None
    observer: Observer | None = None
    jobs: str = ""  # the daemon's --job-mapping-dir
    # The agent calls Recover after each restart; the command-module route never does, and then the
    # start-up reconciliation alone must leave the kernel exactly as recorded.
    recovers: bool = True
    _next_point: int = 0

    # ---- daemon lifecycle ---------------------------------------------------------------------

    def start(self, crash: bool = True) -> None:
        while True:
            if crash:
                point = self.points[self._next_point % len(self.points)]
                self._next_point += 1
                self.sidecar.env = {ENV: f"{point}:{1 + self.rng.randrange(3)}"}
            else:
                self.sidecar.env = {}
            try:
                self.sidecar.start()
                break
            except RuntimeError:
                # Killed at a crash point of the start-up reconciliation (it repairs what the last
                # kill left before serving): that is a kill too, and the next start must cope.
                if not crash or self.sidecar.proc is None or self.sidecar.proc.returncode != -9:
                    raise
                self.kills[self._last_point()] += 1
        if self.isolator is not None:
            self.isolator.close()
        self.isolator = GrpcIsolator(self.sidecar.socket, timeout=60)
        self.ops = 0

    def crashed(self) -> None:
        """Called when a call failed because the daemon died: count the kill, restart, Recover, check."""
        status = self.sidecar.died()
        assert status == -9, f"the sidecar died with {status}, not its own SIGKILL: {self.sidecar.log()}"
        self.kills[self._last_point()] += 1
        while True:
            self.start()
            try:
                self.recover()
                break
            except Crashed:
                assert self.sidecar.died() == -9
                self.kills[self._last_point()] += 1
        self.check()

    def recover(self) -> None:
        if self.recovers:
            self.call("recover", [], [])

    def _last_point(self) -> str:
        log = self.sidecar.log()
        line = log[log.rindex("crash point ") :].split("\n", 1)[0]
        return line.split()[2]

    def check(self) -> None:
        assert self.observer is not None
        problems = self.observer.problems()
        assert not problems, f"after {sum(self.kills.values())} kills {dict(self.kills)}: {problems}"
        if self.jobs:
            # dcgm-exporter's job mapping is exact after every crash: each GPU's file lists exactly
            # the top-level containers whose records hold it (dgx-1: minor == index).
            records = read_records(self.sidecar.work)
            want = {str(i): sorted(c for c, held in records.items() if "." not in c and i in held) for i in range(GPUS)}
            got = {}
            for name in os.listdir(self.jobs):
                with open(os.path.join(self.jobs, name)) as fh:
                    got[name] = fh.read().split()
            assert got == want, f"after {sum(self.kills.values())} kills {dict(self.kills)}: job mapping {got}"

    def call(self, hook: str, *args: Any) -> Any:
        assert self.isolator is not None
        try:
            return getattr(self.isolator, hook)(*args)
        except HookFailed as exc:
            if exc.code in ("UNAVAILABLE", "CANCELLED", "INTERNAL") and self.sidecar.died(timeout=5) is not None:
                raise Crashed() from None
            raise

    # ---- the workload -------------------------------------------------------------------------

    def config(self, gpus: int, image: bool) -> dict[str, Any]:
        sandbox = tempfile.mkdtemp(prefix="sb-", dir=self.sidecar.work)
        config: dict[str, Any] = {"directory": sandbox, "resources": [gpu_resource(gpus)]}
        if image:
            rootfs = os.path.join(sandbox, "rootfs")
            os.makedirs(rootfs)
            config["rootfs"] = rootfs
            config["docker"] = {"manifest": {"config": {"Env": ["NVIDIA_VISIBLE_DEVICES=all"]}}}
        return config

    def step(self) -> None:
        """One operation; a container whose operation was cut by a crash is destroyed afterwards, as
        the agent destroys a container whose launch or update did not complete."""
        roll = self.rng.random()
        if not self.live or (len(self.live) < MAX_LIVE and roll < 0.35):
            self.serial += 1
            c = Container(f"c{self.serial}-{uuid.uuid4().hex[:6]}", image=self.rng.random() < 0.4)
            self.guarded(c, self.prepare, c)
            return
        c = self.live[self.rng.choice(sorted(self.live))]
        if c.proc is None and roll < 0.6:
            self.guarded(c, self.isolate, c)
        elif roll < 0.8:
            self.guarded(c, self.update, c, self.rng.randrange(4))
        else:
            self.destroy(c)

    def guarded(self, c: Container, op: Any, *args: Any) -> None:
        try:
            op(*args)
        except Crashed:
            self.crashed()
            self.destroy(c)

    def prepare(self, c: Container) -> None:
        try:
            self.call("prepare", container_id(c.name), self.config(self.rng.randrange(4), c.image))
        except HookFailed as exc:
            assert exc.code == "RESOURCE_EXHAUSTED", exc
            return
        self.live[c.name] = c

    def isolate(self, c: Container) -> None:
        c.proc = subprocess.Popen(["sleep", "600"])
        self.call("isolate", container_id(c.name), c.proc.pid)

    def update(self, c: Container, gpus: int) -> None:
        try:
            self.call("update", container_id(c.name), gpus)
        except HookFailed as exc:
            assert exc.code == "RESOURCE_EXHAUSTED", exc

    def destroy(self, c: Container) -> None:
        """Kill the container's processes, then Cleanup (retried across crashes until it succeeds)."""
        if c.proc is not None:
            c.proc.kill()
            c.proc.wait()
            c.proc = None
        while True:
            try:
                self.call("cleanup", container_id(c.name))
                break
            except Crashed:
                self.crashed()
        self.live.pop(c.name, None)

    def run(self, wanted: int) -> None:
        self.start()
        self.recover()
        while sum(self.kills.values()) < wanted:
            assert self.misses <= wanted, f"{self.misses} restarts never reached their crash point"
            self.ops += 1
            if self.ops > MAX_OPS_PER_RUN:
                # The aimed-at point was not reached: restart cleanly (that tests recovery too).
                self.misses += 1
                assert self.sidecar.terminate() == 0, self.sidecar.log()
                self.start()
                self.recover()
                self.check()
                continue
            self.step()

    def finish(self) -> None:
        """Restart without crashing, Recover, destroy every container."""
        if self.sidecar.proc is not None and self.sidecar.proc.poll() is None:
            assert self.sidecar.terminate() == 0, self.sidecar.log()
        self.start(crash=False)
        self.recover()
        self.check()
        for c in list(self.live.values()):
            self.destroy(c)
        assert self.isolator is not None
        self.isolator.close()


def crash_points() -> int:
    return int(os.environ.get("GPU_ISOLATOR_CRASH_POINTS", DEFAULT_POINTS))


def points_for(version: str, recovers: bool = True) -> tuple[str, ...]:
    other = "v2." if version == "v1" else "v1."
    # cpuset.* points are passed only under --cpu-affinity enforce, on a host whose GPUs are local to
    # this machine's CPUs (dgx-1 is not): tests/system/test_affinity.py aims at them. mps.* points
    # only where a GPU is shared in mps mode: tests/system/test_mps_identity.py aims at them.
    return tuple(
        p for p in POINTS if not p.startswith((other, "cpuset.", "mps.")) and (recovers or not p.startswith("recover."))
    )


@pytest.mark.parametrize("recovers", [True, False], ids=["agent-recovers", "bridge-route-never-recovers"])
@pytest.mark.parametrize("version", VERSIONS)
def test_sigkill_inside_every_hook_never_double_grants_and_recover_restores_records_and_rules(version, recovers):
    seed = int(os.environ.get("GPU_ISOLATOR_CRASH_SEED", "9"))
    wanted = crash_points()
    work = tempfile.mkdtemp(prefix="gi-crash-", dir="/tmp")
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    jobs = os.path.join(work, "jobs")
    sidecar = CrashableSidecar(
        work=work, host="dgx-1", cgroup_version=version, cgroups_root=root, extra=("--job-mapping-dir", jobs)
    )
    observer = Observer(sidecar, GPUS)
    driver = Driver(
        sidecar, random.Random(seed), points_for(version, recovers), observer=observer, jobs=jobs, recovers=recovers
    )
    try:
        driver.run(wanted)
        driver.finish()
        assert sidecar.terminate() == 0, sidecar.log()
        leftovers = observer.leftovers()
        assert not leftovers, leftovers
        assert sum(driver.kills.values()) >= wanted
        if wanted >= 4 * len(driver.points):
            # The soak aims at every point several times; each must have been hit at least once.
            assert set(driver.points) <= set(driver.kills), f"never killed at {set(driver.points) - set(driver.kills)}"
        print(f"seed {seed}: {sum(driver.kills.values())} kills {dict(driver.kills)}, {driver.misses} misses")
    except BaseException:
        print(f"seed {seed}; sidecar log tail:\n{sidecar.log() if sidecar.log_path else ''}")
        raise
    finally:
        for c in driver.live.values():
            if c.proc is not None:
                c.proc.kill()
                c.proc.wait()
        sidecar.stop()
        shutil.rmtree(work, ignore_errors=True)
