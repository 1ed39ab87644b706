"""Issue 16 item 7: in mesos mode we add and remove NVIDIA rules only; what the agent allowed stays.

The agent's --allowed_devices (here /dev/fuse, ``c 10:229 rwm``, on a node made with mknod in a temp
dir) must still open after our Prepare, Update and Cleanup, on v1 (the cgroup's whitelist) and v2
(our leaf program ANDed with the agent's program on the container's cgroup). A forked prober in the
cgroup reports open() errnos: EPERM is the cgroup's refusal; anything else got past it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from cgroup_helpers import Prober, hierarchy_mounts, scratch_cgroups_root

from isolator.cgroups import bpf, bpfprog
from isolator.cgroups.v1 import V1DeviceController
from isolator.cgroups.v2 import V2DeviceController
from isolator.host.devices import HostDevices
from isolator.model import ContainerId
from isolator.policy.devices import MESOS_DEFAULT_WHITELIST, DeviceRule, container_rules
from isolator.simhost.devnodes import make_device_nodes

GPUS = (0, 1, 2, 3)
FUSE = DeviceRule("c", 10, 229, "rwm")  # the agent's --allowed_devices entry
AGENT_BLOCK = DeviceRule("b", 7, None, "rw")  # loop devices, another agent grant (wildcard, block)


@pytest.fixture
def host(short_tmp: str) -> HostDevices:
    dev = os.path.join(short_tmp, "dev")
    make_device_nodes(dev, GPUS)
    os.mknod(os.path.join(dev, "fuse"), 0o666 | 0o020000, os.makedev(10, 229))
    os.mknod(os.path.join(dev, "loop7"), 0o666 | 0o060000, os.makedev(7, 7))
    return HostDevices(dev)


@pytest.fixture
def prober() -> Iterator[Prober]:
    p = Prober()
    yield p
    p.close()


def access(prober: Prober, host: HostDevices) -> dict[str, str]:
    names = [f"nvidia{m}" for m in GPUS] + ["nvidiactl", "fuse", "loop7"]
    got = prober.open_errnos([host.path(n) for n in names])
    return {os.path.basename(k): v for k, v in got.items()}


def check(got: dict[str, str], gpus: set[int], control: bool = True) -> None:
    for m in GPUS:
        assert (got[f"nvidia{m}"] == "EPERM") == (m not in gpus), got
    assert (got["nvidiactl"] != "EPERM") == control, got
    assert got["fuse"] != "EPERM", f"the agent allowed /dev/fuse and our rules took it away: {got}"
    assert got["loop7"] != "EPERM", f"the agent allowed loop devices and our rules took them away: {got}"


# ---- v1 -------------------------------------------------------------------------------------------


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_v1_mesos_mode_leaves_the_agents_allowed_devices_in_the_whitelist(short_tmp, host, prober):
    hierarchy, _ = hierarchy_mounts()
    assert hierarchy is not None
    with scratch_cgroups_root(hierarchy, "v1") as root:
        cid = ContainerId.parse("agent-grants")
        path = os.path.join(hierarchy, root, cid.value)
        os.mkdir(path)
        with open(os.path.join(path, "devices.deny"), "w") as fh:
            fh.write("a")
        for rule in (*MESOS_DEFAULT_WHITELIST, FUSE, AGENT_BLOCK):  # Mesos: defaults + --allowed_devices
            with open(os.path.join(path, "devices.allow"), "w") as fh:
                fh.write(str(rule))
        ctl = V1DeviceController(hierarchy, root, mode="mesos", nvidia_majors=host.nvidia_majors)
        control = host.control_devices()
        ctl.prepare(cid)
        ctl.add_pid(cid, prober.pid)
        ctl.apply(cid, container_rules(control, [1]))
        check(access(prober, host), {1})
        ctl.apply(cid, container_rules(control, [0, 3]))
        check(access(prober, host), {0, 3})
        assert FUSE in ctl.current(cid) and AGENT_BLOCK in ctl.current(cid)
        ctl.cleanup(cid)
        check(access(prober, host), set(), control=False)
        assert set(ctl.current(cid)) == {*MESOS_DEFAULT_WHITELIST, FUSE, AGENT_BLOCK}, (
            "cleanup left exactly the agent's"
        )
        prober.close()


# ---- v2 -------------------------------------------------------------------------------------------


def attach_agent_program(path: str, rules: list[DeviceRule]) -> None:
    prog_fd = bpf.prog_load(bpfprog.build_bytes(rules), "mesos_devices")
    cg = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        bpf.prog_attach(cg, prog_fd, None, path)
    finally:
        os.close(cg)
        os.close(prog_fd)


@pytest.mark.root
@pytest.mark.cgroup_v2
def test_v2_mesos_mode_program_passes_non_nvidia_devices_to_the_agents_program(short_tmp, host, prober):
    _, mount = hierarchy_mounts()
    assert mount is not None
    with scratch_cgroups_root(mount, "v2") as root:
        cid = ContainerId.parse("agent-grants")
        top = os.path.join(mount, root, cid.value)
        os.makedirs(os.path.join(top, "leaf"))
        control = host.control_devices()
        nvidia = [DeviceRule("c", 195, None), DeviceRule("c", control.uvm.major, None)]
        attach_agent_program(top, [*MESOS_DEFAULT_WHITELIST, FUSE, AGENT_BLOCK, *nvidia])
        ctl = V2DeviceController(mount, os.path.join(short_tmp, "state"), root, mode="mesos")
        ctl.prepare(cid)
        ctl.add_pid(cid, prober.pid)
        ctl.apply(cid, container_rules(control, [2]))
        check(access(prober, host), {2})
        ctl.apply(cid, container_rules(control, [1, 2]))
        check(access(prober, host), {1, 2})
        # The agent's program still decides for everything that is not NVIDIA's: a device it did not
        # allow stays denied (ours passes it through, the agent's refuses it).
        tty9 = os.path.join(short_tmp, "dev", "tty9")
        os.mknod(tty9, 0o666 | 0o020000, os.makedev(4, 9))
        assert prober.open_errnos([tty9])[tty9] == "EPERM"
        ctl.cleanup(cid)
        prober.close()


@pytest.mark.parametrize("standalone", [False, True])
def test_mesos_program_decides_only_for_nvidia_majors_and_standalone_for_everything(standalone):
    # Pure: what our program answers, by the evaluator (checked against the kernel in
    # tests/system/test_bpf_differential.py).
    rules = container_rules_for_test()
    code = bpfprog.build_bytes(rules) if standalone else bpfprog.build_bytes(rules, decide_majors={195, 240})
    fuse = bpfprog.Request("c", 10, 229, "rw")
    block = bpfprog.Request("b", 195, 0, "rw")
    assert bpfprog.evaluate(code, fuse) == (0 if standalone else 1)
    assert bpfprog.evaluate(code, block) == (0 if standalone else 1)
    assert bpfprog.evaluate(code, bpfprog.Request("c", 195, 0, "rw")) == 1
    assert bpfprog.evaluate(code, bpfprog.Request("c", 195, 1, "rw")) == 0
    assert bpfprog.evaluate(code, bpfprog.Request("c", 195, 1, "m")) == 1  # 'c *:* m' from the base
    assert bpfprog.evaluate(code, bpfprog.Request("c", 240, 0, "rw")) == 1  # uvm
    assert bpfprog.evaluate(code, bpfprog.Request("c", 240, 5, "rw")) == 0


def container_rules_for_test() -> tuple[DeviceRule, ...]:
    return (*MESOS_DEFAULT_WHITELIST, DeviceRule("c", 195, 255), DeviceRule("c", 240, 0), DeviceRule("c", 195, 0))
