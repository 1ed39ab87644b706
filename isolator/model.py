"""Plain data shared by every layer: container IDs, GPUs, resources and container configs.

No I/O here. Validation that protects paths (container IDs become cgroup and state names) lives
with the type, so nothing unvalidated can be constructed through ``ContainerId.parse``.
"""

from __future__ import annotations

import math
import posixpath
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

from isolator.devicerule import DeviceRule
from isolator.errors import InvalidArgument, InvalidGpuCount

# Mesos's validateID (src/common/validation.cpp): not empty, at most NAME_MAX bytes, not '.' or
# '..', no '/', '\\' or control characters. We keep exactly that grammar so every ID Mesos
# accepts is accepted here, and nothing that could escape a cgroup or state path is.
NAME_MAX = 255
MAX_NESTING = 32
# Isolate's caller: a remote caller whose pid could not be told (no pid is 0). None means an
# in-process call, which has no peer to check (docs/security.md, "Who can call").
UNKNOWN_CALLER = 0


class Mode(StrEnum):
    """Who creates each container's cgroup: the agent (``mesos``) or the sidecar (``standalone``)."""

    MESOS = "mesos"
    STANDALONE = "standalone"


class CgroupVersion(StrEnum):
    """The devices controller's generation: a whitelist (v1) or an eBPF device program (v2)."""

    V1 = "v1"
    V2 = "v2"

    @property
    def number(self) -> int:
        """1 or 2, as a container record stores it."""
        return 1 if self is CgroupVersion.V1 else 2

    @classmethod
    def of_number(cls, number: int) -> CgroupVersion:
        if number not in (1, 2):
            raise InvalidArgument(f"cgroup version must be 1 or 2, not {number!r}")
        return cls.V1 if number == 1 else cls.V2


class ShareMode(StrEnum):
    """How a shared GPU's sharers run on it (docs/sharing.md)."""

    TIME_SLICE = "time-slice"
    MPS = "mps"


class RecordState(StrEnum):
    """Where a container record stands: prepared, isolated (a pid is in its cgroup), or an orphan."""

    PREPARED = "prepared"
    ISOLATED = "isolated"
    ORPHAN = "orphan"


@dataclass(frozen=True, order=True)
class ContainerId:
    value: str
    parent: ContainerId | None = None

    @classmethod
    def from_chain(cls, values: Iterable[str]) -> ContainerId:
        """The ID whose chain (top-level first) is ``values``, each validated: the one place that
        turns a parent chain (proto, state key, CLI ``a.b`` form, volume user name) into an ID."""
        node: ContainerId | None = None
        for value in values:
            node = cls.parse(value, node)
        if node is None:
            from isolator.errors import InvalidContainerId

            raise InvalidContainerId(value="", reason="must not be empty")
        return node

    @classmethod
    def parse(cls, value: str, parent: ContainerId | None = None) -> ContainerId:
        from isolator.errors import InvalidContainerId

        reason = _id_problem(value)
        if reason:
            raise InvalidContainerId(value=value[:80], reason=reason)
        depth = 0 if parent is None else len(parent.chain())
        if depth >= MAX_NESTING:
            raise InvalidContainerId(value=value[:80], reason=f"nested deeper than {MAX_NESTING} levels")
        return cls(value, parent)

    def chain(self) -> tuple[str, ...]:
        """The IDs from the top-level container down to this one."""
        out: list[str] = []
        node: ContainerId | None = self
        while node is not None:
            out.append(node.value)
            node = node.parent
        return tuple(reversed(out))

    @property
    def root(self) -> ContainerId:
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    @property
    def nested(self) -> bool:
        return self.parent is not None

    def __str__(self) -> str:
        # Mesos's stringify(ContainerID): the parent chain joined with '.'. Two containers can share
        # it (the top-level 'p.c' and 'c' nested in 'p'): never use it as a key, use ``key()``.
        return ".".join(self.chain())

    def key(self) -> str:
        """The chain as a string no other container has: each ID with '%' and '.' escaped, joined
        with '.'. For IDs without either it is Mesos's ``stringify``. ``from_key`` reverses it."""
        return ".".join(v.replace("%", "%25").replace(".", "%2E") for v in self.chain())

    @classmethod
    def from_key(cls, key: str) -> ContainerId:
        return cls.from_chain(_unescape(part) for part in key.split("."))


def key_root(key: str) -> str:
    """The top-level container's part of a ``ContainerId.key()`` (escaped IDs hold no '.')."""
    return key.split(".", 1)[0]


def _unescape(part: str) -> str:
    return part.replace("%2E", ".").replace("%2e", ".").replace("%25", "%")


def _id_problem(value: str) -> str | None:
    if not isinstance(value, str):
        return "must be a string"
    if not value:
        return "must not be empty"
    if len(value.encode("utf-8", "surrogatepass")) > NAME_MAX:
        return f"longer than {NAME_MAX} bytes"
    if value in (".", ".."):
        return "'.' and '..' are reserved"
    for ch in value:
        if ch in "/\\":
            return f"{ch!r} is not allowed"
        if ord(ch) < 0x20 or ord(ch) == 0x7F or 0xD800 <= ord(ch) <= 0xDFFF:
            return "control characters are not allowed"
    return None


def check_rootfs(rootfs: object) -> str:
    """The rootfs as the agent must send it: an absolute, normalized host path (not ``/``)."""
    if not isinstance(rootfs, str) or not rootfs:
        raise InvalidArgument(f"the container's rootfs {rootfs!r} must be a non-empty path")
    if "\x00" in rootfs:
        raise InvalidArgument("the container's rootfs contains a NUL byte")
    if not rootfs.startswith("/"):
        raise InvalidArgument(f"the container's rootfs '{rootfs}' is not an absolute path")
    normal = posixpath.normpath(rootfs)
    if normal != rootfs.rstrip("/") or ".." in rootfs.split("/"):
        raise InvalidArgument(f"the container's rootfs '{rootfs}' is not a normalized path ('{normal}')")
    if normal == "/":
        raise InvalidArgument("the container's rootfs must not be the host's '/'")
    return normal


@dataclass(frozen=True)
class Gpu:
    """One physical GPU as NVML reports it (``nvidia-smi --query-gpu=index,uuid,...``)."""

    index: int
    minor: int
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    memory_total: int = 0
    numa_node: int | None = None
    cpu_affinity: str = ""


class PcieLevel(IntEnum):
    """NVML's nvmlGpuTopologyLevel_t; ``nvidia-smi topo -m`` prints the names on the right."""

    INTERNAL = 0  # same board (multi-GPU boards)
    SINGLE = 10  # PIX: at most one PCIe bridge
    MULTIPLE = 20  # PXB: several PCIe bridges, no host bridge
    HOSTBRIDGE = 30  # PHB: through a PCIe host bridge
    NODE = 40  # NODE: host bridges within one NUMA node
    SYSTEM = 50  # SYS: across NUMA nodes (SMP interconnect)

    @property
    def smi(self) -> str:
        return {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}[int(self)]


@dataclass(frozen=True)
class Link:
    """How two GPUs reach each other: the PCIe path and the NVLink lanes between them.

    ``nvlink_lanes`` counts lanes whose remote end is the peer GPU or, on NVSwitch systems, a
    switch that both GPUs reach (as ``nvidia-smi topo -m`` shows NV#).
    """

    pcie: PcieLevel = PcieLevel.SYSTEM
    nvlink_lanes: int = 0

    @property
    def smi(self) -> str:
        return f"NV{self.nvlink_lanes}" if self.nvlink_lanes else self.pcie.smi


@dataclass(frozen=True)
class Topology:
    """The GPUs of a host and the link between every pair, keyed by ``(index_a, index_b)``, a < b."""

    gpus: tuple[Gpu, ...]
    links: Mapping[tuple[int, int], Link] = field(default_factory=dict)

    def link(self, a: int, b: int) -> Link:
        """The link between NVML indices ``a`` and ``b``; a missing pair is the slowest link."""
        if a == b:
            raise ValueError("a GPU has no link to itself")
        return self.links.get((min(a, b), max(a, b)), Link())


@dataclass(frozen=True)
class MigDevice:
    """A MIG device (GPU instance + compute instance) on a parent GPU.

    ``caps_minors`` are the ``/dev/nvidia-caps/nvidia-cap<minor>`` nodes a container needs to use it
    (the GI and CI access files under /proc/driver/nvidia/capabilities).
    """

    parent_uuid: str
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    caps_minors: tuple[int, ...] = ()
    memory_total: int = 0
    profile: str = ""
    parent_index: int = -1  # the parent GPU's NVML index
    parent_minor: int = -1  # the parent GPU's /dev/nvidia<minor>
    gpu_slices: int = 0  # compute slices of its GPU instance (nvmlDeviceGetAttributes), 0: unknown
    compute_slices: int = 0  # compute slices of its compute instance, 0: unknown
    placement: tuple[int, int] | None = None  # its GPU instance's (start, size) in memory slices
    slot: int = -1  # its index among the parent's MIG devices (nvmlDeviceGetMigDeviceHandleByIndex)


@dataclass(frozen=True)
class Resource:
    """A Mesos resource; only scalars matter to the GPU isolator."""

    name: str
    value: float
    type: str = "SCALAR"
    role: str = "*"


# Mesos stores scalars as fixed-point with three decimals in an int64; anything beyond 2**31 GPUs is a
# typo or an attack, not a host, and is refused with the same message.
MAX_GPU_COUNT = 2**31


def gpu_count(resources: tuple[Resource, ...] | list[Resource]) -> int:
    """The total of the ``gpus`` scalars, refused exactly as Mesos refuses it.

    Mesos's message for fractional GPUs is "The 'gpus' resource must be an unsigned integer".
    """
    total = 0
    for res in resources:
        if res.name != "gpus":
            continue
        if res.type != "SCALAR":
            raise InvalidGpuCount("The 'gpus' resource must be a scalar", value=res.value)
        total += checked_gpu_count(res.value)
    if total > MAX_GPU_COUNT:
        raise InvalidGpuCount(value=total)
    return total


def checked_gpu_count(value: object) -> int:
    """One GPU count as an int, or InvalidGpuCount with Mesos's message.

    Refused: bools, non-numbers, NaN and infinities, negatives, fractions and counts above
    ``MAX_GPU_COUNT``. Integral floats (``2.0``, how Mesos scalars arrive) are accepted.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidGpuCount(value=repr(value)[:40])
    if isinstance(value, float) and (not math.isfinite(value) or value != math.floor(value)):
        raise InvalidGpuCount(value=repr(value))
    if value < 0 or value > MAX_GPU_COUNT:
        raise InvalidGpuCount(value=repr(value)[:40])
    return int(value)


@dataclass(frozen=True)
class ContainerConfig:
    """The subset of Mesos's ContainerConfig the isolator reads."""

    resources: tuple[Resource, ...] = ()
    container_class: str = "DEFAULT"
    directory: str = ""
    user: str = ""
    rootfs: str = ""
    image_env: tuple[str, ...] = ()
    image_labels: tuple[tuple[str, str], ...] = ()
    # ContainerConfig.task_info is set: a command task, whose isolator environment goes in
    # ContainerLaunchInfo.task_environment (the command executor applies it over the image's).
    command_task: bool = False
    # LinuxInfo.share_cgroups (Mesos 1.10+, default true); false: a nested container in cgroups of its own.
    share_cgroups: bool = True

    @property
    def has_image(self) -> bool:
        return bool(self.rootfs)


@dataclass(frozen=True)
class Mount:
    target: str
    source: str = ""
    type: str = ""
    flags: int = 0
    options: str = ""


@dataclass(frozen=True)
class LaunchInfo:
    """What prepare returns; the server converts it to ContainerLaunchInfo."""

    environment: tuple[tuple[str, str], ...] = ()
    mounts: tuple[Mount, ...] = ()
    task_environment: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.environment or self.mounts or self.task_environment)


@dataclass(frozen=True)
class ContainerState:
    """One checkpointed container handed to Recover."""

    container_id: ContainerId
    pid: int = 0
    directory: str = ""


@dataclass(frozen=True)
class Share:
    """``count`` shares of shared GPU ``gpu``, shared in ``mode`` (docs/sharing.md). The store checks
    what it records (a minor, a count of at least 1); this type only carries them."""

    gpu: int
    count: int
    mode: ShareMode
    # The Unix uid the sharer's tasks run as (docs/sharing.md, "Users"): booked with the share, since
    # legacy MPS serves one uid per GPU at a time. None: not known (a record from before schema 10).
    uid: int | None = None
    # How many ways the GPU was cut when the share was booked (``--shared-gpus``' N): a share's size is
    # 1/cut, which its limits and its offer unit (``gpu-share-<cut>``) were made from, so a GPU with
    # sharers keeps its cut. None: not known (a record from before schema 11).
    cut: int | None = None

    def resized(self, count: int) -> Share | None:
        """The same GPU's shares at ``count``; None at 0 (nothing held)."""
        return Share(self.gpu, count, self.mode, self.uid, self.cut) if count else None


@dataclass(frozen=True)
class Holding:
    """What a container holds, one value the books take and give back whole: whole GPUs (device
    minors) and MIG units ((MIG UUID, parent GPU minor)), or shares of one GPU, or nothing.

    A share is never held beside whole GPUs or MIG units: under MPS its CUDA would reach every GPU
    through the shared GPU's daemon, and a whole GPU beside a share gains nothing (docs/sharing.md).
    Whole GPUs and MIG units may be held together (docs/mig.md). A shared GPU has several holders, a
    whole one one: ``gpus`` never includes it.
    """

    gpus: frozenset[int] = frozenset()
    mig: frozenset[tuple[str, int]] = frozenset()
    share: Share | None = None

    def __post_init__(self) -> None:
        if self.share is not None and (self.gpus or self.mig):
            raise InvalidArgument("a container holds shares of one GPU, or whole GPUs and MIG devices, not both")

    @classmethod
    def whole(cls, minors: Iterable[int]) -> Holding:
        return cls(gpus=frozenset(minors))

    @property
    def empty(self) -> bool:
        return not (self.gpus or self.mig or self.share)

    @property
    def shared(self) -> frozenset[int]:
        """The shared GPU it holds shares of, as a set (empty when none): granted like a whole GPU."""
        return frozenset((self.share.gpu,)) if self.share is not None else frozenset()

    @property
    def granted(self) -> frozenset[int]:
        """The GPUs whose /dev/nvidia<minor> the kernel grants it: whole ones and the shared one (a MIG
        unit's parent node comes with its units' rules, core/grant.py)."""
        return self.gpus | self.shared

    @property
    def mig_uuids(self) -> frozenset[str]:
        return frozenset(u for u, _ in self.mig)

    @property
    def mig_parents(self) -> frozenset[int]:
        return frozenset(m for _, m in self.mig)

    @property
    def touched(self) -> frozenset[int]:
        """Every GPU it holds any part of: whole, as the parent of a MIG unit, or shared."""
        return self.gpus | self.mig_parents | self.shared

    @property
    def shares(self) -> int:
        """How many shares it holds (0: none)."""
        return self.share.count if self.share is not None else 0

    def with_gpus(self, minors: Iterable[int]) -> Holding:
        """The same holding with exactly whole GPUs ``minors`` (an update's grow or shrink)."""
        return Holding(frozenset(minors), self.mig, self.share)

    def __or__(self, other: Holding) -> Holding:
        """Both holdings together (a grow added to what was held): shares of the same GPU add up;
        shares of two GPUs, or beside whole GPUs or MIG units, are InvalidArgument."""
        share = self.share or other.share
        if self.share is not None and other.share is not None:
            if (self.share.gpu, self.share.mode) != (other.share.gpu, other.share.mode):
                raise InvalidArgument("a container holds shares of one GPU, not of two")
            share = self.share.resized(self.share.count + other.share.count)
        return Holding(self.gpus | other.gpus, self.mig | other.mig, share)

    def __sub__(self, other: Holding) -> Holding:
        """What is left once ``other`` (a part of it) is let go: shares are counted down, none at 0."""
        share = self.share
        if share is not None and other.share is not None:
            share = share.resized(max(0, share.count - other.share.count))
        return Holding(self.gpus - other.gpus, self.mig - other.mig, share)


NOTHING = Holding()


@dataclass(frozen=True)
class ContainerRecord:
    """What the sidecar knows about one container: what it holds and how it set it up. Built in one
    place in the core (``Core.new_record``), and by the store from its rows."""

    container_id: ContainerId
    holding: Holding = NOTHING
    mode: Mode = Mode.MESOS
    cgroup: str = ""
    cgroup_version: int = 1
    volume_version: str = ""
    state: RecordState = RecordState.PREPARED
    created: float = field(default_factory=time.time)  # the core passes its clock's time
    # The devices cgroup rules granted, as data: the store parses them once where it reads a record.
    rules: tuple[DeviceRule, ...] = ()
    # --cpu-affinity enforce: the CPUs and memory nodes its cpuset is held to (cpulist syntax);
    # "" when none is enforced (docs/affinity.md). Recorded before the cpuset is written.
    cpus: str = ""
    mems: str = ""


@dataclass
class RecoverResult:
    recovered: int = 0
    released: int = 0


# ---- What the core answers (the server turns each into its proto message) -----------------------


@dataclass(frozen=True)
class Limitation:
    """Watch's answer when a container must be told something: ``gpus`` of its GPUs became unusable,
    and ``mig`` (resource name, count) of its MIG devices (their parent GPU did) and of its
    ``gpu_shares`` (their shared GPU did)."""

    gpus: int
    message: str
    reason: str = "REASON_CONTAINER_LIMITATION"
    mig: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class GpuUsage:
    uuid: str
    minor: int
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_percent: int


@dataclass(frozen=True)
class DeviceUse:
    """What one container's own processes use on one device it holds (NVML's per-process view,
    each process attributed to its container by its cgroup; policy/usage.py)."""

    uuid: str  # the GPU's, or the MIG device's
    minor: int  # the GPU's (a MIG device's parent's)
    kind: str  # "gpu" (held whole), "mig" (a MIG device) or "share" (gpu_shares of a shared GPU)
    memory_used: int  # bytes its processes use there
    memory_limit: int  # bytes it may use: the GPU's or MIG device's memory, a share's slice of the GPU
    sm_utilization: int | None = None  # percent of the device's SMs (its processes' sum); None: not reported
    pids: tuple[int, ...] = ()  # its processes NVML lists there, as the sidecar's /proc sees them
    error: str = ""  # why NVML could not say ("" when it could); the figures are then 0

    @property
    def over(self) -> bool:
        """A share over its slice: more memory than shares/total of the GPU's."""
        return self.kind == "share" and not self.error and self.memory_used > self.memory_limit


@dataclass(frozen=True)
class Usage:
    timestamp: float
    gpus: tuple[GpuUsage, ...] = ()  # each GPU it holds, device-wide (every process on it)
    devices: tuple[DeviceUse, ...] = ()  # what its own processes use on each device it holds


@dataclass(frozen=True)
class ContainerStatus:
    gpu_uuids: tuple[str, ...]
    state: str


@dataclass(frozen=True)
class GpuInfo:
    """One managed GPU as the admin view shows it (``gpu-isolator gpus``)."""

    index: int
    minor: int
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    memory_total_bytes: int = 0
    numa_node: int = -1
    cpu_affinity: str = ""
    healthy: bool = True
    last_xid: int = 0
    last_xid_time: float = 0.0
    health_reason: str = ""
    holder: str = ""
    mig_enabled: bool = False
    mig_devices: tuple[MigDeviceInfo, ...] = ()
    # The handover check (docs/handover.md): "" when the GPU may be handed out as far as it goes,
    # else "draining" or "unhealthy" (drained past --drain-timeout), with what was found and when.
    drain_state: str = ""
    drain_since: float = 0.0
    drain_pids: tuple[int, ...] = ()
    drain_reason: str = ""
    drain_memory_used_bytes: int = 0
    # What the last handover reset (or failed to reset), one line each.
    last_reset: tuple[str, ...] = ()
    # An operator's maintenance drain (``gpu-isolator drain GPU --reason TEXT``, docs/operations.md):
    # no new grants of the GPU, nor of a MIG device on it, until ``undrain``; its holders keep it.
    # Not the handover check above, which the sidecar sets and clears by itself.
    maintenance: bool = False
    maintenance_reason: str = ""
    maintenance_since: float = 0.0
    maintenance_by: str = ""
    # Shares (docs/sharing.md): 0 total when not shared; holders as (container, shares); the MPS
    # control daemon's state in mps mode ("" before its first sharer).
    shares_total: int = 0
    shares_held: int = 0
    share_mode: str = ""
    share_holders: tuple[tuple[str, int], ...] = ()
    mps_state: str = ""
    # How often its MPS control daemon was found dead and started again since the sidecar started
    # (the metric gpu_isolator_mps_daemon_restarts_total; not in the gRPC view).
    mps_restarts: int = 0


@dataclass(frozen=True)
class MigDeviceInfo:
    """One MIG device in the admin view (docs/mig.md)."""

    uuid: str
    profile: str
    resource: str  # mig-<profile>; "" when not offered
    gpu_instance_id: int
    compute_instance_id: int
    memory_total_bytes: int
    caps_minors: tuple[int, ...]
    slot: int
    holder: str = ""


@dataclass(frozen=True)
class GpuList:
    driver_version: str
    cuda_driver_version: str
    gpus: tuple[GpuInfo, ...] = ()


@dataclass(frozen=True)
class TopologyLink:
    a: int
    b: int
    kind: str
    nvlink_lanes: int


@dataclass(frozen=True)
class TopologyView:
    """Every pair once (a < b) in ``nvidia-smi topo -m`` notation."""

    indices: tuple[int, ...] = ()
    links: tuple[TopologyLink, ...] = ()
    numa_nodes: tuple[int, ...] = ()
    cpu_affinity: tuple[str, ...] = ()


@dataclass(frozen=True)
class ContainerInfo:
    """One container in the admin views; a nested one shows its top-level container's GPUs."""

    container_id: ContainerId
    gpu_uuids: tuple[str, ...] = ()
    gpu_minors: tuple[int, ...] = ()
    gpu_indices: tuple[int, ...] = ()
    cgroup: str = ""
    mode: str = ""
    volume_version: str = ""
    state: str = ""
    created: float = 0.0
    mig_uuids: tuple[str, ...] = ()
    # gpu_shares it holds (docs/sharing.md), of its shared GPU (not in gpu_minors); 0 when none.
    shares: int = 0
    shares_total: int = 0
    share_mode: str = ""
    share_gpu_minor: int = -1
    share_gpu_index: int = -1
    share_gpu_uuid: str = ""
    # What its processes use on each device it holds (a nested container's count for its top-level one).
    usage: tuple[DeviceUse, ...] = ()

    @property
    def nested(self) -> bool:
        return self.container_id.nested


@dataclass(frozen=True)
class Description:
    """``gpu-isolator describe``: the record beside the rules the kernel holds."""

    container: ContainerInfo
    recorded_rules: tuple[str, ...]
    kernel_rules: tuple[str, ...]
    kernel_source: str
    rules_cgroup: str
    rules_agree: bool
    only_recorded: tuple[str, ...]
    only_kernel: tuple[str, ...]
    kernel_gpu_minors: tuple[int, ...]
    pids: tuple[int, ...]
    gpus: tuple[GpuInfo, ...]
    nested: tuple[ContainerInfo, ...]
    # --cpu-affinity (docs/affinity.md): the mode, the GPUs' local CPUs and nodes here, the recorded
    # cpuset and the kernel's ("" where there is none).
    cpu_affinity: str = "off"
    local_cpus: str = ""
    local_numa_nodes: str = ""
    cpuset_recorded_cpus: str = ""
    cpuset_recorded_mems: str = ""
    cpuset_cpus: str = ""
    cpuset_mems: str = ""
    cpuset_cgroup: str = ""


@dataclass(frozen=True)
class Released:
    """What ``gpu-isolator release`` did."""

    container: ContainerId
    released_gpu_uuids: tuple[str, ...]
    released_gpu_minors: tuple[int, ...]
    pids: tuple[int, ...]
    action: str
    cgroup: str
    detail: str


@dataclass(frozen=True)
class VolumeReport:
    """The driver volumes under the volume root; ``volumes`` is the manifest the volume manager writes."""

    driver_version: str
    volume_root: str
    volumes: tuple[Mapping[str, object], ...]


@dataclass(frozen=True)
class AuditReport:
    """The drift audit: containers compared, one line per container re-applied, repairs so far."""

    checked: int
    repaired: tuple[str, ...] = ()
    repairs_total: int = 0


@dataclass(frozen=True)
class HealthCheck:
    name: str
    ok: bool
    detail: str


# ---- The inventory's view of a GPU: what isolator.gpu.nvml reports and the core reads ---------


@dataclass(frozen=True)
class GpuHealth:
    healthy: bool = True
    reason: str = ""
    last_xid: int = 0
    last_xid_time: float = 0.0
    source: str = ""  # one of HEALTH_*, when unhealthy


@dataclass(frozen=True)
class HealthMark:
    """A GPU marked unhealthy by an XID or a double-bit ECC error (``source``: "xid" or "ecc"), as the
    state store keeps it across restarts (isolator/core/healthmarks.py)."""

    uuid: str
    source: str
    reason: str
    xid: int
    at: float


@dataclass(frozen=True)
class GpuRecord:
    """Everything known about one GPU. ``errors`` lists the queries that failed (then: degraded)."""

    gpu: Gpu
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    errors: tuple[str, ...] = ()
    health: GpuHealth = GpuHealth()

    @property
    def index(self) -> int:
        return self.gpu.index

    @property
    def identified(self) -> bool:
        """Minor and UUID are known, so the GPU can be named and whitelisted at all."""
        return self.gpu.minor >= 0 and bool(self.gpu.uuid)

    @property
    def degraded(self) -> bool:
        return bool(self.errors)

    @property
    def usable(self) -> bool:
        """Healthy, fully read and identified: the allocator may hand it out."""
        return self.health.healthy and not self.errors and self.identified

    @property
    def status(self) -> str:
        """Why the GPU is not usable, or "" when it is."""
        if self.errors:
            return "degraded: " + "; ".join(self.errors)
        return self.health.reason


@dataclass(frozen=True)
class HealthEvent:
    """A GPU's health changed: what the service subscribes to (``Inventory.on_health_change``)."""

    index: int
    uuid: str
    healthy: bool
    reason: str
    xid: int = 0
    time: float = 0.0


@dataclass(frozen=True)
class GpuUsageSample:
    """One GPU's usage as NVML reports it now (``nvidia-smi --query-gpu=memory.used,utilization.gpu``)."""

    index: int
    memory_total: int
    memory_used: int
    gpu_utilization: int  # percent
    memory_utilization: int  # percent


# ---- handover: what a released GPU still runs, and what was reset (docs/handover.md) ------------

# nvmlComputeMode_t values the node's default may take (EXCLUSIVE_THREAD is gone since CUDA 8).
COMPUTE_MODES = {"DEFAULT": 0, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3}


def compute_mode_name(mode: int) -> str:
    names = {v: k for k, v in COMPUTE_MODES.items()}
    return names.get(mode, "EXCLUSIVE_THREAD" if mode == 1 else f"mode {mode}")


@dataclass(frozen=True)
class GpuProcess:
    """A process NVML sees on a GPU (nvidia-smi's "Processes" table)."""

    pid: int
    used_memory: int  # bytes; 0 when NVML cannot tell
    kind: str  # "compute" or "graphics"


@dataclass(frozen=True)
class ProcessUsage:
    """One process on a GPU as NVML's per-process calls report it (nvidia-smi's "Processes" table
    with `nvidia-smi pmon`'s sm and mem columns)."""

    pid: int  # as NVML reports it: the pid in the sidecar's pid namespace when it shares the host's
    gpu: int  # the GPU's NVML index (a MIG device's parent)
    used_memory: int  # bytes; 0 when NVML cannot tell
    kind: str  # "compute", "graphics" or "mps" (an MPS client; its server is a "compute" process)
    mig_uuid: str = ""  # the MIG device it runs on; "" for the whole GPU
    sm_utilization: int | None = None  # percent of the GPU's SMs; None: the driver does not report it
    memory_utilization: int | None = None  # percent of the memory bandwidth; None as above


@dataclass(frozen=True)
class Occupancy:
    """What runs on a GPU now: its processes and the memory in use."""

    processes: tuple[GpuProcess, ...]
    memory_used: int
    memory_total: int


@dataclass(frozen=True)
class ResetStep:
    """One setting brought back to its default after a container (or why it could not be)."""

    setting: str  # "application clocks" or "compute mode"
    before: str
    after: str
    changed: bool  # it differed and was set back
    error: str = ""  # why the reset failed; "" when it worked or was not needed
    code: str = ""  # NVML's error name (NO_PERMISSION, NOT_SUPPORTED...) when it failed

    def __str__(self) -> str:
        if self.error:
            return f"{self.setting}: {self.before}, failed to reset: {self.error}"
        if self.changed:
            return f"{self.setting}: reset from {self.before} to {self.after}"
        return f"{self.setting}: {self.before} (unchanged)"


@dataclass(frozen=True)
class DrainRecord:
    """A GPU kept out of allocation by the handover check (persisted in the state store).

    ``since`` is wall time, for people; ``since_mono`` the clock's monotonic time, for the timeout
    (never used to choose GPUs)."""

    minor: int
    since: float
    since_mono: float
    reason: str
    pids: tuple[int, ...] = ()
    memory_used: int = 0
    timed_out: bool = False

    @property
    def state(self) -> str:
        return "unhealthy" if self.timed_out else "draining"


@dataclass(frozen=True)
class MaintenanceMark:
    """A GPU an operator took out of service (``gpu-isolator drain``), persisted by its UUID so that
    it stays out across restarts and a re-enumeration that renumbers it. ``by``: who asked, as the
    peer gate saw the caller (``uid 0, pid 4242``)."""

    uuid: str
    reason: str
    since: float
    by: str = ""


@dataclass(frozen=True)
class EndedDrain:
    """A maintenance drain an operator ended (``gpu-isolator undrain GPU [--reason TEXT]``), kept as the
    audit trail: the drain (its reason, since when, who) and its end (when, who, why; "" if not said)."""

    uuid: str
    reason: str
    since: float
    by: str
    ended: float
    ended_by: str = ""
    end_reason: str = ""


@dataclass(frozen=True)
class MaintenanceChange:
    """What ``gpu-isolator drain`` or ``undrain`` did to one GPU."""

    index: int
    minor: int
    uuid: str
    drained: bool  # drained for maintenance now
    was_drained: bool  # before the call
    reason: str  # the drain's reason (the one ended, for undrain)
    since: float
    by: str
    detail: str  # one sentence saying what was done and what still keeps the GPU out, if anything
    holders: tuple[str, ...] = ()  # containers holding it (or MIG devices on it): they keep it


@dataclass(frozen=True)
class Undrained:
    """What ``gpu-isolator undrain GPU`` did."""

    index: int
    minor: int
    uuid: str
    was: str  # the drain state it left ("draining", "unhealthy"), or "" when it was not draining
    detail: str
    reset: tuple[str, ...] = ()
