"""The renderers: an Admin answer (its JSON shape, docs/cli.md) as text for people, and the structured
forms (``-o json|yaml``). With ``emit`` and ``fail``, the only code that prints.

The JSON form is the stable contract; these tables are for reading and may change. Each admin
command's row in ``isolator.cli.admin`` names its renderer here: ``(data, now, wide) -> text``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any


def emit(text: str) -> None:
    sys.stdout.write(text)
    if not text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()


def fail(message: str) -> None:
    print(f"gpu-isolator: {message}", file=sys.stderr)


# The answers' times (proto ``double``, seconds since the epoch): every output format shows them as
# ISO 8601 UTC, the tables as JSON and YAML; 0 (never) is null there and "-" in a table.
TIME_FIELDS = frozenset({"created", "last_xid_time", "drain_since", "maintenance_since", "since", "ended", "timestamp"})


def iso8601(seconds: float) -> str:
    """``2026-11-25T15:37:05Z``: the sidecar's own messages write times so."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def with_iso_times(data: Any) -> Any:
    """``data`` with every time field (TIME_FIELDS, at any depth) as ISO 8601 UTC, or None when unset."""
    if isinstance(data, dict):
        return {
            k: (iso8601(float(v)) if v else None)
            if k in TIME_FIELDS and isinstance(v, int | float) and not isinstance(v, bool)
            else with_iso_times(v)
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [with_iso_times(v) for v in data]
    return data


def structured(data: dict[str, Any], output: str) -> str:
    """``-o json`` or ``-o yaml``: the same shape, keys sorted."""
    if output == "json":
        return json.dumps(data, indent=2, sort_keys=True)
    import yaml  # only here and in CDI: the other commands do not pay for the import

    return str(yaml.safe_dump(data, sort_keys=True, default_flow_style=False, allow_unicode=True))


# ---- each admin command's renderer ------------------------------------------------------------------


def gpus(data: dict[str, Any], now: float, wide: bool) -> str:
    return _gpus_table(data, wide)


def topology(data: dict[str, Any], now: float, wide: bool) -> str:
    return _topology_matrix(data)


def containers(data: dict[str, Any], now: float, wide: bool) -> str:
    return _containers_table(data, now, wide)


def describe(data: dict[str, Any], now: float, wide: bool) -> str:
    return _describe_text(data, now)


def volume(data: dict[str, Any], now: float, wide: bool) -> str:
    return _volume_text(data)


def health(data: dict[str, Any], now: float, wide: bool) -> str:
    return _health_table(data)


def detail(data: dict[str, Any], now: float, wide: bool) -> str:
    """A change's one line (``release``, ``drain``)."""
    return str(data.get("detail", ""))


def undrain(data: dict[str, Any], now: float, wide: bool) -> str:
    return "\n".join([str(data.get("detail", "")), *(f"  reset {r}" for r in data.get("reset", []))])


def audit(data: dict[str, Any], now: float, wide: bool) -> str:
    return _audit_text(data)


def drain_history(data: dict[str, Any], now: float, wide: bool) -> str:
    """The ended maintenance drains, oldest end first: the audit trail of ``drain`` and ``undrain``."""
    drains = data.get("drains", [])
    if not drains:
        return "No maintenance drain has ended."
    rows = [
        dict(
            d,
            since=_when(float(d.get("since") or 0)),
            ended=_when(float(d.get("ended") or 0)),
            end_reason=d.get("end_reason") or "-",
        )
        for d in drains
    ]
    columns = [
        ("uuid", "GPU"),
        ("since", "DRAINED"),
        ("by", "BY"),
        ("reason", "REASON"),
        ("ended", "ENDED"),
        ("ended_by", "ENDED BY"),
        ("end_reason", "END REASON"),
    ]
    return table(rows, columns)


# ---- the tables ---------------------------------------------------------------------------------------


def _audit_text(data: dict[str, Any]) -> str:
    repaired = data.get("repaired", [])
    checked = int(data.get("checked", 0))
    head = f"checked {checked} container{'' if checked == 1 else 's'}: "
    head += f"re-applied {len(repaired)}" if repaired else "kernel rules agree with the records"
    lines = [head, *(f"  {line}" for line in repaired)]
    lines.append(f"repairs since the sidecar started: {data.get('repairs_total', 0)}")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str]], indent: str = "") -> str:
    header = [title for _, title in columns]
    body = [["" if r.get(key) is None else str(r.get(key)) for key, _ in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)).rstrip() for b in body]
    return "\n".join(indent + line for line in lines)


def _when(seconds: float) -> str:
    return iso8601(seconds) if seconds else "-"


def _age(created: float, now: float) -> str:
    """kubectl's habit: one or two units, coarser as it grows."""
    s = max(0, int(now - created))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m" if s >= 600 else f"{s // 60}m{s % 60}s"
    if s < 86400:
        return f"{s // 3600}h" if s >= 36000 else f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 86400}d" if s >= 864000 else f"{s // 86400}d{s % 86400 // 3600}h"


def _list(values: Sequence[Any]) -> str:
    return ",".join(str(v) for v in values) if values else "-"


def _depth(cid: dict[str, Any]) -> int:
    depth = 0
    while "parent" in cid:
        cid = cid["parent"]
        depth += 1
    return depth


def _tree_branch() -> str:
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
    return "└─ " if encoding == "utf8" else "`- "


def _container_rows(containers: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    branch = _tree_branch()
    rows = []
    for c in containers:
        depth = _depth(c.get("container_id", {}))
        name = c.get("id", "") if not depth else "   " * (depth - 1) + branch + c["container_id"]["value"]
        indices = c.get("gpu_indices", [])
        # How many, then which (NVML indices): "1 [0]" is one GPU, GPU 0; a bare index read as a count.
        gpus = f"{len(indices)} [{_list(indices)}]" if indices else "0 (none asked)"
        if c.get("shares"):
            # gpu_shares (docs/sharing.md): "1/4 of [4]" is one of GPU 4's four shares.
            gpus = f"{c['shares']}/{c.get('shares_total', 0)} of [{c.get('share_gpu_index', 0)}]"
            indices = [c.get("share_gpu_index", 0)]
        rows.append(
            dict(
                c,
                name=name,
                # A nested container uses its parent's GPUs; the parentheses say they are not its own.
                gpus=f"({gpus})" if c.get("nested") and indices else ("-" if c.get("nested") else gpus),
                volume=c.get("volume_version") or "-",
                age=_age(float(c.get("created", now)), now),
            )
        )
    return rows


def _containers_table(data: dict[str, Any], now: float, wide: bool = False) -> str:
    containers = data.get("containers", [])
    if not containers:
        return "No containers."
    rows = _container_rows(containers, now)
    for row in rows:
        row["minors"] = _list(row.get("gpu_minors") or [])
        row["uuids"] = _list(row.get("gpu_uuids") or [])
        row["used"] = _usage_summary(row.get("usage") or [])
    more = [("minors", "MINORS"), ("uuids", "UUIDS")] if wide else []
    return table(
        rows,
        [
            ("name", "CONTAINER"),
            ("gpus", "GPUS"),
            ("used", "GPU USE"),
            ("state", "STATE"),
            ("mode", "MODE"),
            ("volume", "VOLUME"),
            ("age", "AGE"),
            ("cgroup", "CGROUP"),
            *more,
        ],
    )


def _mib(value: Any) -> str:
    return f"{int(value or 0) // 2**20}"


def _sm_text(d: dict[str, Any]) -> str:
    return "N/A" if d.get("sm_utilization_percent") is None else f"{int(d['sm_utilization_percent'])}%"


def _usage_summary(usage: list[dict[str, Any]]) -> str:
    """What a container's processes use, one device after another: "1024/16160 MiB 37%" (memory
    used of what it may use, SM utilisation), "OVER" for a share past its slice, "N/A" where NVML
    could not say; "-" for nothing held (nested containers count for their top-level one)."""
    parts = []
    for d in usage:
        if d.get("error"):
            parts.append("N/A")
            continue
        text = f"{_mib(d.get('memory_used_bytes'))}/{_mib(d.get('memory_limit_bytes'))} MiB {_sm_text(d)}"
        parts.append(text + (" OVER" if d.get("over") else ""))
    return ", ".join(parts) if parts else "-"


def _usage_lines(usage: list[dict[str, Any]]) -> list[str]:
    """``describe``'s table of what the container's processes use on each device it holds."""
    if not usage:
        return ["GPU use: none held"]
    rows = [
        dict(
            d,
            memory="N/A" if d.get("error") else f"{_mib(d.get('memory_used_bytes'))} MiB",
            limit=f"{_mib(d.get('memory_limit_bytes'))} MiB",
            sm="N/A" if d.get("error") else _sm_text(d),
            over="OVER its slice" if d.get("over") else "-",
            pids=_list(d.get("pids") or []),
        )
        for d in usage
    ]
    lines = [
        "GPU use (its processes, attributed by cgroup):",
        table(
            rows,
            [
                ("uuid", "DEVICE"),
                ("kind", "KIND"),
                ("memory", "MEMORY"),
                ("limit", "MAY USE"),
                ("sm", "SM"),
                ("over", "OVER"),
                ("pids", "PIDS"),
            ],
            indent="  ",
        ),
    ]
    lines += [f"  {d.get('uuid', '')}: NVML could not say: {d['error']}" for d in usage if d.get("error")]
    return lines


def _health_text(g: dict[str, Any]) -> str:
    if g.get("healthy"):
        return "healthy"
    xid = int(g.get("last_xid") or 0)
    if xid:
        return f"UNHEALTHY: XID {xid} at {_when(float(g.get('last_xid_time') or 0))}"
    return f"UNHEALTHY: {g.get('health_reason') or 'unknown'}"


def _gpu_rows(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for g in gpus:
        numa = int(g.get("numa_node", -1))
        rows.append(
            dict(
                g,
                minor=g.get("minor", 0) if g.get("uuid") else "?",
                memory=f"{int(g.get('memory_total_bytes', 0)) // 2**20} MiB",
                numa="N/A" if numa < 0 else numa,
                health=_health_text(g),
                mig="on" if g.get("mig_enabled") else "-",
                holder=g.get("holder") or _sharers_text(g) or "-",
                handover=_handover_text(g),
                drained="yes" if g.get("maintenance") else "-",
                shares=_shares_text(g),
            )
        )
    return rows


def _shares_text(g: dict[str, Any]) -> str:
    """``2/4 mps (running)``: shares held of the GPU's total, its mode and MPS daemon (docs/sharing.md)."""
    total = int(g.get("shares_total") or 0)
    if not total:
        return "-"
    text = f"{int(g.get('shares_held') or 0)}/{total} {g.get('share_mode', '')}"
    return text + (f" ({g['mps_state']})" if g.get("mps_state") else "")


def _sharers_text(g: dict[str, Any]) -> str:
    return ",".join(f"{h.get('holder', '')}:{int(h.get('shares') or 0)}" for h in g.get("share_holders") or ())


def _handover_text(g: dict[str, Any]) -> str:
    state = g.get("drain_state") or ""
    if not state:
        return "-"
    pids = g.get("drain_pids") or []
    return state.upper() + (f" (pids {_list(pids)})" if pids else "")


def _handover_lines(gpus: list[dict[str, Any]]) -> list[str]:
    """Why each draining GPU is kept out and since when, and what the last handovers reset."""
    lines = []
    drained = [g for g in gpus if g.get("maintenance")]
    if drained:
        lines += [
            "",
            "Drained for maintenance (no new grants; their holders keep them; `gpu-isolator undrain GPU` ends it)",
        ]
        for g in drained:
            since = _when(float(g.get("maintenance_since") or 0))
            who = g.get("maintenance_by") or "unknown caller"
            lines.append(f"  GPU {g.get('index', 0)}: since {since} by {who}: {g.get('maintenance_reason', '')}")
    draining = [g for g in gpus if g.get("drain_state")]
    if draining:
        lines += [
            "",
            "Kept out by the handover check (handed out again once nothing runs on them;"
            " `gpu-isolator undrain --handover GPU` forces it)",
        ]
        for g in draining:
            since = _when(float(g.get("drain_since") or 0))
            lines.append(f"  GPU {g.get('index', 0)}: {g['drain_state']} since {since}: {g.get('drain_reason', '')}")
    reset = [g for g in gpus if g.get("last_reset")]
    if reset:
        lines += ["", "Reset at the last handover"]
        lines += [f"  GPU {g.get('index', 0)}: {line}" for g in reset for line in g["last_reset"]]
    return lines


def _gpus_table(data: dict[str, Any], wide: bool = False) -> str:
    header = f"Driver {data.get('driver_version') or 'N/A'}, CUDA {data.get('cuda_driver_version') or 'N/A'}"
    if data.get("sidecar_version"):
        header += f"; gpu-isolator {data['sidecar_version']}"
    if not data.get("gpus"):
        return header + "\nNo GPUs managed."
    text = table(
        _gpu_rows(data.get("gpus", [])),
        [
            ("index", "INDEX"),
            ("minor", "MINOR"),
            ("uuid", "UUID"),
            ("name", "NAME"),
            ("memory", "MEMORY"),
            ("numa", "NUMA"),
            ("pci_bus_id", "BUS-ID"),
            ("mig", "MIG"),
            ("health", "HEALTH"),
            ("drained", "DRAINED"),
            ("handover", "HANDOVER"),
            ("shares", "SHARES"),
            ("holder", "HOLDER"),
            *([("cpu_affinity", "CPU AFFINITY")] if wide else []),
        ],
    )
    handover = _handover_lines(data.get("gpus", []))
    text += "\n".join(["", *handover]) if handover else ""
    migs = _mig_rows(data.get("gpus", []))
    if migs:
        text += "\n\nMIG devices\n" + table(
            migs,
            [
                ("gpu", "GPU"),
                ("slot", "SLOT"),
                ("gpu_instance_id", "GI"),
                ("compute_instance_id", "CI"),
                ("profile", "PROFILE"),
                ("resource", "RESOURCE"),
                ("memory", "MEMORY"),
                ("uuid", "UUID"),
                ("caps", "CAPS"),
                ("holder", "HOLDER"),
            ],
        )
    return header + "\n" + text


def _mig_rows(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for g in gpus:
        for m in g.get("mig_devices") or ():
            rows.append(
                dict(
                    m,
                    gpu=g.get("index", 0),
                    slot=m.get("slot", 0),
                    gpu_instance_id=m.get("gpu_instance_id", 0),
                    compute_instance_id=m.get("compute_instance_id", 0),
                    resource=m.get("resource") or "(not offered)",
                    memory=f"{int(m.get('memory_total_bytes', 0)) // 2**20} MiB",
                    caps=",".join(str(c) for c in m.get("caps_minors") or ()) or "MISSING",
                    holder=m.get("holder") or "-",
                )
            )
    return rows


def _describe_text(data: dict[str, Any], now: float) -> str:
    c = data.get("container", {})
    created = float(c.get("created", now))
    fields = [
        ("Container", c.get("id", "")),
        ("Nested", "yes: it uses its top-level container's GPUs" if c.get("nested") else "no"),
        ("State", c.get("state", "")),
        ("Mode", c.get("mode", "")),
        ("Created", f"{_when(created)} ({_age(created, now)} ago)"),
        ("Cgroup", c.get("cgroup", "")),
        ("Volume", c.get("volume_version") or "-"),
        ("Shares", _container_shares_text(c)),  # gpu_shares (docs/sharing.md)
        ("Processes", _list(data.get("pids", []))),
        ("Affinity", _affinity_text(data)),  # --cpu-affinity (docs/affinity.md)
    ]
    width = max(len(k) for k, _ in fields) + 2
    lines = [f"{k + ':':<{width}}{v}" for k, v in fields]
    lines.append("")
    if data.get("gpus"):
        lines.append("GPUs:")
        lines.append(
            table(
                _gpu_rows(data["gpus"]),
                [
                    ("index", "INDEX"),
                    ("minor", "MINOR"),
                    ("uuid", "UUID"),
                    ("name", "NAME"),
                    ("health", "HEALTH"),
                    ("drained", "DRAINED"),
                ],
                indent="  ",
            )
        )
        lines += _handover_lines(data["gpus"])
    else:
        lines.append("GPUs: none")
    if not c.get("nested"):
        lines.append("")
        lines += _usage_lines(c.get("usage") or [])
    lines.append("")
    lines += _rules_text(data)
    nested = data.get("nested", [])
    if nested:
        lines.append("")
        lines.append("Nested containers:")
        lines.append(
            table(
                _container_rows(nested, now),
                [("id", "CONTAINER"), ("volume", "VOLUME"), ("cgroup", "CGROUP")],
                indent="  ",
            )
        )
    return "\n".join(lines)


def _container_shares_text(c: dict[str, Any]) -> str:
    if not c.get("shares"):
        return "-"
    return (
        f"{c['shares']} of the {c.get('shares_total', 0)} shares of GPU {c.get('share_gpu_index', 0)}"
        f" ({c.get('share_gpu_uuid', '')}, {c.get('share_mode', '')})"
    )


def _affinity_text(data: dict[str, Any]) -> str:
    """``hint: CPUs 0-19,40-59, NUMA nodes 0``, then the cpuset recorded and in force (docs/affinity.md)."""
    mode = data.get("cpu_affinity") or "off"
    local = data.get("local_cpus", "")
    text = f"{mode}: " + (f"CPUs {local}, NUMA nodes {data.get('local_numa_nodes', '')}" if local else "none local")
    recorded = data.get("cpuset_recorded_cpus", "")
    kernel = data.get("cpuset_cpus", "")
    if recorded or kernel:
        rec = f"CPUs {recorded}, nodes {data.get('cpuset_recorded_mems', '')}" if recorded else "none"
        now = f"CPUs {kernel}, nodes {data.get('cpuset_mems', '')}" if kernel else "no cpuset"
        agree = (
            "agree" if (recorded, data.get("cpuset_recorded_mems")) == (kernel, data.get("cpuset_mems")) else "DIFFER"
        )
        text += f"; cpuset recorded {rec}, in force {now} ({agree}) in '{data.get('cpuset_cgroup', '')}'"
    return text


def _rules_text(data: dict[str, Any]) -> list[str]:
    """Recorded next to kernel, one rule a row, so a difference stands out as a 'no'."""
    recorded, kernel = data.get("recorded_rules", []), data.get("kernel_rules", [])
    only_recorded, only_kernel = set(data.get("only_recorded", [])), set(data.get("only_kernel", []))
    agree = data.get("rules_agree", False)
    verdict = "they agree" if agree else "THEY DIFFER"
    lines = [
        f"Device rules: recorded in our state vs held by the kernel ({verdict})",
        f"  kernel source: {data.get('kernel_source', '')}",
        f"  GPU minors the kernel grants: {_list(data.get('kernel_gpu_minors', []))}",
    ]
    rows = []
    for rule in dict.fromkeys([*recorded, *kernel]):
        # A rule covered by a broader one on the other side counts as present there.
        in_recorded = rule in recorded or rule not in only_kernel
        in_kernel = rule in kernel or rule not in only_recorded
        mark = "" if in_recorded and in_kernel else "<- differs"
        rows.append(
            {
                "rule": rule,
                "recorded": "yes" if in_recorded else "no",
                "kernel": "yes" if in_kernel else "no",
                "m": mark,
            }
        )
    lines.append(table(rows, [("rule", "RULE"), ("recorded", "RECORDED"), ("kernel", "KERNEL"), ("m", "")], "  "))
    return lines


def _volume_text(data: dict[str, Any]) -> str:
    from volumes.manifest import describe

    current = data.get("driver_version", "")
    head = f"volume root:     {data.get('volume_root') or 'N/A'}\nrunning driver:  {current or 'N/A'}"
    volumes = data.get("volumes", [])
    if not volumes:
        return head + "\n\nNo driver volume has been built yet: the first container whose image asks for it builds it."
    parts = [head]
    for manifest in volumes:
        mark = " (running driver)" if manifest.get("driver_version") == current else " (older driver)"
        parts.append(f"{manifest.get('name', '')}{mark}\n" + describe(manifest).rstrip("\n"))
    return "\n\n".join(parts)


def _health_table(data: dict[str, Any]) -> str:
    rows = [dict(c, state="ok" if c.get("ok") else "FAIL") for c in data.get("checks", [])]
    verdict = "healthy" if data.get("healthy") else "UNHEALTHY"
    about = f"gpu-isolator {data['version']}" if data.get("version") else ""
    if about and data.get("hostname"):
        about += f" on {data['hostname']}"
    if about and data.get("mode"):
        about += f", {data['mode']} mode"
    return (
        f"Sidecar {verdict}"
        + (f" ({about})" if about else "")
        + "\n"
        + table(rows, [("name", "CHECK"), ("state", "STATE"), ("detail", "DETAIL")])
    )


def _topology_matrix(data: dict[str, Any]) -> str:
    """As ``nvidia-smi topo -m``: X on the diagonal, NV# or the PCIe level elsewhere."""
    indices = [int(i) for i in data.get("indices", [])]
    kinds: dict[tuple[int, int], str] = {}
    for link in data.get("links", []):
        a, b = int(link.get("a", 0)), int(link.get("b", 0))
        kinds[(a, b)] = kinds[(b, a)] = str(link.get("kind", ""))
    numa = [int(n) for n in data.get("numa_nodes", [])]
    cpus = list(data.get("cpu_affinity", []))
    rows = []
    for pos, a in enumerate(indices):
        row: dict[str, Any] = {"gpu": f"GPU{a}"}
        for b in indices:
            row[f"g{b}"] = "X" if a == b else kinds.get((a, b), "SYS")
        row["cpus"] = cpus[pos] if pos < len(cpus) and cpus[pos] else "N/A"
        row["numa"] = numa[pos] if pos < len(numa) and numa[pos] >= 0 else "N/A"
        rows.append(row)
    columns = [
        ("gpu", ""),
        *((f"g{b}", f"GPU{b}") for b in indices),
        ("cpus", "CPU Affinity"),
        ("numa", "NUMA Affinity"),
    ]
    legend = (
        "\n\nLegend:\n"
        "  X    = Self\n"
        "  SYS  = Traverses PCIe and the SMP interconnect between NUMA nodes\n"
        "  NODE = Traverses PCIe and the interconnect between host bridges within a NUMA node\n"
        "  PHB  = Traverses PCIe and a PCIe host bridge\n"
        "  PXB  = Traverses multiple PCIe bridges, without a host bridge\n"
        "  PIX  = Traverses at most a single PCIe bridge\n"
        "  NV#  = Traverses a bonded set of # NVLinks"
    )
    return table(rows, columns) + legend
