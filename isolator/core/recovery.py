"""Recovery: booking recorded GPUs at start-up, Mesos's Recover hook, and reaping vanished containers.

Decisions come from pure policies: ``isolator.policy.reconcile`` (Recover), ``adopt`` (unrecorded
cgroups at start-up) and ``drift`` (the record against the kernel, at start-up and in the audit, as
``describe`` and the health check compare). This module gathers their views (our records, the
kernel's grants, Mesos's list) and carries out the actions, revocations first.
"""

from __future__ import annotations

import contextlib
import logging

from isolator.core.context import Core
from isolator.crashpoints import crashpoint
from isolator.errors import CgroupVanished, IsolatorError
from isolator.model import (
    AuditReport,
    ContainerId,
    ContainerRecord,
    ContainerState,
    Holding,
    Mode,
    RecordState,
    RecoverResult,
    key_root,
)
from isolator.policy import adopt, drift
from isolator.policy import shares as sharing
from isolator.policy.reconcile import Kind, reconcile

LOG = logging.getLogger(__name__)


class Recovery:
    """Start-up reconciliation, Recover, reaping and the drift audit (part of IsolatorService)."""

    core: Core  # set by IsolatorService, which composes the three parts over one Core

    def start(self) -> None:
        """Before the first request, whether or not Recover is ever called (the bridge route never
        calls it): bring every cgroup under our root in line with the records, then book every
        recorded GPU so that nothing is handed out twice.

        Fail closed: a recorded container gets exactly its recorded rules (its cgroup remade in
        standalone mode); an unrecorded cgroup that grants GPUs explicitly is a record we lost, and
        its record is rebuilt from the kernel (a GPU recorded for another container is revoked from
        it instead); in standalone mode an unrecorded cgroup that allows every device (a crash
        between creating it and restricting it) gets deny-all. Two unrecorded cgroups granting one
        GPU cannot be told apart: the start stops with a message naming them.
        """
        core = self.core
        with core.locks.exclusive():
            records = core.store.load()
            for cid, rec in sorted(records.items(), key=lambda kv: kv[0].chain()):
                self._enforce_record(cid, rec)
            unrecorded = [c for c in core.cgroups.containers() if c not in records]
            self._adopt_or_deny(unrecorded, records)
            self._reconcile_cpusets(core.store.load())  # records rebuilt from the kernel included
            self.book()
            core.supervise_mps()  # sharers' daemons adopted or started again, idle ones stopped
            core.handover.start()  # every free GPU passes the handover check before it is handed out

    def book(self) -> None:
        """Rebuild the allocator from what the store says. Call with the table exclusive."""
        core = self.core
        live = core.store.load()
        with core.booking.lock:
            core.booking.reset(core.inventory.topology())
            core.sync_health()
            # --shared-gpus naming a GPU a container holds whole: refused, never both (docs/sharing.md).
            shared = core.booking.shared
            clash = sorted((m, str(r.container_id)) for r in live.values() for m in r.holding.gpus if m in shared)
            if clash:
                raise sharing.RoleChangeRefused(
                    problems="; ".join(
                        f"GPU {m} is held whole by container {c} and cannot become shared" for m, c in clash
                    )
                )
            for rec in live.values():
                kept = core.booking.restore(rec.container_id.key(), rec.holding)
                if kept != rec.holding:
                    LOG.warning(
                        "container %s records GPUs %s that this host does not have; keeping %s",
                        rec.container_id,
                        sorted(rec.holding.gpus - kept.gpus),
                        sorted(kept.gpus),
                    )
            # Sharers recorded as ended by a lost MPS server or daemon stay ended until their Cleanup
            # (their clients failed with it); their Watches answer the limitation again.
            for cid, why in sorted(core.store.mps_ended().items(), key=lambda kv: kv[0].chain()):
                ended = live.get(cid)
                if ended is not None and ended.holding.share is not None:
                    core.booking.mps_ended[cid.key()] = why

    def _reconcile_cpusets(self, records: dict[ContainerId, ContainerRecord]) -> None:
        """Each recorded cpuset as recorded (a kill between recording and writing it, or a cpuset
        changed while we were down); our cpusets with no record and no process are removed."""
        core = self.core
        for cid, rec in sorted(records.items(), key=lambda kv: kv[0].chain()):
            drift = self._cpuset_drift(cid, rec)
            if drift is not None:
                LOG.warning("start: %s: %s; applying the record", core.describe(cid, rec.holding.gpus), drift)
                aff = core.cpuset.recorded_affinity(rec)
                assert aff is not None
                core.cpuset.apply_cpuset(cid, aff)
        for cid in core.cpusets.containers():
            if cid in records or core.cpusets.path(cid) == core.cgroups.cgroup_path(cid):
                continue  # recorded, or a v2 devices cgroup that is also the cpuset (standalone): not ours here
            try:
                core.cpuset.remove_cpuset(cid)
                LOG.warning("start: removed the cpuset '%s', which has no record", core.cpusets.path(cid))
            except IsolatorError as exc:
                LOG.warning("start: the cpuset '%s' has no record and stays: %s", core.cpusets.path(cid), exc)

    def _cpuset_drift(self, cid: ContainerId, rec: ContainerRecord) -> str | None:
        """How the kernel's cpuset differs from the recorded one (policy.drift.cpuset_drift)."""
        core = self.core
        recorded = core.cpuset.recorded_affinity(rec)
        if recorded is None:
            return None
        return drift.cpuset_drift(recorded, core.cpusets.current(cid), core.cpusets.path(cid))

    def _enforce_record(self, cid: ContainerId, rec: ContainerRecord) -> None:
        """Make the kernel grant what is recorded: its GPUs whole, plus its MIG devices (their
        parents' nodes are what the GPU-level comparison sees of them)."""
        core = self.core
        if core.settings.mode == Mode.STANDALONE:
            self._restore_cgroup(cid, rec.holding.gpus)
        elif not core.cgroups.exists(cid):
            return  # Mesos has not made it yet, or destroyed it: the reaper's and Recover's business
        core.grant_recorded_gpus(cid, rec, "start")

    def _adopt_or_deny(self, unrecorded: list[ContainerId], records: dict[ContainerId, ContainerRecord]) -> None:
        core = self.core
        # A MIG holder's parent GPU counts as recorded: an unrecorded cgroup granting it is revoked.
        # So does a sharer's shared GPU.
        recorded = {m: cid for cid, rec in records.items() for m in rec.holding.touched}
        # A shared GPU is never rebuilt as a whole holder's: how many shares a lost sharer had is unknown.
        with core.booking.lock:
            shared = frozenset(core.booking.shared)
        kernel = {c: core.cgroups.in_force(c) for c in unrecorded}
        for step in adopt.plan(kernel, recorded, core.gpus, core.settings.mode == Mode.STANDALONE, shared):
            c = step.container
            if step.stolen:
                LOG.warning(
                    "start: cgroup '%s' has no record and is granted GPUs %s recorded for %s; revoking them",
                    core.cgroups.cgroup_path(c),
                    sorted(step.stolen),
                    ", ".join(map(str, step.owners)),
                )
            if step.lost_shares:
                LOG.warning(
                    "start: cgroup '%s' has no record and is granted shared GPUs %s; its shares are unknown,"
                    " so they are revoked, never rebuilt (docs/sharing.md)",
                    core.cgroups.cgroup_path(c),
                    sorted(step.lost_shares),
                )
            if step.stolen or step.lost_shares:
                core.grants.write(c, core.grants.rules(step.keep))
            if step.keep:
                self._rebuild(c, step.keep)
            elif step.deny_all:
                LOG.warning("start: cgroup '%s' has no record and allows every device; denying all", kernel[c].source)
                core.grants.create(c)
                core.grants.write(c, ())

    def _rebuild(self, cid: ContainerId, gpus: frozenset[int]) -> None:
        core = self.core
        try:
            pids = core.cgroups.pids(cid)
        except CgroupVanished:
            return
        rules = core.cgroups.in_force(cid).rules
        state = RecordState.ISOLATED if pids else RecordState.PREPARED
        core.store.record(core.new_record(cid, Holding.whole(gpus), rules=tuple(rules), state=state))
        core.rebuilt.append(cid)
        LOG.warning(
            "start: rebuilt the lost record of %s from the kernel's rules (GPUs %s, %d processes)",
            core.describe(cid, gpus),
            sorted(gpus),
            len(pids),
        )

    def kernel_grants(self, cid: ContainerId) -> frozenset[int] | None:
        """GPU minors the kernel grants ``cid`` (v1 devices.list, v2 our program), None if no cgroup."""
        try:
            rules = self.core.cgroups.recover(cid)
        except CgroupVanished:
            return None
        return frozenset(drift.granted(rules, self.core.gpus))

    def _restore_cgroup(self, cid: ContainerId, gpus: frozenset[int]) -> None:
        """Standalone mode owns its cgroups: make a recorded container's cgroup whole after a crash.

        A kill between recording and creating the cgroup (prepare), or between removing it and
        forgetting the record (cleanup), leaves a record without rules: the cgroup is made again
        with the recorded rules. A v1 cgroup caught between mkdir and its deny-all still allows
        every device; ``prepare`` (idempotent) turns it into a whitelist first.
        """
        core = self.core
        if not core.cgroups.exists(cid):
            core.grants.create(cid)
            core.grants.apply(cid, gpus)
            LOG.warning("recover: made the missing cgroup of %s again", core.describe(cid, gpus))
            return
        core.grants.create(cid)

    def recover(self, states: list[ContainerState], orphans: list[ContainerId]) -> RecoverResult:
        core = self.core
        with core.locks.exclusive():
            loaded = core.store.load()
            # A MIG holder's cgroup grants its MIG devices' parents' nodes: those count as recorded.
            records = {cid: rec.holding.touched for cid, rec in loaded.items()}
            kernel: dict[ContainerId, frozenset[int]] = {}
            for cid in records:
                if core.settings.mode == Mode.STANDALONE:
                    self._restore_cgroup(cid, loaded[cid].holding.gpus)
                granted = self.kernel_grants(cid)
                if granted is not None:
                    kernel[cid] = granted
            running = None if core.settings.mode == Mode.STANDALONE else [s.container_id.root for s in states]
            actions = reconcile(records, kernel, running, [o for o in orphans if not o.nested])
            result = RecoverResult()
            for action in actions:
                cid = action.container_id
                if action.kind in (Kind.REVOKE, Kind.REAPPLY):
                    core.grants.apply(cid, loaded[cid].holding.gpus if cid in loaded else frozenset())
                elif action.kind is Kind.RELEASE:
                    with contextlib.suppress(CgroupVanished):
                        core.grants.cleanup(cid)
                    core.store.remove(cid)
                    result.released += 1
                    core.release_volume(cid)
                elif action.kind is Kind.MARK_ORPHAN and cid in records:
                    core.store.update(cid, state=RecordState.ORPHAN)
                crashpoint("recover.action")
            # Rebuild the allocator from what the store now says.
            self.book()
            core.supervise_mps()  # a released sharer may have been its GPU's last (docs/sharing.md)
            live = core.store.load()
            result.recovered = len(live)
            # Keep the users of live top-level containers and of everything nested in them:
            # nested containers are never recorded, and their volume must outlive a Recover.
            roots = {c.key() for c in live}
            keep = roots | {u for u in core.volume_users() if key_root(u) in roots}
            core.volumes.reconcile(keep)
        core.changes.notify()
        LOG.info("recovered %d containers, released %d", result.recovered, result.released)
        return result

    def audit(self) -> AuditReport:
        """Compare every recorded container's kernel rules with its record; re-apply on a difference.

        Drift is: a recorded rule the kernel does not enforce, GPUs granted other than the recorded
        ones, nothing of ours in force, and in standalone mode (where the cgroup is all ours) any
        rule the kernel enforces beyond the record. In mesos mode the agent's own rules are its
        business. A standalone cgroup that vanished is made again; a Mesos one is the reaper's.
        Each container is checked under its own lock, so hooks of the others go on meanwhile.
        """
        core = self.core
        repaired: list[str] = []
        checked = 0
        for cid in sorted(core.store.load(), key=ContainerId.chain):
            with core.locks.hold(cid):
                rec = core.store.get(cid)
                if rec is None:
                    continue
                checked += 1
                lines = []
                drift = self._drift(cid, rec)
                if drift is not None:
                    if not core.cgroups.exists(cid):
                        core.grants.create(cid)
                    core.grants.apply(cid, rec.holding.gpus)
                    lines.append(f"container {cid}: {drift}; re-applied the recorded rules")
                cpuset_drift = self._cpuset_drift(cid, rec)
                if cpuset_drift is not None:
                    aff = core.cpuset.recorded_affinity(rec)
                    assert aff is not None
                    core.cpuset.apply_cpuset(cid, aff)
                    lines.append(f"container {cid}: {cpuset_drift}; re-applied the recorded cpuset")
            for line in lines:
                LOG.warning("audit: %s", line)
                repaired.append(line)
        with core.booking.lock:
            core.repairs += len(repaired)
            total = core.repairs
        return AuditReport(checked=checked, repaired=tuple(repaired), repairs_total=total)

    def _drift(self, cid: ContainerId, rec: ContainerRecord) -> str | None:
        core = self.core
        if not core.cgroups.exists(cid):
            if core.settings.mode == Mode.MESOS:
                return None
            return f"its cgroup '{core.cgroups.cgroup_path(cid)}' is gone"
        return core.compare_with_kernel(cid, rec).finding(strict=core.settings.mode == Mode.STANDALONE)

    def reap_vanished(self) -> list[ContainerId]:
        """Release containers whose Mesos cgroup is gone (mesos mode only).

        The command-module route never forwards Recover or orphans, and skips cleanup for containers
        it has no context for (reference §A.1.8), so a container destroyed while the agent was down
        would hold its GPUs for ever. Mesos removes a container's cgroup when it destroys it; a
        record whose cgroup no longer exists therefore belongs to a dead container. Run periodically.
        """
        core = self.core
        if core.settings.mode != Mode.MESOS:
            return []
        reaped = []
        for cid in sorted(core.store.load(), key=ContainerId.chain):
            with core.locks.hold(cid):
                rec = core.store.get(cid)
                if rec is None or core.cgroups.exists(cid):
                    continue
                # Mesos ended it, as a Cleanup says: a later Watch poll (criteo's module polls once
                # more) is routine, not an unknown container, and a later Prepare is stale. Marked
                # before the record goes, so that a Watch asking meanwhile finds one or the other.
                core.changes.mark_ended(cid)
                with contextlib.suppress(CgroupVanished):
                    core.grants.revoke(cid)
                core.cpuset.remove_cpuset(cid)  # its processes died with its Mesos cgroups
                core.drop(cid, rec)
            reaped.append(cid)
            LOG.warning(
                "released %s: its cgroup is gone (destroyed without a cleanup)", core.describe(cid, rec.holding.gpus)
            )
        for cid in reaped:
            core.release_volume(cid)
        return reaped
