"""The v2 conflict report in mesos mode names what the agent's ``--allowed_devices`` can take.

Mesos's cgroups2 devices controller reads ``--allowed_devices`` (a JSON ``DeviceWhitelist``) at start
and accepts device *paths* only: an entry without one fails "Whitelisted device has no device path
provided", and each path is stat'ed for its major and minor
(src/slave/containerizer/mesos/isolators/cgroups2/controllers/devices.cpp). A remedy written as
cgroup rules ("add 'c 195:0 rwm'") cannot be followed; it must name the nodes, in the flag's form.
Seen under the real agent on a pure cgroup2 host (tests/mesos/test_real_cgroup2.py).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import pytest
from cgroup_helpers import hierarchy_mounts, scratch_cgroups_root

from isolator.cgroups import bpf, bpfprog
from isolator.cgroups.v2 import V2DeviceController
from isolator.errors import DeviceProgramConflict
from isolator.host.devices import HostDevices
from isolator.model import ContainerId
from isolator.policy.devices import MESOS_DEFAULT_WHITELIST, DeviceRule, container_rules
from isolator.simhost.devnodes import make_device_nodes

GPUS = (0, 1)


@pytest.fixture
def host(short_tmp: str) -> HostDevices:
    dev = os.path.join(short_tmp, "dev")
    make_device_nodes(dev, GPUS)
    return HostDevices(dev)


def test_node_path_finds_each_nvidia_node_by_its_number(host: HostDevices) -> None:
    control = host.control_devices()
    assert host.node_path("c", 195, 1) == os.path.join(host.dev_root, "nvidia1")
    assert host.node_path("c", 195, 255) == os.path.join(host.dev_root, "nvidiactl")
    assert host.node_path("c", control.uvm.major, control.uvm.minor) == os.path.join(host.dev_root, "nvidia-uvm")
    assert host.node_path("c", 195, 7) is None  # no such GPU here
    assert host.node_path("b", 195, 1) is None  # a character node is not a block device


def test_the_remedy_is_an_allowed_devices_flag_of_device_paths() -> None:
    from isolator.cgroups.v2 import allowed_devices_remedy

    paths = {(195, 0): "/dev/nvidia0", (195, 255): "/dev/nvidiactl"}
    text = allowed_devices_remedy(
        [DeviceRule("c", 195, 255, "rwm"), DeviceRule("c", 195, 0, "rwm"), DeviceRule("c", 240, 0, "rwm")],
        lambda t, major, minor: paths.get((major, minor)),
    )
    (flag,) = re.findall(r"--allowed_devices='([^']*)'", text)
    whitelist = json.loads(flag)
    assert [e["device"] for e in whitelist["allowed_devices"]] == [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia0"}]
    assert all(e["access"] == {"read": True, "write": True, "mknod": True} for e in whitelist["allowed_devices"])
    # A device without a node cannot go in the flag: said, not dropped.
    assert "c 240:0" in text and "no node" in text
    assert "restart the agent" in text


@pytest.fixture
def cgroups_root() -> Iterator[tuple[str, str]]:
    _, mount = hierarchy_mounts()
    if mount is None:
        pytest.skip("[cgroup_v2] no cgroup2 mount")
    with scratch_cgroups_root(mount, "v2-allowed") as relative:
        yield mount, relative


@pytest.mark.root
@pytest.mark.cgroup_v2
def test_a_conflict_with_the_agents_program_names_the_nodes_for_allowed_devices(
    cgroups_root: tuple[str, str], short_tmp: str, host: HostDevices
) -> None:
    mount, root = cgroups_root
    top = os.path.join(mount, root, "executor-1")
    os.makedirs(os.path.join(top, "leaf"))
    # The agent's program from its defaults and no --allowed_devices (unnamed, as Mesos loads it).
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    prog = bpf.prog_load(bpfprog.build_bytes(list(MESOS_DEFAULT_WHITELIST)), "")
    try:
        bpf.prog_attach(fd, prog, None, top)
    finally:
        os.close(prog)
    try:
        ctl = V2DeviceController(
            mount,
            os.path.join(short_tmp, "state"),
            root,
            mode="mesos",
            nvidia_majors=host.nvidia_majors,
            device_path=host.node_path,
        )
        with pytest.raises(DeviceProgramConflict) as info:
            ctl.apply(ContainerId.parse("executor-1"), container_rules(host.control_devices(), [1]))
        (flag,) = re.findall(r"--allowed_devices='([^']*)'", info.value.message)
        paths = [e["device"]["path"] for e in json.loads(flag)["allowed_devices"]]
        dev = host.dev_root
        assert sorted(paths) == sorted(
            os.path.join(dev, n) for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia1")
        )
        assert "'c 195:1 rwm'" not in info.value.message  # no rule the flag cannot take
    finally:
        os.close(fd)  # the program goes with the scratch cgroup
