"""The cpuset half of what the kernel grants a container (``--cpu-affinity``, docs/affinity.md): its
GPUs' locality decided (``isolator.policy.affinity``), and its cpuset cgroup held to it, or let go.

Lock contract (checked, isolator/core/locks.py): ``apply_cpuset``, ``remove_cpuset`` and ``release``
write to the kernel and must be called with the container's lock held and without the booking lock;
``affinity``, ``locality`` and ``recorded_affinity`` need no lock. The optional edges are null
objects (core/absent.py); whether the real ones were given is decided here, once: without a CPU view
there is no locality, without a cpuset hierarchy no cpuset (a recorded one included) is enforced.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from isolator.core.absent import NoCpus, NoCpusets
from isolator.core.booking import Booking
from isolator.core.locks import ContainerLocks, require_kernel_write
from isolator.core.ports import Cpusets, CpuTopology
from isolator.errors import AffinityEmpty, AffinityUnknown, CgroupBusy
from isolator.model import ContainerId, ContainerRecord, MigDevice
from isolator.policy import affinity as affinities
from isolator.policy import mig as migunits
from isolator.policy import shares as sharing

LOG = logging.getLogger(__name__)


class CpusetGrant:
    """Decides a container's CPUs and memory nodes and holds its cpuset to them."""

    def __init__(
        self,
        *,
        booking: Booking,
        locks: ContainerLocks,
        cpu_affinity: str = "off",
        cpus: CpuTopology | None = None,
        cpusets: Cpusets | None = None,
    ) -> None:
        self.booking = booking  # the managed GPUs (``booking.gpus``): their NUMA nodes and local CPUs
        self.locks = locks
        self.cpu_affinity = cpu_affinity
        self._cpus_known = cpus is not None
        self._cpuset_bound = cpusets is not None
        self.cpus: CpuTopology = cpus if cpus is not None else NoCpus()
        self.cpusets: Cpusets = cpusets if cpusets is not None else NoCpusets()

    def _require(self, cid: ContainerId, what: str) -> None:
        require_kernel_write(self.locks, self.booking.lock, cid, what)

    @property
    def enforcing(self) -> bool:
        """Whether containers are held to their GPUs' CPUs with a cpuset (``--cpu-affinity enforce``)."""
        return self.cpu_affinity == "enforce" and self._cpuset_bound

    def affinity(
        self, cid: ContainerId, minors: frozenset[int], units: Iterable[MigDevice] = ()
    ) -> affinities.Affinity | None:
        """The CPUs and memory nodes local to ``minors`` (and MIG ``units``' parents) on this machine.

        None when affinity is off or the container has no GPUs. Enforcing, a locality that leaves
        nothing or is unknown is refused (``AffinityEmpty``/``AffinityUnknown``); hinting, it is
        logged and no hint is given.
        """
        if self.cpu_affinity == "off" or not self._cpus_known:
            return None
        try:
            return self.locality(minors, units)
        except (AffinityEmpty, AffinityUnknown) as exc:
            if self.enforcing:
                LOG.error("container %s: refused: %s", cid, exc.message)
                raise
            LOG.warning("container %s: no CPU affinity hint: %s", cid, exc.message)
            return None

    def locality(self, minors: frozenset[int], units: Iterable[MigDevice] = ()) -> affinities.Affinity | None:
        """``affinity.decide`` for these GPUs on this machine, whatever the mode (the admin views)."""
        if not self._cpus_known:
            return None
        gpus = self.booking.gpus
        held = sorted(minors | migunits.parents(tuple(units)))
        local = [affinities.GpuLocality(m, gpus[m].numa_node, gpus[m].cpu_affinity) for m in held if m in gpus]
        return affinities.decide(local, self.cpus.machine())

    def task_nodes(self, cid: ContainerId) -> frozenset[int] | None:
        """The NUMA nodes of the CPUs ``cid`` may run on (its cpuset's parent's: what the agent or the
        operator's slice allows it), for placing its gpu_shares near them (docs/sharing.md); None
        when affinity is off, there is no cpuset hierarchy, or nothing restricts it."""
        if self.cpu_affinity == "off" or not self._cpus_known or not self._cpuset_bound:
            return None
        allowed = self.cpusets.allowed(cid)
        if not allowed:
            return None
        return sharing.nodes_of(allowed, self.cpus.machine().node_cpus)

    def apply_cpuset(self, cid: ContainerId, aff: affinities.Affinity, before: frozenset[int] | None = None) -> None:
        """Hold ``cid``'s cpuset to ``aff`` (recorded first by the caller), saying so when it narrows
        the CPUs the container could use before (``before``: the cpuset's parent's when None)."""
        self._require(cid, "apply_cpuset")
        if before is None:
            before = self.cpusets.allowed(cid) or self.cpus.machine().cpus
        self.cpusets.apply(cid.root, aff.cpus, aff.mems)
        lost = affinities.narrowed(before, aff.cpus)
        if lost:
            LOG.info(
                "container %s: cpuset '%s' narrows it from CPUs %s to %s, memory nodes %s (local to its GPUs)",
                cid,
                self.cpusets.path(cid),
                affinities.format_list(before),
                aff.cpu_list,
                aff.mem_list,
            )

    def remove_cpuset(self, cid: ContainerId) -> None:
        """Remove ``cid``'s cpuset (CgroupBusy while it holds processes)."""
        self._require(cid, "remove_cpuset")
        self.cpusets.remove(cid)

    def recorded_affinity(self, rec: ContainerRecord | None) -> affinities.Affinity | None:
        """The cpuset a record holds its container to; None without one, or without a cpuset
        hierarchy to hold it in (a record from a machine that had one is not enforced here)."""
        if rec is None or not rec.cpus or not self._cpuset_bound:
            return None
        return affinities.Affinity(affinities.parse_list(rec.cpus), affinities.parse_list(rec.mems))

    def release(self, cid: ContainerId, keep_busy: bool = False) -> None:
        """At a top-level container's cleanup: remove its cpuset. ``keep_busy``: a forced release of
        a container whose processes run on; they keep their CPUs, and the start-up reconciliation
        removes the cpuset once it is empty."""
        self._require(cid, "cleanup")
        try:
            self.cpusets.remove(cid)
        except CgroupBusy as exc:
            if not keep_busy:
                raise
            LOG.warning("container %s: its cpuset stays for its processes: %s", cid, exc.message)
