"""Host descriptions of the simulated GPU host: parse and validate the TOML, render the fake's state.

Pure: text in, plain data or state text out; reading the file is the only I/O. A file that is
malformed or inconsistent is refused with ``HostFileError`` naming its line, key and reason.
The format is documented in docs/simhost.md.
"""

from __future__ import annotations

import os
import re
import tomllib
import uuid as uuidlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from isolator.errors import HostFileError, InvalidArgument
from isolator.model import PcieLevel
from isolator.policy import affinity

HOSTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hosts")
LEVELS = {
    "INTERNAL": PcieLevel.INTERNAL,
    "PIX": PcieLevel.SINGLE,
    "PXB": PcieLevel.MULTIPLE,
    "PHB": PcieLevel.HOSTBRIDGE,
    "NODE": PcieLevel.NODE,
    "SYS": PcieLevel.SYSTEM,
}
# Limits of the fake library (MAX_GPUS, MAX_MIG in fakenvml.c) and of the hardware: 18 NVLink lanes
# per GPU is the most any shipped GPU has (H100 SXM5).
MAX_GPUS = 64
MAX_MIG_DEVICES = 7
MAX_LANES = 18
MAX_CPUS = 64 * 64
# /dev/nvidia254 and 255 are nvidia-modeset and nvidiactl.
MAX_MINOR = 253
# Mesos and the driver use GPU instance ids 0-14 and compute instance ids 0-7
# (/proc/driver/nvidia-caps/mig-minors lists exactly those).
MAX_GI, MAX_CI = 14, 7
# A MIG-capable GPU's memory is cut into 8 slices; GPU instance placements are counted in them
# (go-nvml's A100 tables: 1g at starts 0..6 with size 1, 3g at 0 and 4 with size 4, 7g at 0 with size 8).
MIG_MEMORY_SLICES = 8
PROFILE = re.compile(r"^(?:(\d)c\.)?(\d)g\.(\d+)gb(\+me)?$")
BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{4}|[0-9a-fA-F]{8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
UUID_NAMESPACE = uuidlib.UUID("6d1c9a52-3f0e-4a8e-9a51-8f4e2b7c1d00")


@dataclass(frozen=True)
class MigSpec:
    gpu_instance: int
    compute_instance: int
    profile: str
    memory_mib: int
    uuid: str
    gpu_slices: int = 1  # compute slices of its GPU instance (the N of Ng)
    compute_slices: int = 1  # compute slices of its compute instance (the N of Nc, else = gpu_slices)
    placement_start: int = 0  # its GPU instance's placement, in memory slices (0..7)
    placement_size: int = 1

    @property
    def profile_id(self) -> int:
        """NVML's NVML_GPU_INSTANCE_PROFILE_* id of its GPU instance (nvml.h)."""
        if self.profile.endswith("+me"):
            return {1: 7, 2: 8}.get(self.gpu_slices, 7)  # *_SLICE_REV1: with media extensions
        if self.gpu_slices == 1 and self.placement_size == 2:
            return 9  # NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 (1g.10gb on A100-40GB)
        return {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}.get(self.gpu_slices, 0)


@dataclass(frozen=True)
class GpuSpec:
    index: int
    minor: int
    uuid: str
    name: str
    pci_bus_id: str  # sysfs form, 0000:06:00.0
    memory_mib: int
    numa_node: int | None
    pci_device_id: int
    mig: bool | None  # None: not MIG-capable
    mig_devices: tuple[MigSpec, ...] = ()
    nvlink: Mapping[int, int] = field(default_factory=dict)  # peer index -> lanes
    nvswitch: Mapping[int, int] = field(default_factory=dict)  # switch id -> lanes

    @property
    def nvml_bus_id(self) -> str:
        """NVML's form: an 8-digit domain and upper-case hex (``nvidia-smi --query-gpu=pci.bus_id``)."""
        return nvml_bus_id(self.pci_bus_id)


@dataclass(frozen=True)
class HostSpec:
    name: str
    description: str
    driver_version: str
    cuda_driver_version: int  # NVML's encoding: 1000 * major + 10 * minor
    numa: Mapping[int, tuple[int, ...]]  # node -> CPUs
    gpus: tuple[GpuSpec, ...]
    switches: Mapping[int, str]  # switch id -> sysfs bus id
    levels: Mapping[tuple[int, int], PcieLevel]  # every pair (a < b)

    def level(self, a: int, b: int) -> PcieLevel:
        if a == b:
            return PcieLevel.INTERNAL
        return self.levels[(min(a, b), max(a, b))]

    @property
    def caps_minors(self) -> tuple[int, ...]:
        """nvidia-caps minors that exist: config, monitor and those of every MIG device."""
        out = {CAP_CONFIG, CAP_MONITOR}
        for gpu in self.gpus:
            for mig in gpu.mig_devices:
                out.update(mig_caps_minors(gpu.minor, mig.gpu_instance, mig.compute_instance))
        return tuple(sorted(out))


# ---- bus ids and CPU lists ------------------------------------------------------------------


def normalise_bus_id(text: str) -> str:
    """``00000000:1A:00.0`` (NVML) or ``1a:00.0`` -> ``0000:1a:00.0`` (sysfs), as go-gpuallocator does."""
    m = BUS_ID.match(text.strip().rstrip("\0"))
    if not m:
        raise ValueError(f"{text!r} is not a PCI bus id (expected DDDD:BB:DD.F)")
    domain = int(m.group(1) or "0", 16)
    if domain > 0xFFFF:
        raise ValueError(f"{text!r} has a PCI domain above ffff")
    return f"{domain:04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


def nvml_bus_id(sysfs: str) -> str:
    domain, rest = sysfs.split(":", 1)
    return f"0000{domain}:{rest}".upper()


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``0-19,40-59`` -> the CPUs, as in /sys/devices/system/node/node*/cpulist (the syntax is
    isolator.policy.affinity's; a host file's error is a ValueError here)."""
    try:
        cpus = tuple(sorted(affinity.parse_list(text)))
    except InvalidArgument as exc:
        raise ValueError(exc.message) from exc
    if cpus and cpus[-1] >= MAX_CPUS:
        raise ValueError(f"{text!r} names CPU {cpus[-1]}; a simulated host has at most {MAX_CPUS}")
    return cpus


def format_cpu_list(cpus: tuple[int, ...] | list[int]) -> str:
    return affinity.format_list(cpus)


# ---- /proc/driver/nvidia-caps/mig-minors ---------------------------------------------------

CAP_CONFIG, CAP_MONITOR = 1, 2


def mig_caps_minors(gpu_minor: int, gi: int, ci: int) -> tuple[int, int]:
    """The GI and CI access minors, laid out as the driver's mig-minors file (see ``mig_minors_text``)."""
    base = 3 + gpu_minor * (MAX_GI + 1) * (MAX_CI + 2)
    gi_minor = base + gi * (MAX_CI + 2)
    return gi_minor, gi_minor + 1 + ci


def mig_minors_text(gpu_minors: list[int]) -> str:
    """The content of /proc/driver/nvidia-caps/mig-minors for these GPUs.

    The driver lists ``config``, ``monitor`` and, per GPU minor, ``gpu<m>/gi<i>/access`` followed by
    its ``gpu<m>/gi<i>/ci<c>/access`` lines, numbered consecutively.
    """
    lines = [f"config {CAP_CONFIG}", f"monitor {CAP_MONITOR}"]
    for minor in sorted(gpu_minors):
        for gi in range(MAX_GI + 1):
            gi_minor, _ = mig_caps_minors(minor, gi, 0)
            lines.append(f"gpu{minor}/gi{gi}/access {gi_minor}")
            lines += [
                f"gpu{minor}/gi{gi}/ci{ci}/access {mig_caps_minors(minor, gi, ci)[1]}" for ci in range(MAX_CI + 1)
            ]
    return "\n".join(lines) + "\n"


# ---- locating keys in the text ----------------------------------------------------------------

_HEADER = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-]+)\s*\]\]?")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=")


def _key_lines(text: str) -> dict[str, int]:
    """Map key paths such as ``gpu[3].minor`` or ``gpu[0].mig_device[1]`` to 1-based line numbers.

    tomllib reports positions only for syntax errors, so semantic errors find their line here.
    """
    out: dict[str, int] = {}
    counts: dict[str, int] = {}  # array path -> elements seen ("gpu[2].mig_device" -> 1)
    current: dict[str, str] = {}  # table name -> path of its current element ("gpu" -> "gpu[2]")
    prefix = ""
    for lineno, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header:
            parts = header.group(2).split(".")
            parent = ".".join(parts[:-1])
            base = (current.get(parent, parent) + "." if parent else "") + parts[-1]
            if header.group(1) == "[[":
                n = counts.get(base, 0)
                counts[base] = n + 1
                prefix = f"{base}[{n}]"
                current[header.group(2)] = prefix
            else:
                prefix = base
            out.setdefault(prefix, lineno)
            continue
        key = _KEY.match(line)
        if key:
            out.setdefault(f"{prefix}.{key.group(1)}" if prefix else key.group(1), lineno)
    return out


def _line_of(lines: dict[str, int], path: str) -> int | None:
    probe = path
    while probe:
        if probe in lines:
            return lines[probe]
        probe = probe.rsplit(".", 1)[0] if "." in probe else ""
    return None


# ---- the parser ----------------------------------------------------------------------------


class _Reader:
    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.lines = _key_lines(text)

    def fail(self, key: str, reason: str) -> NoReturn:
        line = _line_of(self.lines, key)
        where = f"line {line} ({key}): " if line else f"{key}: "
        raise HostFileError(path=self.path, where=where, reason=reason)

    def get(
        self, table: Mapping[str, Any], prefix: str, key: str, kind: type | tuple[type, ...], default: Any = ...
    ) -> Any:
        path = f"{prefix}.{key}" if prefix else key
        if key not in table:
            if default is ...:
                self.fail(path.rsplit(".", 1)[0] if "." in path else path, f"missing required key '{key}'")
            return default
        value = table[key]
        if isinstance(value, bool) and kind is not bool:
            self.fail(path, f"expected {_kind_name(kind)}, got a boolean")
        if not isinstance(value, kind):
            self.fail(path, f"expected {_kind_name(kind)}, got {type(value).__name__} {value!r}")
        return value

    def only(self, table: Mapping[str, Any], prefix: str, allowed: set[str]) -> None:
        for key in table:
            if key not in allowed:
                path = f"{prefix}.{key}" if prefix else key
                self.fail(path, f"unknown key '{key}' (known: {', '.join(sorted(allowed))})")

    def non_negative(self, table: Mapping[str, Any], prefix: str, key: str, default: Any = ...) -> Any:
        value = self.get(table, prefix, key, int, default)
        if isinstance(value, int) and value < 0:
            self.fail(f"{prefix}.{key}" if prefix else key, f"{value} must not be negative")
        return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", str: "a string", bool: "a boolean", list: "an array", dict: "a table"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def resolve_host_path(host: str) -> str:
    """A path to a host file, or the name of a shipped host (``dgx-1``) -> the file's path."""
    if os.sep in host or host.endswith(".toml"):
        return host
    path = os.path.join(HOSTS_DIR, f"{host}.toml")
    if not os.path.exists(path):
        raise HostFileError(
            path=host,
            where="",
            reason=f"no such file and no shipped host of that name (shipped: {', '.join(shipped_hosts())})",
        )
    return path


def shipped_hosts() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(HOSTS_DIR) if f.endswith(".toml"))


def load_host(host: str) -> HostSpec:
    """Read and validate a host file, given by path or by shipped name."""
    path = resolve_host_path(host)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise HostFileError(path=path, where="", reason=exc.strerror or str(exc)) from exc
    except UnicodeDecodeError as exc:
        raise HostFileError(path=path, where="", reason=f"not UTF-8 text: {exc}") from exc
    return parse_host(text, path)


def parse_host(text: str, path: str = "<string>") -> HostSpec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise HostFileError(path=path, where="", reason=f"not valid TOML: {exc}") from exc
    r = _Reader(path, text)
    r.only(
        data, "", {"name", "description", "driver_version", "cuda_driver_version", "numa", "nvswitch", "pcie", "gpu"}
    )
    name = r.get(data, "", "name", str)
    description = r.get(data, "", "description", str, "")
    driver = r.get(data, "", "driver_version", str)
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", driver):
        r.fail("driver_version", f"{driver!r} is not a driver version (e.g. 535.104.05)")
    cuda_text = r.get(data, "", "cuda_driver_version", str)
    m = re.fullmatch(r"(\d+)\.(\d)", cuda_text)
    if not m:
        r.fail("cuda_driver_version", f"{cuda_text!r} is not a CUDA version (e.g. 12.2)")
    cuda = int(m.group(1)) * 1000 + int(m.group(2)) * 10

    numa = _parse_numa(r, data)
    switches = _parse_switches(r, data)
    gpus = _parse_gpus(r, data, numa, switches, name)
    levels = _parse_pcie(r, data, gpus)
    return HostSpec(
        name=name,
        description=description,
        driver_version=driver,
        cuda_driver_version=cuda,
        numa=numa,
        gpus=gpus,
        switches=switches,
        levels=levels,
    )


def _tables(r: _Reader, data: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        r.fail(key, f"'{key}' must be an array of tables ([[{key}]])")
    return value


def _parse_numa(r: _Reader, data: Mapping[str, Any]) -> dict[int, tuple[int, ...]]:
    numa: dict[int, tuple[int, ...]] = {}
    owner: dict[int, int] = {}
    for i, t in enumerate(_tables(r, data, "numa")):
        p = f"numa[{i}]"
        r.only(t, p, {"node", "cpus"})
        node = r.non_negative(t, p, "node")
        if node in numa:
            r.fail(f"{p}.node", f"NUMA node {node} is declared twice")
        try:
            cpus = parse_cpu_list(r.get(t, p, "cpus", str))
        except ValueError as exc:
            r.fail(f"{p}.cpus", str(exc))
        for cpu in cpus:
            if cpu in owner:
                r.fail(f"{p}.cpus", f"CPU {cpu} is already in NUMA node {owner[cpu]}")
            owner[cpu] = node
        numa[node] = cpus
    return numa


def _parse_switches(r: _Reader, data: Mapping[str, Any]) -> dict[int, str]:
    switches: dict[int, str] = {}
    for i, t in enumerate(_tables(r, data, "nvswitch")):
        p = f"nvswitch[{i}]"
        r.only(t, p, {"id", "pci_bus_id"})
        sid = r.non_negative(t, p, "id")
        if sid in switches:
            r.fail(f"{p}.id", f"NVSwitch {sid} is declared twice")
        try:
            switches[sid] = normalise_bus_id(r.get(t, p, "pci_bus_id", str))
        except ValueError as exc:
            r.fail(f"{p}.pci_bus_id", str(exc))
    return switches


def _int_keyed(r: _Reader, t: Mapping[str, Any], p: str, key: str) -> dict[int, int]:
    table = r.get(t, p, key, dict, {})
    out: dict[int, int] = {}
    for k, v in table.items():
        if not k.isdigit():
            r.fail(f"{p}.{key}", f"key {k!r} is not an index")
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            r.fail(f"{p}.{key}", f"lanes for {k} must be a positive integer, got {v!r}")
        out[int(k)] = v
    return out


GPU_KEYS = {
    "index",
    "minor",
    "uuid",
    "name",
    "pci_bus_id",
    "memory_mib",
    "numa_node",
    "pci_device_id",
    "mig",
    "mig_device",
    "nvlink",
    "nvswitch",
}


def _parse_gpus(
    r: _Reader, data: Mapping[str, Any], numa: Mapping[int, Any], switches: Mapping[int, str], host: str
) -> tuple[GpuSpec, ...]:
    tables = _tables(r, data, "gpu")
    if not tables:
        r.fail("gpu", "a host needs at least one [[gpu]]")
    if len(tables) > MAX_GPUS:
        r.fail("gpu", f"{len(tables)} GPUs; the simulation supports at most {MAX_GPUS}")
    gpus: list[GpuSpec] = []
    seen: dict[str, dict[Any, int]] = {"index": {}, "minor": {}, "uuid": {}, "pci_bus_id": {}}
    for i, t in enumerate(tables):
        p = f"gpu[{i}]"
        r.only(t, p, GPU_KEYS)
        index = r.non_negative(t, p, "index")
        minor = r.non_negative(t, p, "minor")
        if minor > MAX_MINOR:
            r.fail(f"{p}.minor", f"minor {minor} is above {MAX_MINOR} (254 and 255 are nvidia-modeset and nvidiactl)")
        gpu_uuid = r.get(t, p, "uuid", str, "") or "GPU-" + str(uuidlib.uuid5(UUID_NAMESPACE, f"{host}/gpu/{index}"))
        if not re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", gpu_uuid):
            r.fail(f"{p}.uuid", f"{gpu_uuid!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
        name = r.get(t, p, "name", str)
        if not name or "\n" in name or len(name) > 64:
            r.fail(f"{p}.name", "a GPU name must be one line of 1 to 64 characters")
        try:
            bus = normalise_bus_id(r.get(t, p, "pci_bus_id", str))
        except ValueError as exc:
            r.fail(f"{p}.pci_bus_id", str(exc))
        memory = r.get(t, p, "memory_mib", int)
        if memory <= 0:
            r.fail(f"{p}.memory_mib", f"{memory} must be positive")
        node = r.get(t, p, "numa_node", int, None)
        if node is not None and numa and node not in numa:
            r.fail(f"{p}.numa_node", f"NUMA node {node} is not declared in [[numa]]")
        if node is not None and node < 0:
            r.fail(f"{p}.numa_node", f"{node} must not be negative (leave it out for no affinity)")
        device_id = r.non_negative(t, p, "pci_device_id", 0x1DB110DE)
        mig = r.get(t, p, "mig", bool, None)
        for key, value in (("index", index), ("minor", minor), ("uuid", gpu_uuid), ("pci_bus_id", bus)):
            if value in seen[key]:
                r.fail(f"{p}.{key}", f"{key} {value} is already used by gpu[{seen[key][value]}]")
            seen[key][value] = i
        migs = _parse_mig(r, t, p, mig, memory, host, index, name)
        nvlink = _int_keyed(r, t, p, "nvlink")
        nvswitch = _int_keyed(r, t, p, "nvswitch")
        for sid in nvswitch:
            if sid not in switches:
                r.fail(f"{p}.nvswitch", f"link to NVSwitch {sid}, which is not declared in [[nvswitch]]")
        lanes = sum(nvlink.values()) + sum(nvswitch.values())
        if lanes > MAX_LANES:
            r.fail(f"{p}.nvlink", f"{lanes} NVLink lanes; a GPU has at most {MAX_LANES}")
        gpus.append(
            GpuSpec(
                index=index,
                minor=minor,
                uuid=gpu_uuid,
                name=name,
                pci_bus_id=bus,
                memory_mib=memory,
                numa_node=node,
                pci_device_id=device_id,
                mig=mig,
                mig_devices=migs,
                nvlink=nvlink,
                nvswitch=nvswitch,
            )
        )
    # NVML indices are dense: 0..n-1 in PCI bus order.
    by_index = {g.index: (i, g) for i, g in enumerate(gpus)}
    for expected in range(len(gpus)):
        if expected not in by_index:
            bad = max(by_index)
            r.fail(f"gpu[{by_index[bad][0]}].index", f"indices must be 0..{len(gpus) - 1}; {expected} is missing")
    for i, g in enumerate(gpus):
        for peer, lanes in g.nvlink.items():
            p = f"gpu[{i}].nvlink"
            if peer == g.index:
                r.fail(p, f"GPU {g.index} has an NVLink to itself")
            if peer not in by_index:
                r.fail(p, f"link to GPU {peer}, which does not exist")
            back = by_index[peer][1].nvlink.get(g.index, 0)
            if back != lanes:
                r.fail(
                    p,
                    f"asymmetric link: GPU {g.index} has {lanes} lane(s) to GPU {peer}, "
                    f"but GPU {peer} has {back} back (gpu[{by_index[peer][0]}].nvlink)",
                )
    return tuple(sorted(gpus, key=lambda g: g.index))


def _parse_mig(
    r: _Reader, t: Mapping[str, Any], p: str, mig: bool | None, memory: int, host: str, index: int, name: str
) -> tuple[MigSpec, ...]:
    tables = t.get("mig_device", [])
    if not isinstance(tables, list) or not all(isinstance(v, dict) for v in tables):
        r.fail(f"{p}.mig_device", "'mig_device' must be an array of tables ([[gpu.mig_device]])")
    if tables and mig is not True:
        r.fail(f"{p}.mig_device", "MIG devices on a GPU whose 'mig' is not true")
    if len(tables) > MAX_MIG_DEVICES:
        r.fail(f"{p}.mig_device", f"{len(tables)} MIG devices; a GPU has at most {MAX_MIG_DEVICES}")
    out: list[MigSpec] = []
    seen: set[tuple[int, int]] = set()
    placements: dict[int, tuple[int, int]] = {}  # GPU instance -> (start, size)
    total = 0
    gpu_gb = -(-memory // 1024)
    for j, m in enumerate(tables):
        q = f"{p}.mig_device[{j}]"
        r.only(m, q, {"gpu_instance", "compute_instance", "profile", "memory_mib", "uuid", "placement"})
        gi = r.non_negative(m, q, "gpu_instance")
        ci = r.non_negative(m, q, "compute_instance")
        if gi > MAX_GI:
            r.fail(f"{q}.gpu_instance", f"GPU instance {gi} is above {MAX_GI}")
        if ci > MAX_CI:
            r.fail(f"{q}.compute_instance", f"compute instance {ci} is above {MAX_CI}")
        if (gi, ci) in seen:
            r.fail(q, f"GPU instance {gi} / compute instance {ci} is declared twice")
        seen.add((gi, ci))
        profile = r.get(m, q, "profile", str)
        pm = PROFILE.fullmatch(profile)
        if not pm:
            r.fail(f"{q}.profile", f"{profile!r} is not a MIG profile (e.g. 3g.20gb, 1g.5gb+me, 1c.3g.20gb)")
        gslices = int(pm.group(2))
        cslices = int(pm.group(1) or gslices)
        if not 1 <= gslices <= 8 or not 1 <= cslices <= gslices:
            r.fail(f"{q}.profile", f"{profile!r}: slices must satisfy 1 <= compute <= GPU instance <= 8")
        mem = r.get(m, q, "memory_mib", int)
        if mem <= 0:
            r.fail(f"{q}.memory_mib", f"{mem} must be positive")
        # Compute instances of one GPU instance share its memory: count it once.
        if gi not in placements:
            total += mem
        if total > memory:
            r.fail(f"{q}.memory_mib", f"MIG devices hold {total} MiB, more than the GPU's {memory} MiB")
        # Placement size in memory slices: the profile's memory as a share of the GPU's 8 slices.
        size = max(1, min(MIG_MEMORY_SLICES, round(int(pm.group(3)) * MIG_MEMORY_SLICES / gpu_gb)))
        start = r.get(m, q, "placement", int, None)
        if gi in placements:
            if start is not None and start != placements[gi][0]:
                r.fail(f"{q}.placement", f"GPU instance {gi} is already placed at {placements[gi][0]}")
            start, size = placements[gi]
        else:
            taken = {s for a, b in placements.values() for s in range(a, a + b)}
            if start is None:
                # The first aligned start that is free, as the driver places a new instance.
                start = next(
                    (x for x in range(0, MIG_MEMORY_SLICES - size + 1, size) if taken.isdisjoint(range(x, x + size))),
                    -1,
                )
                if start < 0:
                    r.fail(q, f"no free placement of size {size} left on the GPU")
            if start < 0 or start + size > MIG_MEMORY_SLICES:
                r.fail(f"{q}.placement", f"placement {start}+{size} is outside slices 0..{MIG_MEMORY_SLICES - 1}")
            if not taken.isdisjoint(range(start, start + size)):
                r.fail(f"{q}.placement", f"placement {start}+{size} overlaps another GPU instance")
            placements[gi] = (start, size)
        mig_uuid = r.get(m, q, "uuid", str, "") or "MIG-" + str(
            uuidlib.uuid5(UUID_NAMESPACE, f"{host}/{index}/{gi}/{ci}")
        )
        out.append(MigSpec(gi, ci, profile, mem, mig_uuid, gslices, cslices, start, size))
    return tuple(out)


def _parse_pcie(r: _Reader, data: Mapping[str, Any], gpus: tuple[GpuSpec, ...]) -> dict[tuple[int, int], PcieLevel]:
    # Default: GPUs on one NUMA node meet at its host bridges (NODE), else across the SMP link (SYS).
    levels: dict[tuple[int, int], PcieLevel] = {}
    for a in gpus:
        for b in gpus:
            if a.index < b.index:
                same = a.numa_node is not None and a.numa_node == b.numa_node
                levels[(a.index, b.index)] = PcieLevel.NODE if same else PcieLevel.SYSTEM
    indices = {g.index for g in gpus}
    for i, t in enumerate(_tables(r, data, "pcie")):
        p = f"pcie[{i}]"
        r.only(t, p, {"level", "gpus"})
        level_name = r.get(t, p, "level", str)
        if level_name not in LEVELS:
            r.fail(f"{p}.level", f"{level_name!r} is not one of {', '.join(LEVELS)}")
        members = r.get(t, p, "gpus", list)
        if len(members) < 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in members):
            r.fail(f"{p}.gpus", "a PCIe group lists at least two GPU indices")
        for x in members:
            if x not in indices:
                r.fail(f"{p}.gpus", f"GPU {x} does not exist")
        # A pair takes the closest level of any group holding both: groups nest like PCIe switches.
        for a in members:
            for b in members:
                if a < b:
                    levels[(a, b)] = min(levels[(a, b)], LEVELS[level_name])
    return levels


# ---- the fake library's state -------------------------------------------------------------------

# NVML_NVLINK_DEVICE_TYPE_GPU / _SWITCH (nvml.h).
REMOTE_GPU, REMOTE_SWITCH = 0, 2


def _affinity_words(cpus: tuple[int, ...]) -> str:
    words = [0] * (max(cpus) // 64 + 1 if cpus else 1)
    for cpu in cpus:
        words[cpu // 64] |= 1 << (cpu % 64)
    return ",".join(f"{w:x}" for w in words)


def render_state(spec: HostSpec, control_dir: str) -> str:
    """The line format fakenvml.c reads (documented at the top of that file and in docs/simhost.md)."""
    major = spec.cuda_driver_version // 1000
    lines = [
        "fakenvml 1",
        f"driver {spec.driver_version}",
        f"nvml {major}.{spec.driver_version}",
        f"cuda {spec.cuda_driver_version}",
        f"control {control_dir}",
    ]
    by_index = {g.index: g for g in spec.gpus}
    for g in spec.gpus:
        cpus = spec.numa.get(g.numa_node, ()) if g.numa_node is not None else ()
        mig = 2 if g.mig is None else int(g.mig)
        numa = -1 if g.numa_node is None else g.numa_node
        lines.append(
            f"gpu {g.index} {g.minor} {numa} {g.memory_mib * 2**20} {g.pci_device_id:x} {mig} {g.uuid} "
            f"{g.nvml_bus_id} {_affinity_words(cpus)} {g.name}"
        )
    for (a, b), level in sorted(spec.levels.items()):
        lines.append(f"topo {a} {b} {int(level)}")
    for g in spec.gpus:
        link = 0
        for peer in sorted(g.nvlink):
            for _ in range(g.nvlink[peer]):
                lines.append(f"nvlink {g.index} {link} 1 {REMOTE_GPU} {by_index[peer].nvml_bus_id}")
                link += 1
        for sid in sorted(g.nvswitch):
            for _ in range(g.nvswitch[sid]):
                lines.append(f"nvlink {g.index} {link} 1 {REMOTE_SWITCH} {nvml_bus_id(spec.switches[sid])}")
                link += 1
        for slot, m in enumerate(g.mig_devices):
            mem = m.memory_mib * 2**20
            lines.append(
                f"mig {g.index} {slot} {m.gpu_instance} {m.compute_instance} {mem} {m.gpu_slices} "
                f"{m.compute_slices} {m.profile_id} {m.placement_start} {m.placement_size} {m.uuid} "
                f"{g.name} MIG {m.profile}"
            )
    return "\n".join(lines) + "\n"
