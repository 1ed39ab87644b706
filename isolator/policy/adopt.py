"""Adoption at start-up: what to do with cgroups under our root that have no record. Pure: the
kernel's rules of each, the recorded GPUs and the mode in, a plan out (or a refusal to start).

An unrecorded cgroup that grants GPUs by name (``c 195:<minor> rw``, as our rules do) is a record we
lost, rebuilt from the kernel; a GPU it is granted that another container's record holds is revoked
from it instead. Two unrecorded cgroups granting one GPU cannot be told apart: the start stops. In
standalone mode (the cgroups are all ours) an unrecorded cgroup that allows every device (a crash
between creating it and restricting it) gets deny-all. Fail closed, every way.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass

from isolator.errors import FailedPrecondition
from isolator.model import ContainerId
from isolator.policy.devices import NVIDIA_MAJOR, KernelRules
from isolator.policy.drift import granted


def explicit_grants(kernel: KernelRules, known: Container[int]) -> frozenset[int]:
    """The ``known`` GPUs the rules grant by name, read and write, as our rules do; not through wildcards."""
    if not kernel.present:
        return frozenset()
    return frozenset(
        m
        for r in kernel.rules
        if (m := r.minor) is not None
        and r.type == "c"
        and r.major == NVIDIA_MAJOR
        and m in known
        and "r" in r.access
        and "w" in r.access
    )


def allows_everything(kernel: KernelRules, known: Iterable[int]) -> bool:
    """Nothing restricts the cgroup: no rules of ours (v2: no program), or GPUs granted only through
    wildcards (v1: a cgroup caught between mkdir and its deny-all)."""
    known = tuple(known)
    if not kernel.present:
        return True
    return bool(granted(kernel.rules, known)) and not explicit_grants(kernel, known)


@dataclass(frozen=True)
class Adoption:
    """What start-up does with one unrecorded cgroup, in this order."""

    container: ContainerId
    granted: frozenset[int]  # the GPUs its rules grant by name
    stolen: frozenset[int]  # of those, GPUs recorded for others: its rules are rewritten without them
    owners: tuple[ContainerId, ...]  # whose records hold the stolen GPUs
    keep: frozenset[int]  # its record is rebuilt from the kernel with these (none: no record)
    lost_shares: frozenset[int]  # shared GPUs it is granted: how many shares it had is unknown, so revoked
    deny_all: bool  # standalone, nothing kept and nothing restricts it: deny every device


def plan(
    kernel: Mapping[ContainerId, KernelRules],
    recorded: Mapping[int, ContainerId],
    known: Iterable[int],
    standalone: bool,
    shared: Iterable[int] = (),
) -> list[Adoption]:
    """One ``Adoption`` per unrecorded cgroup (``kernel``: what each holds, in the order given), given
    which container's record holds each GPU (``recorded``; a MIG holder's parent GPU and a sharer's
    shared GPU count). A ``shared`` GPU (--shared-gpus, docs/sharing.md) is never rebuilt as a whole
    holder's: it is revoked. Raises ``FailedPrecondition`` when several of them claim one GPU no
    record holds."""
    known = frozenset(known)
    shared = frozenset(shared)
    explicit = {c: explicit_grants(k, known) for c, k in kernel.items()}
    claimants: dict[int, list[ContainerId]] = {}
    for c, minors in explicit.items():
        for m in minors - recorded.keys() - shared:
            claimants.setdefault(m, []).append(c)
    ambiguous = {m: cs for m, cs in claimants.items() if len(cs) > 1}
    if ambiguous:
        detail = "; ".join(f"GPU {m} by {', '.join(map(str, cs))}" for m, cs in sorted(ambiguous.items()))
        raise FailedPrecondition(
            f"cannot start: the kernel grants GPUs to several containers that have no record ({detail}); "
            "the state cannot be rebuilt from the kernel. Stop all but one container holding each GPU "
            "(or remove their cgroups) and start again (docs/reliability.md, 'Lost state')"
        )
    out = []
    for c, k in kernel.items():
        minors = explicit[c]
        stolen = minors & recorded.keys()
        lost_shares = (minors & shared) - stolen
        keep = minors - stolen - lost_shares
        out.append(
            Adoption(
                container=c,
                granted=minors,
                stolen=stolen,
                owners=tuple(sorted({recorded[m] for m in stolen})),
                keep=keep,
                lost_shares=lost_shares,
                deny_all=not keep and standalone and allows_everything(k, known),
            )
        )
    return out
