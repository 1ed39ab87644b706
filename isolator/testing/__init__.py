"""Test doubles shipped with the package, for our tests and for projects built on this one.

Each fake implements one port of the core (isolator/core/ports.py) and passes the same contract
tests as the real edge (tests/contract/test_contracts.py); ``fake_service`` wires them all to the real core.

    FakeCgroups      CgroupBackend   rules and membership in memory, fault points
    FakeCpusets      Cpusets         cpusets in memory, and the machine's CPUs (CpuTopology)
    FakeStore        RecordStore     records in memory, the same refusals, fault points
    FakeVolumes      DriverVolumes   volumes and their users in memory, fault points
    FakeInventory    GpuInventory    a shipped host's GPUs; XIDs, usage, processes, clocks, compute mode on demand
    FakeDeviceNodes  DeviceNodes     nvidiactl, nvidia-uvm(-tools), nvidia-caps numbers
    FakeProcesses    Processes       a pid table
    FakeFilesystem   Filesystem      directories by path
    FakeUsers        UserDb          user names -> uids (root, nobody, and any given)
    FakeMps          MpsDaemons      MPS control daemons in memory (servers, clients, FAULT); kill one, fault points
    ManualClock      Clock           time that moves when told
    StubService      IsolatorApi     a whole-service double answering UNIMPLEMENTED

One port a module: cgroups.py, cpusets.py, store.py, volumes.py, inventory.py, system.py (the small
edges and the clock), mps.py, stub.py; faults.py holds their fault points, rig.py ``fake_service``,
rules.py helpers for looking at rule sets.

For system tests, the demo and the benchmark (need root and cgroups; imported on their own):
``isolator.testing.mesos`` plays the Mesos containerizer over gRPC or the bridge executables,
``isolator.testing.sidecar`` runs a real daemon on a simulated host, ``isolator.testing.cgroupfs``
makes throwaway cgroups under ``gpu-isolator-test/``, ``isolator.testing.cluster`` runs a real Mesos
master and agents with the sidecar behind criteo's command module or ours (``make test-mesos``; its
``Agent`` in ``agent.py``, its ``Task`` in ``task.py``, the Mesos it finds in ``mesoshome.py``).
Beside them: ``mesos_json`` (the ContainerConfig JSON an agent hands criteo's module), ``forkserver``
(test daemons forked from a process that imported the daemon once), ``grpcproxy`` (a proxy between
our module and the sidecar), ``reaper`` (a child subreaper, as systemd reaps), ``sandbox`` (the unit's
process sandbox rebuilt), ``scheduler`` (a minimal v1 framework), ``images`` (a busybox image for Mesos's local
Docker registry), ``node`` (a Debian node booted with
systemd as PID 1 by systemd-nspawn, ``make test-node``) and ``container/`` (what runs inside a test
container).
"""

from isolator.testing.cgroups import FakeCgroups
from isolator.testing.cpusets import FakeCpusets
from isolator.testing.faults import Faults
from isolator.testing.inventory import FakeInventory
from isolator.testing.rig import Rig, fake_service
from isolator.testing.store import FakeStore
from isolator.testing.stub import StubService
from isolator.testing.system import FakeDeviceNodes, FakeFilesystem, FakeProcesses, FakeUsers, ManualClock
from isolator.testing.volumes import FakeVolumes

__all__ = [
    "FakeCgroups",
    "FakeCpusets",
    "FakeDeviceNodes",
    "FakeFilesystem",
    "FakeInventory",
    "FakeProcesses",
    "FakeStore",
    "FakeUsers",
    "FakeVolumes",
    "Faults",
    "ManualClock",
    "Rig",
    "StubService",
    "fake_service",
]
