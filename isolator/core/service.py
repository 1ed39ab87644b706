"""The isolator service: the hooks, recovery and the admin views over one set of edges.

This is the object the transport's handlers call (``isolator.core.api.IsolatorApi``, where
the hook API is declared). It is the three parts, each in its own module, over one ``Core``
(isolator/core/context.py); each method is written once, in its part:

    hooks.Hooks        prepare, isolate, update, watch, usage, status, cleanup
    recovery.Recovery  start-up reconciliation, recover, reap_vanished, the drift audit
    admin.Admin        list_gpus, topology, list_containers, describe_container, release, volume, health

It speaks the domain model (isolator.model) only: no grpc, no proto, no dicts shaped like messages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from isolator.core.absent import NoUsers
from isolator.core.admin import Admin
from isolator.core.context import Core, Edges, Settings
from isolator.core.hooks import Hooks
from isolator.core.ports import (
    CgroupBackend,
    Clock,
    Cpusets,
    CpuTopology,
    DeviceNodes,
    DriverVolumes,
    Filesystem,
    GpuInventory,
    MpsDaemons,
    Processes,
    RecordStore,
    UserDb,
)
from isolator.core.recovery import Recovery
from isolator.errors import ConfigError
from isolator.model import (
    ContainerId,
    ShareMode,
)
from isolator.policy.shares import ShareSpec


class IsolatorService(Hooks, Recovery, Admin):
    def __init__(
        self,
        *,
        inventory: GpuInventory,
        cgroups: CgroupBackend,
        devices: DeviceNodes,
        store: RecordStore,
        volumes: DriverVolumes | None,
        processes: Processes,
        filesystem: Filesystem,
        clock: Clock,
        settings: Settings | None = None,
        cpus: CpuTopology | None = None,
        cpusets: Cpusets | None = None,
        mps: MpsDaemons | None = None,
        users: UserDb | None = None,
    ) -> None:
        edges = Edges(
            inventory,
            cgroups,
            devices,
            store,
            volumes,
            processes,
            filesystem,
            clock,
            cpus,
            cpusets,
            mps,
            users or NoUsers(),
        )
        self.core = Core(edges, settings or Settings())
        self.start()

    def subscribe(self, callback: Callable[[], None], container: ContainerId | None = None) -> Callable[[], None]:
        """Call ``callback`` on each change that may end a Watch of ``container``; returns the
        unsubscribe function. A Watch asks again with ``watch(cid)`` when called back."""
        return self.core.changes.subscribe(callback, container)

    def share_gpus(self, specs: tuple[ShareSpec, ...]) -> None:
        """A reload of ``--shared-gpus`` (docs/sharing.md): these GPUs are shared from now on, or
        RoleChangeRefused (ConfigError for a GPU not managed or in MIG mode, or in mps mode on a
        sidecar that started without nvidia-cuda-mps-control) and nothing changes."""
        if self.core.edges.mps is None:
            # No MPS edge (compose.py builds one only when mps was asked at start): a GPU switched to
            # mps would refuse every sharer (issue 41 item 6: refused whole, never taken half).
            with self.core.booking.lock:
                was = self.core.booking.shared
            mps = [s for s in self.core.booking.resolve_shared(specs).values() if s.mode is ShareMode.MPS]
            switched = sorted(s.index for s in mps if s.minor not in was or was[s.minor].mode is not ShareMode.MPS)
            if switched:
                names = ", ".join(f"GPU {i}" for i in switched)
                raise ConfigError(
                    f"{names} cannot be shared in mps mode: this sidecar has no nvidia-cuda-mps-control"
                    " (it started with nothing in mps mode); restart it to share in mps mode"
                )
        with self.core.booking.lock:
            self.core.booking.share(specs)
        self.core.changes.notify()

    def supervise_mps(self) -> None:
        """The periodic pass over the MPS control daemons (the daemon's probe loop, docs/sharing.md):
        restarted where sharers need one and it is gone, stopped where no sharer is left."""
        self.core.supervise_mps()

    def recheck_draining(self) -> None:
        """Check the draining GPUs again (the daemon's probe loop, docs/handover.md)."""
        self.core.handover.recheck()

    def close(self) -> None:
        """Stop the inventory's event thread and close the state store."""
        with contextlib.suppress(Exception):
            self.core.inventory.close()
        with contextlib.suppress(Exception):
            self.core.store.close()
