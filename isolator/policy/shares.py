"""Shares of a GPU (docs/sharing.md): which GPUs are shared and how, the agent's resources, where a
request of N shares goes, and which role changes a reload may make.

Pure: the operator's ``--shared-gpus``, the inventory's facts and the books in; a decision or a typed
error out. No NVML, no files, no clock. GPUs are named by device minor, as in the allocator.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from isolator.errors import ConfigError, FailedPrecondition, InvalidArgument, ResourceExhausted
from isolator.model import Resource, ShareMode

# The agent resource a framework asks for, as it asks for ``cpus`` (a Mesos scalar of our own: the
# master refuses fractional ``gpus``, "The 'gpus' resource must be an unsigned integer").
RESOURCE = "gpu_shares"
# Most shares one GPU is cut into. MPS: 48 client CUDA contexts per device on Volta and later (the
# MPS documentation, "Limitations"); time-slicing has no hard limit, 64 keeps every share a useful
# slice and keeps the per-share MPS limits (100/shares percent) above 1.
MAX_SHARES = {ShareMode.TIME_SLICE: 64, ShareMode.MPS: 48}
# Most shares one request may name before it is judged: any larger count fits no GPU anyway.
MAX_REQUEST = max(MAX_SHARES.values())

_SPEC = re.compile(r"(\d+)(?:-(\d+))?:(\d+)(?::([a-z-]+))?")


class InvalidShareCount(InvalidArgument, ValueError):
    msg_fmt = "The '" + RESOURCE + "' resource must be a whole number of shares from 1 to {most}, got {value}"


class ShareRequestTooLarge(InvalidArgument):
    msg_fmt = (
        "Requested {requested} " + RESOURCE + " but a shared GPU here holds at most {most}; shares of one"
        " request are never split across GPUs (ask for whole 'gpus' instead)"
    )


class SharesExhausted(ResourceExhausted):
    msg_fmt = "Requested {requested} " + RESOURCE + " but no shared GPU has that many free ({free})"


class SharesNotHeld(FailedPrecondition):
    msg_fmt = "container {holder} holds no " + RESOURCE


class RoleChangeRefused(FailedPrecondition):
    msg_fmt = "refused to change how GPUs are shared while they are held: {problems}"


@dataclass(frozen=True, order=True)
class ShareSpec:
    """One GPU of ``--shared-gpus``, by NVML index (as ``--nvidia-gpu-devices`` names GPUs)."""

    index: int
    shares: int
    mode: ShareMode = ShareMode.TIME_SLICE


@dataclass(frozen=True, order=True)
class SharedGpu:
    """A shared GPU as the books see it."""

    minor: int
    index: int
    shares: int
    mode: ShareMode = ShareMode.TIME_SLICE
    numa: int | None = None


@dataclass(frozen=True)
class Placement:
    """Where a request landed: ``shares`` of GPU ``minor`` (shared in ``mode``), of ``total``."""

    minor: int
    shares: int
    mode: ShareMode
    total: int


# ---- the operator's choice -----------------------------------------------------------------------


def parse_shared_gpus(value: object) -> tuple[ShareSpec, ...]:
    """``--shared-gpus``: ``INDEX[-LAST]:SHARES[:MODE]`` items, comma-separated (or a TOML list of them).

    ``4:4:mps,5-7:2`` shares GPU 4 four ways under MPS and GPUs 5, 6 and 7 two ways, time-sliced (the
    default mode). Sorted by index; a GPU named twice, a mode not known, a share count out of
    1..MAX_SHARES[mode] is a ConfigError naming the item.
    """
    if isinstance(value, (list, tuple)):
        items = [str(v).strip() for v in value]
    elif isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    else:
        raise ConfigError(f"--shared-gpus must be a string or a list of strings, got {value!r}")
    out: dict[int, ShareSpec] = {}
    for item in items:
        if not item:
            continue
        m = _SPEC.fullmatch(item)
        if m is None:
            raise ConfigError(f"--shared-gpus item {item!r} is not INDEX[-LAST]:SHARES[:MODE]")
        first = int(m.group(1))
        last = first if m.group(2) is None else int(m.group(2))
        shares = int(m.group(3))
        named = m.group(4) or ShareMode.TIME_SLICE
        if named not in tuple(ShareMode):
            known = ", ".join(ShareMode)
            raise ConfigError(f"--shared-gpus item {item!r}: mode {named!r} is not one of {known}")
        mode = ShareMode(named)
        if last < first:
            raise ConfigError(f"--shared-gpus item {item!r}: the range {first}-{last} is empty")
        if not 2 <= shares <= MAX_SHARES[mode]:
            raise ConfigError(
                f"--shared-gpus item {item!r}: a GPU is shared 2 to {MAX_SHARES[mode]} ways in {mode} mode,"
                f" not {shares}"
            )
        for index in range(first, last + 1):
            if index in out:
                raise ConfigError(f"--shared-gpus names GPU {index} twice")
            out[index] = ShareSpec(index, shares, mode)
    return tuple(out[i] for i in sorted(out))


def format_shared_gpus(specs: Iterable[ShareSpec]) -> str:
    """The canonical flag text of ``specs`` (one item per GPU): what ``parse_shared_gpus`` reads back."""
    return ",".join(f"{s.index}:{s.shares}:{s.mode}" for s in sorted(specs))


def resolve(
    specs: Iterable[ShareSpec],
    managed: Iterable[tuple[int, int, bool]],
    numa: Mapping[int, int | None] | None = None,
) -> dict[int, SharedGpu]:
    """The shared GPUs by minor. ``managed``: (index, minor, in MIG mode) of each GPU the sidecar manages.

    A GPU the sidecar does not manage, or one in MIG mode, is refused: a MIG GPU's instances are
    offered as ``mig-<profile>`` resources, and sharing them too is not supported (docs/sharing.md).
    """
    by_index = {index: (minor, mig) for index, minor, mig in managed}
    out: dict[int, SharedGpu] = {}
    for spec in specs:
        if spec.index not in by_index:
            known = ",".join(str(i) for i in sorted(by_index)) or "none"
            raise ConfigError(f"--shared-gpus names GPU {spec.index}, which is not managed (managed indices: {known})")
        minor, mig = by_index[spec.index]
        if mig:
            raise ConfigError(
                f"--shared-gpus names GPU {spec.index}, which is in MIG mode; its MIG devices are offered as"
                " mig-<profile> resources and are not shared (docs/sharing.md)"
            )
        out[minor] = SharedGpu(minor, spec.index, spec.shares, spec.mode, (numa or {}).get(minor))
    return out


def agent_resources(whole_gpus: int, shared: Mapping[int, SharedGpu]) -> str:
    """``gpus:N;gpu_shares:M`` (the latter only when something is shared): ``whole_gpus`` should
    already leave the shared GPUs out, since a GPU is never both exclusive and shared."""
    total = sum(g.shares for g in shared.values())
    return f"gpus:{whole_gpus}" + (f";{RESOURCE}:{total}" if total else "")


# ---- requests ------------------------------------------------------------------------------------


def checked_share_count(value: object) -> int:
    """One share count as an int, or InvalidShareCount: bools, non-numbers, NaN, infinities,
    fractions, zero, negatives and counts above MAX_REQUEST. ``2.0`` (a Mesos scalar) is 2."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidShareCount(value=repr(value)[:40], most=MAX_REQUEST)
    if isinstance(value, float) and (not math.isfinite(value) or value != math.floor(value)):
        raise InvalidShareCount(value=repr(value), most=MAX_REQUEST)  # a float's repr is short
    if value < 1 or value > MAX_REQUEST:
        raise InvalidShareCount(value=repr(value)[:40], most=MAX_REQUEST)
    return int(value)


def share_request(resources: Iterable[Resource]) -> int:
    """The ``gpu_shares`` a container asks for: 0 when it names none. Several entries (one per
    role) are added; each must be a valid count, and so must the sum."""
    counts = []
    for res in resources:
        if res.name != RESOURCE:
            continue
        if res.type != "SCALAR":
            raise InvalidShareCount(f"The '{RESOURCE}' resource must be a scalar")
        counts.append(checked_share_count(res.value))
    return checked_share_count(sum(counts)) if counts else 0


def place(
    count: object,
    shared: Mapping[int, SharedGpu],
    held: Mapping[int, int],
    blocked: Iterable[int] = (),
    near: Iterable[int] | None = None,
) -> Placement:
    """Where ``count`` shares go: one shared GPU with that many free, not ``blocked`` (unhealthy,
    draining). Among those, the GPU holding the fewest shares, then one whose NUMA node is in
    ``near`` (the task's CPUs' nodes, where affinity is on), then the lowest minor. Deterministic.
    """
    n = checked_share_count(count)
    most = max((g.shares for g in shared.values()), default=0)
    if n > most:
        raise ShareRequestTooLarge(requested=n, most=most)
    out = set(blocked)
    nodes = None if near is None else frozenset(near)
    room = [g for g in shared.values() if g.minor not in out and g.shares - held.get(g.minor, 0) >= n]
    if not room:
        free = {g.minor: g.shares - held.get(g.minor, 0) for g in sorted(shared.values())}
        detail = ", ".join(f"GPU {m}: {f}" + (" (not usable)" if m in out else "") for m, f in free.items())
        raise SharesExhausted(requested=n, free=detail)  # not empty: with nothing shared, n > most above

    def key(g: SharedGpu) -> tuple[int, bool, int]:
        near_it = nodes is None or g.numa in nodes
        return (held.get(g.minor, 0), not near_it, g.minor)

    best = min(room, key=key)
    return Placement(best.minor, n, best.mode, best.shares)


def nodes_of(cpus: Iterable[int], node_cpus: Mapping[int, Iterable[int]]) -> frozenset[int]:
    """The NUMA nodes holding any of ``cpus`` (a task's CPUs): ``place``'s ``near``."""
    wanted = frozenset(cpus)
    return frozenset(node for node, members in node_cpus.items() if wanted & frozenset(members))


def limits(shares: int, total: int, memory_bytes: int) -> tuple[int, int]:
    """MPS limits of ``shares`` out of ``total``: (active thread percentage, pinned device memory in
    MiB), each in proportion and at least 1. A GPU of unknown memory (0) gets no memory limit (0)."""
    if not 1 <= shares <= total:
        raise InvalidShareCount(value=f"{shares} of {total}", most=total)
    percent = max(1, (100 * shares) // total)
    mib = (memory_bytes // (1024 * 1024)) * shares // total
    return percent, max(1, mib) if memory_bytes > 0 else 0


# ---- the books -----------------------------------------------------------------------------------


class ShareBook:
    """Who holds which shares: holder (the container's key) -> (minor, shares). In memory only; the
    durable record is the state store, written by the core before it grants anything."""

    def __init__(self, shared: Mapping[int, SharedGpu]) -> None:
        self.shared: dict[int, SharedGpu] = dict(shared)
        self._holders: dict[str, tuple[int, int]] = {}

    def held(self) -> dict[int, int]:
        """Shares held per shared GPU (every shared GPU, 0 when none). Every holder's GPU is shared:
        ``place`` and ``restore`` book nothing else, and a GPU stops being shared only without holders."""
        out = dict.fromkeys(self.shared, 0)
        for minor, n in self._holders.values():
            out[minor] += n
        return out

    def holders(self, minor: int) -> dict[str, int]:
        """Holders of GPU ``minor`` and their shares, by holder."""
        return {h: n for h, (m, n) in sorted(self._holders.items()) if m == minor}

    def of(self, holder: str) -> tuple[int, int] | None:
        return self._holders.get(holder)

    def place(
        self, holder: str, count: object, blocked: Iterable[int] = (), near: Iterable[int] | None = None
    ) -> Placement:
        """Choose and book; a holder books once (a second request is refused, nothing changes)."""
        if holder in self._holders:
            raise InvalidArgument(f"container {holder} already holds {RESOURCE}")
        choice = place(count, self.shared, self.held(), blocked, near)
        self._holders[holder] = (choice.minor, choice.shares)
        return choice

    def restore(self, holder: str, minor: int, shares: int) -> None:
        """Book a recorded holding at recovery. A GPU no longer shared, more shares than the GPU
        has, or a holder booked twice is refused (FailedPrecondition): the records and the flags disagree."""
        gpu = self.shared.get(minor)
        if gpu is None:
            raise FailedPrecondition(
                f"container {holder} holds {shares} {RESOURCE} of GPU {minor}, which is not shared"
            )
        if holder in self._holders:
            raise FailedPrecondition(f"container {holder} is booked twice for {RESOURCE}")
        n = checked_share_count(shares)
        if self.held()[minor] + n > gpu.shares:
            raise FailedPrecondition(
                f"container {holder} holds {n} {RESOURCE} of GPU {minor}, more than are left of its {gpu.shares}"
            )
        self._holders[holder] = (minor, n)

    def release(self, holder: str) -> tuple[int, int]:
        """Free a holder's shares; (minor, shares) that were freed. Not held: SharesNotHeld."""
        try:
            return self._holders.pop(holder)
        except KeyError:
            raise SharesNotHeld(holder=holder) from None


# ---- changes of role -----------------------------------------------------------------------------


def role_problems(
    old: Mapping[int, SharedGpu],
    new: Mapping[int, SharedGpu],
    whole_held: Iterable[int],
    shares_held: Mapping[int, int],
) -> list[str]:
    """What forbids going from sharing ``old`` to ``new`` now: a GPU held whole that would become
    shared, a shared GPU with sharers that would become whole, change mode, or shrink below what is
    held. Empty when the change is safe (a GPU nobody holds may change freely)."""
    problems: list[str] = []
    whole = set(whole_held)
    for minor in sorted(set(old) | set(new)):
        before, after = old.get(minor), new.get(minor)
        held = shares_held.get(minor) or 0
        if after is not None and before is None and minor in whole:
            problems.append(f"GPU {minor} is held whole and cannot become shared")
        elif before is not None and held:
            if after is None:
                problems.append(f"GPU {minor} has {held} {RESOURCE} held and cannot become whole")
            elif after.mode != before.mode:
                problems.append(
                    f"GPU {minor} has {held} {RESOURCE} held and cannot switch from {before.mode} to {after.mode}"
                )
            elif after.shares < held:
                problems.append(f"GPU {minor} has {held} {RESOURCE} held and cannot be cut into {after.shares}")
    return problems


def check_roles(
    old: Mapping[int, SharedGpu],
    new: Mapping[int, SharedGpu],
    whole_held: Iterable[int],
    shares_held: Mapping[int, int],
) -> None:
    """RoleChangeRefused when ``role_problems`` finds anything."""
    problems = role_problems(old, new, whole_held, shares_held)
    if problems:
        raise RoleChangeRefused(problems="; ".join(problems))
