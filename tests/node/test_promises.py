"""What the shipped unit promises, seen under a real systemd (issue 43, item 3), on the node the
walkthrough set up: READY only once both sockets serve, the watchdog restarting a stopped sidecar
with its running task untouched, ``systemctl reload``, exit 78 not restarted and 75 restarted within
the start limit. Each scenario leaves the sidecar active, as it found it."""

from __future__ import annotations

import json
import re
import time

import pytest
from conftest import PAGE, SHARE_IN_NODE, STATE, Walked

from isolator.testing.node import MESOS_IN_NODE, Node

pytestmark = pytest.mark.node

CLI = "/opt/gpu-isolator/bin/gpu-isolator"
CONFIG = "/etc/gpu-isolator/config.toml"


def show(node: Node, unit: str, *props: str) -> dict[str, str]:
    out = node.run(f"systemctl show {' '.join('-p ' + p for p in props)} {unit}").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_for(node: Node, unit: str, what: dict[str, str], timeout: float = 90) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        props = show(node, unit, *what)
        if all(props.get(k) == v for k, v in what.items()):
            return props
        if time.monotonic() > deadline:
            journal = node.run(f"journalctl --no-pager -n 40 -u {unit}", check=False).stdout
            raise AssertionError(f"{unit}: {props}, waited for {what}\n{journal}")
        time.sleep(0.5)


def containers(node: Node) -> dict[str, list[int]]:
    """What the sidecar holds: container id -> GPU indices (``gpu-isolator containers --json``)."""
    data = json.loads(node.run(f"{CLI} containers --json").stdout)
    return {c.get("id", ""): sorted(c.get("gpu_indices", [])) for c in data.get("containers", [])}


@pytest.fixture
def active(walked: Walked) -> Node:
    """The node with the sidecar active (the walkthrough ran); made active again afterwards."""
    assert walked.returncode == 0, walked.said()
    node = walked.node
    yield node
    node.run("systemctl reset-failed gpu-isolator; systemctl start gpu-isolator mesos-agent", check=False)


def test_systemd_says_active_only_when_both_sockets_serve(active: Node):
    # `systemctl restart` of a Type=notify unit returns once READY=1 came: right then both sockets
    # must answer (the gRPC one a real call, the bridge one a connect).
    probe = (
        "import socket, sys; s = socket.socket(socket.AF_UNIX);"
        " s.connect('/run/gpu-isolator/isolator.sock.bridge'); print('bridge ok')"
    )
    out = active.run(f"systemctl restart gpu-isolator && {CLI} gpus --json && python3 -c {json.dumps(probe)}").stdout
    assert "bridge ok" in out
    assert len(json.loads(out[: out.rindex("bridge ok")]).get("gpus", [])) == 8, out


def test_sigstop_is_killed_by_the_watchdog_and_restarted_with_the_running_task_untouched(active: Node):
    node = active
    flags = dict(
        line.split("=", 1) for line in node.run("cat /etc/default/mesos-agent").stdout.splitlines() if "=" in line
    )
    node.run(
        f"setsid nohup env LD_LIBRARY_PATH={MESOS_IN_NODE}/lib {MESOS_IN_NODE}/bin/mesos-execute"
        f" --master={flags['MESOS_MASTER']} --name=long-gpu-task --framework_capabilities=GPU_RESOURCES"
        f" --resources='cpus:0.1;mem:32;gpus:1' --command='python3 {SHARE_IN_NODE}/probe.py {STATE}/simhost/dev 600'"
        " > /root/long-task.log 2>&1 < /dev/null & echo $! > /root/long-task.pid"
    )
    deadline = time.monotonic() + 60
    while "TASK_RUNNING" not in node.run("cat /root/long-task.log").stdout:
        assert time.monotonic() < deadline, node.run("cat /root/long-task.log").stdout
        time.sleep(0.5)
    held = containers(node)
    assert len(held) == 1 and [len(g) for g in held.values()] == [1], held
    before = show(node, "gpu-isolator", "MainPID", "NRestarts")
    node.run(f"kill -STOP {before['MainPID']}")
    # WatchdogSec=30s, then RestartSec=5s: a new MainPID, one more restart, READY again.
    deadline = time.monotonic() + 90
    while True:
        now = show(node, "gpu-isolator", "MainPID", "NRestarts", "ActiveState", "SubState")
        if now["MainPID"] not in ("0", before["MainPID"]) and now["SubState"] == "running":
            break
        assert time.monotonic() < deadline, now
        time.sleep(1)
    assert int(now["NRestarts"]) == int(before["NRestarts"]) + 1, now
    journal = node.run("journalctl --no-pager -u gpu-isolator").stdout
    assert "Watchdog timeout" in journal, journal[-3000:]
    # The task runs on, and the restarted sidecar holds its grant as before.
    assert "TASK_FAILED" not in node.run("cat /root/long-task.log").stdout
    said = node.run(
        "cat /root/long-task.log; journalctl --no-pager -o cat -n 80 -u gpu-isolator; "
        "journalctl --no-pager -o cat -u mesos-agent | grep -v '^ ' | tail -40",
        check=False,
    ).stdout
    assert containers(node) == held, said
    node.run("kill $(cat /root/long-task.pid)")  # the framework goes, and its task with it


def test_reload_sends_sighup_and_keeps_the_daemon(active: Node):
    before = show(active, "gpu-isolator", "MainPID")["MainPID"]
    since = active.run("date '+%Y-%m-%d %H:%M:%S'").stdout.strip()
    active.run("systemctl reload gpu-isolator")
    time.sleep(2)
    assert show(active, "gpu-isolator", "MainPID", "ActiveState") == {"MainPID": before, "ActiveState": "active"}
    journal = active.run(f"journalctl --no-pager -o cat -u gpu-isolator --since '{since}'").stdout
    assert "Reloaded" in journal or "reload" in journal.lower(), journal


def test_reload_of_a_file_serve_would_refuse_fails_saying_why_and_sends_no_sighup(active: Node):
    """A walkthrough of the node, by hand: `systemctl reload` after a typo in the config file said
    "Reloaded" and exited 0, while the daemon refused the file and kept its old settings, saying so
    in its log alone. The unit checks the file first: the reload fails with the reason."""
    node = active
    before = show(node, "gpu-isolator", "MainPID")["MainPID"]
    since = node.run("date '+%Y-%m-%d %H:%M:%S'").stdout.strip()
    node.run(f"cp {CONFIG} /root/config.toml.good && echo 'cgroup_versoin = \"v1\"' >> {CONFIG}")
    try:
        reload = node.run("systemctl reload gpu-isolator", check=False)
        assert reload.returncode != 0, reload
        assert show(node, "gpu-isolator", "MainPID", "ActiveState") == {"MainPID": before, "ActiveState": "active"}
        journal = node.run(f"journalctl --no-pager -o cat -u gpu-isolator --since '{since}'").stdout
        assert "unknown key 'cgroup_versoin'" in journal and "Reload failed" in journal, journal
        assert "SIGHUP" not in journal, journal  # the daemon was not asked
    finally:
        node.run(f"cp /root/config.toml.good {CONFIG}")
    node.run("systemctl reload gpu-isolator")


def test_a_configuration_error_exit_78_is_not_restarted(active: Node):
    node = active
    node.run(f"cp {CONFIG} /root/config.toml.good && echo 'no_such_setting = 1' >> {CONFIG}")
    try:
        node.run("systemctl restart --no-block gpu-isolator")
        props = wait_for(node, "gpu-isolator", {"ActiveState": "failed"}, timeout=60)
        props = show(node, "gpu-isolator", "ExecMainStatus", "NRestarts", "Result")
        assert props["ExecMainStatus"] == "78", props
        time.sleep(7)  # past RestartSec=5s: nothing restarted it
        assert show(node, "gpu-isolator", "ActiveState", "NRestarts") == {
            "ActiveState": "failed",
            "NRestarts": props["NRestarts"],
        }
    finally:
        node.run(f"cp /root/config.toml.good {CONFIG}")
        node.run("systemctl reset-failed gpu-isolator; systemctl start gpu-isolator mesos-agent")


def test_exit_75_another_holder_is_restarted_until_it_is_gone(active: Node):
    node = active
    node.run("systemctl stop gpu-isolator")
    before = int(show(node, "gpu-isolator", "NRestarts")["NRestarts"])
    # Another holder of the state directory (its flock, isolator/daemon/workdir.py) for 8 s.
    node.run(f"setsid flock {STATE}/gpu-isolator.pid sleep 8 < /dev/null > /dev/null 2>&1 &")
    time.sleep(0.5)
    node.run("systemctl start --no-block gpu-isolator mesos-agent")
    props = wait_for(node, "gpu-isolator", {"ActiveState": "active", "SubState": "running"}, timeout=60)
    props = show(node, "gpu-isolator", "NRestarts")
    assert int(props["NRestarts"]) > before, props
    journal = node.run("journalctl --no-pager -u gpu-isolator").stdout
    assert "status=75" in journal, journal[-3000:]


def start_long_task(node: Node, name: str) -> None:
    """A ``gpus:1`` task that runs for 10 minutes, its framework checkpointing (a restarted agent
    recovers its executors, as production frameworks ask); until TASK_RUNNING."""
    flags = dict(
        line.split("=", 1) for line in node.run("cat /etc/default/mesos-agent").stdout.splitlines() if "=" in line
    )
    node.run(
        f"setsid nohup env LD_LIBRARY_PATH={MESOS_IN_NODE}/lib {MESOS_IN_NODE}/bin/mesos-execute --checkpoint"
        f" --master={flags['MESOS_MASTER']} --name={name} --framework_capabilities=GPU_RESOURCES"
        f" --resources='cpus:0.1;mem:32;gpus:1' --command='python3 {SHARE_IN_NODE}/probe.py {STATE}/simhost/dev 600'"
        f" > /root/{name}.log 2>&1 < /dev/null & echo $! > /root/{name}.pid"
    )
    deadline = time.monotonic() + 60
    while "TASK_RUNNING" not in node.run(f"cat /root/{name}.log").stdout:
        assert time.monotonic() < deadline, node.run(f"cat /root/{name}.log").stdout
        time.sleep(0.5)


@pytest.mark.parametrize("first", ["mesos-agent", "gpu-isolator"])
def test_stopping_agent_and_sidecar_in_either_order_loses_no_grant(active: Node, first: str):
    node = active
    name = f"stop-{first}-first"
    start_long_task(node, name)
    held = containers(node)
    mine = {c: g for c, g in held.items() if g}
    assert len(mine) >= 1, held
    second = "gpu-isolator" if first == "mesos-agent" else "mesos-agent"
    node.run(f"systemctl stop {first} && systemctl stop {second}")
    assert show(node, "gpu-isolator", "ActiveState")["ActiveState"] == "inactive"
    node.run("systemctl start gpu-isolator && systemctl start mesos-agent")
    deadline = time.monotonic() + 60
    while "Finished recovery" not in node.run("journalctl --no-pager -o cat -u mesos-agent -n 200").stdout:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    time.sleep(3)  # the agent's reregistration and its first reconciliation with the sidecar
    said = node.run(f"cat /root/{name}.log; journalctl --no-pager -o cat -n 40 -u gpu-isolator", check=False).stdout
    after = containers(node)
    for container, gpus in mine.items():
        assert after.get(container) == gpus, said
    assert not re.search("TASK_(LOST|FAILED|KILLED)", node.run(f"cat /root/{name}.log").stdout), said
    node.run(f"kill $(cat /root/{name}.pid)")


def test_systemd_analyze_security_scores_the_running_unit_as_operations_md_says(active: Node):
    out = active.run("systemd-analyze security --no-pager gpu-isolator.service").stdout
    found = re.search(r"Overall exposure level for gpu-isolator.service: (\d+\.\d) (\w+)", out)
    assert found, out[-2000:]
    with open(PAGE) as fh:
        page = fh.read()
    stated = f"scores the running unit **{found.group(1)} {found.group(2)}**"
    assert stated in page, f"docs/operations.md must say: {stated}"
