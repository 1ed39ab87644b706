"""docs/operations.md's node walkthrough run as written, inside a node booted with systemd as PID 1
(issue 43, items 1 and 5): the sidecar from the wheel as the unit ``install-unit`` writes (plus the
simulated host's one-line drop-in), READY under systemd, the agent's unit after it with our module,
and a ``gpus:1`` command task that could open exactly one GPU."""

from __future__ import annotations

import pytest
from conftest import CONTROL, SIM_DROPIN, Walked, opened_gpus, seen, walkthrough_blocks, with_values

pytestmark = pytest.mark.node


def test_the_section_names_its_values_and_has_the_blocks_an_operator_runs():
    blocks = walkthrough_blocks()
    assert len(blocks) >= 4 and "GPU_CHECK=" in blocks[0]
    text = "".join(blocks)
    for step in ("install-unit", "systemctl restart gpu-isolator", "mesos-agent.service", "mesos-execute"):
        assert step in text, step
    with_values(
        blocks[0],
        {
            n: "x"
            for n in (
                "WHEEL",
                "WHEELS",
                "MESOS_HOME",
                "MODULE",
                "MASTER",
                "AGENT_IP",
                "AGENT_PORT",
                "AGENT_RESOURCES",
                "CGROUPS_ROOT",
                "CGROUP_VERSION",
                "NVIDIA_DEV",
                "SIDECAR_SETTINGS",
                "GPU_CHECK",
            )
        },
    )


def test_walkthrough_runs_and_the_first_task_opens_exactly_one_gpu(walked: Walked):
    said = walked.said()
    assert walked.returncode == 0, said
    assert "TASK_FINISHED" in walked.stdout, said
    assert "probed" in walked.stdout, said
    assert len(opened_gpus(walked.stdout)) == 1, said
    assert {seen(walked.stdout)[name] for name in CONTROL} == {"ENXIO"}, said


def test_the_sidecar_runs_the_unit_install_unit_wrote_under_systemd_and_said_ready(walked: Walked):
    node = walked.node
    show = node.run(
        "systemctl show -p Type -p ActiveState -p SubState -p NotifyAccess -p FragmentPath"
        " -p DropInPaths -p StatusText gpu-isolator"
    ).stdout
    props = dict(line.split("=", 1) for line in show.splitlines() if "=" in line)
    assert props["Type"] == "notify" and props["ActiveState"] == "active" and props["SubState"] == "running", show
    assert props["FragmentPath"] == "/etc/systemd/system/gpu-isolator.service", show
    # Only the simulated host's drop-in beside it, and that one says only CAP_MKNOD.
    assert props["DropInPaths"].split() == ["/etc/systemd/system/gpu-isolator.service.d/simulated-host.conf"], show
    assert [ln for ln in SIM_DROPIN.splitlines() if ln and not ln.startswith(("#", "["))] == [
        "CapabilityBoundingSet=CAP_MKNOD"
    ]
    # The file systemd runs is what install-unit wrote from the shipped template, byte for byte.
    written = node.run("cat /etc/systemd/system/gpu-isolator.service").stdout
    expected = node.run(
        "/opt/gpu-isolator/bin/python -c 'import sys; from isolator.cli.unit import unit_text;"
        ' sys.stdout.write(unit_text("/opt/gpu-isolator/bin/gpu-isolator", "/etc/gpu-isolator/config.toml"))\''
    ).stdout
    assert written == expected
    # The agent's unit started after the sidecar's READY (Type=notify: 'active' only after READY=1).
    order = node.run("systemctl show -P After mesos-agent").stdout.split()
    assert "gpu-isolator.service" in order
    ready = node.run(
        "journalctl --no-pager -o cat -u gpu-isolator | grep -c 'Started gpu-isolator.service\\|Started GPU isolator'",
        check=False,
    ).stdout
    assert int(ready.strip() or 0) >= 1, walked.said()


def test_the_walkthrough_run_a_second_time_leaves_the_same_files_and_applies_them(walked: Walked):
    """An operator runs a page again, after a fix or by accident. Walked by hand, the second run
    printed no error and left the config file with every key appended twice: the sidecar kept
    running on its old settings (``enable --now`` does not restart a running unit) until its next
    start, which then exited 78. Each file is now written whole and each unit restarted."""
    node = walked.node
    assert walked.returncode == 0, walked.said()
    files = "/etc/gpu-isolator/config.toml /etc/default/mesos-agent /etc/mesos/gpu-isolator-modules.json"
    before = node.run(f"cat {files}").stdout
    pids = (node.unit_pid("gpu-isolator"), node.unit_pid("mesos-agent"))
    again = walked.again()
    assert again.returncode == 0, f"{again.stdout[-3000:]}\n{again.stderr[-3000:]}"
    assert node.run(f"cat {files}").stdout == before
    node.run("/opt/gpu-isolator/bin/gpu-isolator config check /etc/gpu-isolator/config.toml")
    after = (node.unit_pid("gpu-isolator"), node.unit_pid("mesos-agent"))
    assert 0 not in after and after[0] != pids[0] and after[1] != pids[1], (pids, after)  # both restarted
    assert "TASK_FINISHED" in again.stdout and "with master" in again.stdout
