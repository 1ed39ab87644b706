"""MIG units: resource names, requests, placement and the rules a holder gets (pure, no NVML)."""

from __future__ import annotations

import itertools
import random

import paths
import pytest

from isolator.model import MigDevice, Resource
from isolator.policy import mig
from isolator.policy.devices import MESOS_DEFAULT_WHITELIST, ControlDevices, DeviceNumber, container_rules
from isolator.policy.mig import InvalidMigRequest, MigExhausted
from isolator.simhost.host import load_host, mig_caps_minors
from isolator.testing.rules import own_rules

CONTROL = ControlDevices(nvidiactl=DeviceNumber(195, 255), uvm=DeviceNumber(510, 0), uvm_tools=DeviceNumber(510, 1))
CAPS_MAJOR = 511


def a100_devices() -> list[MigDevice]:
    """The shipped dgx-a100's MIG devices as the inventory reports them (tests/system/test_nvml.py checks that)."""
    out = []
    for g in load_host("dgx-a100").gpus:
        for m in g.mig_devices:
            out.append(
                MigDevice(
                    parent_uuid=g.uuid,
                    uuid=m.uuid,
                    gpu_instance_id=m.gpu_instance,
                    compute_instance_id=m.compute_instance,
                    caps_minors=mig_caps_minors(g.minor, m.gpu_instance, m.compute_instance),
                    memory_total=m.memory_mib * 2**20,
                    profile=m.profile,
                    parent_index=g.index,
                    parent_minor=g.minor,
                    gpu_slices=m.gpu_slices,
                    compute_slices=m.compute_slices,
                    placement=(m.placement_start, m.placement_size),
                )
            )
    return out


DEVICES = a100_devices()


def where(devices) -> list[tuple[int, int]]:
    return [(d.parent_index, d.gpu_instance_id) for d in devices]


def by(index: int, gi: int) -> MigDevice:
    return next(d for d in DEVICES if (d.parent_index, d.gpu_instance_id) == (index, gi))


# ---- names and requests ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "name"),
    [
        ("1g.5gb", "mig-1g.5gb"),
        ("3g.20gb", "mig-3g.20gb"),
        ("7g.80gb", "mig-7g.80gb"),
        ("1g.5gb+me", "mig-1g.5gb.me"),
        ("1c.3g.20gb", None),  # a compute instance smaller than its GPU instance is not a unit
        ("3c.3g.20gb", "mig-3c.3g.20gb"),
        ("", None),
        ("3g", None),
        ("1g.5gb;cpus", None),
    ],
)
def test_resource_names_follow_k8s_mixed_strategy(profile, name):
    assert mig.resource_name(profile) == name


def _mesos_simple_string(text: str) -> list[tuple[str, str]]:
    """Mesos's Resources::fromSimpleString split rules: ';' between entries, one ':' in each,
    the role in parentheses after the name, the name trimmed."""
    out = []
    for token in (t for t in text.split(";") if t):
        pair = [p for p in token.split(":") if p]
        assert len(pair) == 2, f"Bad value for resources, missing or extra ':' in {token}"
        out.append((pair[0].split("(", 1)[0].strip(), pair[1]))
    return out


def test_every_offered_name_is_a_valid_mesos_resource_name_in_both_forms():
    line = mig.agent_resources(3, DEVICES)
    assert line == "gpus:3;mig-1g.10gb:1;mig-1g.5gb:8;mig-2g.10gb:2;mig-3g.20gb:3;mig-4g.20gb:1"
    parsed = _mesos_simple_string(line)
    assert [n for n, _ in parsed] == ["gpus", "mig-1g.10gb", "mig-1g.5gb", "mig-2g.10gb", "mig-3g.20gb", "mig-4g.20gb"]
    for name, _ in parsed[1:]:
        assert mig.valid_resource_name(name) and mig.is_mig_resource(name)
        assert not set(name) & set(";:() \t[]{}")
    # With a role, the name still comes back whole.
    assert _mesos_simple_string("mig-1g.5gb(gpu-jobs):7") == [("mig-1g.5gb", "7")]


def test_requests_sum_per_name_and_refuse_what_mesos_would():
    resources = [
        Resource("cpus", 1.0),
        Resource("mig-1g.5gb", 2.0),
        Resource("mig-1g.5gb", 1.0, role="ml"),
        Resource("mig-3g.20gb", 0.0),
        Resource("gpus", 1.0),
    ]
    assert mig.requests(resources) == {"mig-1g.5gb": 3}
    with pytest.raises(InvalidMigRequest, match=r"'mig-1g\.5gb' resource must be an unsigned integer"):
        mig.requests([Resource("mig-1g.5gb", 0.5)])
    with pytest.raises(InvalidMigRequest, match="must be a scalar"):
        mig.requests([Resource("mig-1g.5gb", 1.0, type="SET")])
    with pytest.raises(InvalidMigRequest, match="unsigned integer"):
        mig.requests([Resource("mig-1g.5gb", -1.0)])


def test_devices_without_both_caps_minors_or_sharing_a_gpu_instance_are_not_offered():
    dev = DEVICES[0]
    assert mig.offered(dev)
    assert not mig.offered(MigDevice(**{**dev.__dict__, "caps_minors": ()}))
    assert not mig.offered(MigDevice(**{**dev.__dict__, "profile": "1c.3g.20gb", "compute_slices": 1}))
    assert not mig.offered(MigDevice(**{**dev.__dict__, "gpu_slices": 3, "compute_slices": 1}))


# ---- placement -------------------------------------------------------------------------------------


def test_first_small_device_keeps_the_most_contiguous_slices_free():
    # GPU 0's only 1g.5gb sits at slice 2 (free run after: 5); GPU 1's at slice 0 leaves 1-7 (7).
    assert where(mig.choose({"mig-1g.5gb": 1}, DEVICES, held=()).devices) == [(1, 7)]


def test_next_small_devices_pack_onto_the_gpu_already_in_use():
    held = {by(1, 7).uuid}
    assert where(mig.choose({"mig-1g.5gb": 1}, DEVICES, held).devices) == [(1, 8)]
    assert where(mig.choose({"mig-1g.5gb": 3}, DEVICES, held).devices) == [(1, 8), (1, 9), (1, 10)]


def test_seven_small_devices_fill_one_gpu_and_leave_gpu0_whole():
    choice = mig.choose({"mig-1g.5gb": 7}, DEVICES, held=())
    assert where(choice.devices) == [(1, gi) for gi in range(7, 14)]


def test_large_devices_tie_break_on_the_lowest_gpu():
    assert where(mig.choose({"mig-3g.20gb": 1}, DEVICES, held=()).devices) == [(0, 1)]
    # With GPU 2 already touched, its second 3g.20gb is taken rather than touching GPU 0.
    assert where(mig.choose({"mig-3g.20gb": 1}, DEVICES, held={by(2, 1).uuid}).devices) == [(2, 2)]


def test_mixed_request_serves_large_profiles_first():
    choice = mig.choose({"mig-1g.5gb": 1, "mig-3g.20gb": 2}, DEVICES, held=())
    assert [n for n, _ in choice.scores] == ["mig-3g.20gb", "mig-1g.5gb"]
    assert where(choice.devices) == [(1, 7), (2, 1), (2, 2)]


def test_not_enough_free_devices_is_resource_exhausted_with_the_reason():
    with pytest.raises(MigExhausted, match=r"Requested 4 mig-3g.20gb but only 3 available") as err:
        mig.choose({"mig-3g.20gb": 4}, DEVICES, held=())
    assert err.value.code == "RESOURCE_EXHAUSTED"
    with pytest.raises(MigExhausted, match=r"only 1 available \(0 held, 2 on GPUs held whole or unhealthy\)"):
        mig.choose({"mig-3g.20gb": 2}, DEVICES, held=(), blocked={2})
    with pytest.raises(MigExhausted, match=r"only 0 available \(1 held, 0 on GPUs"):
        mig.choose({"mig-4g.20gb": 1}, DEVICES, held={by(3, 1).uuid})


def test_a_profile_this_host_does_not_offer_is_invalid():
    with pytest.raises(InvalidMigRequest, match=r"offered as 'mig-7g.40gb' \(offered: mig-1g.10gb, mig-1g.5gb"):
        mig.choose({"mig-7g.40gb": 1}, DEVICES, held=())


def test_held_and_blocked_devices_are_never_chosen():
    held = {d.uuid for d in DEVICES if d.parent_index == 1 and d.gpu_instance_id % 2}
    choice = mig.choose({"mig-1g.5gb": 3}, DEVICES, held, blocked={0})
    assert not {d.uuid for d in choice.devices} & held
    assert all(d.parent_index != 0 for d in choice.devices)


def _brute(count: int, held: set[str], blocked: set[int]) -> tuple[int, int]:
    name = "mig-1g.5gb"
    free = [d for d in DEVICES if mig.resource_name(d.profile) == name and d.uuid not in held]
    free = [d for d in free if d.parent_minor not in blocked]
    parents = sorted({d.parent_minor for d in free})
    best = None
    for combo in itertools.combinations(free, count):
        after = held | {d.uuid for d in combo}
        score = [0, 0]
        for p in parents:
            mine = [d for d in DEVICES if d.parent_minor == p]
            score[0] += int(not any(d.uuid in after for d in mine))
            score[1] += mig._largest_free_run(mine, after)
        best = max(best or (score[0], score[1]), (score[0], score[1]))
    assert best is not None
    return best


def test_placement_is_optimal_against_brute_force_on_random_holdings():
    rng = random.Random(21)
    ones = [d for d in DEVICES if d.profile == "1g.5gb"]
    for _ in range(40):
        held = {d.uuid for d in ones if rng.random() < 0.3}
        blocked = {0} if rng.random() < 0.2 else set()
        free = [d for d in ones if d.uuid not in held and d.parent_minor not in blocked]
        if not free:
            continue
        count = rng.randint(1, min(3, len(free)))
        choice = mig.choose({"mig-1g.5gb": count}, DEVICES, held, blocked)
        assert len(choice.devices) == count
        assert choice.scores[0][1] == _brute(count, held, blocked)
        # Deterministic: the same input gives the same devices.
        assert mig.choose({"mig-1g.5gb": count}, DEVICES, held, blocked).devices == choice.devices


# ---- what a holder is granted ----------------------------------------------------------------------


def test_a_mig_holder_gets_its_parent_node_and_its_two_caps_nodes_only():
    dev = by(1, 7)
    rules = container_rules(CONTROL, mig.parents([dev]), mig_devices=[dev], caps_major=CAPS_MAJOR)
    gi, ci = mig_caps_minors(1, 7, 0)
    assert [str(r) for r in own_rules(rules, MESOS_DEFAULT_WHITELIST)] == [
        "c 195:255 rwm",
        "c 510:0 rwm",
        "c 510:1 rwm",
        "c 195:1 rwm",
        f"c {CAPS_MAJOR}:{gi} rwm",
        f"c {CAPS_MAJOR}:{ci} rwm",
    ]
    assert mig.visible_devices([dev]) == dev.uuid


def test_two_devices_on_two_gpus_name_both_parents_and_four_caps():
    devs = [by(2, 2), by(0, 13)]
    rules = own_rules(container_rules(CONTROL, mig.parents(devs), devs, CAPS_MAJOR), MESOS_DEFAULT_WHITELIST)
    assert {str(r) for r in rules if r.major == 195 and r.minor != 255} == {"c 195:0 rwm", "c 195:2 rwm"}
    assert sum(1 for r in rules if r.major == CAPS_MAJOR) == 4
    assert mig.visible_devices(devs) == f"{by(0, 13).uuid},{by(2, 2).uuid}"


def test_nothing_can_change_a_gpus_mig_layout():
    """The sidecar and the fake NVML never set the MIG mode nor create or destroy instances."""
    import pathlib

    root = pathlib.Path(paths.ROOT) / "isolator"
    setters = ("SetMigMode", "CreateGpuInstance", "CreateComputeInstance", "InstanceDestroy")
    for path in [*root.rglob("*.py"), *root.rglob("*.c")]:
        text = path.read_text(encoding="utf-8")
        assert not [s for s in setters if s in text], f"{path} mentions a MIG setter"
