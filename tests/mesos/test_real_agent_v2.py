"""cgroup v2 under the real agent: its device manager's program on ``<id>``, ours on ``<id>/leaf``.

What the agent does on a pure cgroup2 host (Mesos master's cgroups2 isolators), each answer shown by
what the task could open (ENXIO: past every program, no driver behind the simulated node; EPERM:
refused) and by which programs bpf(2) finds attached where (BPF_PROG_QUERY on each cgroup; Mesos's
device manager loads its programs without a name, ours are named ``gpu_isolator``).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import PROBE, assert_sees_exactly, granted, granted_at, probe_command

from isolator.model import CgroupVersion
from isolator.testing.cluster import Cluster
from isolator.testing.mesoshome import Program, Route, device_programs, wait_for
from isolator.testing.task import Task

LAYOUTS = (CgroupVersion.V2,)  # conftest: these scenarios apply to cgroup v2 only

OURS = "gpu_isolator"
# Beside the GPUs: in Mesos's default whitelist (/dev/null, /dev/zero), and not (/dev/kmsg, c 1:11).
DEFAULTS = "/dev/null,/dev/zero,/dev/kmsg"


def probe_loop(cluster: Cluster, gpus: int) -> Task:
    """A task that probes once a second until killed (what it can open now, after a restart)."""
    devdir = cluster.agents[0].sidecar.dev_root  # type: ignore[union-attr]
    return cluster.submit(f"while :; do python3 {PROBE} {devdir} 0 {DEFAULTS}; sleep 1; done", gpus=gpus)


def last_probe(stdout: str) -> str:
    """The last complete probe in the output of ``probe_loop``."""
    blocks = [b for b in re.split(r"^start ", stdout, flags=re.M) if "\nprobed" in b]
    assert blocks, stdout
    return blocks[-1]


def probes(task: Task) -> int:
    return task.stdout().count("\nprobed")


def layout(task: Task, *nested: str) -> dict[str, list[str]]:
    """Program names on the container's cgroup and its leaf (and the agent's root): where is what."""
    agent = task.agent()
    root = os.path.join(agent.cgroups_mount(), agent.cgroups_root)
    return {
        where: [p.name for p in device_programs(path)]
        for where, path in (("root", root), ("container", task.cgroup(*nested)), ("leaf", task.leaf(*nested)))
    }


def the(programs: list[Program], name: str) -> Program:
    (prog,) = [p for p in programs if p.name == name]
    return prog


def test_the_agents_program_sits_on_the_container_ours_on_its_leaf_and_the_agents_defaults_survive(
    cluster: Cluster,
) -> None:
    agent = cluster.agents[0]
    devdir = agent.sidecar.dev_root  # type: ignore[union-attr]
    task = cluster.submit(f"python3 {PROBE} {devdir} 60 {DEFAULTS}", gpus=1)
    task.wait("TASK_RUNNING")
    out = task.wait_stdout("probed")
    cid = task.container_id()
    held = {i for i, h in agent.holders().items() if h == cid}
    # What the task could open: its GPU and the control nodes, the agent's defaults, nothing else.
    assert_sees_exactly(out, held)
    paths = dict(re.findall(r"^path (\S+) (\S+)$", out, re.M))
    assert paths == {"/dev/null": "ok", "/dev/zero": "ok", "/dev/kmsg": "EPERM"}, paths
    # Where the programs are: one of the agent's (no name) on <id>, one of ours on <id>/leaf.
    assert layout(task) == {"root": [], "container": [""], "leaf": [OURS]}
    mesos = the(device_programs(task.cgroup()), "")
    ours = the(device_programs(task.leaf()), OURS)
    # The agent's program lets every GPU of --allowed_devices through (and its defaults), ours
    # decides the GPUs and lets every other device through to it.
    # (the harness lists every /dev/nvidia* node of the host: nvidia-modeset, 195:254, too)
    assert {m for m in range(255) if mesos.allows("c", 195, m)} == set(range(8)) | {254}
    assert {m for m in range(255) if ours.allows("c", 195, m)} == held
    assert mesos.allows("c", 1, 3) and ours.allows("c", 1, 3)  # /dev/null
    assert not mesos.allows("c", 1, 11) and ours.allows("c", 1, 11)  # /dev/kmsg: the agent's call
    assert ours.allows("c", 195, 255) and not ours.allows("c", 195, 254)  # nvidiactl; nvidia-modeset
    task.teardown()
    task.wait_gone()
    assert not os.path.exists(task.cgroup())


CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


@pytest.fixture(scope="module", params=["control-only", "no-flag"])
def narrow(request: pytest.FixtureRequest, mesos_home: str, cgroups: CgroupVersion) -> Iterator[Cluster]:
    """An agent whose --allowed_devices holds the NVIDIA control nodes but no GPU, or that has no
    --allowed_devices at all (the agent's defaults alone)."""
    c = Cluster(mesos_home, cgroups=cgroups)
    c.agents[0].allowed_nvidia = CONTROL_NODES if request.param == "control-only" else ()
    with c:
        yield c


def test_without_the_gpus_in_the_agents_allowed_devices_a_gpu_task_fails_naming_the_flag(narrow: Cluster) -> None:
    agent = narrow.agents[0]
    assert agent.sidecar is not None
    task = probe_command(narrow)
    failed = narrow.submit(task, gpus=1)
    update = failed.wait("TASK_FAILED", timeout=60)
    assert update.reason == "REASON_CONTAINER_LAUNCH_FAILED", update
    assert "FAILED_PRECONDITION" in update.message, update
    assert re.search(r"denies 'c 195:\d+ r'", update.message), update
    assert "to the Mesos agent's --allowed_devices" in update.message, update
    # ... in the flag's own form: the nodes by path (the GPU's, and the control nodes if missing).
    (flag,) = re.findall(r"--allowed_devices='([^']*)'", update.message)
    named = {os.path.basename(e["device"]["path"]) for e in json.loads(flag)["allowed_devices"]}
    (gpu,) = [n for n in named if n[6:].isdigit()]
    assert named - {gpu} == (set() if agent.allowed_nvidia else set(CONTROL_NODES)), named
    failed.wait_gone()
    assert all(h == "" for h in agent.holders().values())
    zero = narrow.submit(task, gpus=0)
    if agent.allowed_nvidia:
        # The control nodes are in the flag: a 0-GPU task runs, and opens them.
        zero.wait("TASK_FINISHED")
        zero.wait_gone()
        assert_sees_exactly(zero.stdout(), set())
    else:
        # Without the flag even the control nodes are refused: fail closed, naming them.
        update = zero.wait("TASK_FAILED", timeout=60)
        assert update.reason == "REASON_CONTAINER_LAUNCH_FAILED", update
        assert "denies 'c 195:255 r'" in update.message and "nvidiactl" in update.message, update


def test_agent_restart_the_agent_reattaches_its_program_ours_stays_and_the_task_opens_the_same(
    cluster: Cluster, route: Route
) -> None:
    agent = cluster.agents[0]
    task = probe_loop(cluster, gpus=2)
    task.wait("TASK_RUNNING")
    task.wait_stdout("probed")
    cid = task.container_id()
    held = {i for i, h in agent.holders().items() if h == cid}
    mesos_before = the(device_programs(task.cgroup()), "")
    ours_before = the(device_programs(task.leaf()), OURS)
    agent.restart()
    # The agent's device manager recovers its checkpoint and puts a freshly loaded program in place
    # of its old one (BPF_F_REPLACE): one program of its own on <id>, a new id. Ours stays: still
    # exactly one on the leaf with the same rules. Criteo's route never forwards `recover`, so
    # nothing touches ours (same id); our module forwards it, and the sidecar's Recover re-attaches
    # the checkpointed rules (BPF_F_REPLACE, no gap): a new id, the same instructions.
    assert layout(task) == {"root": [], "container": [""], "leaf": [OURS]}
    mesos_after = the(device_programs(task.cgroup()), "")
    assert mesos_after.id != mesos_before.id and mesos_after.insns == mesos_before.insns
    ours_after = the(device_programs(task.leaf()), OURS)
    assert ours_after.insns == ours_before.insns
    if route == Route.CRITEO:
        assert ours_after.id == ours_before.id
    assert agent.holders() == {i: (cid if i in held else h) for i, h in agent.holders().items()}
    assert granted(task) == held
    count = probes(task)
    task.wait_stdout(r"(?s)" + r"\nprobed.*" * (count + 1))
    assert_sees_exactly(last_probe(task.stdout()), held)
    # The sidecar restarted ("recover" on our side): it re-attaches ours from its checkpoint, also
    # with BPF_F_REPLACE: still exactly one of ours on the leaf, the agent's left alone.
    assert agent.sidecar is not None
    agent.sidecar.terminate()
    agent.start_sidecar()
    assert layout(task) == {"root": [], "container": [""], "leaf": [OURS]}
    assert the(device_programs(task.cgroup()), "").id == mesos_after.id
    assert granted(task) == held
    count = probes(task)
    task.wait_stdout(r"(?s)" + r"\nprobed.*" * (count + 1))
    assert_sees_exactly(last_probe(task.stdout()), held)
    task.teardown()
    task.wait_gone()
    assert cid not in agent.holders().values()


@pytest.mark.parametrize("share_cgroups", [True, False], ids=["shared-cgroups", "own-cgroups"])
def test_nested_containers_each_get_a_leaf_with_our_program_and_the_agents_only_without_sharing(
    cluster: Cluster, share_cgroups: bool
) -> None:
    """Every nested task has ``<executor>/mesos/<task>`` and its leaf on v2, sharing or not. With
    ``share_cgroups`` the agent prepares no controller for it (no program of its own there, its
    program on the executor's ``<id>`` applies as an ancestor's); without, its device manager
    configures ``<executor>/mesos/<task>`` like a top-level container. Ours goes on each leaf."""
    agent = cluster.agents[0]
    command = probe_command(cluster, seconds=60)
    extra = {} if share_cgroups else {"container": {"type": "MESOS", "linux_info": {"share_cgroups": False}}}
    name = f"nested-{share_cgroups}"
    group = cluster.submit_group([{"name": name, "command": command, "resources": "cpus:0.1;mem:32;gpus:1", **extra}])
    group.wait("TASK_RUNNING")
    out = group.wait_stdout("probed", task=name)
    cid = group.container_id()
    held = {i for i, h in agent.holders().items() if h == cid}
    assert len(held) == 1
    assert_sees_exactly(out, held)
    (path,) = re.findall(r"^cgroup2 (\S+)$", out, re.M)
    child = path.rstrip("/").split("/")[-2]
    assert path.endswith(f"/{cid}/mesos/{child}/leaf"), path
    assert layout(group, child) == {"root": [], "container": [] if share_cgroups else [""], "leaf": [OURS]}
    assert granted_at(group.leaf(child), CgroupVersion.V2) == held
    group.teardown()
    group.wait_gone()
    assert cid not in agent.holders().values()


def test_a_debug_container_gets_a_leaf_with_our_program_and_opens_its_parents_gpus(cluster: Cluster) -> None:
    """LAUNCH_NESTED_CONTAINER_SESSION (``mesos task exec``) makes a DEBUG container below the task:
    on v2 it has ``<id>/mesos/<debug>/leaf``, without a program of the agent's (its controllers are
    not prepared), with ours holding the task's GPUs."""
    agent = cluster.agents[0]
    task = cluster.submit(probe_command(cluster, seconds=120), gpus=2)
    task.wait("TASK_RUNNING")
    task.wait_stdout("probed")
    cid = task.container_id()
    held = {i for i, h in agent.holders().items() if h == cid}
    result: dict[str, Any] = {}

    def session() -> None:
        try:
            result["child"], result["out"] = task.debug(probe_command(cluster, seconds=20))
        except BaseException as exc:  # handed to the test thread
            result["error"] = exc

    thread = threading.Thread(target=session, daemon=True)
    thread.start()
    mesos_dir = os.path.join(task.cgroup(), "mesos")

    def debug_leaf() -> str | None:
        for d in os.listdir(mesos_dir) if os.path.isdir(mesos_dir) else []:
            leaf = os.path.join(mesos_dir, d, "leaf")
            if os.path.isdir(leaf) and [p.name for p in device_programs(leaf)] == [OURS]:
                return d
        return None

    child = wait_for("the DEBUG container's leaf with our program", lambda: debug_leaf() or result.get("error"), 60)
    assert not isinstance(child, BaseException), child
    assert layout(task, child) == {"root": [], "container": [], "leaf": [OURS]}
    assert granted_at(task.leaf(child), CgroupVersion.V2) == held
    thread.join(90)
    assert "error" not in result, result.get("error")
    assert result["child"] == child
    assert_sees_exactly(result["out"], held)
    # The session over, the agent destroys the DEBUG container (its leaf, and our program with it)
    # and the module's cleanup reaches the sidecar: our checkpoint for it goes too.
    assert agent.sidecar is not None
    checkpoint = os.path.join(agent.sidecar.work, "devices", cid, "nested", child)
    wait_for("the DEBUG container's cleanup", lambda: not os.path.exists(task.cgroup(child)), 60)
    wait_for("our checkpoint of the DEBUG container to go", lambda: not os.path.exists(checkpoint), 60)
    assert layout(task) == {"root": [], "container": [""], "leaf": [OURS]}
    assert granted(task) == held  # the task's own grant is untouched
    task.teardown()
    task.wait_gone()
