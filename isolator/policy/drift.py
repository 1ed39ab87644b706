"""Drift: how a container's record and what the kernel holds for it differ. Pure: both sides in, a
``Drift`` out; nothing here reads the kernel.

The one record-vs-kernel comparison: start-up (re-apply the record), the audit (re-apply and say
why), ``describe`` (show both sides) and the health check (say which containers differ) all compare
through ``compare``, and each reads the facets it acts on, so they cannot disagree on what differs.
The cpuset's comparison is ``cpuset_drift``, used by start-up and the audit alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from isolator.devicerule import DeviceRule
from isolator.model import Holding
from isolator.policy.affinity import Affinity
from isolator.policy.devices import NVIDIA_MAJOR, KernelRules, permits


def granted(rules: Iterable[DeviceRule], known: Iterable[int]) -> tuple[int, ...]:
    """The minors of the ``known`` GPUs that ``rules`` let a process read and write, sorted."""
    rules = tuple(rules)
    return tuple(sorted(m for m in known if permits(rules, DeviceRule.char(NVIDIA_MAJOR, m, "rw"))))


@dataclass(frozen=True)
class Drift:
    """Both sides of one container, compared."""

    present: bool  # rules of ours are in force (False: no cgroup, or no program of ours)
    source: str  # where the kernel's rules were read, or why there are none
    granted: tuple[int, ...]  # GPUs the kernel grants
    recorded: tuple[int, ...]  # GPUs the record holds whole
    expected: tuple[int, ...]  # GPUs the kernel must grant: those, and the parents of its MIG devices
    missing: tuple[DeviceRule, ...]  # recorded rules the kernel does not enforce
    extra: tuple[DeviceRule, ...]  # rules the kernel enforces beyond the record

    @property
    def gpus_agree(self) -> bool:
        """Rules of ours are in force and grant exactly the expected GPUs (start-up, health)."""
        return self.present and self.granted == self.expected

    @property
    def rules_agree(self) -> bool:
        """Rules of ours are in force and match the record rule for rule, both ways (describe)."""
        return self.present and not self.missing and not self.extra

    def absence(self) -> str:
        """Why nothing of ours is in force, as the backend said it."""
        return self.source.removeprefix("none: ")

    def finding(self, strict: bool) -> str | None:
        """The audit's: what differs, or None. ``strict`` (standalone mode, where the cgroup is all
        ours) counts rules beyond the record too; in mesos mode the agent's own rules are its business."""
        if not self.present:
            return self.absence()
        extra = self.extra if strict else ()
        if self.granted == self.expected and not self.missing and not extra:
            return None
        parts = [f"kernel grants GPUs {list(self.granted)} (recorded {list(self.expected)})"]
        if self.missing:
            parts.append(f"missing {[str(r) for r in self.missing]}")
        if extra:
            parts.append(f"unrecorded {[str(r) for r in extra]}")
        return ", ".join(parts)

    def gpu_finding(self) -> str | None:
        """The health check's: which GPUs differ, or None (what Recover would fix)."""
        if not self.present:
            return self.absence()
        if self.granted != self.expected:
            return f"recorded GPUs {list(self.recorded)}, kernel grants {list(self.granted)}"
        return None


def compare(rules: Iterable[DeviceRule], holding: Holding, kernel: KernelRules, known: Iterable[int]) -> Drift:
    """A record (its ``rules`` and what it holds: whole GPUs, MIG devices whose parents' nodes it is
    granted, a sharer's shared GPU, docs/sharing.md) against what the kernel holds, over the ``known``
    GPUs. Rules are compared in the order given."""
    recorded = tuple(rules)
    in_force = kernel.rules
    return Drift(
        present=kernel.present,
        source=kernel.source,
        granted=granted(in_force, known),
        recorded=tuple(sorted(holding.gpus)),
        expected=tuple(sorted(holding.touched)),
        missing=tuple(r for r in recorded if not permits(in_force, r)),
        extra=tuple(r for r in in_force if not permits(recorded, r)),
    )


def cpuset_drift(recorded: Affinity | None, current: Affinity | None, path: str) -> str | None:
    """How the kernel's cpuset (``current``, None: gone) differs from the ``recorded`` one; None when
    it agrees or none is recorded. ``path``: the cpuset's, for the message."""
    if recorded is None:
        return None
    if current is None:
        return f"its cpuset '{path}' is gone (recorded CPUs {recorded.cpu_list}, nodes {recorded.mem_list})"
    if current != recorded:
        return (
            f"its cpuset holds CPUs {current.cpu_list or '(none)'}, memory nodes {current.mem_list or '(none)'} "
            f"(recorded CPUs {recorded.cpu_list}, nodes {recorded.mem_list})"
        )
    return None
