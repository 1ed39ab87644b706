"""Who uses the driver volume, kept exact (issue 16 item 8), in-process over the shipped fakes.

A container's volume-user record is its ``ContainerId.key()``: unique per container, so cleaning one
container never forgets another's; nested containers (never recorded in the state store) keep
theirs across a Recover; and a volume of an older driver stays while anyone still uses it.
"""

from __future__ import annotations

import pytest

from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.testing import FakeInventory, Rig, fake_service


def image(n: float, rootfs: str) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpus", n),), rootfs=rootfs, image_env=("NVIDIA_VISIBLE_DEVICES=all",))


def top(value: str) -> ContainerId:
    return ContainerId.parse(value)


def nested(*chain: str) -> ContainerId:
    return ContainerId.from_chain(chain)


@pytest.fixture
def rig() -> Rig:
    rig = fake_service("dgx-1")
    for path in ("/rootfs/p", "/rootfs/pc", "/rootfs/c", "/rootfs/n"):
        rig.filesystem.make_dirs(path)
    return rig


@pytest.mark.parametrize(
    "chain",
    [("p.c",), ("p", "c"), ("a%2Eb",), ("a.b", "c.d"), ("x", "y.z", "w"), ("%",), ("..x",)],
)
def test_a_key_names_one_container_and_reads_back_as_it(chain: tuple[str, ...]) -> None:
    cid = nested(*chain)
    assert ContainerId.from_key(cid.key()) == cid


def test_the_top_level_p_dot_c_and_c_nested_in_p_have_different_keys() -> None:
    assert top("p.c").key() != nested("p", "c").key()
    assert str(top("p.c")) == str(nested("p", "c")), "Mesos's stringify cannot tell them apart"
    assert nested("p", "c").key() == "p.c", "IDs without '.' or '%' keep Mesos's form on disk"


def test_cleaning_the_top_level_p_dot_c_keeps_the_volume_of_c_nested_in_p(rig: Rig) -> None:
    rig.service.prepare(top("p"), image(1, "/rootfs/p"))
    rig.service.prepare(nested("p", "c"), image(0, "/rootfs/c"))
    rig.service.prepare(top("p.c"), image(1, "/rootfs/pc"))
    assert rig.volumes.in_use_by(top("p.c").key()) and rig.volumes.in_use_by(nested("p", "c").key())
    rig.service.cleanup(top("p.c"))
    assert rig.volumes.in_use_by(nested("p", "c").key()), "the nested container's record survives"
    assert not rig.volumes.in_use_by(top("p.c").key())
    rig.service.cleanup(nested("p", "c"))
    assert not rig.volumes.in_use_by(nested("p", "c").key())
    # (The top-level p.c, cleaned up, is not prepared again: Mesos never reuses a container ID.)


def test_recover_keeps_the_volume_users_of_nested_containers_of_live_ones(rig: Rig) -> None:
    rig.service.prepare(top("p"), image(1, "/rootfs/p"))
    rig.service.prepare(nested("p", "n"), image(0, "/rootfs/n"))
    rig.service.prepare(nested("p", "n", "deeper"), image(0, "/rootfs/n"))
    rig.service.recover([], [])
    users = rig.service.core.volume_users()
    assert set(users) == {"p", "p.n", "p.n.deeper"} and set(users.values()) == {rig.inventory.driver_version}
    listed = [c.container_id for c in rig.service.list_containers()]
    assert nested("p", "n") in listed


def test_cleanup_of_a_top_level_container_takes_its_nested_containers_records_with_it(rig: Rig) -> None:
    rig.service.prepare(top("p"), image(1, "/rootfs/p"))
    rig.service.prepare(nested("p", "n"), image(0, "/rootfs/n"))  # dies unseen: no cleanup of its own
    rig.service.cleanup(top("p"))
    assert rig.volumes.users.get(rig.inventory.driver_version, set()) == set()


def test_an_old_drivers_volume_stays_while_a_nested_container_uses_it_across_an_upgrade_and_recover() -> None:
    inventory = FakeInventory.of_host("dgx-1")
    rig = fake_service("dgx-1", inventory=inventory)
    for path in ("/rootfs/n", "/rootfs/new"):
        rig.filesystem.make_dirs(path)
    rig.service.prepare(top("p"), ContainerConfig(resources=(Resource("gpus", 1),)))  # no image, no volume
    rig.service.prepare(nested("p", "n"), image(0, "/rootfs/n"))
    old = inventory.driver_version
    inventory.driver_version = "550.54.15"  # the driver is upgraded under running containers
    rig.service.recover([], [])
    rig.service.prepare(top("new"), image(1, "/rootfs/new"))
    rig.service.cleanup(top("new"))
    assert nested("p", "n").key() in rig.volumes.users.get(old, set()), "the old volume is still in use"
    rig.service.cleanup(top("p"))
    assert old not in rig.volumes.users, "and goes with its last user"
