"""Cleanup: a container's rules, record and GPUs let go (idempotent; fine for a container never
prepared, MESOS-6059).
"""

from __future__ import annotations

import logging

from isolator.core.context import Core
from isolator.crashpoints import crashpoint
from isolator.model import ContainerId, Mode

LOG = logging.getLogger(__name__)


class CleanupHook:
    """Cleanup (part of IsolatorService, through ``hooks.Hooks``)."""

    core: Core  # set by IsolatorService, which composes the parts over one Core

    def cleanup(self, container_id: ContainerId) -> None:
        core = self.core
        if container_id.nested:
            if core.settings.mode == Mode.MESOS:
                with core.locks.hold(container_id):
                    core.grants.revoke(container_id)  # our rules in its own cgroup, if any
            core.release_volume(container_id)
            return
        with core.locks.hold(container_id):
            core.failed_after_answer.forget(container_id)
            rec = core.store.get(container_id)
            # The tombstone before the record goes: a Watch asking meanwhile (woken by the drop, or
            # polling) finds one or the other, never neither ("unknown container").
            core.changes.mark_ended(container_id)
            if rec is not None:
                core.end_mps_clients(container_id, rec.holding)  # before its cgroup (and pids) go
                core.grants.cleanup(container_id)
                crashpoint("cleanup.cgroup")
                core.drop(container_id, rec)
        if rec is None:
            # Mesos calls cleanup for containers it never prepared with us (MESOS-6059).
            LOG.info("ignoring cleanup of unknown container %s", container_id)
            core.release_volume(container_id)
            return
        crashpoint("cleanup.record")
        core.release_volume(container_id)
        LOG.info("cleaned up %s", core.describe(container_id, rec.holding.gpus))
