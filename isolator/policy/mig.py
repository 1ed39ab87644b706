"""MIG devices as allocatable units: resource names, requests, placement and what a holder gets.

Pure: MIG devices (as the inventory reports them) and what is held in, a decision out. Nothing here
reads NVML or changes a GPU's MIG layout; the sidecar hands out the MIG devices an operator made.

Resource names (docs/mig.md): ``mig-<profile>`` with ``+`` turned into ``.``, as k8s-device-plugin's
"mixed" strategy names them (``mig-1g.5gb``, ``mig-3g.20gb``, ``mig-1g.5gb.me``). Mesos accepts any
non-empty name (``Resources::validate``), and its text form of ``--resources`` splits entries on
``;``, name from value on ``:`` and takes the role from ``(...)`` (``Resources::fromSimpleString``,
src/common/resources.cpp); our names use only ``[a-z0-9.-]``, so they survive both forms unchanged.
Only profiles whose compute instance spans its whole GPU instance are offered (as k8s's mixed
strategy): a ``1c.3g.20gb`` compute instance shares its GPU instance's memory with its siblings.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from isolator.errors import InvalidArgument, ResourceExhausted
from isolator.model import MigDevice, MigDeviceInfo, Resource, checked_gpu_count

PREFIX = "mig-"
# A MIG-capable GPU's memory is 8 slices; GPU-instance placements are counted in them.
MEMORY_SLICES = 8
_PROFILE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb((?:\+[a-z0-9]+)*)$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


class InvalidMigRequest(InvalidArgument):
    msg_fmt = "invalid MIG request: {reason}"


class MigExhausted(ResourceExhausted):
    msg_fmt = "Requested {requested} {name} but only {available} available{detail}"


def resource_name(profile: str) -> str | None:
    """``1g.5gb`` -> ``mig-1g.5gb``; None for a profile that is not offered (see the module doc)."""
    m = _PROFILE.fullmatch(profile)
    if m is None or (m.group(1) is not None and m.group(1) != m.group(2)):
        return None
    name = PREFIX + profile.replace("+", ".")
    return name if valid_resource_name(name) else None


def valid_resource_name(name: str) -> bool:
    """A name Mesos takes in both forms of ``--resources`` (no ``;``, ``:``, ``(``, ``)``, spaces)."""
    return bool(_NAME.fullmatch(name)) and len(name) <= 64


def is_mig_resource(name: str) -> bool:
    return name.startswith(PREFIX)


def offered(device: MigDevice) -> bool:
    """Whether a MIG device is a unit we hand out: a named profile that spans its GPU instance,
    with both nvidia-caps minors known (without them a holder could not use it: fail closed)."""
    if resource_name(device.profile) is None or len(device.caps_minors) != 2 or device.parent_minor < 0:
        return False
    return not (device.gpu_slices and device.compute_slices and device.gpu_slices != device.compute_slices)


def requests(resources: Iterable[Resource]) -> dict[str, int]:
    """The ``mig-*`` scalars of a container's resources, summed per name (zero counts dropped)."""
    out: dict[str, int] = {}
    for res in resources:
        if not is_mig_resource(res.name):
            continue
        if res.type != "SCALAR":
            raise InvalidMigRequest(reason=f"the '{res.name}' resource must be a scalar")
        try:
            count = checked_gpu_count(res.value)
        except InvalidArgument:
            raise InvalidMigRequest(reason=f"the '{res.name}' resource must be an unsigned integer") from None
        if count:
            out[res.name] = out.get(res.name, 0) + count
    return out


def resources_offered(devices: Iterable[MigDevice]) -> dict[str, int]:
    """Resource name -> number of MIG devices of that profile, sorted by name."""
    counts: dict[str, int] = {}
    for dev in devices:
        if offered(dev):
            name = resource_name(dev.profile)
            assert name is not None
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def agent_resources(whole_gpus: int, devices: Iterable[MigDevice]) -> str:
    """The agent's ``--resources`` entries for GPUs: ``gpus:N;mig-1g.5gb:7;...``.

    ``whole_gpus`` should count the GPUs that are not in MIG mode: a MIG-enabled GPU is handed out
    whole only while none of its MIG devices is held, so advertising it twice invites refusals.
    """
    parts = [f"gpus:{whole_gpus}"]
    parts += [f"{name}:{count}" for name, count in resources_offered(devices).items()]
    return ";".join(parts)


def visible_devices(devices: Iterable[MigDevice]) -> str:
    """``NVIDIA_VISIBLE_DEVICES`` for MIG devices: their UUIDs, in (parent, GI, CI) order."""
    return ",".join(d.uuid for d in sorted(devices, key=_order))


def parents(devices: Iterable[MigDevice]) -> frozenset[int]:
    """The parent GPUs' minors: the ``/dev/nvidia<minor>`` nodes the driver requires for MIG access."""
    return frozenset(d.parent_minor for d in devices)


def device_views(devices: Iterable[MigDevice], holders: Mapping[str, str]) -> tuple[MigDeviceInfo, ...]:
    """The admin ``gpus`` view of MIG devices (holder: ``parent.child`` or "")."""
    return tuple(
        MigDeviceInfo(
            uuid=d.uuid,
            profile=d.profile,
            resource=(resource_name(d.profile) or "") if offered(d) else "",
            gpu_instance_id=d.gpu_instance_id,
            compute_instance_id=d.compute_instance_id,
            memory_total_bytes=d.memory_total,
            caps_minors=tuple(d.caps_minors),
            slot=max(d.slot, 0),
            holder=holders.get(d.uuid, ""),
        )
        for d in sorted(devices, key=_order)
    )


@dataclass(frozen=True)
class Choice:
    devices: tuple[MigDevice, ...]
    # Per resource name: (untouched MIG GPUs, sum of largest free placement runs) after the choice.
    scores: tuple[tuple[str, tuple[int, int]], ...] = ()


def choose(
    request: Mapping[str, int],
    devices: Sequence[MigDevice],
    held: Collection[str],
    blocked: Collection[int] = (),
) -> Choice:
    """Pick MIG devices for ``request`` (resource name -> count).

    ``devices`` are every MIG device of the managed GPUs, ``held`` the UUIDs already handed out and
    ``blocked`` the parent minors that cannot serve MIG requests (held whole, unhealthy, degraded).
    Profiles are served largest first; for each, among the free devices of that profile:

    1. keep the most MIG GPUs untouched (no device held), so whole GPUs stay free;
    2. then keep the largest contiguous runs of free memory slices per GPU (held GPU instances'
       placements are taken), summed over GPUs, so large profiles stay placeable;
    3. then the lowest (parent index, GPU instance, compute instance).

    Deterministic: no clock, no load. Exact (a knapsack over GPUs of per-GPU exhaustive choices).
    """
    by_name: dict[str, list[MigDevice]] = {}
    for dev in devices:
        if offered(dev):
            name = resource_name(dev.profile)
            assert name is not None
            by_name.setdefault(name, []).append(dev)
    for name, count in request.items():
        if not is_mig_resource(name) or name not in by_name:
            known = ", ".join(sorted(by_name)) or "none"
            raise InvalidMigRequest(reason=f"no MIG device of this host is offered as '{name}' (offered: {known})")
        if count < 0:
            raise InvalidMigRequest(reason=f"negative count for '{name}'")
    taken = set(held)
    chosen: list[MigDevice] = []
    scores: list[tuple[str, tuple[int, int]]] = []

    def size(name: str) -> tuple[int, int, str]:
        d = by_name[name][0]
        return (-(d.gpu_slices or 0), -(d.memory_total or 0), name)

    for name in sorted((n for n, c in request.items() if c > 0), key=size):
        count = request[name]
        free = [d for d in by_name[name] if d.uuid not in taken and d.parent_minor not in blocked]
        if len(free) < count:
            busy = sum(1 for d in by_name[name] if d.uuid in taken)
            down = sum(1 for d in by_name[name] if d.uuid not in taken and d.parent_minor in blocked)
            detail = f" ({busy} held, {down} on GPUs held whole or unhealthy)" if busy or down else ""
            raise MigExhausted(requested=count, name=name, available=len(free), detail=detail)
        picked, score = _pick(free, count, devices, taken)
        chosen.extend(picked)
        taken.update(d.uuid for d in picked)
        scores.append((name, score))
    return Choice(devices=tuple(sorted(chosen, key=_order)), scores=tuple(scores))


def _order(d: MigDevice) -> tuple[int, int, int, str]:
    return (d.parent_index, d.gpu_instance_id, d.compute_instance_id, d.uuid)


def _largest_free_run(devices: Iterable[MigDevice], held: Collection[str]) -> int:
    """The longest run of memory slices that no held GPU instance occupies."""
    used = [False] * MEMORY_SLICES
    for d in devices:
        if d.uuid in held and d.placement is not None:
            start, length = d.placement
            for s in range(max(start, 0), min(start + length, MEMORY_SLICES)):
                used[s] = True
    best = run = 0
    for u in used:
        run = 0 if u else run + 1
        best = max(best, run)
    return best


def _pick(
    free: list[MigDevice], count: int, everything: Sequence[MigDevice], held: Collection[str]
) -> tuple[tuple[MigDevice, ...], tuple[int, int]]:
    on_parent: dict[int, list[MigDevice]] = {}
    for d in everything:
        on_parent.setdefault(d.parent_minor, []).append(d)
    cands: dict[int, list[MigDevice]] = {}
    for d in sorted(free, key=_order):
        cands.setdefault(d.parent_minor, []).append(d)
    # Per GPU: the best way to take c devices of it, for every c.
    Key = tuple[tuple[int, int, int, str], ...]
    options: list[list[tuple[tuple[int, int], Key, tuple[MigDevice, ...]] | None]] = []
    for minor in sorted(cands, key=lambda m: (cands[m][0].parent_index, m)):
        mine = cands[minor]
        row: list[tuple[tuple[int, int], Key, tuple[MigDevice, ...]] | None] = []
        for c in range(min(count, len(mine)) + 1):
            best: tuple[tuple[int, int], Key, tuple[MigDevice, ...]] | None = None
            for combo in itertools.combinations(mine, c):
                after = set(held) | {d.uuid for d in combo}
                untouched = int(not any(d.uuid in after for d in on_parent[minor]))
                score = (untouched, _largest_free_run(on_parent[minor], after))
                key = tuple(_order(d) for d in combo)
                if best is None or score > best[0] or (score == best[0] and key < best[1]):
                    best = (score, key, combo)
            row.append(best)
        options.append(row)
    # Knapsack over GPUs (in index order): dp[j] = best total score taking j devices so far.
    dp: dict[int, tuple[tuple[int, int], Key, tuple[MigDevice, ...]]] = {0: ((0, 0), (), ())}
    for row in options:
        nxt: dict[int, tuple[tuple[int, int], Key, tuple[MigDevice, ...]]] = {}
        for j, (score, key, picked) in dp.items():
            for c, opt in enumerate(row):
                if opt is None or j + c > count:
                    continue
                total = (score[0] + opt[0][0], score[1] + opt[0][1])
                cand = (total, key + opt[1], picked + opt[2])
                cur = nxt.get(j + c)
                if cur is None or cand[0] > cur[0] or (cand[0] == cur[0] and cand[1] < cur[1]):
                    nxt[j + c] = cand
        dp = nxt
    score, _key, picked = dp[count]
    return picked, score
