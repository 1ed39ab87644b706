"""The agent's ``--attributes`` for its GPUs (``gpu-isolator attributes``), so that frameworks can place
tasks by GPU model, memory, driver, CUDA version and MIG capability. Pure: GPU records in, the string out.

Mesos's grammar (docs/attributes-resources.md; src/common/attributes.cpp and values.cpp, which parse
the flag): ``name:value`` pairs separated by ``;`` (or a newline), split at the first ``:``; the
value is a range when it starts with ``[``, refused for an attribute when it starts with ``{`` (a
set), a scalar when the whole of it parses as a double, and text otherwise. Every space is removed
before that, so ``Tesla V100-SXM2-16GB`` would silently become ``TeslaV100-SXM2-16GB``; the documented
text alphabet is ``[a-zA-Z0-9_/.-]``. ``mesos_type`` models that parse, and the attributes built
here are checked against it (``tests/mesos/`` runs Mesos's own parser on them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from isolator.model import GpuRecord
from isolator.policy import mig
from isolator.policy import shares as sharing

TEXT_ALPHABET = re.compile(r"[A-Za-z0-9_/.-]+")
_NOT_TEXT = re.compile(r"[^A-Za-z0-9_/.-]+")
# What Mesos's values::parse takes for a scalar (tests/mesos/test_attributes_parse.py runs it): a
# decimal float with an optional "+" ("0x10" stays text). A negative number, "inf" and "nan" also
# parse as doubles, and then Mesos 1.11 refuses them ("Negative values not supported": the agent
# aborts) while 1.12 reads them as text: unusable either way, so "invalid" here.
_DOUBLE = re.compile(r"[+]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_REFUSED_DOUBLE = re.compile(r"-(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:inf(?:inity)?|nan)", re.IGNORECASE)
MIXED = "mixed"


def mesos_type(value: str) -> str:
    """``scalar``, ``ranges``, ``text``, or ``invalid``: what Mesos makes of an attribute's value."""
    value = value.replace(" ", "")
    if not value or any(value.count(a) != value.count(b) for a, b in ("{}", "[]", "()")):
        return "invalid"
    if value.startswith("["):
        return "ranges"
    if "[" in value or "{" in value:
        return "invalid"  # a set ({...}) is not an attribute; a bracket inside is refused
    if _REFUSED_DOUBLE.fullmatch(value):
        return "invalid"
    return "scalar" if _DOUBLE.fullmatch(value) else "text"


def text_value(raw: str) -> str:
    """``raw`` as Mesos text: each run of characters outside the text alphabet (a space above all) is
    one ``-``; ``Tesla V100-SXM2-16GB`` -> ``Tesla-V100-SXM2-16GB``."""
    text = _NOT_TEXT.sub("-", raw.strip()).strip("-")
    text = re.sub(r"-{2,}", "-", text)
    return text or "unknown"


def model_text(raw: str) -> str:
    """A GPU model name as ``gpu_model``'s text: ``text_value``, and ``gpu-`` before one that Mesos
    would read as a number or refuse (``1080``, ``1e5``, ``inf``): the attribute's type must not
    depend on the model, or a framework's constraint on it breaks on some nodes."""
    text = text_value(raw)
    return text if mesos_type(text) == "text" else f"gpu-{text}"


def attributes(records: Sequence[GpuRecord], driver_version: str, cuda_version: str) -> list[tuple[str, str]]:
    """(name, value) in a fixed order. With no GPUs only ``gpu_count:0``.

    * ``gpu_count``: the GPUs this sidecar manages (scalar);
    * ``gpu_model``: their model as text (``model_text``), or ``mixed`` when they differ: the
      allocator, not the framework, chooses which GPUs a task gets, so on a mixed node no model can
      be promised;
    * ``gpu_memory_mib``: the smallest GPU's memory in MiB (scalar): what any task can count on;
    * ``gpu_mig_capable``: ``true``, ``false`` or ``mixed``;
    * ``nvidia_driver``: the driver version as NVML reports it (``535.104.05``, text; a two-part
      version such as ``418.67`` is a scalar to Mesos) and ``nvidia_driver_major`` (scalar);
    * ``cuda_version``: the newest CUDA the driver supports, ``major.minor`` (scalar), and
      ``cuda_version_major`` (scalar), for comparisons where a framework has them.
    """
    out: list[tuple[str, str]] = [("gpu_count", str(len(records)))]
    if not records:
        return out
    models = sorted({model_text(r.gpu.name) for r in records})
    out.append(("gpu_model", models[0] if len(models) == 1 else MIXED))
    memory = min(r.gpu.memory_total for r in records) // 2**20
    out.append(("gpu_memory_mib", str(memory)))
    capable = {r.mig_capable for r in records}
    out.append(("gpu_mig_capable", MIXED if len(capable) > 1 else str(capable.pop()).lower()))
    driver = driver_version.strip()
    if driver:
        out.append(("nvidia_driver", text_value(driver)))
        major = driver.split(".", 1)[0]
        if major.isdigit():
            out.append(("nvidia_driver_major", major))
    cuda = cuda_version.strip()
    m = re.fullmatch(r"(\d+)\.(\d+)", cuda)
    if m:
        out.append(("cuda_version", cuda))
        out.append(("cuda_version_major", m.group(1)))
    return out


def share_attributes(records: Sequence[GpuRecord], shared: Mapping[int, sharing.SharedGpu]) -> list[tuple[str, str]]:
    """(name, value) describing the shared GPUs (docs/sharing.md), one group per size N, sizes ascending,
    so that a framework asking ``gpu-share-<N>:1`` can constrain on what that unit is:

    * ``gpu_share_<N>_gpus``: how many GPUs are cut N ways (scalar);
    * ``gpu_share_<N>_mode``: ``mps``, ``time-slice`` or ``mixed`` when they differ (text);
    * ``gpu_share_<N>_memory_mib``: one Nth of the smallest such GPU's memory in MiB (scalar): under
      MPS the pinned limit every unit gets, time-sliced what a unit may count on (nothing enforces it).

    Nothing when no GPU is shared."""
    memory = {r.gpu.minor: r.gpu.memory_total // 2**20 for r in records}
    sizes: dict[int, list[sharing.SharedGpu]] = {}
    for g in shared.values():
        sizes.setdefault(g.shares, []).append(g)
    out: list[tuple[str, str]] = []
    for n in sorted(sizes):
        gpus = sizes[n]
        modes = sorted({str(g.mode) for g in gpus})
        out.append((f"gpu_share_{n}_gpus", str(len(gpus))))
        out.append((f"gpu_share_{n}_mode", modes[0] if len(modes) == 1 else MIXED))
        known = [memory[g.minor] for g in gpus if g.minor in memory]
        if known:
            out.append((f"gpu_share_{n}_memory_mib", str(min(known) // n)))
    return out


def agent_flags(
    records: Sequence[GpuRecord], shared: Mapping[int, sharing.SharedGpu], driver_version: str, cuda_version: str
) -> tuple[str, list[tuple[str, str]]]:
    """The agent's ``--resources`` (``gpus:N;gpu-share-<S>:U...;mig-<profile>:M...``) and ``--attributes``
    pairs for these GPUs (``share_attributes`` after the others): ``gpus`` counts the GPUs neither in
    MIG mode (docs/mig.md) nor shared (docs/sharing.md). Offline (``gpu-isolator resources``) and from
    the running sidecar alike."""
    whole = sum(1 for r in records if not r.mig_enabled and r.gpu.minor not in shared)
    line = mig.agent_resources(whole, [d for r in records if r.mig_enabled for d in r.mig_devices])
    head, sep, rest = line.partition(";")
    resources = sharing.agent_resources(int(head.removeprefix("gpus:")), shared) + sep + rest
    return resources, attributes(records, driver_version, cuda_version) + share_attributes(records, shared)


def render(pairs: Sequence[tuple[str, str]]) -> str:
    """The ``--attributes`` flag's value; every pair is checked against Mesos's parse first."""
    for name, value in pairs:
        if not name or any(c in name for c in ":; \n") or mesos_type(value) == "invalid" or " " in value:
            raise ValueError(f"attribute {name}:{value} is not one Mesos parses as written")
    return ";".join(f"{name}:{value}" for name, value in pairs)


def typed(pairs: Sequence[tuple[str, str]]) -> dict[str, int | float | str]:
    """Each attribute's value as Mesos types it: a number for a scalar, a string for text."""
    out: dict[str, int | float | str] = {}
    for name, value in pairs:
        number = float(value) if mesos_type(value) == "scalar" else None
        out[name] = value if number is None else int(number) if number.is_integer() else number
    return out
