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

# The pooled resource of earlier releases (a Mesos scalar of our own: the master refuses fractional
# ``gpus``, "The 'gpus' resource must be an unsigned integer"): one count per agent, so the master could
# grant ``gpu_shares:3`` on an agent whose free shares lay on several GPUs. Still read (an agent whose
# --resources still offers it, records and updates of its sharers), no longer printed for the agent.
RESOURCE = "gpu_shares"
# What the agent offers now (docs/sharing.md, "The framework side"): a GPU cut N ways offers N units
# named ``gpu-share-<N>`` (one Nth of a GPU), as a MIG unit is named by its profile; a request takes
# exactly one unit, so the master's count per name is the free units and every grant fits one GPU.
UNIT_PREFIX = "gpu-share-"
_UNIT = re.compile(r"gpu-share-([1-9][0-9]?)")
# Most shares one GPU is cut into. MPS: 48 client CUDA contexts per device on Volta and later (the
# MPS documentation, "Limitations"); time-slicing has no hard limit, 64 keeps every share a useful
# slice and keeps the per-share MPS limits (100/shares percent) above 1.
MAX_SHARES = {ShareMode.TIME_SLICE: 64, ShareMode.MPS: 48}
# Most shares one request may name before it is judged: any larger count fits no GPU anyway.
MAX_REQUEST = max(MAX_SHARES.values())
# ``--share-placement``: ``spread`` (sharers apart while there is room) or ``pack`` (fill a GPU before
# opening the next, keeping whole GPUs' worth of shares free).
SPREAD, PACK = "spread", "pack"
PLACEMENTS = (SPREAD, PACK)

_SPEC = re.compile(r"(\d+)(?:-(\d+))?:(\d+)(?::([a-z-]+))?(?::([a-z-]+))?")
# The item's last word for an MPS GPU whose daemon runs -multiuser-server: every uid's sharers on one
# MPS server, the operator's explicit choice (no isolation between users, docs/sharing.md "Users").
MULTIUSER = "multiuser"


class InvalidShareCount(InvalidArgument, ValueError):
    msg_fmt = "The '" + RESOURCE + "' resource must be a whole number of shares from 1 to {most}, got {value}"


class ShareRequestTooLarge(InvalidArgument):
    msg_fmt = (
        "Requested {requested} " + RESOURCE + " but a shared GPU here holds at most {most}; shares of one"
        " request are never split across GPUs (ask for whole 'gpus' instead)"
    )


class InvalidShareUnit(InvalidArgument):
    msg_fmt = "invalid gpu-share request: {reason}"


class SharesExhausted(ResourceExhausted):
    msg_fmt = "Requested {requested} " + RESOURCE + " but no shared GPU has that many free ({free})"


class MpsShareCount(InvalidArgument):
    msg_fmt = (
        "Requested {requested} " + RESOURCE + " but every GPU here that could hold them is shared in mps mode,"
        " where each sharer holds exactly one share (MPS sets one limit per server, and one server serves"
        " a GPU's sharers): ask for gpu_shares:1, or one gpu-share-<N>:1 unit (N/{requested} of a GPU cut N ways"
        " is gpu-share-<N/{requested}>:1)"
    )


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
    multiuser: bool = False  # mps only: its daemon runs -multiuser-server


@dataclass(frozen=True, order=True)
class SharedGpu:
    """A shared GPU as the books see it."""

    minor: int
    index: int
    shares: int
    mode: ShareMode = ShareMode.TIME_SLICE
    numa: int | None = None
    multiuser: bool = False  # mps only: one MPS server for every uid (-multiuser-server)

    @property
    def one_user(self) -> bool:
        """Whether its sharers must all run as one Unix user: legacy MPS serves one uid at a time
        (another uid's client waits until every client of the current one has exited, measured)."""
        return self.mode is ShareMode.MPS and not self.multiuser


@dataclass(frozen=True)
class Placement:
    """Where a request landed: ``shares`` of GPU ``minor`` (shared in ``mode``), of ``total``."""

    minor: int
    shares: int
    mode: ShareMode
    total: int


# ---- the operator's choice -----------------------------------------------------------------------


def parse_shared_gpus(value: object) -> tuple[ShareSpec, ...]:
    """``--shared-gpus``: ``INDEX[-LAST]:SHARES[:MODE[:multiuser]]`` items, comma-separated (or a TOML
    list of them).

    ``4:4:mps,5-7:2`` shares GPU 4 four ways under MPS and GPUs 5, 6 and 7 two ways, time-sliced (the
    default mode); ``4:4:mps:multiuser`` runs GPU 4's MPS daemon with ``-multiuser-server``. Sorted by
    index; a GPU named twice, a mode not known, a share count out of 1..MAX_SHARES[mode], a last word
    other than ``multiuser`` or ``multiuser`` on a time-sliced GPU is a ConfigError naming the item.
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
            raise ConfigError(f"--shared-gpus item {item!r} is not INDEX[-LAST]:SHARES[:MODE[:{MULTIUSER}]]")
        first = int(m.group(1))
        last = first if m.group(2) is None else int(m.group(2))
        shares = int(m.group(3))
        named = m.group(4) or ShareMode.TIME_SLICE
        if named not in tuple(ShareMode):
            known = ", ".join(ShareMode)
            raise ConfigError(f"--shared-gpus item {item!r}: mode {named!r} is not one of {known}")
        mode = ShareMode(named)
        multiuser = m.group(5) is not None
        if multiuser and (m.group(5) != MULTIUSER or mode is not ShareMode.MPS):
            raise ConfigError(
                f"--shared-gpus item {item!r}: only an mps GPU takes a last word, and it is {MULTIUSER!r}"
                " (one MPS server for every user: no isolation between them, docs/sharing.md)"
            )
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
            out[index] = ShareSpec(index, shares, mode, multiuser)
    return tuple(out[i] for i in sorted(out))


def format_shared_gpus(specs: Iterable[ShareSpec]) -> str:
    """The canonical flag text of ``specs`` (one item per GPU): what ``parse_shared_gpus`` reads back."""
    return ",".join(f"{s.index}:{s.shares}:{s.mode}" + (f":{MULTIUSER}" if s.multiuser else "") for s in sorted(specs))


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
        out[minor] = SharedGpu(minor, spec.index, spec.shares, spec.mode, (numa or {}).get(minor), spec.multiuser)
    return out


def unit_name(shares: int) -> str:
    """The resource of one share of a GPU cut ``shares`` ways: ``gpu-share-4`` is a quarter GPU."""
    return f"{UNIT_PREFIX}{shares}"


def unit_size(name: str) -> int | None:
    """``gpu-share-4`` -> 4; None for a name that is not a share unit (``gpu_shares`` included)."""
    m = _UNIT.fullmatch(name)
    return int(m.group(1)) if m else None


def is_share_resource(name: str) -> bool:
    """Whether a resource asks for shares: the units ``gpu-share-<N>`` or the pooled ``gpu_shares``."""
    return name == RESOURCE or name.startswith(UNIT_PREFIX)


def units_offered(shared: Mapping[int, SharedGpu]) -> dict[str, int]:
    """Resource name -> the units the agent offers of it (every share of every GPU cut that many
    ways), by size: ``{"gpu-share-2": 4, "gpu-share-4": 8}``."""
    counts: dict[int, int] = {}
    for g in shared.values():
        counts[g.shares] = counts.get(g.shares, 0) + g.shares
    return {unit_name(n): counts[n] for n in sorted(counts)}


def agent_resources(whole_gpus: int, shared: Mapping[int, SharedGpu]) -> str:
    """``gpus:N;gpu-share-<S>:M...`` (the units only when something is shared), sizes ascending:
    ``whole_gpus`` should already leave the shared GPUs out, since a GPU is never both exclusive and
    shared."""
    return ";".join([f"gpus:{whole_gpus}", *(f"{name}:{n}" for name, n in units_offered(shared).items())])


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


@dataclass(frozen=True)
class ShareAsk:
    """What a container asks of shares: ``count`` shares of one GPU (0: none), and ``size``, the
    ways that GPU must be cut (``gpu-share-<size>``: then ``count`` is 1), 0 for the pooled
    ``gpu_shares`` (any shared GPU with ``count`` free)."""

    count: int = 0
    size: int = 0


def share_request(resources: Iterable[Resource]) -> int:
    """The shares a container asks for (``share_ask``'s count): 0 when it names none."""
    return share_ask(resources).count


def share_ask(resources: Iterable[Resource]) -> ShareAsk:
    """Shares asked by a container's resources. ``gpu-share-<N>``: exactly one unit of one size
    (two units may lie on two GPUs, so more than one, or two sizes, is InvalidShareUnit telling the
    framework what to ask instead). ``gpu_shares`` (pooled): a count, several entries (one per role)
    added, each a valid count and so the sum. The two kinds together are refused."""
    pooled: list[int] = []
    units: dict[int, float] = {}
    for res in resources:
        if res.name == RESOURCE:
            if res.type != "SCALAR":
                raise InvalidShareCount(f"The '{RESOURCE}' resource must be a scalar")
            pooled.append(checked_share_count(res.value))
        elif res.name.startswith(UNIT_PREFIX):
            size = unit_size(res.name)
            if size is None or not 2 <= size <= MAX_REQUEST:
                what = f"one Nth of a GPU, N from 2 to {MAX_REQUEST}"
                raise InvalidShareUnit(reason=f"'{res.name[:40]}' is not a share unit (gpu-share-N: {what})")
            if res.type != "SCALAR":
                raise InvalidShareUnit(reason=f"the '{res.name}' resource must be a scalar")
            value = res.value
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise InvalidShareUnit(reason=f"the '{res.name}' resource must be 1, got {str(value)[:40]}")
            units[size] = units.get(size, 0) + value
    units = {size: n for size, n in units.items() if n}
    if pooled and units:
        raise InvalidShareUnit(
            reason=f"asks for both {RESOURCE} and {', '.join(unit_name(s) for s in sorted(units))}; ask one unit only"
        )
    if pooled:
        return ShareAsk(checked_share_count(sum(pooled)))
    if not units:
        return ShareAsk()
    if len(units) > 1:
        names = " and ".join(unit_name(s) for s in sorted(units))
        raise InvalidShareUnit(
            reason=f"asks for {names}: a request takes exactly one unit of one size, on one GPU;"
            " ask for the one unit the task needs"
        )
    ((size, n),) = units.items()
    if n != 1:
        raise InvalidShareUnit(reason=_one_unit(size, n))
    return ShareAsk(1, size)


def _one_unit(size: int, n: float) -> str:
    """Why ``n`` units of ``gpu-share-<size>`` are refused, and what to ask instead."""
    head = f"asks for {n:g} {unit_name(size)}; a request takes exactly 1 unit (two units may lie on two GPUs)"
    if n != math.floor(n) or n < 1:
        return f"{head}: ask for {unit_name(size)}:1"
    whole = int(n)
    if whole < size and size % whole == 0:
        bigger = unit_name(size // whole)
        where = f"offered where a GPU is cut {size // whole} ways"
        return f"{head}: for {whole}/{size} of one GPU ask for {bigger}:1 ({where})"
    return f"{head}: for {whole}/{size} of a GPU ask for a larger unit (gpu-share-N:1 is 1/N of a GPU) or whole 'gpus'"


def place(
    count: object,
    shared: Mapping[int, SharedGpu],
    held: Mapping[int, int],
    blocked: Iterable[int] = (),
    near: Iterable[int] | None = None,
    *,
    size: int = 0,
    placement: str = SPREAD,
    uid: int | None = None,
    users: Mapping[int, frozenset[int | None]] | None = None,
) -> Placement:
    """Where ``count`` shares go: one shared GPU with that many free, not ``blocked`` (unhealthy,
    draining), and cut ``size`` ways when ``size`` is given (a ``gpu-share-<size>`` unit; 0: any).
    Under MPS (docs/sharing.md, "Limits" and "Users"): a count other than 1 never goes to an mps GPU
    (one limit per server: every sharer holds one share; MpsShareCount when only mps GPUs could
    hold it), and with ``users`` (the uids of each GPU's sharers, None for one not known) a sharer
    running as ``uid`` goes to a single-user mps GPU only when it is empty or all its sharers run as
    ``uid`` (the refusal names the GPUs that were passed over for that).
    Among those, by ``placement``: ``spread``, the GPU holding the fewest shares; ``pack``, the one
    left with the fewest free after this request (best fit: a started GPU is filled before an empty
    one is opened, so empty GPUs stay whole); then one whose NUMA node is in ``near`` (the task's
    CPUs' nodes, where affinity is on), then the lowest minor. Deterministic. Keyword-only arguments
    may be added (other predicates on a GPU) without touching the callers.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"share placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    n = checked_share_count(count)
    if size:
        shared = {m: g for m, g in shared.items() if g.shares == size}
        if not shared:
            raise SharesExhausted(
                f"Requested 1 {unit_name(size)} but no GPU here is cut {size} ways", requested=n, free="none"
            )
    most = max((g.shares for g in shared.values()), default=0)
    if n > most:
        raise ShareRequestTooLarge(requested=n, most=most)
    if n != 1:
        single = {m: g for m, g in shared.items() if g.mode is not ShareMode.MPS}
        if not any(g.shares >= n for g in single.values()):
            raise MpsShareCount(requested=n)
        shared = single
    out = set(blocked)
    nodes = None if near is None else frozenset(near)
    others = {m: other for m, g in shared.items() if (other := _other_users(g, uid, users))}
    room = [
        g
        for g in shared.values()
        if g.minor not in out and g.minor not in others and g.shares - held.get(g.minor, 0) >= n
    ]
    if not room:
        free = {g.minor: g.shares - held.get(g.minor, 0) for g in sorted(shared.values())}
        detail = ", ".join(
            f"GPU {m}: {f}" + (" (not usable)" if m in out else "") + (f" ({others[m]})" if m in others else "")
            for m, f in free.items()
        )
        who = (f" for uid {uid}" if uid is not None else " for a user not known here") if others else ""
        if size:
            raise SharesExhausted(
                f"Requested 1 {unit_name(size)} but no GPU cut {size} ways has one free{who} ({detail})"
            )
        raise SharesExhausted(requested=n, free=detail + who)  # not empty: with nothing shared, n > most above

    def key(g: SharedGpu) -> tuple[int, bool, int]:
        near_it = nodes is None or g.numa in nodes
        first = held.get(g.minor, 0) if placement == SPREAD else g.shares - held.get(g.minor, 0) - n
        return (first, not near_it, g.minor)

    best = min(room, key=key)
    return Placement(best.minor, n, best.mode, best.shares)


def _other_users(gpu: SharedGpu, uid: int | None, users: Mapping[int, frozenset[int | None]] | None) -> str:
    """Why a sharer running as ``uid`` (None: a user this host does not know) may not join
    single-user MPS GPU ``gpu``, or "" when it may: an empty one, or one whose sharers all run as
    ``uid``. Without ``users`` there is no such rule."""
    if users is None or not gpu.one_user:
        return ""
    if uid is None:
        return "a single-user MPS GPU takes no sharer whose user this host does not know"
    on = users.get(gpu.minor, frozenset())
    if not on or on == {uid}:
        return ""
    others = ", ".join(sorted(f"uid {u}" if u is not None else "an unknown uid" for u in on - {uid}))
    return f"its sharers run as {others}; an MPS server serves one user at a time"


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

    def __init__(self, shared: Mapping[int, SharedGpu], placement: str = SPREAD) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"share placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
        self.shared: dict[int, SharedGpu] = dict(shared)
        self.placement = placement
        self._holders: dict[str, tuple[int, int]] = {}
        self._users: dict[str, int | None] = {}  # holder -> the uid its tasks run as (None: not known)

    def users(self) -> dict[int, frozenset[int | None]]:
        """The uids of each shared GPU's sharers (only GPUs with sharers)."""
        out: dict[int, set[int | None]] = {}
        for holder, (minor, _n) in self._holders.items():
            out.setdefault(minor, set()).add(self._users.get(holder))
        return {m: frozenset(u) for m, u in out.items()}

    def user(self, holder: str) -> int | None:
        return self._users.get(holder)

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
        self,
        holder: str,
        count: object,
        blocked: Iterable[int] = (),
        near: Iterable[int] | None = None,
        *,
        size: int = 0,
        uid: int | None = None,
        by_user: bool = False,
    ) -> Placement:
        """Choose and book for a sharer running as ``uid``, keeping single-user MPS GPUs to one uid
        when ``by_user`` (``place``'s ``users``); a holder books once (a second request is refused,
        nothing changes)."""
        if holder in self._holders:
            raise InvalidArgument(f"container {holder} already holds {RESOURCE}")
        choice = place(
            count,
            self.shared,
            self.held(),
            blocked,
            near,
            size=size,
            placement=self.placement,
            uid=uid,
            users=self.users() if by_user else None,
        )
        self._holders[holder] = (choice.minor, choice.shares)
        self._users[holder] = uid
        return choice

    def restore(
        self, holder: str, minor: int, shares: int, mode: ShareMode | None = None, uid: int | None = None
    ) -> None:
        """Book a recorded holding at recovery. A GPU no longer shared, shared in another mode than
        the one recorded (``mode``; None: not checked, an update's shrink), more shares than the GPU
        has, or a holder booked twice is refused (FailedPrecondition): the records and the flags disagree."""
        gpu = self.shared.get(minor)
        if gpu is None:
            raise FailedPrecondition(
                f"container {holder} holds {shares} {RESOURCE} of GPU {minor}, which is not shared"
            )
        if mode is not None and ShareMode(mode) != gpu.mode:
            # Its sharers run under the recorded mode (under mps: their MPS client, the GPU's
            # EXCLUSIVE_PROCESS compute mode); the other mode would be set up half (issue 41 item 6).
            raise FailedPrecondition(
                f"container {holder} holds {shares} {RESOURCE} of GPU {minor} in {ShareMode(mode)} mode,"
                f" which the flags now share in {gpu.mode} mode (a GPU with sharers keeps its mode)"
            )
        if holder in self._holders:
            raise FailedPrecondition(f"container {holder} is booked twice for {RESOURCE}")
        n = checked_share_count(shares)
        if self.held()[minor] + n > gpu.shares:
            raise FailedPrecondition(
                f"container {holder} holds {n} {RESOURCE} of GPU {minor}, more than are left of its {gpu.shares}"
            )
        self._holders[holder] = (minor, n)
        self._users[holder] = uid

    def release(self, holder: str) -> tuple[int, int]:
        """Free a holder's shares; (minor, shares) that were freed. Not held: SharesNotHeld."""
        try:
            held = self._holders.pop(holder)
        except KeyError:
            raise SharesNotHeld(holder=holder) from None
        self._users.pop(holder, None)
        return held


# ---- changes of role -----------------------------------------------------------------------------


def role_problems(
    old: Mapping[int, SharedGpu],
    new: Mapping[int, SharedGpu],
    whole_held: Iterable[int],
    shares_held: Mapping[int, int],
) -> list[str]:
    """What forbids going from sharing ``old`` to ``new`` now: a GPU held whole that would become
    shared, a shared GPU with sharers that would become whole, change mode, or be cut another number of
    ways (its sharers' units, and their MPS limits, are slices of the old cut). Empty when the change is
    safe (a GPU nobody holds may change freely)."""
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
            elif after.mode != before.mode or after.multiuser != before.multiuser:
                # Its sharers run under the daemon of the old mode (an MPS daemon is started multi-user
                # or not; its servers and their users follow from that).
                problems.append(
                    f"GPU {minor} has {held} {RESOURCE} held and cannot switch from {_mode_name(before)} to"
                    f" {_mode_name(after)}"
                )
            elif after.shares != before.shares:
                # Its sharers hold units of one before.shares-th (gpu-share-<before.shares>) and, under MPS,
                # limits of that slice: a new cut would make its units and its sharers' slices disagree.
                problems.append(
                    f"GPU {minor} has {held} {RESOURCE} held and cannot be re-cut from {before.shares} to"
                    f" {after.shares} ways (its sharers hold {unit_name(before.shares)} units)"
                )
    return problems


def _mode_name(gpu: SharedGpu) -> str:
    return f"{gpu.mode} ({MULTIUSER})" if gpu.multiuser else str(gpu.mode)


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
