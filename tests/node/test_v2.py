"""The node booted with cgroup2 alone (issue 43, item 2 "on pure v2"): systemd-nspawn mounts the
host's cgroup2 hierarchy at ``/sys/fs/cgroup`` in a cgroup namespace of the node's own
(``SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1``, isolator/testing/node.py), the node's systemd runs on it
alone, and docs/operations.md's walkthrough runs with ``CGROUP_VERSION=v2``: the sidecar's unit with
``cgroup_version = "v2"``, the agent's unit through the shipped wrapper with ``--allowed_devices``.
Device access is the eBPF programs' (the agent's on ``<id>``, ours on ``<id>/leaf``), read back from
the kernel on the host. The agent's cgroups root is not the default one (``gpu-tasks``): the
wrapper must find it in the unit's environment file, where the walkthrough puts every flag.

The sidecar simulates a ``dgx-a100`` from the start (MIG on GPUs 0-4, GPU 5 shared under MPS, 6 by
time slices, 7 whole), so that the walkthrough's ``--allowed_devices`` lists the MIG devices'
capability nodes: on v2 the agent's program must let them through, and a MIG task on an agent
whose list predates a re-cut fails at once, the sidecar naming the nodes to add.

The same node then runs what the v1 node runs beyond that: a task group (test_groups.py), criteo's
route with our bridge (test_criteo.py) and ``systemctl restart`` of the sidecar under an MPS sharer
(test_restart_mps.py), reusing their helpers."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from conftest import (
    CONTROL,
    Walked,
    granted,
    isolator_errors,
    launch,
    opened_gpus,
    seen,
    since,
    wait_registered,
    walk,
)
from test_criteo import command_task, criteo_image_task, criteo_route
from test_groups import task_group_with_a_mig_unit
from test_images import IMAGE_FLAGS, OURS, agent_with, image_task, provide_image
from test_units import CHECKS, SHARED, UNITS, probed, restart_sidecar_under_mps, unit_task

from isolator.testing.mesoshome import MesosNotFound, cgroups_v2_unsupported, device_programs, find_mesos_home
from isolator.testing.node import Node

pytestmark = pytest.mark.node

ROOT = "gpu-tasks"
RESOURCES = "cpus:4;mem:2048;disk:2048;gpus:1;gpu-share-4:4;gpu-share-2:2;mig-1g.5gb:8"


@pytest.fixture(scope="module")
def walked_v2() -> Iterator[Walked]:
    try:
        reason = cgroups_v2_unsupported(find_mesos_home())
    except MesosNotFound as exc:
        pytest.fail(f"tests/node/ needs a Mesos: {exc}")
    if reason:
        pytest.skip(f"[cgroup_v2] {reason}")
    settings = f'simulate = "dgx-a100"\nshared_gpus = "{SHARED}"'
    with walk("v2", cgroups_root=ROOT, settings=settings, resources=RESOURCES) as w:
        yield w


def test_the_walkthrough_on_cgroup_v2_alone_and_its_first_task_opens_exactly_one_gpu(walked_v2: Walked):
    node, said = walked_v2.node, walked_v2.said()
    assert walked_v2.returncode == 0, said
    assert node.run("stat -f -c %T /sys/fs/cgroup").stdout.strip() == "cgroup2fs"
    assert node.run("systemctl is-system-running", check=False).stdout.strip() in ("running", "degraded")
    assert "mesos-agent-cgroup2.sh" in node.run("systemctl show -P ExecStart mesos-agent").stdout
    assert "TASK_FINISHED" in walked_v2.stdout, said
    assert len(opened_gpus(walked_v2.stdout)) == 1, said
    assert {seen(walked_v2.stdout)[name] for name in CONTROL} == {"ENXIO"}, said


def test_a_gpu_task_on_v2_opens_what_the_device_programs_grant(walked_v2: Walked):
    assert walked_v2.returncode == 0, walked_v2.said()
    node = walked_v2.node
    when = since(node)
    task = launch(node, "v2-gpu-task", "cpus:0.1;mem:32;gpus:1")
    try:
        out = task.wait_probed()
        said = f"{task.log()[-2000:]}\n{out}"
        assert opened_gpus(out) == {7}, said  # the one whole GPU
        assert granted(node, out) == {7}, said
        assert f"cgroup2 /{ROOT}/" in out, said
    finally:
        task.stop()
    assert isolator_errors(node, when) == []


def test_shares_and_a_mig_unit_on_v2(walked_v2: Walked):
    """A time-slice share, an MPS share and a MIG unit held at once, as test_units.py on v1."""
    assert walked_v2.returncode == 0, walked_v2.said()
    node = walked_v2.node
    when = since(node)
    tasks = {kind: launch(node, f"v2-unit-{kind}", f"cpus:0.1;mem:32;{unit}") for kind, unit in UNITS.items()}
    try:
        for kind, check in CHECKS.items():
            check(node, *probed(tasks, kind, node))
    finally:
        for task in tasks.values():
            task.stop()
    assert isolator_errors(node, when) == []


@pytest.mark.parametrize("backend", ["copy", "overlay"])
def test_an_image_task_on_v2(walked_v2: Walked, backend: str):
    assert walked_v2.returncode == 0, walked_v2.said()
    node = walked_v2.node
    provide_image(node)
    with agent_with(node, OURS + IMAGE_FLAGS.format(backend=backend)) as when:
        image_task(node, f"v2-image-{backend}", when)


def ours_on(node: Node, out: str) -> list[int]:
    """The ids of our device programs (``gpu_isolator``) on the probe's own cgroup2 cgroup."""
    (path,) = re.findall(r"^cgroup2 (\S+)$", out, re.M)
    return [p.id for p in device_programs(node.host_cgroup(path)) if p.name == "gpu_isolator"]


def test_restarts_of_the_sidecar_and_of_the_agent_keep_a_v2_task_s_program(walked_v2: Walked):
    """``systemctl restart gpu-isolator`` (its Recover re-attaches ours from its checkpoint, inside the
    unit's sandbox) and ``systemctl restart mesos-agent`` (the agent's recover through our module):
    the running task keeps exactly one program of ours on its leaf, granting the same GPU."""
    assert walked_v2.returncode == 0, walked_v2.said()
    node = walked_v2.node
    when = since(node)
    task = launch(node, "v2-restarts", "cpus:0.1;mem:32;gpus:1", "--checkpoint")
    try:
        out = task.wait_probed()
        before = granted(node, out)
        assert before == opened_gpus(out) and len(before) == 1, out
        assert len(ours_on(node, out)) == 1, out
        for unit in ("gpu-isolator", "mesos-agent"):
            node.run(f"systemctl restart {unit}")
            if unit == "mesos-agent":
                wait_registered(node, since(node))
            assert len(ours_on(node, out)) == 1, f"after restarting {unit}: {out}"
            assert granted(node, out) == before, f"after restarting {unit}"
        assert "TASK_RUNNING" in task.log() and not re.search("TASK_(LOST|FAILED|KILLED)", task.log()), task.log()
    finally:
        task.stop()
    assert isolator_errors(node, when) == []


def test_a_task_group_on_v2_gets_its_gpus_in_every_nested_container(walked_v2: Walked):
    """As test_groups.py on v1: each nested task's leaf (``<id>/mesos/<task>/leaf``) carries our
    program granting the group's two GPUs, the agent's on the executor's ``<id>`` above it. The v2
    node offers one whole GPU (7), so the group holds it and a MIG unit (on GPU 0 or 1)."""
    assert walked_v2.returncode == 0, walked_v2.said()
    task_group_with_a_mig_unit(walked_v2.node, "v2-group")


def test_restart_of_the_sidecar_keeps_the_mps_daemon_and_its_sharer_on_v2(walked_v2: Walked):
    """``systemctl restart gpu-isolator`` under a running MPS sharer (GPU 5, as the walkthrough set
    the v2 node's sidecar): the control daemon keeps its pid, the sharer's processes stay in its
    leaf, our one program there still grants GPU 5 alone, and the restarted sidecar reports the
    daemon running as soon as ``systemctl restart`` returned (READY=1 comes after its start-up
    pass adopted the daemon)."""
    assert walked_v2.returncode == 0, walked_v2.said()
    node = walked_v2.node
    when = since(node)
    task = launch(node, "v2-mps-restart", "cpus:0.1;mem:32;gpu-share-4:1", "--checkpoint")
    try:
        out = task.wait_probed()
        pipe = re.search(r"^env CUDA_MPS_PIPE_DIRECTORY=(\S+)$", out, re.M)
        assert pipe and opened_gpus(out) == {5}, out
        pidfile = f"{pipe.group(1)}/nvidia-cuda-mps-control.pid"
        daemon = node.run(f"cat {pidfile}").stdout.strip()
        (path,) = re.findall(r"^cgroup2 (\S+)$", out, re.M)
        procs = f"{node.host_cgroup(path)}/cgroup.procs"
        with open(procs) as fh:
            sharer = fh.read().split()
        programs = ours_on(node, out)
        assert sharer and len(programs) == 1, (sharer, programs)
        took, state = restart_sidecar_under_mps(node, 5)
        said = (
            f"restart took {took:.2f} s\n{task.log()[-2000:]}\n"
            + node.run("journalctl --no-pager -o cat -n 40 -u gpu-isolator", check=False).stdout
        )
        print(f"systemctl restart gpu-isolator under an MPS sharer: {took:.2f} s, GPU 5's daemon {state!r}")
        assert node.run(f"kill -0 {daemon}", check=False).returncode == 0, f"daemon {daemon} died\n{said}"
        assert node.run(f"cat {pidfile}").stdout.strip() == daemon, said
        assert state == "running", said
        with open(procs) as fh:
            assert fh.read().split() == sharer, said
        assert ours_on(node, out) == programs, said
        assert granted(node, out) == {5}, said
        assert not re.search("TASK_(LOST|FAILED|KILLED)", task.log()), said
    finally:
        task.stop()
    assert isolator_errors(node, when) == []


@pytest.fixture(scope="module")
def criteo_v2(walked_v2: Walked) -> Iterator[tuple[Node, str]]:
    """Criteo's command module and our bridge on the v2 node, its sidecar's host as the walkthrough
    set it (GPU 5 shared under MPS, 6 by time slices), the route's provisioner ``copy``."""
    assert walked_v2.returncode == 0, walked_v2.said()
    with criteo_route(walked_v2.node, 'simulate = "dgx-a100"', "copy") as when:
        yield walked_v2.node, when


def test_a_command_task_on_v2_through_criteo_s_module_and_the_bridge(criteo_v2):
    node, when = criteo_v2
    command_task(node, "v2-criteo-task", when)


@pytest.mark.parametrize("backend", ["copy", "overlay"])
def test_an_image_task_on_v2_through_criteo_s_module(criteo_v2, backend: str):
    node, _ = criteo_v2
    criteo_image_task(node, f"v2-criteo-image-{backend}", backend)


@pytest.mark.parametrize("kind", list(UNITS))
def test_unit_tasks_on_v2_through_criteo_s_module(criteo_v2, kind: str):
    """A time-slice share, an MPS share (its client environment from the bridge's Prepare) and a MIG
    unit (its capability nodes let through by the walkthrough's ``--allowed_devices``)."""
    node, when = criteo_v2
    unit_task(node, f"v2-criteo-{kind}", kind, when)


def test_a_task_group_on_v2_through_criteo_s_module(criteo_v2):
    """The module forwards nested containers: each nested task's leaf gets our program as through
    our module."""
    node, _ = criteo_v2
    task_group_with_a_mig_unit(node, "v2-criteo-group")


def test_restart_of_the_sidecar_under_criteo_s_watch_keeps_a_v2_task(criteo_v2):
    """``systemctl restart gpu-isolator`` while criteo's module polls the bridge's watch every second
    for a running task: the task keeps running, its leaf keeps our one program granting the same
    GPU, and neither log holds an isolator error (a watch that reached no sidecar is not a limit)."""
    node, _ = criteo_v2
    when = since(node)
    task = launch(node, "v2-criteo-restart", "cpus:0.1;mem:32;gpus:1")
    try:
        out = task.wait_probed()
        before, programs = granted(node, out), ours_on(node, out)
        assert before == opened_gpus(out) and len(programs) == 1, out
        node.run("systemctl restart gpu-isolator")
        time.sleep(4)  # a few of the module's watches (isolator_watch_frequence = 1) after the restart
        said = (
            f"{task.log()[-3000:]}\n"
            + node.run("journalctl --no-pager -o cat -n 40 -u gpu-isolator -u mesos-agent", check=False).stdout
        )
        assert not re.search("TASK_(LOST|FAILED|KILLED|FINISHED)", task.log()), said
        assert ours_on(node, out) == programs, said
        assert granted(node, out) == before, said
    finally:
        task.stop()
    journal = node.run(f"journalctl --no-pager -o short-precise -u gpu-isolator -u mesos-agent --since '{when}'").stdout
    assert isolator_errors(node, when) == [], journal[-12000:]
