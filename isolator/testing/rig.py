"""``fake_service()``: the real service core over the shipped fakes, for in-process tests as any user.

rig = fake_service("dgx-1")
rig.service.prepare(ContainerId.parse("a"), ContainerConfig(resources=(Resource("gpus", 2),)))
rig.cgroups.rules_of(ContainerId.parse("a"))      # what the "kernel" grants
rig.restart()                                     # a sidecar restart over the same machine
"""

from __future__ import annotations

from dataclasses import dataclass, field

from isolator.core.context import Settings
from isolator.core.service import IsolatorService
from isolator.testing.cgroups import FakeCgroups
from isolator.testing.cpusets import FakeCpusets
from isolator.testing.inventory import FakeInventory
from isolator.testing.mps import FakeMps
from isolator.testing.store import FakeStore
from isolator.testing.system import FakeDeviceNodes, FakeFilesystem, FakeProcesses, FakeUsers, ManualClock
from isolator.testing.volumes import FakeVolumes


@dataclass
class Rig:
    inventory: FakeInventory
    cgroups: FakeCgroups
    store: FakeStore
    volumes: FakeVolumes
    processes: FakeProcesses
    filesystem: FakeFilesystem
    clock: ManualClock
    devices: FakeDeviceNodes
    settings: Settings
    cpusets: FakeCpusets = field(default_factory=FakeCpusets)  # also the machine's CPUs (CpuTopology)
    mps: FakeMps = field(default_factory=FakeMps)  # MPS control daemons (docs/sharing.md)
    users: FakeUsers = field(default_factory=FakeUsers)  # user names -> uids (a sharer's user)
    service: IsolatorService = field(init=False)

    def __post_init__(self) -> None:
        self.service = self._build()

    def _build(self, mps: bool = True) -> IsolatorService:
        return IsolatorService(
            inventory=self.inventory,
            cgroups=self.cgroups,
            devices=self.devices,
            store=self.store,
            volumes=self.volumes,
            processes=self.processes,
            filesystem=self.filesystem,
            clock=self.clock,
            settings=self.settings,
            cpus=self.cpusets,
            cpusets=self.cpusets,
            mps=self.mps if mps else None,
            users=self.users,
        )

    def without_mps(self) -> IsolatorService:
        """The service as compose.py builds it when nothing was shared in mps mode at start: no
        nvidia-cuda-mps-control behind it (core/absent.py's null edge)."""
        self.service = self._build(mps=False)
        return self.service

    def restart(self) -> IsolatorService:
        """A new service over the same machine and state, as after a sidecar restart."""
        self.service = self._build()
        return self.service


def fake_service(
    host: str = "dgx-1",
    *,
    mode: str = "standalone",
    version: str = "v1",
    policy: str = "topology",
    inventory: FakeInventory | None = None,
    cpu_affinity: str = "off",
    cpusets: FakeCpusets | None = None,
) -> Rig:
    return Rig(
        inventory=inventory if inventory is not None else FakeInventory.of_host(host),
        cgroups=FakeCgroups(mode=mode, version=version),
        store=FakeStore(),
        volumes=FakeVolumes(),
        processes=FakeProcesses(),
        filesystem=FakeFilesystem(),
        clock=ManualClock(),
        devices=FakeDeviceNodes(),
        settings=Settings(mode=mode, policy=policy, isolate_settle_s=2.0, cpu_affinity=cpu_affinity),
        cpusets=cpusets if cpusets is not None else FakeCpusets(),
    )
