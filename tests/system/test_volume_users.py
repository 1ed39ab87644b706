"""Issue 16 item 8: who uses a driver volume, kept exactly, through the core and the real manager.

The core runs over the shipped fakes except for the volumes: the real VolumeManager on a temp
volume root and a simulated driver installation, so user files, reconciliation and removal are
the ones the daemon uses.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.simhost.driver import build_driver_root
from isolator.testing import Rig, fake_service
from volumes.manager import VolumeManager

OLD, NEW = "535.104.05", "550.54.15"


def image(n: float, rootfs: str) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpus", n),), rootfs=rootfs, image_env=("NVIDIA_VISIBLE_DEVICES=all",))


def chain(*ids: str) -> ContainerId:
    return ContainerId.from_chain(ids)


@pytest.fixture
def world(tmp_path):
    driver = str(tmp_path / "driver")
    info = build_driver_root(driver, OLD)
    manager = VolumeManager(str(tmp_path / "volumes"), driver, path=info.path)
    base = fake_service("dgx-1")
    base.inventory.driver_version = OLD
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Rig) if f.init}
    rig = Rig(**{**fields, "volumes": manager})
    for rootfs in ("/rootfs/p", "/rootfs/c", "/rootfs/pc", "/rootfs/q"):
        rig.filesystem.make_dirs(rootfs)
    return rig, manager, driver


def users(manager: VolumeManager) -> set[ContainerId]:
    return {ContainerId.from_key(u) for us in manager.users().values() for u in us}


def test_top_level_p_dot_c_and_c_nested_in_p_are_two_users(world):
    rig, manager, _driver = world
    rig.service.prepare(chain("p"), image(1, "/rootfs/p"))
    rig.service.prepare(chain("p", "c"), image(0, "/rootfs/c"))
    rig.service.prepare(chain("p.c"), image(1, "/rootfs/pc"))
    assert users(manager) == {chain("p"), chain("p", "c"), chain("p.c")}
    rig.service.cleanup(chain("p.c"))
    assert users(manager) == {chain("p"), chain("p", "c")}, "cleaning up 'p.c' erased the nested 'c' of 'p'"
    rig.service.cleanup(chain("p", "c"))
    assert users(manager) == {chain("p")}


def test_recover_keeps_the_users_of_nested_containers_of_live_parents(world):
    rig, manager, _driver = world
    rig.service.prepare(chain("p"), image(1, "/rootfs/p"))
    rig.service.prepare(chain("p", "c"), image(0, "/rootfs/c"))
    rig.service.prepare(chain("p", "c", "d"), image(0, "/rootfs/c"))
    rig.restart().recover([], [])
    assert users(manager) == {chain("p"), chain("p", "c"), chain("p", "c", "d")}


def test_recover_still_drops_users_of_containers_that_are_gone(world):
    rig, manager, _driver = world
    rig.service.prepare(chain("p"), image(1, "/rootfs/p"))
    rig.service.prepare(chain("p", "c"), image(0, "/rootfs/c"))
    manager.acquire(chain("gone").key(), OLD)
    manager.acquire(chain("gone", "child").key(), OLD)
    rig.restart().recover([], [])
    assert users(manager) == {chain("p"), chain("p", "c")}


def test_after_a_driver_upgrade_the_old_volume_stays_while_a_nested_container_still_uses_it(world):
    rig, manager, driver = world
    rig.service.prepare(chain("p"), ContainerConfig(resources=(Resource("gpus", 1),)))  # no image: no volume
    rig.service.prepare(chain("p", "c"), image(0, "/rootfs/c"))  # the nested task mounts nvidia_<OLD>
    old_path = manager.builder.path_of(OLD)
    assert os.path.isdir(old_path)
    rig.restart().recover([], [])  # the sidecar restarts while the task runs
    build_driver_root(driver, NEW)  # the driver is upgraded in place
    rig.inventory.driver_version = NEW
    rig.service.prepare(chain("q"), image(1, "/rootfs/q"))  # builds nvidia_<NEW>, collects unused ones
    assert os.path.isdir(old_path), "the old volume was deleted while the nested task still has it mounted"
    rig.service.cleanup(chain("p", "c"))
    assert not os.path.exists(old_path), "the old volume goes with its last user"


def test_after_a_driver_upgrade_cleaning_top_level_p_dot_c_keeps_the_volume_of_c_nested_in_p(world):
    rig, manager, driver = world
    rig.service.prepare(chain("p"), ContainerConfig(resources=(Resource("gpus", 1),)))
    rig.service.prepare(chain("p", "c"), image(0, "/rootfs/c"))
    rig.service.prepare(chain("p.c"), image(1, "/rootfs/pc"))
    old_path = manager.builder.path_of(OLD)
    build_driver_root(driver, NEW)
    rig.inventory.driver_version = NEW
    rig.service.cleanup(chain("p.c"))
    assert os.path.isdir(old_path), "the old volume was deleted while nested 'c' of 'p' still has it mounted"


@pytest.mark.parametrize("ids", [("p.c",), ("p", "c"), ("a%2Eb",), ("a%", "b.c", "%25"), ("x.",)])
def test_container_keys_round_trip_and_never_collide(ids):
    cid = chain(*ids)
    assert ContainerId.from_key(cid.key()) == cid
    others = [chain("p.c"), chain("p", "c"), chain("a%2Eb"), chain("a.b"), chain("a%", "b.c", "%25"), chain("x.")]
    assert [o for o in others if o.key() == cid.key()] == [cid]
