"""What the hook tests share (tests/unit/core/test_{prepare,isolate,update,watch,cleanup,grant}.py):
IDs, configs, and what the fake kernel grants."""

from __future__ import annotations

from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.devices import NVIDIA_MAJOR, DeviceRule, permits
from isolator.testing import Rig, fake_service


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def gpus(n: float) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpus", n), Resource("cpus", 1.0)))


def image(n: float, rootfs: str = "/rootfs/a", *env: str) -> ContainerConfig:
    return ContainerConfig(
        resources=(Resource("gpus", n),), rootfs=rootfs, image_env=env or ("NVIDIA_VISIBLE_DEVICES=all",)
    )


def granted(rig: Rig, c: ContainerId) -> list[int] | None:
    """GPU minors the fake kernel lets ``c`` read and write; None when it has no cgroup."""
    rules = rig.cgroups.rules_of(c)
    if rules is None:
        return None
    return [m for m in range(16) if permits(rules, DeviceRule.char(NVIDIA_MAJOR, m, "rw"))]


def held(rig: Rig, c: ContainerId) -> list[int]:
    rec = rig.store.get(c)
    return sorted(rec.holding.gpus) if rec is not None else []


def free(rig: Rig) -> frozenset[int]:
    return rig.service.core.booking.available


def minor_of(rig: Rig, index: int) -> int:
    return next(g.minor for g in rig.inventory.topology().gpus if g.index == index)


def uuid_of(rig: Rig, index: int) -> str:
    return next(g.uuid for g in rig.inventory.topology().gpus if g.index == index)


def make_rig() -> Rig:
    return fake_service("dgx-1")
