"""The daemon's periodic jobs (isolator/daemon/jobs.py): the one table, and the loop that runs them."""

from __future__ import annotations

import threading

from isolator.daemon.config import Config
from isolator.daemon.jobs import Job, Jobs, periodic_jobs
from isolator.model import Mode
from isolator.policy.shares import parse_shared_gpus
from isolator.testing import fake_service


def _names(config: Config, host: str = "dgx-1", keeper: object = None) -> list[str]:
    rig = fake_service(host, mode=config.mode)
    jobs = periodic_jobs(config, rig.service, keeper, lambda _n: None, lambda _n: None)  # type: ignore[arg-type]
    return [job.name for job in jobs]


def test_mesos_mode_reaps_and_standalone_mode_does_not():
    assert _names(Config(mode=Mode.MESOS)) == ["reaper", "drain", "audit"]
    assert _names(Config(mode=Mode.STANDALONE)) == ["drain", "audit"]


def test_the_mps_job_runs_only_with_shared_gpus_and_the_drain_job_only_with_the_check_on():
    config = Config(mode=Mode.STANDALONE, shared_gpus=parse_shared_gpus("4-5:4:mps"), drain_check="off")
    assert _names(config) == ["mps", "audit"]


def test_each_job_runs_at_its_options_interval():
    config = Config(mode=Mode.MESOS, reap_interval=7.0, gpu_probe_interval=3.0, audit_interval=0.0)
    rig = fake_service("dgx-1", mode=Mode.MESOS)
    jobs = periodic_jobs(config, rig.service, None, lambda _n: None, lambda _n: None)
    assert {job.name: job.interval for job in jobs} == {"reaper": 7.0, "drain": 3.0, "audit": 0.0}


def test_the_audit_job_tells_how_many_containers_it_repaired():
    heard: list[int] = []
    rig = fake_service("dgx-1", mode=Mode.STANDALONE)
    (audit,) = [
        j
        for j in periodic_jobs(Config(mode=Mode.STANDALONE), rig.service, None, print, heard.append)
        if j.name == "audit"
    ]
    audit.work()
    assert heard == [0]


def _counting(name: str, interval: float) -> tuple[Job, threading.Semaphore]:
    ran = threading.Semaphore(0)
    return Job(name, interval, ran.release, f"{name} failed"), ran


def test_a_job_runs_on_its_thread_until_stopped_and_a_failure_does_not_end_it():
    job, ran = _counting("test-every", 0.01)
    failures = iter([RuntimeError("once")])

    def work() -> None:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        job.work()

    jobs = Jobs((Job(job.name, job.interval, work, job.failure),)).start()
    try:
        assert ran.acquire(timeout=10) and ran.acquire(timeout=10), "the job ran again after it failed"
        (thread,) = [t for t in threading.enumerate() if t.name == "test-every"]
    finally:
        jobs.stop()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the job's thread ended when the jobs stopped"


def test_an_interval_of_zero_starts_no_thread_and_a_restart_can_start_it():
    job, ran = _counting("test-restart", 0.0)
    jobs = Jobs((job,)).start()
    try:
        assert not ran.acquire(timeout=0.05)
        jobs.restart("test-restart", 0.01)
        assert ran.acquire(timeout=10)
        jobs.restart("test-restart", 0.0)
    finally:
        jobs.stop()


def test_restarting_a_job_not_in_the_table_starts_nothing():
    before = {t.name for t in threading.enumerate()}
    Jobs(()).restart("unknown", 0.01)
    assert {t.name for t in threading.enumerate()} - before == set()
