"""Recovery: booking recorded GPUs at start-up, Mesos's Recover hook, and reaping vanished containers.

Decisions come from the pure ``isolator.reconcile``; this module gathers its three views (our
records, the kernel's grants, Mesos's list) and carries out the actions, revocations first.
"""

from __future__ import annotations

import contextlib
import logging

from isolator.allocator import Allocator
from isolator.core.context import Core
from isolator.crashpoints import crashpoint
from isolator.errors import CgroupVanished
from isolator.model import ContainerId, ContainerState, RecoverResult
from isolator.reconcile import Kind, reconcile

LOG = logging.getLogger(__name__)


class Recovery:
    def __init__(self, core: Core) -> None:
        self.core = core

    def restore(self) -> None:
        """Book every recorded GPU before the first request, so nothing is handed out twice even
        on the bridge route, where Mesos never calls Recover."""
        core = self.core
        with core.locks.exclusive():
            records = core.store.load()
            with core.alloc:
                for rec in records.values():
                    known = rec.gpus & core.allocator.total
                    if known != rec.gpus:
                        LOG.warning(
                            "container %s records GPUs %s that this host does not have; keeping %s",
                            rec.container_id,
                            sorted(rec.gpus - known),
                            sorted(known),
                        )
                    core.allocator.restore(known)
                    core.hold_mig(rec.mig, restore=True)

    def kernel_grants(self, cid: ContainerId) -> frozenset[int] | None:
        """GPU minors the kernel grants ``cid`` (v1 devices.list, v2 our program), None if no cgroup."""
        try:
            rules = self.core.cgroups.recover(cid)
        except CgroupVanished:
            return None
        return frozenset(self.core.granted(rules))

    def _restore_cgroup(self, cid: ContainerId, gpus: frozenset[int]) -> None:
        """Standalone mode owns its cgroups: make a recorded container's cgroup whole after a crash.

        A kill between recording and creating the cgroup (prepare), or between removing it and
        forgetting the record (cleanup), leaves a record without rules: the cgroup is made again
        with the recorded rules. A v1 cgroup caught between mkdir and its deny-all still allows
        every device; ``prepare`` (idempotent) turns it into a whitelist first.
        """
        core = self.core
        if not core.cgroups.exists(cid):
            core.cgroups.prepare(cid)
            core.apply(cid, gpus)
            LOG.warning("recover: made the missing cgroup of %s again", core.describe(cid, gpus))
            return
        core.cgroups.prepare(cid)

    def recover(self, states: list[ContainerState], orphans: list[ContainerId]) -> RecoverResult:
        core = self.core
        with core.locks.exclusive():
            loaded = core.store.load()
            # A MIG holder's cgroup grants its MIG devices' parents' nodes: those count as recorded.
            records = {cid: rec.gpus | rec.mig_parents for cid, rec in loaded.items()}
            kernel: dict[ContainerId, frozenset[int]] = {}
            for cid in records:
                if core.settings.mode == "standalone":
                    self._restore_cgroup(cid, loaded[cid].gpus)
                granted = self.kernel_grants(cid)
                if granted is not None:
                    kernel[cid] = granted
            running = None if core.settings.mode == "standalone" else [s.container_id.root for s in states]
            actions = reconcile(records, kernel, running, [o for o in orphans if not o.nested])
            result = RecoverResult()
            for action in actions:
                cid = action.container_id
                if action.kind in (Kind.REVOKE, Kind.REAPPLY):
                    core.apply(cid, loaded[cid].gpus if cid in loaded else frozenset())
                elif action.kind is Kind.RELEASE:
                    with contextlib.suppress(CgroupVanished):
                        core.cgroups.cleanup(cid)
                    core.store.remove(cid)
                    result.released += 1
                    core.release_volume(cid)
                elif action.kind is Kind.MARK_ORPHAN and cid in records:
                    core.store.update(cid, state="orphan")
                crashpoint("recover.action")
            # Rebuild the allocator from what the store now says.
            live = core.store.load()
            with core.alloc:
                core.allocator = Allocator(core.inventory.topology(), core.allocator.policy)
                core.mig_held, core.mig_booked = {}, set()
                core.sync_health()
                for rec in live.values():
                    core.allocator.restore(rec.gpus & core.allocator.total)
                    core.hold_mig(rec.mig, restore=True)
            result.recovered = len(live)
            if core.volumes is not None:
                core.volumes.reconcile(str(c) for c in live)
        core.notify()
        LOG.info("recovered %d containers, released %d", result.recovered, result.released)
        return result

    def reap_vanished(self) -> list[ContainerId]:
        """Release containers whose Mesos cgroup is gone (mesos mode only).

        The command-module route never forwards Recover or orphans, and skips cleanup for containers
        it has no context for (reference §A.1.8), so a container destroyed while the agent was down
        would hold its GPUs for ever. Mesos removes a container's cgroup when it destroys it; a
        record whose cgroup no longer exists therefore belongs to a dead container. Run periodically.
        """
        core = self.core
        if core.settings.mode != "mesos":
            return []
        reaped = []
        for cid in sorted(core.store.load(), key=ContainerId.chain):
            with core.locks.hold(cid):
                rec = core.store.get(cid)
                if rec is None or core.cgroups.exists(cid):
                    continue
                with contextlib.suppress(CgroupVanished):
                    core.cgroups.cleanup(cid)
                core.drop(cid, rec)
            reaped.append(cid)
            LOG.warning("released %s: its cgroup is gone (destroyed without a cleanup)", core.describe(cid, rec.gpus))
        for cid in reaped:
            core.release_volume(cid)
        return reaped
