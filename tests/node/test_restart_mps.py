"""``systemctl restart gpu-isolator`` keeps the MPS control daemons and their sharers alive (issue 43,
item 3; docs/sharing.md: the daemons "outlive a restart of the sidecar, which adopts them"). The
sidecar starts them in sessions of their own, but they stay in the unit's cgroup: with systemd's
default ``KillMode=control-group`` a stop kills them too. The simulated host's stand-in
``nvidia-cuda-mps-control`` runs as the driver's would."""

from __future__ import annotations

import re
import time

import pytest
from conftest import Walked
from test_units import restart_sidecar_under_mps

from isolator.testing.node import MESOS_IN_NODE, Node

pytestmark = pytest.mark.node

CONFIG = "/etc/gpu-isolator/config.toml"
PIDS = "cat /var/lib/gpu-isolator/mps/*/pipe/nvidia-cuda-mps-control.pid"


def wait_registered(node: Node, since: str) -> None:
    deadline = time.monotonic() + 90
    while (
        "egistered with master" not in node.run(f"journalctl --no-pager -o cat -u mesos-agent --since '{since}'").stdout
    ):
        assert time.monotonic() < deadline, node.run("journalctl --no-pager -o cat -n 30 -u mesos-agent").stdout
        time.sleep(0.5)


def test_restart_keeps_the_mps_daemon_and_its_sharer(walked: Walked):
    assert walked.returncode == 0, walked.said()
    node = walked.node
    # GPU 7 in MPS mode, 4 shares; the agent offers them (a new agent: its resources changed).
    node.run(
        f"systemctl stop mesos-agent && cp {CONFIG} /root/config.plain && cp /etc/default/mesos-agent /root/agent.plain"
        f" && echo 'shared_gpus = \"7:4:mps\"' >> {CONFIG}"
        " && echo \"MESOS_RESOURCES='cpus:4;mem:2048;disk:2048;gpus:7;gpu_shares:4'\" >> /etc/default/mesos-agent"
        " && rm -f /var/lib/mesos/meta/slaves/latest"
    )
    try:
        since = node.run("date '+%Y-%m-%d %H:%M:%S'").stdout.strip()
        node.run("systemctl restart gpu-isolator && systemctl start mesos-agent")
        wait_registered(node, since)
        master = node.run("sed -n 's/^MESOS_MASTER=//p' /etc/default/mesos-agent").stdout.strip()
        node.run(
            f"setsid nohup env LD_LIBRARY_PATH={MESOS_IN_NODE}/lib {MESOS_IN_NODE}/bin/mesos-execute --checkpoint"
            f" --master={master} --name=mps-sharer --framework_capabilities=GPU_RESOURCES"
            " --resources='cpus:0.1;mem:32;gpu_shares:1' --command='echo $CUDA_MPS_PIPE_DIRECTORY; sleep 600'"
            " > /root/mps-sharer.log 2>&1 < /dev/null & echo $! > /root/mps-sharer.pid"
        )
        deadline = time.monotonic() + 60
        while "TASK_RUNNING" not in node.run("cat /root/mps-sharer.log").stdout:
            assert time.monotonic() < deadline, node.run("cat /root/mps-sharer.log").stdout
            time.sleep(0.5)
        daemons = node.run(PIDS).stdout.split()
        assert len(daemons) == 1, daemons
        deadline = time.monotonic() + 30  # TASK_RUNNING may come before the command's shell forks
        while not (sharer := node.run("pgrep -f '^sleep 600$'", check=False).stdout.split()):
            assert time.monotonic() < deadline, "the sharer's process never started"
            time.sleep(0.2)
        took, state = restart_sidecar_under_mps(node, 7)
        said = (
            f"restart took {took:.2f} s, GPU 7's daemon {state!r}\n"
            + node.run(
                "cat /root/mps-sharer.log; journalctl --no-pager -o cat -n 30 -u gpu-isolator", check=False
            ).stdout
        )
        print(f"systemctl restart gpu-isolator under an MPS sharer (v1): {took:.2f} s, GPU 7's daemon {state!r}")
        assert state == "running", said
        alive = node.run(f"kill -0 {daemons[0]} && echo alive", check=False).stdout
        assert "alive" in alive, f"the MPS control daemon {daemons[0]} died with the restart\n{said}"
        assert node.run(PIDS).stdout.split() == daemons, said
        assert node.run("pgrep -f '^sleep 600$'").stdout.split() == sharer, said
        assert not re.search("TASK_(LOST|FAILED|KILLED)", node.run("cat /root/mps-sharer.log").stdout), said
    finally:
        node.run("kill $(cat /root/mps-sharer.pid) 2>/dev/null; sleep 3", check=False)
        node.run(
            f"systemctl stop mesos-agent; cp /root/config.plain {CONFIG};"
            " cp /root/agent.plain /etc/default/mesos-agent; rm -f /var/lib/mesos/meta/slaves/latest;"
            " systemctl restart gpu-isolator; systemctl start mesos-agent",
            check=False,
        )
