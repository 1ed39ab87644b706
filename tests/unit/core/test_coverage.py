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
from isolator.core.cleanup import CleanupHook
from isolator.core.context import Core
from isolator.core.cpuset import CpusetGrant
from isolator.core.grant import KernelGrants
from isolator.core.isolate import IsolateHook
from isolator.core.locks import ContainerLocks
from isolator.core.prepare import PrepareHook
from isolator.core.recovery import Recovery
from isolator.core.service import IsolatorService
from isolator.core.update import UpdateHook
from isolator.core.watch import WatchHook

HERE = os.path.dirname(os.path.abspath(__file__))
# The core's unit tests are this directory's (tests/unit/core/); the contract suite is tests/contract/.
CORE_TESTS = tuple(sorted(n for n in os.listdir(HERE) if n.startswith("test_") and n != "test_coverage.py"))
CONTRACT_TESTS = tuple(
    os.path.join("..", "..", "contract", n)
    for n in ("test_contracts.py", "test_processes_hostile.py", "test_state_shares.py", "test_mps_control.py")
)


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
    "end_mps_clients": "cleanup",  # a sharer's MPS clients terminated (tests/unit/core/test_mps_faults.py)
    "set_mps_faults": "supervise_mps",  # an MPS server in FAULT (tests/unit/core/test_mps_faults.py)
    # an MPS daemon found dead under sharers (tests/unit/core/test_mps_attacks.py)
    "end_lost_mps_sharers": "supervise_mps",
    "end_holders": "supervise_mps",
    "unspare": "prepare",  # a sharer's daemon set up (tests/unit/core/test_mps_attacks.py)
    "recorded_affinity": "isolate",  # the cpuset a pid joins (tests/unit/core/test_affinity.py)
    "notify": "cleanup",
    "rules": "prepare",
    "compute": "prepare",
    "set_health": "recover",
    "set_gpu_health": "cleanup",  # a health event (tests/unit/core/test_watch.py)
    "reset": "recover",
    "mark_ended": "cleanup",
    "recently_ended": "watch",  # and prepare
    "granted": "describe_container",
    "describe": "prepare",
    "require": "status",
    "apply": "update",
    "apply_nested": "prepare",  # of a nested container with a cgroup of its own (mesos mode)
    "drop": "cleanup",
    "release_gpus": "update",  # a shrinking Update (tests/unit/core/test_handover.py)
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
    "affinity": "prepare",  # --cpu-affinity (tests/unit/core/test_affinity.py)
    "locality": "describe_container",
    "apply_cpuset": "update",
    "release": "cleanup",  # a top-level container's cpuset (tests/unit/core/test_affinity.py)
    "drain_for_maintenance": "maintenance_drain",  # an operator's drain (tests/unit/core/test_maintenance.py)
    "end_maintenance": "maintenance_undrain",
    "idle_share": "cleanup",  # of the last sharer of a GPU in mps mode (tests/unit/core/test_shares.py)
    "task_nodes": "prepare",  # of a sharer under --cpu-affinity hint (tests/unit/core/test_shares.py)
}


@pytest.mark.parametrize(
    "cls",
    [
        IsolatorService,
        PrepareHook,
        IsolateHook,
        UpdateHook,
        WatchHook,
        CleanupHook,
        Recovery,
        Admin,
        Core,
        Booking,
        Changes,
        ContainerLocks,
        KernelGrants,
        CpusetGrant,
    ],
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
        if name in (
            "Volume",
            "GpuHealth",
            "GpuRecord",
            "GpuUsageSample",
            "HealthEvent",
            "DriverVolumes",
            "GpuInventory",
        ):
            continue  # data shapes, and the ports whose contract is a comparison with the real edge below
        missing = sorted(m for m in public_methods(proto) if m not in seen)
        assert missing == [], f"{name}: the contract suite never calls {missing}"
