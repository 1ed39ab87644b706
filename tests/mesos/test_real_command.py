"""Command tasks under a real agent: what each task opens, what the kernel holds, what the sidecar says."""

from __future__ import annotations

from conftest import assert_sees_exactly, granted, kernel_allows, kernel_view, opened_gpus, probe, seen

from isolator.testing.cluster import Cluster


def test_gpus_1_opens_exactly_its_gpu_and_the_control_devices(cluster: Cluster) -> None:
    agent = cluster.agents[0]
    task = probe(cluster, gpus=1, seconds=60)
    task.wait("TASK_RUNNING")
    out = task.wait_stdout("probed")
    cid = task.container_id()
    held = {i for i, h in agent.holders().items() if h == cid}
    assert len(held) == 1
    assert_sees_exactly(out, held)  # dgx-1: minor == index
    assert granted(task) == held
    assert kernel_allows(task, "c 195:255 rwm")  # nvidiactl
    # A command task without an image gets no NVIDIA_* variables, as under Mesos's own isolator.
    assert "env NVIDIA_VISIBLE_DEVICES" not in out
    # The master's record of the updates (what the agent benchmark times), in order.
    times = task.status_times()
    assert task.submitted_at <= times["TASK_STARTING"] <= times["TASK_RUNNING"], times
    task.teardown()
    task.wait_gone()
    assert cid not in agent.holders().values()


def test_gpus_0_opens_no_gpu(cluster: Cluster) -> None:
    task = probe(cluster, gpus=0)
    task.wait("TASK_FINISHED")
    task.wait_gone()  # its GPUs are re-offered before the agent cleans up (docs)
    out = task.stdout()
    # No GPU; the control devices stay open, as Mesos's isolator grants them to every container
    # (nvidia-smi works in a 0-GPU container; isolator/policy/devices.py ControlDevices).
    assert_sees_exactly(out, set())
    assert seen(out)["nvidia-modeset"] == "EPERM"
    assert all(h == "" for h in cluster.agents[0].holders().values())


def test_concurrent_tasks_get_disjoint_nvlink_pairs_and_a_killed_tasks_gpus_are_free_at_once(cluster: Cluster) -> None:
    agent = cluster.agents[0]
    a = probe(cluster, gpus=2, seconds=120)
    # Killed 30 s after it runs: the checks below read its cgroup first (5 s was too short for a
    # loaded 2-core machine: its cgroup was gone before they read it).
    b = probe(cluster, gpus=2, seconds=120, kill_after="30secs")
    for t in (a, b):
        t.wait("TASK_RUNNING")
        t.wait_stdout("probed")
    holders = agent.holders()
    sets = {t.name: {i for i, h in holders.items() if h == t.container_id()} for t in (a, b)}
    assert all(len(s) == 2 for s in sets.values()), sets
    assert not sets[a.name] & sets[b.name]
    # dgx-1's NVLink pairs sharing two links (the hybrid cube mesh): each set is one.
    pairs = [{0, 3}, {1, 2}, {4, 7}, {5, 6}, {0, 1}, {2, 3}, {4, 5}, {6, 7}, {0, 4}, {1, 5}, {2, 6}, {3, 7}]
    assert all(s in pairs for s in sets.values()), sets
    for t in (a, b):
        assert_sees_exactly(t.stdout(), sets[t.name])
        assert granted(t) == sets[t.name]
    # b is killed by its framework 30 s after it started: TASK_KILLED, and its GPUs are free at once.
    cid_b = b.container_id()
    b.wait("TASK_KILLED")
    b.wait_gone()
    assert cid_b not in agent.holders().values()
    # ... free enough that a new task gets them.
    c = probe(cluster, gpus=2, seconds=0)
    c.wait("TASK_FINISHED")
    c.wait_gone()  # its GPUs are re-offered before the agent cleans up (docs)
    assert opened_gpus(c.stdout()) == sets[b.name]
    a.teardown()
    a.wait_gone()
    assert all(h == "" for h in agent.holders().values())


def test_agent_restart_with_gpu_tasks_running_keeps_every_grant(cluster: Cluster) -> None:
    agent = cluster.agents[0]
    a = probe(cluster, gpus=3, seconds=300)
    b = probe(cluster, gpus=1, seconds=300)
    for t in (a, b):
        t.wait("TASK_RUNNING")
        t.wait_stdout("probed")
    before = agent.holders()
    rules = {t.name: kernel_view(t) for t in (a, b)}
    agent.restart()  # recovery through the module: it reloads its contexts, the sidecar its records
    assert agent.holders() == before
    for t in (a, b):
        assert kernel_view(t) == rules[t.name]
        assert t.state == "TASK_RUNNING", t.updates()
    # The recovered containers are still watched and cleaned up through the module.
    cid_a = a.container_id()
    a.teardown()
    a.wait_gone()
    assert cid_a not in agent.holders().values()
    assert b.container_id() in agent.holders().values()
    b.teardown()
    b.wait_gone()
    assert all(h == "" for h in agent.holders().values())


def test_sidecar_restart_keeps_every_grant(cluster: Cluster) -> None:
    agent = cluster.agents[0]
    assert agent.sidecar is not None
    a = probe(cluster, gpus=2, seconds=300)
    a.wait("TASK_RUNNING")
    a.wait_stdout("probed")
    before, rules = agent.holders(), kernel_view(a)
    agent.sidecar.terminate()
    assert kernel_view(a) == rules  # the kernel's rules do not depend on the sidecar running
    agent.start_sidecar()
    assert agent.holders() == before
    # A new task gets other GPUs, the old one is cleaned up through the restarted sidecar.
    b = probe(cluster, gpus=2)
    b.wait("TASK_FINISHED")
    b.wait_gone()  # its GPUs are re-offered before the agent cleans up (docs)
    assert not opened_gpus(b.stdout()) & {i for i, h in before.items() if h}
    a.teardown()
    a.wait_gone()
    assert all(h == "" for h in agent.holders().values())


def test_zz_no_watch_noise_for_containers_that_were_cleaned_up(cluster: Cluster) -> None:
    """Runs last on the shared agent: every container so far was cleaned up, and the module polled
    Watch once more after each cleanup; none of those polls may read as an error on either side."""
    agent = cluster.agents[0]
    assert agent.sidecar is not None
    last = probe(cluster, gpus=1)
    last.wait("TASK_FINISHED")
    last.wait_gone()
    # A further task spans several watch periods (1 s) after the last cleanup.
    probe(cluster, gpus=0, seconds=3).wait("TASK_FINISHED")
    assert "unknown container" not in agent.sidecar.log()
    # Since the sidecar last started (scenarios before this one may restart it on purpose: it keeps
    # the containers cleaned up lately in memory, so a poll that outlives it reads NOT_FOUND once).
    noise = [line for line in agent.log()[agent.log_mark :].splitlines() if "NOT_FOUND" in line]
    assert not noise, noise[:3]
