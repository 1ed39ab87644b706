"""Every public method of the core and every method of every port is exercised by the unprivileged
unit tests (``make test-unit``): a method nobody calls in-process is a method nobody checked.

The check is by name: each public method must be called (``.<name>(``) somewhere in the unit test
files below. It is coarse, but it fails the day a method is added without a test.
"""

from __future__ import annotations

import inspect
import os
import re

import pytest

from isolator.core import ports
from isolator.core.admin import Admin
from isolator.core.booking import Booking
from isolator.core.changes import Changes
from isolator.core.context import Core
from isolator.core.grant import KernelGrants
from isolator.core.hooks import Hooks
from isolator.core.locks import ContainerLocks
from isolator.core.recovery import Recovery
from isolator.core.service import IsolatorService

HERE = os.path.dirname(os.path.abspath(__file__))
CORE_TESTS = (
    "test_core_hooks.py",
    "test_core_recovery.py",
    "test_core_admin.py",
    "test_core_concurrency.py",
    "test_core_mig.py",
    "test_core_volume_users.py",
    "test_core_affinity.py",
    "test_core_handover.py",
    "test_core_shares.py",
)
CONTRACT_TESTS = ("test_contracts.py", "test_state_shares.py", "test_mps_control.py")


def called(files: tuple[str, ...]) -> set[str]:
    text = ""
    for name in files:
        with open(os.path.join(HERE, name)) as fh:
            text += fh.read()
    return set(re.findall(r"\.([a-z_][a-z0-9_]*)\(", text))


def public_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and inspect.isfunction(v)}


# Reached only through another public method (each named with the one its tests call).
INDIRECT = {
    "sync_health": "recover",
    "generation": "watch",
    "wait_for_change": "watch",
    "notify": "cleanup",
    "rules": "prepare",
    "compute": "prepare",
    "set_health": "recover",
    "set_gpu_health": "cleanup",  # a health event (tests/test_core_hooks.py watch tests)
    "reset": "recover",
    "mark_ended": "cleanup",
    "forget_ended": "prepare",
    "recently_ended": "watch",
    "granted": "describe_container",
    "describe": "prepare",
    "require": "status",
    "apply": "update",
    "apply_nested": "prepare",  # of a nested container with a cgroup of its own (mesos mode)
    "drop": "cleanup",
    "release_gpus": "update",  # a shrinking Update (tests/test_core_handover.py)
    "create": "prepare",
    "write": "prepare",
    "revoke": "cleanup",  # of a nested container (mesos mode)
    "remove_cpuset": "cleanup",
    "release_volume": "cleanup",
    "start": "restart",
    "book": "recover",
    "inconsistencies": "health",
    "allocate_whole": "prepare",
    "choose_mig": "prepare",
    "mig_of": "watch",
    "hold_mig": "restart",
    "free_mig": "cleanup",
    "affinity": "prepare",  # --cpu-affinity (tests/test_core_affinity.py)
    "locality": "describe_container",
    "apply_cpuset": "update",
    "idle_share": "cleanup",  # of the last sharer of a GPU in mps mode (tests/test_core_shares.py)
    "task_nodes": "prepare",  # of a sharer under --cpu-affinity hint (tests/test_core_shares.py)
}


@pytest.mark.parametrize(
    "cls", [IsolatorService, Hooks, Recovery, Admin, Core, Booking, Changes, ContainerLocks, KernelGrants]
)
def test_every_public_method_of_the_core_is_called_by_a_unit_test(cls: type) -> None:
    seen = called(CORE_TESTS)
    missing = sorted(m for m in public_methods(cls) if m not in seen and INDIRECT.get(m) not in seen)
    assert missing == [], f"{cls.__name__}: no unit test calls {missing}"


def test_every_port_method_is_in_the_contract_suite() -> None:
    seen = called(CONTRACT_TESTS)
    for name, proto in vars(ports).items():
        if not (inspect.isclass(proto) and getattr(proto, "_is_protocol", False)) or proto.__module__ != ports.__name__:
            continue
        if name in ("Volume", "GpuHealth", "GpuRecord", "GpuUsageSample", "HealthEvent", "VolumeBuilder", "Inventory"):
            continue  # data shapes, and the ports whose contract is a comparison with the real edge below
        missing = sorted(m for m in public_methods(proto) if m not in seen)
        assert missing == [], f"{name}: the contract suite never calls {missing}"
