"""Update: what a running container holds grown or shrunk (whole GPUs, MIG units, shares of its GPU):
book, record, then grant on a grow; revoke, then forget, then free on a shrink (never grant what is
not recorded); its cpuset follows whole GPUs. What may change is policy/request.py's rule.
"""

from __future__ import annotations

import contextlib
import logging

from isolator.core import usage as usage_view
from isolator.core.context import Core
from isolator.crashpoints import crashpoint
from isolator.errors import CgroupVanished, FailedPrecondition, IsolatorError
from isolator.model import ContainerId, ContainerRecord, Holding, Resource
from isolator.policy import request as requests
from isolator.policy.affinity import Affinity

LOG = logging.getLogger(__name__)


class UpdateHook:
    """Update (part of IsolatorService, through ``hooks.Hooks``)."""

    core: Core  # set by IsolatorService, which composes the parts over one Core

    def update(self, container_id: ContainerId, resources: list[Resource]) -> None:
        core = self.core
        if container_id.nested:
            raise FailedPrecondition(f"update is not supported for nested containers ({container_id})")
        request = requests.read(resources)
        with core.locks.hold(container_id):
            rec = core.require(container_id)
            held = rec.holding
            requests.check_update(container_id, held, request)
            if request.gpus > len(held.gpus) or sum(request.mig.values()) > len(held.mig):
                core.handover.recheck()
            in_use = self._in_use(rec) if 0 < request.gpus < len(held.gpus) else frozenset()
            with core.booking.lock:
                grown, shrunk, why = core.booking.resize(container_id.key(), held, request, in_use)
            add, release = grown.gpus, shrunk.gpus
            if release:
                LOG.info(
                    "shrinking %s: drops GPUs %s, keeps %s (%s)",
                    core.describe(container_id, held.gpus),
                    sorted(release),
                    sorted(held.gpus - release),
                    why,
                )
            try:
                # Decided before anything changes: an enforced locality that leaves nothing refuses the update.
                moved = (
                    core.cpuset.affinity(container_id, (held.gpus | add) - release) if core.cpuset.enforcing else None
                )
            except BaseException:
                self._unbook_grow(container_id, grown)
                raise
            now = held
            if not grown.empty:
                # Grow: book, record, then grant (never grant what is not recorded).
                recorded = False
                try:
                    self._record(container_id, held | grown, grown)
                    recorded = True
                    crashpoint("update.grown")
                    self._grant(container_id, held | grown)
                except BaseException:
                    self._undo_grow(container_id, held, grown, recorded)
                    raise
                now = held | grown
            if not shrunk.empty:
                # Shrink: revoke, then let the record and the books go (shares are counted down on their
                # GPU; a sharer at 0 is no longer granted it, and its MPS clients are ended first).
                if (now - shrunk).share is None:
                    core.end_mps_clients(container_id, now)
                self._grant(container_id, now - shrunk)
                crashpoint("update.revoked")
                if shrunk.mig or shrunk.share is not None:
                    core.store.set_holding(container_id, now - shrunk)
                else:
                    core.store.remove_gpus(container_id, release)
                crashpoint("update.recorded")
                core.release(container_id, shrunk)
                now = now - shrunk
            if core.cpuset.enforcing and (add or release):
                self._move_cpuset(container_id, rec, moved)
        LOG.info(
            "updated %s to %d GPUs, %d MIG devices, %d gpu_shares",
            core.describe(container_id, now.touched),
            len(now.gpus),
            len(now.mig),
            now.shares,
        )

    def _in_use(self, rec: ContainerRecord) -> frozenset[int]:
        """The GPUs held whole on which the container's processes run now (NVML's per-process view,
        core/usage.py), asked outside the booking lock. A GPU NVML cannot list makes the use unknown:
        none is then reported, and the shrink falls back to the rule that ignores use."""
        devices = usage_view.container_use(self.core, (rec,))[rec.container_id]
        failed = [d for d in devices if d.kind == "gpu" and d.error]
        if failed:
            LOG.warning(
                "%s: which GPUs its processes use is unknown (%s); the shrink ignores use",
                self.core.describe(rec.container_id, rec.holding.gpus),
                "; ".join(d.error for d in failed),
            )
            return frozenset()
        return frozenset(d.minor for d in devices if d.kind == "gpu" and d.pids)

    def _record(self, cid: ContainerId, target: Holding, grown: Holding) -> None:
        """Record a grow: whole GPUs added to the record, or (MIG units, shares) the holding replaced."""
        if grown.mig or grown.share is not None:
            self.core.store.set_holding(cid, target)
        else:
            self.core.store.add_gpus(cid, grown.gpus)

    def _grant(self, cid: ContainerId, holding: Holding) -> None:
        """Make the kernel grant exactly ``holding`` (whole GPUs, MIG units, the shared GPU); record the rules."""
        grants = self.core.grants
        grants.apply(cid, holding.gpus, grants.mig_units(cid, holding), shared=holding.shared)

    def _move_cpuset(self, cid: ContainerId, rec: ContainerRecord, held: Affinity | None) -> None:
        """After an update: record the cpuset of the GPUs now held, then write it. A container left
        with no GPUs is let go back to what its parent allows (it is left alone, as without GPUs)."""
        core = self.core
        old = core.cpuset.recorded_affinity(rec)
        if held is None:
            if old is None:
                return
            machine = core.cpuset.cpus.machine()
            held = Affinity(core.cpusets.allowed(cid) or machine.cpus, machine.mems)
        if old == held:
            return
        core.store.set_cpuset(cid, held.cpu_list, held.mem_list)
        crashpoint("cpuset.recorded")
        core.cpuset.apply_cpuset(cid, held, before=old.cpus if old is not None else None)
        if old is None:
            # It had no GPUs, so no cpuset: its processes join the one just made.
            for member in [cid, *core.grants.nested_cgroups(cid)] if core.cgroups.exists(cid) else []:
                with contextlib.suppress(CgroupVanished):
                    for pid in core.cgroups.pids(member):
                        core.cpusets.join(cid, pid)

    def _undo_grow(self, cid: ContainerId, kept: Holding, grown: Holding, recorded: bool) -> None:
        """Take back a grow that failed half-way: revoke in the kernel, then forget, then free.

        The kernel may already grant what it grew by (the rules were applied, their record failed),
        so the container's rules go back to ``kept`` first; what fails to be revoked stays recorded
        and booked, never free while granted.
        """
        core = self.core
        if recorded:
            rules = core.grants.rules(kept.granted, core.grants.mig_units(cid, kept))
            try:
                core.grants.write(cid, rules)
            except CgroupVanished:
                pass  # no cgroup, no grant: nothing to revoke
            except Exception:
                LOG.exception("failed to revoke %s of %s after a failed update; it stays booked", grown, cid)
                return
            try:
                if grown.mig or grown.share is not None:
                    core.store.set_holding(cid, kept)
                else:
                    core.store.remove_gpus(cid, grown.gpus)
            except IsolatorError as exc:
                LOG.error("failed to forget %s of %s after a failed update; it stays booked: %s", grown, cid, exc)
                return
            with contextlib.suppress(IsolatorError):
                core.store.update(cid, rules=rules)
        self._unbook_grow(cid, grown)

    def _unbook_grow(self, cid: ContainerId, grown: Holding) -> None:
        """Give back a grow that never reached the kernel: no handover check."""
        with self.core.booking.lock:
            self.core.booking.free(cid.key(), grown)
