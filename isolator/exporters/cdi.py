"""A CDI spec of the GPUs, MIG devices and driver volume this sidecar manages (docs/cdi.md).

``build_spec`` is pure: inventory records and host facts in, the spec as a dict out. ``write_spec``
is the one edge (an atomic write into a CDI spec directory). Facts from the CDI specification
(cncf-tags/container-device-interface, SPEC.md and specs-go at spec 1.1.0, see
shared/reference/nvidia-volume-cdi.md §3):

* keys: ``cdiVersion``, ``kind``, ``devices[].{name, containerEdits}``, top-level ``containerEdits``
  with ``env`` (``KEY=VALUE``), ``deviceNodes`` (``path``, ``hostPath`` since 0.5.0) and ``mounts``
  (``hostPath``, ``containerPath``, ``options``); loading fails on unknown fields;
* device names start and end with a letter or digit and may contain ``_ - . :``; ``nvidia.com/gpu=0``,
  ``=GPU-<uuid>``, ``=0:1`` (GPU 0's MIG device 1) and ``=all`` are NVIDIA's names (nvidia-ctk);
* device nodes without ``major``/``minor`` are stat'ed by the runtime when it injects them, so the
  dynamic nvidia-uvm and nvidia-caps majors are left out; the runtime writes the cgroup rules;
* ``env`` entries replace the image's variable of the same key;
* ``cdiVersion`` is the lowest version that knows every field the spec uses (``minimum_version``), as
  nvidia-ctk writes it: a runtime on an older CDI library refuses a version it does not know, and
  every library refuses a spec that declares less than its fields need.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from isolator.errors import FailedPrecondition, InvalidArgument
from isolator.model import MigDevice

# Released spec versions (SPEC.md "Released versions"); 0.3.0 is the earliest a library still loads.
VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
DEFAULT_KIND = "nvidia.com/gpu"
SPEC_FILE = "gpu-isolator.json"
CONTAINER_DEV = "/dev"
VOLUME_TARGET = "/usr/local/nvidia"
# As Mesos mounts the volume (read-only, recursive bind), plus nosuid,nodev like nvidia-ctk's mounts.
VOLUME_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")
# The legacy nvidia-container-runtime hook must not inject a second time (nvidia-ctk does the same);
# PATH and LD_LIBRARY_PATH are volumes.inject's values for an image that sets neither.
VOID_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES=void"

# nvidia-ctk's --device-name-strategy (pkg/nvcdi/namer.go): how a GPU and a MIG device are named.
# nvidia-ctk's default is index and uuid together, every device under both names: "both" here.
NAME_STRATEGIES = ("index", "uuid", "type-index")
DEFAULT_NAME_STRATEGIES = ("index", "uuid")
FORMATS = ("yaml", "json")
# Where runtimes look for specs, lowest priority first (pkg/cdi/spec-dirs.go): /var/run/cdi wins.
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")

_KIND = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*(?:\.[A-Za-z0-9_-]+)*/[A-Za-z][A-Za-z0-9_.-]{0,62}$")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class GpuEntry:
    """One managed GPU as the spec needs it (from an inventory record)."""

    index: int
    minor: int
    uuid: str
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    usable: bool = True


def entries(records: Iterable[Any]) -> list[GpuEntry]:
    """GpuEntry per inventory record (``isolator.gpu.nvml.GpuRecord``)."""
    return [
        GpuEntry(
            index=r.gpu.index,
            minor=r.gpu.minor,
            uuid=r.gpu.uuid,
            mig_enabled=r.mig_enabled,
            mig_devices=tuple(r.mig_devices),
            usable=r.usable,
        )
        for r in records
    ]


def check_kind(kind: str) -> str:
    if not _KIND.fullmatch(kind):
        raise InvalidArgument(f"invalid CDI kind {kind!r} (expected vendor.com/class, e.g. {DEFAULT_KIND})")
    return kind


def _node(name: str, dev_root: str) -> dict[str, str]:
    """A device node at /dev/<name> in the container, read from <dev_root>/<name> on the host."""
    node = {"path": f"{CONTAINER_DEV}/{name}"}
    host = os.path.join(dev_root, name)
    if host != node["path"]:
        node["hostPath"] = host
    return node


def _mig_nodes(dev: MigDevice) -> list[str]:
    return [f"nvidia-caps/nvidia-cap{m}" for m in dev.caps_minors]


def build_spec(
    gpus: Sequence[GpuEntry],
    *,
    dev_root: str,
    control_nodes: Sequence[str],
    volume_path: str,
    volume_env: Sequence[tuple[str, str]],
    kind: str = DEFAULT_KIND,
    names: Sequence[str] = DEFAULT_NAME_STRATEGIES,
) -> dict[str, Any]:
    """The spec: each usable GPU and MIG device under the name of each strategy in ``names`` (``index``:
    ``0`` and ``0:1`` for GPU 0's MIG device in slot 1; ``uuid``: the UUIDs; ``type-index``: ``gpu0``
    and ``mig0:1``, as nvidia-ctk names them), and ``all``; the control nodes, the driver volume and
    its environment for every device.

    ``control_nodes`` are names under ``dev_root`` (``nvidiactl``, ``nvidia-uvm``...). A GPU in MIG
    mode named as a whole gets its MIG devices' caps nodes too, as the sidecar grants it. GPUs that
    are unhealthy, degraded or unidentified are left out (fail closed), with their MIG devices; so
    are MIG devices whose nvidia-caps minors are unknown (a holder could not use them).
    """
    check_kind(kind)
    unknown = [n for n in names if n not in NAME_STRATEGIES]
    if unknown or not names:
        known = ", ".join(NAME_STRATEGIES)
        raise InvalidArgument(f"unknown device name strategy {unknown or names!r} (known: {known})")
    devices: list[dict[str, Any]] = []
    every: list[str] = []

    def add(names: Iterable[str], nodes: list[str]) -> None:
        edits = {"deviceNodes": [_node(n, dev_root) for n in nodes]}
        for name in names:
            if not _DEVICE_NAME.fullmatch(name):
                raise FailedPrecondition(f"cannot name CDI device {name!r}: not a valid CDI device name")
            devices.append({"name": name, "containerEdits": edits})
        every.extend(n for n in nodes if n not in every)

    for gpu in sorted(gpus, key=lambda g: g.index):
        if not gpu.usable or gpu.minor < 0 or not gpu.uuid:
            continue
        migs = [d for d in gpu.mig_devices if len(d.caps_minors) == 2] if gpu.mig_enabled else []
        whole = [f"nvidia{gpu.minor}"] + [n for d in migs for n in _mig_nodes(d)]
        by = {"index": str(gpu.index), "uuid": gpu.uuid, "type-index": f"gpu{gpu.index}"}
        add(_unique(by[n] for n in names), whole)
        for pos, dev in enumerate(sorted(migs, key=lambda d: (d.slot, d.gpu_instance_id, d.compute_instance_id))):
            slot = dev.slot if dev.slot >= 0 else pos
            by = {"index": f"{gpu.index}:{slot}", "uuid": dev.uuid, "type-index": f"mig{gpu.index}:{slot}"}
            add(_unique(by[n] for n in names), [f"nvidia{gpu.minor}", *_mig_nodes(dev)])
    if not devices:
        raise FailedPrecondition("no usable GPU to describe: a CDI spec needs at least one device")
    add(["all"], list(every))
    env = [VOID_VISIBLE_DEVICES] + [f"{k}={v}" for k, v in volume_env]
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": kind,
        "devices": devices,
        "containerEdits": {
            "env": env,
            "deviceNodes": [_node(n, dev_root) for n in control_nodes],
            "mounts": [{"hostPath": volume_path, "containerPath": VOLUME_TARGET, "options": list(VOLUME_OPTIONS)}],
        },
    }
    spec["cdiVersion"] = minimum_version(spec)
    return spec


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


def minimum_version(spec: dict[str, Any]) -> str:
    """The lowest CDI spec version whose fields cover ``spec``'s (the rules of the spec's version table,
    SPEC.md, as specs-go/version.go's ``MinimumRequiredVersion`` applies them):

    * 0.4.0: a mount with a ``type``;
    * 0.5.0: a device node with a ``hostPath``, or a device name starting with a digit;
    * 0.6.0: ``annotations`` (spec or device), or a dot in the kind's class (after the ``/``);
    * 0.7.0: ``intelRdt`` or ``additionalGids`` (spec or device edits);
    * 0.8.0, 1.0.0: changed the Go API only; no content needs them;
    * 1.1.0: ``netDevices``, or ``intelRdt`` with ``schemata`` or ``enableMonitoring``.
    """
    edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec.get("devices", [])]
    rdt = [e["intelRdt"] for e in edits if e.get("intelRdt") is not None]
    if any(e.get("netDevices") for e in edits) or any(r.get("schemata") or r.get("enableMonitoring") for r in rdt):
        return "1.1.0"
    if rdt or any(e.get("additionalGids") for e in edits):
        return "0.7.0"
    cls = str(spec.get("kind", "")).partition("/")[2]
    if spec.get("annotations") or any(d.get("annotations") for d in spec.get("devices", [])) or "." in cls:
        return "0.6.0"
    digit_first = any(str(d.get("name", ""))[:1] in tuple("0123456789") for d in spec.get("devices", []))
    if digit_first or any(n.get("hostPath") for e in edits for n in e.get("deviceNodes", [])):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts", [])):
        return "0.4.0"
    return VERSIONS[0]


def render(spec: dict[str, Any], fmt: str = "json") -> str:
    """The spec as JSON or YAML (nvidia-ctk's default). YAML quotes every string a YAML 1.1 reader
    would take for something else (``'0'``, ``'1:0'``, which YAML 1.1 reads as the base-60 integer 60),
    so the CDI library's loader reads back exactly the strings written."""
    if fmt == "yaml":
        import yaml  # the one place outside the CLI's -o yaml that needs it (docs/dependencies.md)

        class Dumper(yaml.SafeDumper):
            def ignore_aliases(self, data: Any) -> bool:
                return True  # devices share their edits: written out in full, as nvidia-ctk does, no &id001

        text = yaml.dump(spec, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=1 << 16)
        return str(text)
    if fmt != "json":
        raise InvalidArgument(f"unknown CDI spec format {fmt!r} (known: {', '.join(FORMATS)})")
    return json.dumps(spec, indent=2) + "\n"


def format_of(filename: str) -> str:
    """The format a spec file's name asks for: runtimes read ``*.json`` and ``*.yaml`` only."""
    return "yaml" if filename.endswith((".yaml", ".yml")) else "json"


def write_spec(
    spec: dict[str, Any], directory: str, filename: str = SPEC_FILE, fmt: str | None = None
) -> tuple[str, bool]:
    """Write the spec atomically (mode 0644, as nvidia-ctk) as ``fmt`` (default: as the file name says);
    returns (path, changed).

    An unchanged spec is not rewritten, so runtimes that watch the directory are not woken for nothing.
    """
    os.makedirs(directory, mode=0o755, exist_ok=True)
    path = os.path.join(directory, filename)
    text = render(spec, fmt or format_of(filename))
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text:
                return path, False
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".tmp")  # not *.json: runtimes scan those
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path, True


# ---- reading the spec directories: ``gpu-isolator cdi list`` ---------------------------------------


@dataclass(frozen=True)
class Listing:
    """What a CDI runtime would see in the spec directories: its devices by qualified name
    (``nvidia.com/gpu=0``) with the file that defines each, and the problems that cost devices."""

    devices: dict[str, str]
    problems: tuple[str, ...]


# The fields a CDI library loads (specs-go/config.go's JSON tags at spec 1.1.0); loading fails on any other.
_SPEC_FIELDS = frozenset({"cdiVersion", "kind", "annotations", "devices", "containerEdits"})
_DEVICE_FIELDS = frozenset({"name", "annotations", "containerEdits"})
_EDITS_FIELDS = frozenset({"env", "deviceNodes", "mounts", "hooks", "intelRdt", "additionalGids", "netDevices"})
_ITEM_FIELDS = {
    "deviceNodes": frozenset({"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}),
    "mounts": frozenset({"hostPath", "containerPath", "options", "type"}),
    "hooks": frozenset({"hookName", "path", "args", "env", "timeout"}),
}


def _check_fields(value: Any, known: frozenset[str], where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} is not a mapping")
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise InvalidArgument(f"unknown field '{unknown[0]}' in {where}")
    return value


def _check_edits(edits: Any, where: str) -> None:
    edits = _check_fields(edits, _EDITS_FIELDS, where)
    for key, fields in _ITEM_FIELDS.items():
        items = edits.get(key) or []
        if not isinstance(items, list):
            raise InvalidArgument(f"{key} in {where} is not a list")
        for item in items:
            _check_fields(item, fields, f"{key} of {where}")


def _check_version(spec: dict[str, Any]) -> None:
    """As the CDI library's validateVersion: a known version, and at least what the fields need."""
    declared = spec.get("cdiVersion")
    if declared is None:
        raise InvalidArgument("no cdiVersion")
    if str(declared) not in VERSIONS:
        raise InvalidArgument(f"unknown cdiVersion '{declared}' (known: {', '.join(VERSIONS)})")
    needed = minimum_version(spec)
    if VERSIONS.index(str(declared)) < VERSIONS.index(needed):
        raise InvalidArgument(f"cdiVersion {declared} is below {needed}, which the spec's fields need")


def device_names(spec: Any) -> list[str]:
    """The qualified names a spec defines; InvalidArgument when a runtime would refuse the spec: an
    unknown field, an unknown cdiVersion or one below what the fields need, a bad kind or name."""
    if not isinstance(spec, dict):
        raise InvalidArgument("not a CDI spec: not a mapping")
    unknown = sorted(str(k) for k in spec if k not in _SPEC_FIELDS)
    if unknown:
        raise InvalidArgument(f"unknown field '{unknown[0]}'")
    kind = spec.get("kind")
    if not isinstance(kind, str):
        raise InvalidArgument("not a CDI spec: no kind")
    check_kind(kind)
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        raise InvalidArgument("a CDI spec needs at least one device")
    if "containerEdits" in spec:
        _check_edits(spec["containerEdits"], "containerEdits")
    out = []
    for device in devices:
        name = device.get("name") if isinstance(device, dict) else None
        if not isinstance(name, str) or not _DEVICE_NAME.fullmatch(name):
            raise InvalidArgument(f"invalid CDI device name {name!r}")
        _check_fields(device, _DEVICE_FIELDS, f"device '{name}'")
        if "containerEdits" in device:
            _check_edits(device["containerEdits"], f"containerEdits of device '{name}'")
        out.append(f"{kind}={name}")
    if len(out) != len(set(out)):
        raise InvalidArgument("a device name is defined twice")
    _check_version(spec)
    return out


def parse_spec(text: str, path: str) -> Any:
    """A spec file's content (JSON is YAML too: the CDI library reads both with one YAML parser)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"cannot parse '{path}': {exc}") from exc


def list_specs(specs: Sequence[tuple[int, str, Any]]) -> Listing:
    """(priority, path, parsed spec) in, the devices a CDI runtime resolves out (pkg/cdi/cache.go's
    refresh): a higher priority (a later directory) overrides a device; the same device in two specs of
    one priority is a conflict, and the device is dropped altogether; a spec a runtime refuses counts
    for nothing."""
    chosen: dict[str, tuple[int, str]] = {}
    conflicts: dict[str, list[str]] = {}
    problems = []
    for priority, path, spec in sorted(specs, key=lambda s: (s[0], s[1])):
        try:
            names = device_names(spec)
        except InvalidArgument as exc:
            problems.append(f"'{path}': {exc.message}")
            continue
        for name in names:
            held = chosen.get(name)
            if held is not None and held[0] == priority:
                conflicts.setdefault(name, [held[1]]).append(path)
                continue
            chosen[name] = (priority, path)
    for name, paths in sorted(conflicts.items()):
        chosen.pop(name, None)
        problems.append(f"conflicting device {name} (specs {', '.join(repr(p) for p in paths)}): dropped")
    return Listing(devices={name: chosen[name][1] for name in sorted(chosen)}, problems=tuple(problems))


def read_spec_dirs(directories: Sequence[str]) -> Listing:
    """``list_specs`` over the ``*.json`` and ``*.yaml`` files of ``directories`` (lowest priority
    first, as SPEC_DIRS); a missing directory holds nothing, an unreadable file is a problem."""
    specs: list[tuple[int, str, Any]] = []
    problems: list[str] = []
    for priority, directory in enumerate(directories):
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"failed to read '{directory}': {exc.strerror}")
            continue
        for name in names:
            path = os.path.join(directory, name)
            if not name.endswith((".json", ".yaml")) or not os.path.isfile(path):
                continue
            try:
                with open(path, encoding="utf-8") as fh:
                    specs.append((priority, path, parse_spec(fh.read(), path)))
            except (OSError, UnicodeDecodeError) as exc:
                problems.append(f"failed to read '{path}': {getattr(exc, 'strerror', None) or exc}")
            except InvalidArgument as exc:
                problems.append(exc.message)
    listing = list_specs(specs)
    return Listing(devices=listing.devices, problems=(*problems, *listing.problems))
