"""The other route under the shipped unit's sandbox (issue 43, item 2): criteo's command module
running our bridge executables (installed from the wheel with ``python -m isolator.bridge install``,
docs/mesos-agent.md) against the unit's bridge socket, and a ``gpus:1`` command task that could open
exactly one GPU."""

from __future__ import annotations

import json
import os
import time

import pytest
from conftest import SHARE_IN_NODE, STATE, Walked, opened_gpus, seen

from isolator.testing.mesoshome import MODULE
from isolator.testing.node import MESOS_IN_NODE

pytestmark = pytest.mark.node

BIN = "/usr/libexec/gpu-isolator"


def test_a_command_task_through_criteo_s_module_and_the_bridge(walked: Walked):
    assert walked.returncode == 0, walked.said()
    node = walked.node
    node.run(f"/opt/gpu-isolator/bin/python -m isolator.bridge install {BIN}")
    params = [{"key": "module_name", "value": "gpu-isolator-node"}]
    for hook in ("prepare", "isolate", "cleanup", "watch"):
        params.append({"key": f"isolator_{hook}_command", "value": f"{BIN}/gpu-isolator-{hook}"})
        if hook != "watch":
            params.append({"key": f"isolator_{hook}_timeout", "value": "30"})
    params.append({"key": "isolator_watch_frequence", "value": "1"})
    lib = f"{MESOS_IN_NODE}/lib/libmesos_command_modules.so"
    with open(os.path.join(node.share, "criteo-modules.json"), "w") as fh:
        json.dump({"libraries": [{"file": lib, "modules": [{"name": MODULE, "parameters": params}]}]}, fh)
    since = node.run("date '+%Y-%m-%d %H:%M:%S'").stdout.strip()
    node.run(
        "systemctl stop mesos-agent && cp /etc/default/mesos-agent /root/agent.native"
        f" && cat >> /etc/default/mesos-agent <<EOF\nMESOS_ISOLATION=cgroups/devices,{MODULE}\nMESOS_MODULES=file://{SHARE_IN_NODE}/criteo-modules.json\n"
        "EOF\nsystemctl start mesos-agent"
    )
    try:
        deadline = time.monotonic() + 60
        journal = f"journalctl --no-pager -o cat -u mesos-agent --since '{since}'"
        while "egistered with master" not in node.run(journal).stdout:
            assert time.monotonic() < deadline, node.run(f"{journal} | tail -30").stdout
            time.sleep(0.5)
        master = node.run("sed -n 's/^MESOS_MASTER=//p' /etc/default/mesos-agent").stdout.strip()
        run = node.run(
            f"LD_LIBRARY_PATH={MESOS_IN_NODE}/lib {MESOS_IN_NODE}/bin/mesos-execute --master={master}"
            " --name=criteo-task --framework_capabilities=GPU_RESOURCES --resources='cpus:0.1;mem:32;gpus:1'"
            f" --command='python3 {SHARE_IN_NODE}/probe.py {STATE}/simhost/dev 0'",
            check=False,
            timeout=180,
        )
        out = node.run(
            "cat /var/lib/mesos/slaves/*/frameworks/*/executors/criteo-task/runs/latest/stdout", check=False
        ).stdout
        said = (
            f"{run.stdout[-3000:]}\n{out}\n" + node.run(f"{journal} | grep -E '^[EW]2' | tail -20", check=False).stdout
        )
        assert "TASK_FINISHED" in run.stdout, said
        assert len(opened_gpus(out)) == 1, said
        assert {seen(out)[name] for name in ("nvidiactl", "nvidia-uvm")} == {"ENXIO"}, said
    finally:
        node.run(
            "systemctl stop mesos-agent; cp /root/agent.native /etc/default/mesos-agent; systemctl start mesos-agent",
            check=False,
        )
