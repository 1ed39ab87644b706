"""System tests: the v1 devices whitelist, enforced by the kernel on simulated NVIDIA nodes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from cgroup_helpers import Prober, hierarchy_mounts, scratch_cgroups_root

from isolator.cgroups.v1 import V1DeviceController
from isolator.errors import CgroupBusy, CgroupError, CgroupVanished
from isolator.host.devices import HostDevices
from isolator.model import ContainerId
from isolator.policy.devices import MESOS_DEFAULT_WHITELIST, ControlDevices, DeviceRule, container_rules
from isolator.simhost.devnodes import make_device_nodes

pytestmark = [pytest.mark.root, pytest.mark.cgroup_v1]

GPUS = (0, 1, 2, 3)


@pytest.fixture
def hierarchy() -> str:
    v1, _ = hierarchy_mounts()
    assert v1 is not None
    return v1


@pytest.fixture
def cgroups_root(hierarchy: str) -> Iterator[str]:
    with scratch_cgroups_root(hierarchy, "v1") as relative:
        yield relative


@pytest.fixture
def host(short_tmp: str) -> HostDevices:
    dev = os.path.join(short_tmp, "dev")
    make_device_nodes(dev, GPUS)
    return HostDevices(dev)


@pytest.fixture
def prober() -> Iterator[Prober]:
    p = Prober()
    yield p
    p.close()


def simulate_mesos_agent(hierarchy: str, cgroups_root: str, container: ContainerId) -> str:
    """What Mesos's cgroups/devices subsystem does in prepare: deny all, then its whitelist."""
    path = os.path.join(hierarchy, cgroups_root, container.value)
    os.mkdir(path)
    with open(os.path.join(path, "devices.deny"), "w") as fh:
        fh.write("a")
    for rule in MESOS_DEFAULT_WHITELIST:
        with open(os.path.join(path, "devices.allow"), "w") as fh:
            fh.write(str(rule))
    return path


def parent_allows_only(hierarchy: str, cgroups_root: str, control: ControlDevices, gpus: list[int]) -> None:
    """Whitelist the scratch parent cgroup for ``gpus`` only: the kernel then refuses (EPERM) any other
    GPU in a child, which is how the tests make a write fail midway."""
    parent = os.path.join(hierarchy, cgroups_root)
    with open(os.path.join(parent, "devices.deny"), "w") as fh:
        fh.write("a")
    for rule in container_rules(control, gpus):
        with open(os.path.join(parent, "devices.allow"), "w") as fh:
            fh.write(str(rule))


def gpu_access(prober: Prober, host: HostDevices) -> dict[str, str]:
    names = [f"nvidia{m}" for m in GPUS] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"]
    got = prober.open_errnos([host.path(n) for n in names] + ["/dev/null"])
    return {os.path.basename(k) if k != "/dev/null" else k: v for k, v in got.items()}


def expected(allowed_gpus: set[int]) -> dict[str, str]:
    # ENXIO: the open got past the cgroup and found no driver; EPERM: the cgroup refused it.
    out = {f"nvidia{m}": "ENXIO" if m in allowed_gpus else "EPERM" for m in GPUS}
    out.update({"nvidiactl": "ENXIO", "nvidia-uvm": "ENXIO", "nvidia-uvm-tools": "ENXIO"})
    out.update({"nvidia-modeset": "EPERM", "/dev/null": "OK"})
    return out


def test_mesos_mode_grants_only_allocated_gpus_and_follows_updates_for_a_running_process(
    hierarchy: str, cgroups_root: str, host: HostDevices, prober: Prober
) -> None:
    cid = ContainerId.parse("executor-1")
    path = simulate_mesos_agent(hierarchy, cgroups_root, cid)
    ctl = V1DeviceController(hierarchy, cgroups_root, mode="mesos", nvidia_majors=host.nvidia_majors)
    assert ctl.cgroup_path(cid) == path
    control = host.control_devices()

    ctl.prepare(cid)
    ctl.apply(cid, container_rules(control, [0, 2]))
    ctl.add_pid(cid, prober.pid)
    assert ctl.pids(cid) == (prober.pid,)
    assert gpu_access(prober, host) == expected({0, 2})

    ctl.apply(cid, container_rules(control, [0, 1, 2]))
    assert gpu_access(prober, host) == expected({0, 1, 2})

    ctl.apply(cid, container_rules(control, [2]))
    assert gpu_access(prober, host) == expected({2})
    assert DeviceRule.parse("c 195:2 rwm") in ctl.current(cid)
    assert DeviceRule.parse("c 195:0 rwm") not in ctl.current(cid)

    ctl.cleanup(cid)
    assert set(ctl.current(cid)) == set(MESOS_DEFAULT_WHITELIST)
    assert os.path.isdir(path), "mesos mode must leave Mesos's cgroup in place"
    ctl.cleanup(cid)  # idempotent
    assert set(ctl.current(cid)) == set(MESOS_DEFAULT_WHITELIST)


def test_standalone_mode_denies_everything_until_apply_and_removes_its_cgroup(
    hierarchy: str, cgroups_root: str, host: HostDevices, prober: Prober
) -> None:
    cid = ContainerId.parse("task-7")
    ctl = V1DeviceController(hierarchy, cgroups_root, mode="standalone")
    ctl.prepare(cid)
    assert ctl.current(cid) == ()
    ctl.add_pid(cid, prober.pid)
    assert prober.open_errnos(["/dev/null"]) == {"/dev/null": "EPERM"}

    ctl.apply(cid, container_rules(host.control_devices(), [3]))
    assert gpu_access(prober, host) == expected({3})
    ctl.apply(cid, container_rules(host.control_devices(), [1, 3]))
    assert gpu_access(prober, host) == expected({1, 3})

    with pytest.raises(CgroupBusy, match=str(prober.pid)):
        ctl.cleanup(cid)
    prober.close()
    ctl.cleanup(cid)
    assert not os.path.exists(ctl.cgroup_path(cid))
    ctl.cleanup(cid)


def test_rules_survive_a_restart_because_the_kernel_list_is_read_back(
    hierarchy: str, cgroups_root: str, host: HostDevices
) -> None:
    cid = ContainerId.parse("executor-2")
    simulate_mesos_agent(hierarchy, cgroups_root, cid)
    rules = container_rules(host.control_devices(), [1, 3])
    V1DeviceController(hierarchy, cgroups_root).apply(cid, rules)

    recovered = V1DeviceController(hierarchy, cgroups_root).recover(cid)
    assert set(recovered) == set(rules)


def test_failed_apply_rolls_back_to_the_previous_rules(
    hierarchy: str, cgroups_root: str, host: HostDevices, prober: Prober
) -> None:
    # A parent whose whitelist lacks GPU 3 makes the kernel refuse 'c 195:3' in the child (EPERM).
    control = host.control_devices()
    parent_allows_only(hierarchy, cgroups_root, control, [0, 1, 2])
    cid = ContainerId.parse("executor-3")
    simulate_mesos_agent(hierarchy, cgroups_root, cid)
    ctl = V1DeviceController(hierarchy, cgroups_root)
    ctl.apply(cid, container_rules(control, [1]))
    before = ctl.current(cid)
    ctl.add_pid(cid, prober.pid)

    with pytest.raises(CgroupError, match=r"devices.allow.*c 195:3 rwm"):
        ctl.apply(cid, container_rules(control, [0, 3]))
    assert ctl.current(cid) == before
    assert gpu_access(prober, host) == expected({1})


def test_mesos_mode_refuses_a_cgroup_that_mesos_did_not_whitelist(hierarchy: str, cgroups_root: str) -> None:
    cid = ContainerId.parse("no-devices-isolator")
    os.mkdir(os.path.join(hierarchy, cgroups_root, cid.value))  # inherits 'a *:* rwm'
    with pytest.raises(CgroupError, match=r"not a whitelist.*cgroups/devices"):
        V1DeviceController(hierarchy, cgroups_root).prepare(cid)


def test_mesos_mode_prepare_fails_when_the_cgroup_does_not_exist(hierarchy: str, cgroups_root: str) -> None:
    ctl = V1DeviceController(hierarchy, cgroups_root)
    with pytest.raises(CgroupVanished, match="no longer exists"):
        ctl.prepare(ContainerId.parse("never-created"))


def test_apply_to_a_vanished_cgroup_is_a_typed_error_and_cleanup_of_it_succeeds(
    hierarchy: str, cgroups_root: str, host: HostDevices
) -> None:
    cid = ContainerId.parse("gone")
    path = simulate_mesos_agent(hierarchy, cgroups_root, cid)
    os.rmdir(path)
    ctl = V1DeviceController(hierarchy, cgroups_root)
    with pytest.raises(CgroupVanished):
        ctl.apply(cid, container_rules(host.control_devices(), [0]))
    ctl.cleanup(cid)


def test_a_cgroup_removed_between_two_writes_of_one_run_is_vanished_not_a_write_error(
    hierarchy: str, cgroups_root: str
) -> None:
    # A run keeps devices.allow/deny open across its writes; the kernel answers a write to a removed
    # cgroup's file with ENODEV (not the ENOENT of an open), which must read as "vanished" too.
    from isolator.cgroups.v1 import Write, _Files

    cid = ContainerId.parse("removed-mid-run")
    path = simulate_mesos_agent(hierarchy, cgroups_root, cid)
    with _Files(path) as files:
        files.write(Write(True, DeviceRule.char(1, 3, "rw")))
        files.write(Write(False, DeviceRule.char(1, 3, "w")))
        os.rmdir(path)
        with pytest.raises(CgroupVanished):
            files.write(Write(True, DeviceRule.char(1, 5, "rw")))
        with pytest.raises(CgroupVanished):
            files.write(Write(False, DeviceRule.char(1, 5, "rw")))


def test_nested_container_maps_to_mesos_nested_cgroup_path(hierarchy: str, cgroups_root: str) -> None:
    parent = ContainerId.parse("exec")
    child = ContainerId.parse("task", parent)
    ctl = V1DeviceController(hierarchy, cgroups_root, mode="standalone")
    ctl.prepare(parent)
    os.mkdir(os.path.join(ctl.cgroup_path(parent), "mesos"))
    ctl.prepare(child)
    assert ctl.cgroup_path(child) == os.path.join(hierarchy, cgroups_root, "exec", "mesos", "task")
    assert ctl.current(child) == ()
    ctl.cleanup(parent)
    assert not os.path.exists(ctl.cgroup_path(parent))


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_no_descriptor_is_left_open_by_a_refused_write_its_rollback_or_a_vanished_cgroup(
    hierarchy: str, cgroups_root: str, host: HostDevices, monkeypatch: pytest.MonkeyPatch
) -> None:
    import isolator.cgroups.v1 as v1

    control = host.control_devices()
    parent_allows_only(hierarchy, cgroups_root, control, [0, 1, 2])
    cid = ContainerId.parse("fd-count")
    path = simulate_mesos_agent(hierarchy, cgroups_root, cid)
    ctl = V1DeviceController(hierarchy, cgroups_root)
    ctl.apply(cid, container_rules(control, [1]))
    before_rules = ctl.current(cid)
    fds = _open_fds()

    # EPERM midway (the parent lacks GPU 3); the rollback opens devices.deny too.
    with pytest.raises(CgroupError):
        ctl.apply(cid, container_rules(control, [0, 3]))
    assert ctl.current(cid) == before_rules
    assert _open_fds() == fds

    # The cgroup removed between two writes of one run: vanished, and nothing left open.
    calls = {"n": 0}

    def remove_after_first_write(name: str) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            os.rmdir(path)

    monkeypatch.setattr(v1, "crashpoint", remove_after_first_write)
    with pytest.raises(CgroupVanished):
        ctl.apply(cid, container_rules(control, [0, 2]))
    assert calls["n"] == 1
    assert _open_fds() == fds
    ctl.cleanup(cid)  # a vanished cgroup: nothing to do
    assert _open_fds() == fds


def test_a_rollback_restores_bits_stripped_from_an_entry_that_stays(
    hierarchy: str, cgroups_root: str, host: HostDevices, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run of allow + deny writes failing on its last write: every earlier write, allows and the
    # denies that stripped bits from an entry that stays, is undone through the same open files.
    import isolator.cgroups.v1 as v1

    cid = ContainerId.parse("rollback-bits")
    simulate_mesos_agent(hierarchy, cgroups_root, cid)
    ctl = V1DeviceController(hierarchy, cgroups_root, mode="standalone")
    control = host.control_devices()
    ctl.apply(cid, container_rules(control, [0, 1]))
    before = set(ctl.current(cid))
    desired = [r for r in container_rules(control, [0, 2]) if r.type != "a"]
    desired = [DeviceRule(r.type, r.major, r.minor, "r") if r.minor == 0 and r.major == 195 else r for r in desired]
    writes = v1.whitelist_diff(ctl.current(cid), desired)
    assert any(not w.allow for w in writes) and any(w.allow for w in writes)
    seen = {"n": 0}

    def fail_on_last(name: str) -> None:
        seen["n"] += 1
        if seen["n"] == len(writes) - 1:
            real = v1._Files.write

            def refuse(self: v1._Files, write: v1.Write) -> None:
                if write == writes[-1]:
                    raise CgroupError(op="write", path=self.cgroup, cause="injected")
                real(self, write)

            monkeypatch.setattr(v1._Files, "write", refuse)

    monkeypatch.setattr(v1, "crashpoint", fail_on_last)
    with pytest.raises(CgroupError, match="injected"):
        ctl.apply(cid, desired)
    assert set(ctl.current(cid)) == before
