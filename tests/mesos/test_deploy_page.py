"""docs/deploy.md run as written (issue 44, item 1): its ``sh`` blocks, in order, in one ``bash -eu``
script from the checkout's root, with only the assignments of its first block ("Your values") replaced
by this run's own, one for one, as the page says. Then: the GPU task finished, opened exactly one GPU
(the probe on the simulated host), and the agent's log holds no isolator error.

The page's v1 route on this host's hybrid layout: the agent in its own mount namespace without
``/sys/fs/cgroup/unified``. The master is the harness's (``Cluster(agents=0)``); the sidecar and the
agent are the page's, stopped by the page's last block, or here by the PIDs it wrote if it failed."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator

import paths
import pytest
from conftest import CONTROL, PROBE, opened_gpus, seen
from docpage import VALUE, sh_blocks, with_values

from isolator.testing.cgroupfs import TEST_PARENT, remove_cgroup_tree
from isolator.testing.cluster import Cluster
from isolator.testing.mesoshome import listen_port_outside_ephemeral, unmount_below, v1_hierarchies

PAGE = os.path.join(paths.ROOT, "docs", "deploy.md")


def page_blocks() -> list[str]:
    with open(PAGE) as fh:
        return sh_blocks(fh.read())


def test_the_page_finds_its_values_and_runs_every_sh_block():
    blocks = page_blocks()
    assert len(blocks) >= 6 and "GPU_CHECK=" in blocks[0] and "mesos-execute" in "".join(blocks)
    replaced = with_values(blocks[0], {m.group(1): "x" for m in map(VALUE.match, blocks[0].splitlines()) if m})
    assert "/opt/mesos" not in replaced and "MESOS_HOME=x" in replaced


@pytest.fixture
def work() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="gi-deploy-", dir="/tmp")
    yield path
    if not os.environ.get("GI_MESOS_KEEP"):
        shutil.rmtree(path, ignore_errors=True)


def _stop(pid_file: str) -> None:
    """SIGTERM the process the page started and wrote to ``pid_file`` (ours), SIGKILL after 20 s."""
    with contextlib.suppress(OSError, ValueError):
        with open(pid_file) as fh:
            pid = int(fh.read().strip())
        os.kill(pid, signal.SIGTERM)
        for _ in range(200):
            os.kill(pid, 0)  # ProcessLookupError once it is gone (and reaped)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)


def _text(output: bytes | str | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def test_deploy_page_runs_as_written_to_a_gpu_task_through_our_module(mesos_home: str, work: str) -> None:
    blocks = page_blocks()
    state = os.path.join(work, "sidecar")
    logs = os.path.join(work, "logs")
    cgroups_root = f"{TEST_PARENT}/deploy-{os.getpid()}-{os.path.basename(work)}"
    with Cluster(mesos_home, agents=0) as cluster:
        values = {
            "MESOS_HOME": mesos_home,
            "MASTER": cluster.master_address,
            "AGENT_IP": "127.0.0.1",
            "AGENT_PORT": str(listen_port_outside_ephemeral()),
            "AGENT_WORK": os.path.join(work, "agent"),
            "AGENT_RUNTIME": os.path.join(work, "agent-run"),
            "AGENT_RESOURCES": "cpus:2;mem:1024;disk:1024;gpus:8",
            "CGROUPS_ROOT": cgroups_root,
            "MODULE_DIR": os.path.join(work, "modules"),
            "CONF_DIR": os.path.join(work, "etc"),
            "STATE_DIR": state,
            "SOCKET": os.path.join(work, "run", "isolator.sock"),
            "LOG_DIR": logs,
            "SIDECAR_FLAGS": "--simulate dgx-1",
            # The simulated host's nodes (no driver): the probe prints `dev nvidia<n> ENXIO` for an
            # open the devices cgroup let through, EPERM for one it refused.
            "GPU_CHECK": f"python3 {PROBE} {state}/simhost/dev 0",
        }
        script = with_values(blocks[0], values) + "\n".join(blocks[1:])
        timed_out: subprocess.TimeoutExpired | None = None
        try:
            run = subprocess.run(
                ["bash", "-eu", "-c", script],
                cwd=paths.ROOT,
                capture_output=True,
                text=True,
                timeout=420,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as expired:
            timed_out = expired
        finally:
            _stop(os.path.join(logs, "agent.pid"))
            _stop(os.path.join(logs, "sidecar.pid"))
            for mount in v1_hierarchies():
                with contextlib.suppress(Exception):
                    remove_cgroup_tree(os.path.join(mount, cgroups_root))
            unmount_below(values["AGENT_WORK"])

        def log_of(name: str) -> str:
            with contextlib.suppress(OSError), open(os.path.join(logs, name), errors="replace") as fh:
                return fh.read()
            return ""

        def agent_log() -> str:
            return log_of("agent.log")

        if timed_out is not None:
            # Everything a reader needs to tell a hung page from a slow host, read before `work` goes.
            out, err = (_text(timed_out.stdout), _text(timed_out.stderr))
            pytest.fail(
                f"the page ran past {timed_out.timeout} s\nstdout:\n{out[-4000:]}\nstderr:\n{err[-3000:]}\n"
                f"agent:\n{agent_log()[-6000:]}\nsidecar:\n{log_of('sidecar.log')[-4000:]}"
            )
        said = f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}\nagent:\n{agent_log()[-3000:]}"
        assert run.returncode == 0, said
        assert "TASK_FINISHED" in run.stdout, said
        # The probe's output (the sandbox's stdout, which the page prints): one GPU opened of eight.
        assert "probed" in run.stdout, said
        assert len(opened_gpus(run.stdout)) == 1, said
        assert {seen(run.stdout)[name] for name in CONTROL} == {"ENXIO"}, said  # the control devices too
        log = agent_log()
        assert "Finished recovery" in log and "Registered with master" in log, log[-3000:]  # as the page says
        assert "org_gpuisolator_GpuIsolator" in log, log[-3000:]
        assert not re.search(r"gpu-isolator (Recover|Prepare|Isolate|Update|Watch|Cleanup)", log), log[-3000:]
