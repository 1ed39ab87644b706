"""Update: a running container's GPUs grown or shrunk: book, record, then grant on a grow; revoke,
then forget, then free on a shrink (never grant what is not recorded); its cpuset follows.
"""

from __future__ import annotations

import contextlib
import logging

from isolator.core.context import Core
from isolator.crashpoints import crashpoint
from isolator.errors import CgroupVanished, FailedPrecondition, IsolatorError
from isolator.model import ContainerId, ContainerRecord, Holding, Resource
from isolator.policy import mig as migunits
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
            requests.check_update(container_id, held, self._mig_counts(rec), request)
            if request.gpus > len(held.gpus):
                core.handover.recheck()
            with core.booking.lock:
                grown, shrunk = core.booking.resize(held, request.gpus)
            add, release = grown.gpus, shrunk.gpus
            try:
                # Decided before anything changes: an enforced locality that leaves nothing refuses the update.
                moved = (
                    core.cpuset.affinity(container_id, (held.gpus | add) - release) if core.cpuset.enforcing else None
                )
            except BaseException:
                self._unbook_grow(container_id, grown)
                raise
            if add:
                # Grow: book, record, then grant (never grant what is not recorded).
                recorded = False
                try:
                    core.store.add_gpus(container_id, add)
                    recorded = True
                    crashpoint("update.grown")
                    core.grants.apply(container_id, held.gpus | add)
                except BaseException:
                    self._undo_grow(container_id, held.gpus, grown, recorded)
                    raise
            if release:
                # Shrink: revoke, then let the record and the books go.
                core.grants.apply(container_id, held.gpus - release)
                crashpoint("update.revoked")
                core.store.remove_gpus(container_id, release)
                core.release(container_id, shrunk)
            final = (held.gpus | add) - release
            if core.cpuset.enforcing and (add or release):
                self._move_cpuset(container_id, rec, moved)
        LOG.info("updated %s to %d GPUs", core.describe(container_id, frozenset(final)), request.gpus)

    def _mig_counts(self, rec: ContainerRecord) -> dict[str, int]:
        """The MIG units a record holds, per ``mig-<profile>`` resource (the profile when it has none)."""
        held: dict[str, int] = {}
        for dev in self.core.grants.mig_of(rec):
            name = migunits.resource_name(dev.profile) or dev.profile
            held[name] = held.get(name, 0) + 1
        return held

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

    def _undo_grow(self, cid: ContainerId, kept: frozenset[int], grown: Holding, recorded: bool) -> None:
        """Take back a grow that failed half-way: revoke in the kernel, then forget, then free.

        The kernel may already grant ``add`` (the rules were applied, their record failed), so they
        are revoked first; a GPU whose revocation fails stays recorded and booked, never free while
        granted.
        """
        core = self.core
        add = grown.gpus
        units = core.grants.mig_of(core.store.get(cid))  # MIG holdings never change in an update
        if recorded:
            try:
                core.grants.write(cid, core.grants.rules(kept, units))
            except CgroupVanished:
                pass  # no cgroup, no grant: nothing to revoke
            except Exception:
                LOG.exception(
                    "failed to revoke GPUs %s of %s after a failed update; they stay booked", sorted(add), cid
                )
                return
            try:
                core.store.remove_gpus(cid, add)
            except IsolatorError as exc:
                LOG.error(
                    "failed to forget GPUs %s of %s after a failed update; they stay booked: %s", sorted(add), cid, exc
                )
                return
            with contextlib.suppress(IsolatorError):
                core.store.update(cid, rules=core.grants.rules(kept, units))
        self._unbook_grow(cid, grown)

    def _unbook_grow(self, cid: ContainerId, grown: Holding) -> None:
        """Give back a grow that never reached the kernel: no handover check."""
        with self.core.booking.lock:
            self.core.booking.free(cid.key(), grown)
