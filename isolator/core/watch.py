"""What a running container reports: watch (is there a limitation now; never waits: the transport
does), usage and status.
"""

from __future__ import annotations

import logging

from isolator.core import usage as usage_view
from isolator.core.context import Core
from isolator.errors import ContainerGone, NotFound
from isolator.model import ContainerId, ContainerRecord, ContainerStatus, GpuUsage, Limitation, Usage
from isolator.policy import mig as migunits
from isolator.policy import shares as sharing

LOG = logging.getLogger(__name__)


class WatchHook:
    """Watch, usage, status (part of IsolatorService, through ``hooks.Hooks``)."""

    core: Core  # set by IsolatorService, which composes the parts over one Core

    def watch(self, container_id: ContainerId) -> Limitation | None:
        """Is there a limitation now: one when a GPU the container holds is unhealthy, else None.
        Never waits: a Watch that waits does so in the transport, subscribed to ``core.changes``."""
        core = self.core
        rec = core.store.get(container_id.root)
        if rec is None:
            if container_id.nested:
                return None
            if core.changes.recently_ended(container_id):
                # The module polls Watch once more after each Cleanup; the bridge answers that
                # poll "no limitation", an open gRPC Watch ends NOT_FOUND.
                raise ContainerGone(container=str(container_id))
            raise NotFound(f"unknown container {container_id}")
        with core.booking.lock:
            sick = sorted(m for m in rec.holding.touched if m in core.booking.unhealthy)
            ended = core.booking.mps_ended.get(container_id.key())
        if sick:
            return self._limitation(container_id, sick, rec)
        share = rec.holding.share
        if ended is not None and share is not None:
            # An MPS FAULT on its GPU (docs/sharing.md, "Faults"): as an XID ends every sharer.
            return Limitation(
                gpus=0,
                message=f"container {container_id} holds {share.count} {sharing.RESOURCE} of GPU {share.gpu}"
                f" ({share.mode}) and {ended}",
                mig=((sharing.RESOURCE, share.count),),
            )
        return None

    def _limitation(self, cid: ContainerId, sick: list[int], rec: ContainerRecord) -> Limitation:
        """An XID on a GPU limits every container on it: holders of the GPU and of its MIG devices."""
        reasons = {}
        for r in self.core.inventory.records:
            if r.gpu.minor in sick:
                reasons[r.gpu.minor] = f"{r.gpu.uuid}: {r.status or 'unhealthy'}"
        detail = "; ".join(f"GPU {m} ({reasons.get(m, 'unhealthy')})" for m in sick)
        units: dict[str, list[str]] = {}
        for dev in self.core.grants.mig_of(rec):
            if dev.parent_minor in sick:
                units.setdefault(migunits.resource_name(dev.profile) or dev.profile, []).append(dev.uuid)
        if units:
            detail += "; its MIG devices " + ", ".join(u for us in units.values() for u in us)
        # A sharer loses its shares (the limitation's resources: ``gpu_shares``, beside the MIG units).
        lost = [(name, len(uuids)) for name, uuids in sorted(units.items())]
        share = rec.holding.share
        if share is not None and share.gpu in sick:
            detail += f"; its {share.count} {sharing.RESOURCE} of GPU {share.gpu} ({share.mode})"
            lost.append((sharing.RESOURCE, share.count))
        return Limitation(
            gpus=len([m for m in sick if m in rec.holding.gpus]),
            message=f"container {cid} holds a GPU that became unhealthy: {detail}",
            mig=tuple(lost),
        )

    def usage(self, container_id: ContainerId) -> Usage:
        core = self.core
        rec = core.require(container_id.root)
        gpus = []
        for minor in sorted(rec.holding.granted):
            gpu = core.gpus.get(minor)
            if gpu is None:
                continue
            u = core.inventory.usage(gpu.index)
            gpus.append(GpuUsage(gpu.uuid, minor, u.memory_used, u.memory_total, u.gpu_utilization))
        devices = usage_view.container_use(core, (rec,))[rec.container_id]
        return Usage(timestamp=core.clock.time(), gpus=tuple(gpus), devices=devices)

    def status(self, container_id: ContainerId) -> ContainerStatus:
        core = self.core
        rec = core.require(container_id.root)
        uuids = tuple(core.gpus[m].uuid for m in sorted(rec.holding.granted) if m in core.gpus)
        return ContainerStatus(uuids + tuple(sorted(rec.holding.mig_uuids)), rec.state)
