"""System tests: eBPF device programs on cgroup2, enforced by the kernel on simulated NVIDIA nodes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from cgroup_helpers import Prober, hierarchy_mounts, scratch_cgroups_root

from isolator.cgroups import bpf, bpfprog
from isolator.cgroups.v2 import PROG_NAME, V2DeviceController
from isolator.errors import BpfError, CgroupBusy, CgroupError, CgroupVanished, DeviceProgramConflict
from isolator.host.devices import HostDevices
from isolator.model import ContainerId
from isolator.policy.devices import MESOS_DEFAULT_WHITELIST, DeviceRule, container_rules
from isolator.simhost.devnodes import make_device_nodes

pytestmark = [pytest.mark.root, pytest.mark.cgroup_v2]

GPUS = (0, 1, 2, 3)


@pytest.fixture
def mount() -> str:
    _, v2 = hierarchy_mounts()
    assert v2 is not None
    return v2


@pytest.fixture
def cgroups_root(mount: str) -> Iterator[str]:
    with scratch_cgroups_root(mount, "v2") as relative:
        yield relative


@pytest.fixture
def host(short_tmp: str) -> HostDevices:
    dev = os.path.join(short_tmp, "dev")
    make_device_nodes(dev, GPUS)
    return HostDevices(dev)


@pytest.fixture
def state_dir(short_tmp: str) -> str:
    return os.path.join(short_tmp, "state")


@pytest.fixture
def prober() -> Iterator[Prober]:
    p = Prober()
    yield p
    p.close()


def gpu_access(prober: Prober, host: HostDevices) -> dict[str, str]:
    names = [f"nvidia{m}" for m in GPUS] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"]
    got = prober.open_errnos([host.path(n) for n in names] + ["/dev/null"])
    return {os.path.basename(k) if k != "/dev/null" else k: v for k, v in got.items()}


def expected(allowed_gpus: set[int]) -> dict[str, str]:
    # ENXIO: the open got past the program and found no driver; EPERM: the program denied it.
    out = {f"nvidia{m}": "ENXIO" if m in allowed_gpus else "EPERM" for m in GPUS}
    out.update({"nvidiactl": "ENXIO", "nvidia-uvm": "ENXIO", "nvidia-uvm-tools": "ENXIO"})
    out.update({"nvidia-modeset": "EPERM", "/dev/null": "OK"})
    return out


def programs_on(path: str) -> list[tuple[int, str]]:
    """(id, name) of every device program attached directly to ``path``: our own BPF_PROG_QUERY."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = []
        for prog_id in bpf.prog_query(fd, path):
            pfd = bpf.prog_fd_by_id(prog_id)
            try:
                out.append((prog_id, bpf.prog_info(pfd).name))
            finally:
                os.close(pfd)
        return out
    finally:
        os.close(fd)


def attach_foreign(path: str, rules: list[DeviceRule], name: str = "mesos_devices") -> int:
    """Attach a program we did not 'own' (another name), as Mesos's devices controller would."""
    prog_fd = bpf.prog_load(bpfprog.build_bytes(rules), name)
    cg = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        bpf.prog_attach(cg, prog_fd, None, path)
        return bpf.prog_info(prog_fd).id
    finally:
        os.close(cg)
        os.close(prog_fd)


def test_standalone_program_grants_allocated_gpus_and_follows_updates_for_a_running_process(
    mount: str, cgroups_root: str, state_dir: str, host: HostDevices, prober: Prober
) -> None:
    cid = ContainerId.parse("task-1")
    ctl = V2DeviceController(mount, state_dir, cgroups_root, mode="standalone")
    control = host.control_devices()
    ctl.prepare(cid)
    path = ctl.cgroup_path(cid)
    assert path == os.path.join(mount, cgroups_root, "task-1")
    ctl.add_pid(cid, prober.pid)
    assert ctl.pids(cid) == (prober.pid,)
    assert prober.open_errnos(["/dev/null"]) == {"/dev/null": "EPERM"}, "prepare must deny everything"

    ids: list[int] = []
    for gpus in ([0, 2], [0, 1, 2], [2]):
        ctl.apply(cid, container_rules(control, gpus))
        assert gpu_access(prober, host) == expected(set(gpus))
        attached = programs_on(path)
        assert [name for _, name in attached] == [PROG_NAME], "replace must keep exactly one program of ours"
        ids.append(attached[0][0])
    assert len(set(ids)) == 3, "each update attaches a new program in place of the old one"
    assert set(ctl.current(cid)) == set(container_rules(control, [2]))

    with pytest.raises(CgroupBusy, match=str(prober.pid)):
        ctl.cleanup(cid)
    assert gpu_access(prober, host) == expected({2}), "a refused cleanup must keep isolating"
    prober.close()
    ctl.cleanup(cid)
    assert not os.path.exists(path)
    assert not os.path.exists(ctl.checkpoint_path(cid))
    assert os.listdir(state_dir) == []
    ctl.cleanup(cid)


def test_mesos_mode_attaches_to_leaf_and_leaves_other_programs_alone(
    mount: str, cgroups_root: str, state_dir: str, host: HostDevices, prober: Prober
) -> None:
    cid = ContainerId.parse("executor-1")
    top = os.path.join(mount, cgroups_root, "executor-1")
    leaf = os.path.join(top, "leaf")
    os.makedirs(leaf)  # what Mesos's cgroups2 isolator creates before our prepare
    control = host.control_devices()
    # Mesos's devices controller with --allowed_devices covering the NVIDIA majors.
    extra = [DeviceRule("c", 195, None), DeviceRule("c", control.uvm.major, None)]
    mesos_id = attach_foreign(top, [*MESOS_DEFAULT_WHITELIST, *extra])

    ctl = V2DeviceController(mount, state_dir, cgroups_root, mode="mesos")
    assert ctl.cgroup_path(cid) == leaf
    ctl.prepare(cid)
    ctl.apply(cid, container_rules(control, [1]))
    ctl.add_pid(cid, prober.pid)
    assert gpu_access(prober, host) == expected({1})
    assert [name for _, name in programs_on(leaf)] == [PROG_NAME]

    ctl.cleanup(cid)
    assert programs_on(leaf) == []
    assert programs_on(top) == [(mesos_id, "mesos_devices")], "cleanup must not touch Mesos's program"
    assert os.path.isdir(leaf), "mesos mode must leave Mesos's cgroups in place"
    assert gpu_access(prober, host)["nvidia0"] == "ENXIO", "after cleanup only Mesos's program applies"
    ctl.cleanup(cid)


def test_refuses_when_an_ancestor_program_would_deny_the_gpus_and_names_it(
    mount: str, cgroups_root: str, state_dir: str, host: HostDevices
) -> None:
    cid = ContainerId.parse("executor-2")
    top = os.path.join(mount, cgroups_root, "executor-2")
    os.makedirs(os.path.join(top, "leaf"))
    mesos_id = attach_foreign(top, list(MESOS_DEFAULT_WHITELIST))  # no --allowed_devices
    ctl = V2DeviceController(mount, state_dir, cgroups_root, mode="mesos")

    with pytest.raises(DeviceProgramConflict) as info:
        ctl.apply(cid, container_rules(host.control_devices(), [0]))
    message = info.value.message
    assert f"program id {mesos_id}" in message and "'mesos_devices'" in message
    assert f"attached to '{top}'" in message
    assert "c 195:0" in message and "--allowed_devices" in message
    assert programs_on(os.path.join(top, "leaf")) == []
    assert ctl.current(cid) == (), "nothing may be checkpointed for a refused apply"


def test_failed_apply_keeps_the_previous_program_and_checkpoint(
    mount: str, cgroups_root: str, state_dir: str, host: HostDevices, prober: Prober
) -> None:
    cid = ContainerId.parse("task-2")
    ctl = V2DeviceController(mount, state_dir, cgroups_root, mode="standalone")
    control = host.control_devices()
    ctl.prepare(cid)
    ctl.apply(cid, container_rules(control, [3]))
    ctl.add_pid(cid, prober.pid)
    before_ids = programs_on(ctl.cgroup_path(cid))
    # A checkpoint that cannot be written makes apply fail before anything is attached.
    checkpoint = ctl.checkpoint_path(cid)
    os.unlink(checkpoint)
    os.mkdir(checkpoint)
    try:
        with pytest.raises(CgroupError, match="checkpoint"):
            ctl.apply(cid, container_rules(control, [0, 3]))
        assert programs_on(ctl.cgroup_path(cid)) == before_ids
        assert gpu_access(prober, host) == expected({3})
    finally:
        os.rmdir(checkpoint)


def test_recover_reattaches_the_checkpointed_rules_after_a_restart(
    mount: str, cgroups_root: str, state_dir: str, host: HostDevices, prober: Prober
) -> None:
    cid = ContainerId.parse("task-3")
    rules = container_rules(host.control_devices(), [1, 2])
    first = V2DeviceController(mount, state_dir, cgroups_root, mode="standalone")
    first.prepare(cid)
    first.apply(cid, rules)
    with open(first.checkpoint_path(cid)) as fh:
        assert json.load(fh)["rules"] == [str(r) for r in rules]

    restarted = V2DeviceController(mount, state_dir, cgroups_root, mode="standalone")
    assert restarted.recover(cid) == rules
    assert [n for _, n in programs_on(restarted.cgroup_path(cid))] == [PROG_NAME]
    restarted.add_pid(cid, prober.pid)
    assert gpu_access(prober, host) == expected({1, 2})


def test_rules_checkpointed_but_never_attached_are_not_reported_in_force(
    mount: str, cgroups_root: str, state_dir: str, host: HostDevices, prober: Prober
) -> None:
    # A SIGKILL between the checkpoint and the attach (crash point v2.checkpoint) leaves the old
    # program under the new checkpoint. in_force must not take the checkpoint's word for it, or the
    # start-up reconciliation and the drift audit would see the record honoured while the kernel
    # grants the old set.
    cid = ContainerId.parse("task-ckpt")
    ctl = V2DeviceController(mount, state_dir, cgroups_root, mode="standalone")
    ctl.prepare(cid)
    old, new = container_rules(host.control_devices(), [1]), container_rules(host.control_devices(), [1, 2])
    ctl.apply(cid, old)
    assert ctl.in_force(cid).present and ctl.in_force(cid).rules == old
    fd = bpf.prog_load(bpfprog.build_bytes(new), PROG_NAME)
    try:
        tag = bpf.prog_info(fd).tag
    finally:
        os.close(fd)
    ctl._write_checkpoint(cid, new, tag)  # what the killed apply had written: checkpoint, no attach
    kernel = ctl.in_force(cid)
    assert not kernel.present and "not the one its checkpoint was built from" in kernel.source
    ctl.add_pid(cid, prober.pid)
    assert gpu_access(prober, host) == expected({1}), "the kernel still enforces the old program"
    ctl.apply(cid, new)
    assert ctl.in_force(cid).present and gpu_access(prober, host) == expected({1, 2})


def test_prepare_in_mesos_mode_needs_the_leaf_cgroup(mount: str, cgroups_root: str, state_dir: str) -> None:
    ctl = V2DeviceController(mount, state_dir, cgroups_root, mode="mesos")
    with pytest.raises(CgroupVanished, match="leaf"):
        ctl.prepare(ContainerId.parse("never-created"))


def test_kernel_refusal_carries_the_verifier_log() -> None:
    # Reading past the 12-byte bpf_cgroup_dev_ctx is refused by the verifier.
    bad = bpfprog.assemble([bpfprog.Insn(bpfprog.LDX_W, 2, 1, 12), bpfprog.Insn(bpfprog.MOV32_K, 0, imm=1)])
    bad += bpfprog.assemble([bpfprog.Insn(bpfprog.EXIT)])
    with pytest.raises(BpfError) as info:
        bpf.prog_load(bad, "bad_prog")
    assert "invalid bpf_context access" in info.value.verifier_log
    assert "verifier log" in info.value.message


@pytest.mark.skipif(shutil.which("bpftool") is None, reason="bpftool is not installed (optional check)")
def test_bpftool_sees_our_program_and_then_nothing_after_cleanup(
    mount: str, cgroups_root: str, state_dir: str, host: HostDevices
) -> None:
    cid = ContainerId.parse("task-4")
    ctl = V2DeviceController(mount, state_dir, cgroups_root, mode="standalone")
    ctl.prepare(cid)
    ctl.apply(cid, container_rules(host.control_devices(), [0]))
    path = ctl.cgroup_path(cid)
    shown = subprocess.run(["bpftool", "-j", "cgroup", "show", path], capture_output=True, text=True, check=True)
    assert [p["name"] for p in json.loads(shown.stdout)] == [PROG_NAME]
    ctl.cleanup(cid)
    assert not os.path.exists(path)
