"""Recovery: reconcile our records, the kernel's grants and Mesos's container list into actions.

Pure: three views in, a list of actions out; the service applies them. Every disagreement is
resolved toward isolation (nothing is granted that is not recorded) and reported with both sides.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from isolator.model import ContainerId

LOG = logging.getLogger(__name__)


class Kind(enum.Enum):
    """What the service must do for one container, in the order it must do it."""

    # Remove device grants the kernel holds but our records do not (v1 devices.deny, v2 new program).
    REVOKE = "revoke-kernel-entries"
    # Grant what is recorded but missing in the kernel (a crash between writing state and rules).
    REAPPLY = "reapply-recorded-rules"
    # Forget a record whose container neither Mesos nor the kernel knows: its GPUs become free.
    RELEASE = "release-record"
    # Mesos handed the container over as an orphan: keep its GPUs until its cleanup.
    MARK_ORPHAN = "mark-orphan"
    # Records, kernel and Mesos agree (or the kernel view is absent for a container Mesos runs).
    KEEP = "keep"


_ORDER = {kind: i for i, kind in enumerate(Kind)}


@dataclass(frozen=True)
class Action:
    kind: Kind
    container_id: ContainerId
    gpus: frozenset[int] = frozenset()
    reason: str = ""


def reconcile(
    records: Mapping[ContainerId, frozenset[int]],
    kernel: Mapping[ContainerId, frozenset[int]],
    running: Iterable[ContainerId] | None,
    orphans: Iterable[ContainerId] = (),
) -> list[Action]:
    """The actions that bring records and kernel in line, given what Mesos says exists.

    ``records``: our state, container -> recorded GPU minors. ``kernel``: container -> GPU minors its
    cgroup grants (v1 devices.list, v2 attached program); a container missing here has no cgroup or
    no program. ``running``: the container states Mesos handed to Recover, or None in standalone
    mode, where our records are the only authority. ``orphans``: Mesos's orphans.

    Rules: a GPU the kernel grants beyond a container's record is revoked; a recorded GPU missing
    from the kernel is re-granted when Mesos still runs the container (the record is written before
    the rules, so this is a crash in between); orphans keep their GPUs until cleanup; a record that
    neither Mesos nor the kernel knows is released; a running container without a record holds no
    GPUs and needs no action. Actions are ordered so that revocations come first.
    """
    orphan_ids = set(orphans)
    running_ids = None if running is None else set(running) - orphan_ids
    actions: list[Action] = []
    every = set(records) | set(kernel) | orphan_ids | (running_ids or set())
    for container in sorted(every, key=ContainerId.chain):
        rec = records.get(container)
        granted = kernel.get(container)
        recorded = rec if rec is not None else frozenset()
        orphan = container in orphan_ids
        known = running_ids is None or container in running_ids
        if orphan:
            mesos = "orphan"
        elif running_ids is None:
            mesos = "nothing (standalone)"
        else:
            mesos = "running" if known else "not running"
        sides = f"state records {_fmt(rec)}, kernel grants {_fmt(granted)}, mesos says {mesos}"

        def act(kind: Kind, gpus: Iterable[int], why: str, c: ContainerId = container, s: str = sides) -> None:
            actions.append(Action(kind, c, frozenset(gpus), f"{why} ({s})"))

        gone = rec is not None and not known and not orphan
        # Never grant what is not recorded; and for a container that is gone, take every grant away
        # before its GPUs go back to the pool.
        revoke = (granted or frozenset()) if gone else (granted or frozenset()) - recorded
        if revoke:
            act(Kind.REVOKE, revoke, "the kernel grants GPUs that are not recorded for a live container")
        if rec is None:
            # A container Mesos runs without a record of ours holds no GPUs: nothing to keep.
            if orphan:
                act(Kind.MARK_ORPHAN, (), "an orphan without a record holds no GPUs")
        elif orphan:
            act(Kind.MARK_ORPHAN, recorded, "an orphan keeps its GPUs until its cleanup")
        elif gone:
            act(Kind.RELEASE, recorded, "Mesos does not know this container")
        elif granted is None:
            act(Kind.KEEP, recorded, "no cgroup or program was found; its GPUs stay reserved until cleanup")
        elif recorded - granted:
            act(Kind.REAPPLY, recorded - granted, "recorded GPUs are not granted by the kernel")
        else:
            act(Kind.KEEP, recorded, "records and kernel agree")
    actions.sort(key=lambda a: (_ORDER[a.kind], a.container_id.chain()))
    for action in actions:
        if action.kind is Kind.KEEP and action.reason.startswith("records and kernel agree"):
            LOG.info("recover: keep container %s, GPUs %s", action.container_id, _fmt(action.gpus))
        else:
            LOG.warning(
                "recover: %s for container %s, GPUs %s: %s",
                action.kind.value,
                action.container_id,
                _fmt(action.gpus),
                action.reason,
            )
    return actions


def _fmt(gpus: frozenset[int] | None) -> str:
    if gpus is None:
        return "nothing (absent)"
    return "{" + ", ".join(str(g) for g in sorted(gpus)) + "}"
