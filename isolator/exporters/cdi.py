"""A CDI spec of the GPUs, MIG devices and driver volume this sidecar manages (docs: README, "CDI").

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
) -> dict[str, Any]:
    """The spec: each usable GPU by index and by UUID, each MIG device by ``<gpu>:<slot>`` and UUID,
    and ``all``; the control nodes, the driver volume and its environment for every device.

    ``control_nodes`` are names under ``dev_root`` (``nvidiactl``, ``nvidia-uvm``...). A GPU in MIG
    mode named as a whole gets its MIG devices' caps nodes too, as the sidecar grants it. GPUs that
    are unhealthy, degraded or unidentified are left out (fail closed), with their MIG devices; so
    are MIG devices whose nvidia-caps minors are unknown (a holder could not use them).
    """
    check_kind(kind)
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
        add([str(gpu.index), gpu.uuid], whole)
        for pos, dev in enumerate(sorted(migs, key=lambda d: (d.slot, d.gpu_instance_id, d.compute_instance_id))):
            slot = dev.slot if dev.slot >= 0 else pos
            add([f"{gpu.index}:{slot}", dev.uuid], [f"nvidia{gpu.minor}", *_mig_nodes(dev)])
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


def render(spec: dict[str, Any]) -> str:
    return json.dumps(spec, indent=2) + "\n"


def write_spec(spec: dict[str, Any], directory: str, filename: str = SPEC_FILE) -> tuple[str, bool]:
    """Write the spec atomically (mode 0644, as nvidia-ctk); returns (path, changed).

    An unchanged spec is not rewritten, so runtimes that watch the directory are not woken for nothing.
    """
    os.makedirs(directory, mode=0o755, exist_ok=True)
    path = os.path.join(directory, filename)
    text = render(spec)
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
