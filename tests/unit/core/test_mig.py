"""The core's MIG units over the shipped fakes (no root, no cgroups): fast checks of the wiring that
tests/system/test_mig_cgroup.py shows against the kernel."""

from __future__ import annotations

import pytest

from isolator.errors import ResourceExhausted
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.devices import MESOS_DEFAULT_WHITELIST
from isolator.simhost.host import load_host, mig_caps_minors
from isolator.testing.rig import fake_service
from isolator.testing.rules import own_rules

HOST = load_host("dgx-a100")
CAPS_MAJOR = 511  # FakeDeviceNodes


def config(gpus: int = 0, **mig: int) -> ContainerConfig:
    resources = [Resource("cpus", 1.0), Resource("gpus", float(gpus))]
    resources += [Resource("mig-" + k.replace("_", "."), float(v)) for k, v in mig.items()]
    return ContainerConfig(resources=tuple(resources))


def cid(name: str) -> ContainerId:
    return ContainerId.parse(name)


def visible(info) -> list[str]:
    env = dict(info.environment)
    return env["NVIDIA_VISIBLE_DEVICES"].split(",")


def test_a_mig_holder_is_granted_its_caps_and_parent_and_told_its_uuids():
    rig = fake_service("dgx-a100")
    info = rig.service.prepare(cid("a"), config(**{"1g_5gb": 2}))
    gpu1 = HOST.gpus[1]
    assert visible(info) == [gpu1.mig_devices[0].uuid, gpu1.mig_devices[1].uuid]
    own = own_rules(rig.cgroups.rules_of(cid("a")), MESOS_DEFAULT_WHITELIST)
    caps = {c for gi in (7, 8) for c in mig_caps_minors(1, gi, 0)}
    assert {(r.major, r.minor) for r in own if r.major in (195, CAPS_MAJOR) and r.minor != 255} == {
        (195, 1),
        *((CAPS_MAJOR, c) for c in caps),
    }
    rec = rig.store.get(cid("a"))
    assert rec.holding.gpus == frozenset() and rec.holding.mig == {(u, 1) for u in visible(info)}
    assert rig.service.status(cid("a")).gpu_uuids == tuple(sorted(visible(info)))


def test_whole_and_mig_exclude_each_other_until_released():
    rig = fake_service("dgx-a100")
    svc = rig.service
    svc.prepare(cid("mig"), config(**{"3g_20gb": 1}))  # GPU 0
    with pytest.raises(ResourceExhausted, match="Requested 8 gpus but only 7 available"):
        svc.prepare(cid("whole"), config(gpus=8))
    svc.prepare(cid("seven"), config(gpus=7))
    assert 0 not in rig.store.get(cid("seven")).holding.gpus
    with pytest.raises(ResourceExhausted, match="on GPUs held whole or unhealthy"):
        svc.prepare(cid("more"), config(**{"2g_10gb": 2}))  # the other 2g.10gb is on GPU 3, held whole
    svc.cleanup(cid("seven"))
    svc.cleanup(cid("mig"))
    svc.prepare(cid("all"), config(gpus=8))


def test_whole_requests_take_gpus_not_in_mig_mode_first():
    rig = fake_service("dgx-a100")
    rig.service.prepare(cid("w"), config(gpus=3))
    assert rig.store.get(cid("w")).holding.gpus == {g.minor for g in HOST.gpus if not g.mig}


def test_an_xid_on_the_parent_limits_its_mig_holders_only():
    rig = fake_service("dgx-a100")
    svc = rig.service
    svc.prepare(cid("on1"), config(**{"1g_5gb": 1}))  # GPU 1
    svc.prepare(cid("on2"), config(**{"3g_20gb": 1}))  # GPU 0
    rig.inventory.xid(1, 79)
    lim = svc.watch(cid("on1"))
    assert lim is not None and lim.gpus == 0 and lim.mig == (("mig-1g.5gb", 1),) and "XID 79" in lim.message
    assert svc.watch(cid("on2")) is None
    # The sick GPU's devices are no longer handed out.
    with pytest.raises(ResourceExhausted):
        svc.prepare(cid("next"), config(**{"1g_5gb": 2}))


def test_mig_holdings_are_booked_again_after_a_restart_and_kept_by_an_update():
    rig = fake_service("dgx-a100")
    rig.service.prepare(cid("a"), config(**{"1g_10gb": 1}))
    svc = rig.restart()
    with pytest.raises(ResourceExhausted):
        svc.prepare(cid("b"), config(**{"1g_10gb": 1}))
    with pytest.raises(ResourceExhausted):
        svc.prepare(cid("b"), config(gpus=8))
    svc.update(cid("a"), [Resource("gpus", 1.0), Resource("mig-1g.10gb", 1.0)])  # grows whole GPUs only
    assert len(rig.store.get(cid("a")).holding.gpus) == 1
    svc.recover([], [])
    assert [c for c in svc.inconsistencies()] == []
    svc.cleanup(cid("a"))
    svc.prepare(cid("b"), config(**{"1g_10gb": 1}))


def test_gpus_view_shows_mig_devices_and_holders():
    rig = fake_service("dgx-a100")
    info = rig.service.prepare(cid("h"), config(**{"4g_20gb": 1}))
    view = {g.index: g for g in rig.service.list_gpus().gpus}
    devices = {m.uuid: m for m in view[3].mig_devices}
    assert devices[visible(info)[0]].holder == "h" and devices[visible(info)[0]].resource == "mig-4g.20gb"
    assert sum(len(g.mig_devices) for g in view.values()) == 15
    listed = {str(c.container_id): c for c in rig.service.list_containers()}
    assert listed["h"].mig_uuids == tuple(visible(info))


def test_the_drift_audit_finds_nothing_wrong_with_a_mig_holder_and_repairs_lost_caps():
    rig = fake_service("dgx-a100")
    rig.service.prepare(cid("a"), config(**{"1g_5gb": 1}))
    granted = rig.cgroups.rules_of(cid("a"))
    assert rig.service.audit().repaired == ()
    rig.cgroups.apply(cid("a"), tuple(r for r in granted if r.major != CAPS_MAJOR))  # the caps rules vanish
    report = rig.service.audit()
    assert len(report.repaired) == 1 and "missing" in report.repaired[0]
    assert set(rig.cgroups.rules_of(cid("a"))) == set(granted)
    # A restart enforces the records without touching a MIG holder that is right.
    rig.restart()
    assert set(rig.cgroups.rules_of(cid("a"))) == set(granted) and rig.service.audit().repaired == ()
