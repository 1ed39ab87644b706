"""Which GPUs the sidecar manages, from ``--nvidia-gpu-devices`` and ``--resources``, as Mesos decides.

Pure: flags and the number of GPUs NVML reports in, a decision or a ConfigError out. Mirrors
Mesos's enumerateGpuResources (src/slave/containerizer/mesos/isolators/gpu/allocator.cpp) and the
twelve cases of its FlagValidation test (reference/mesos-gpu-isolator.md sections 2.3 and 3.1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from isolator.errors import ConfigError, GpusUnavailable

DEVICES_FLAG = "'--nvidia-gpu-devices'"


@dataclass(frozen=True)
class GpuFlags:
    """The outcome: the ``gpus`` resource to advertise (None: none) and the NVML indices to manage."""

    gpus: int | None
    indices: tuple[int, ...] = ()
    discovered: bool = False  # True when the GPUs were auto-discovered rather than listed


def parse_gpus(resources: str) -> float | None:
    """The total of the ``gpus`` entries of an agent ``--resources`` string; None when it has none.

    Both Mesos forms are accepted: ``cpus:1;gpus(role):2`` and the JSON array of Resource objects.
    """
    text = resources.strip()
    if not text:
        return None
    found = False
    total = 0.0
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"invalid --resources JSON: {exc}") from exc
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and item.get("name") == "gpus":
                found = True
                value = (item.get("scalar") or {}).get("value")
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise ConfigError("The 'gpus' resource must be a scalar")
                total += float(value)
        return total if found else None
    for entry in text.split(";"):
        name, sep, value = entry.partition(":")
        if not sep:
            continue
        if name.split("(", 1)[0].strip() != "gpus":
            continue
        found = True
        try:
            total += float(value.strip())
        except ValueError:
            raise ConfigError(f"The 'gpus' resource must be a scalar, got {value.strip()!r}") from None
    return total if found else None


def wants_nvml(resources: str, devices: tuple[int, ...] | None, isolation: bool = True) -> bool:
    """Whether deciding needs NVML at all: not for ``gpus:0`` (the opt-out) nor without isolation."""
    if not isolation:
        return False
    gpus = parse_gpus(resources)
    return not (gpus == 0 and not devices)


def decide(
    resources: str,
    devices: tuple[int, ...] | None,
    available: int | None,
    isolation: bool = True,
    nvml_problem: str = "",
) -> GpuFlags:
    """Mesos's decision sequence. ``available`` is NVML's GPU count, None when NVML is not found.

    ``isolation`` is Mesos's "gpu/nvidia in --isolation"; the sidecar always isolates, but the
    argument keeps the three pass-through cases of FlagValidation expressible.
    """
    if devices is not None and not isolation:
        raise ConfigError(f"{DEVICES_FLAG} can only be specified if GPU isolation ('gpu/nvidia') is enabled")
    gpus = parse_gpus(resources)
    if not isolation:
        # Advertised but not isolated: no validation, as Mesos does.
        return GpuFlags(gpus=None if gpus is None else int(gpus))
    if gpus is not None and (not math.isfinite(gpus) or gpus < 0 or gpus != math.floor(gpus)):
        # Mesos checks this on milli-units; its message reads "must be an non-negative integer".
        raise ConfigError("The 'gpus' resource must be a non-negative integer")
    if gpus == 0:
        if devices is not None:
            raise ConfigError(f"{DEVICES_FLAG} cannot be specified when '--resources' specifies 0 GPUs")
        return GpuFlags(gpus=None)  # the explicit opt-out from auto-discovery
    if devices is not None and gpus is None:
        raise ConfigError(f"{DEVICES_FLAG} cannot be set without also setting 'gpus' in '--resources'")
    if gpus is not None and devices is None:
        raise ConfigError(f"The 'gpus' resource cannot be set without also setting {DEVICES_FLAG}")
    if gpus is not None and devices is not None:
        if len(set(devices)) != len(devices):
            raise ConfigError(f"{DEVICES_FLAG} contains duplicates")
        if len(devices) != int(gpus):
            raise ConfigError(f"'--resources' and {DEVICES_FLAG} specify different numbers of GPU devices")
        if available is None:
            raise GpusUnavailable(f"gpus requested but NVML not found{': ' + nvml_problem if nvml_problem else ''}")
        if int(gpus) > available:
            raise GpusUnavailable(
                "The number of GPUs requested is greater than the number of GPUs available on the machine"
            )
        missing = sorted(i for i in devices if i >= available)
        if missing:
            # Mesos fails later, in deviceGetHandleByIndex ("GPU device not found"); we say it here.
            raise GpusUnavailable(
                f"{DEVICES_FLAG} names GPU {missing[0]}, but NVML reports GPUs 0-{available - 1} only"
            )
        return GpuFlags(gpus=int(gpus), indices=tuple(devices))
    # Auto-discovery: every GPU NVML reports. Without NVML there is nothing to discover.
    if available is None:
        return GpuFlags(gpus=None, discovered=True)
    return GpuFlags(gpus=available, indices=tuple(range(available)), discovered=True)
