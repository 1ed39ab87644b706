"""``gpu-isolator``: the daemon (``serve``) and the admin commands. The only module that prints.

Exit codes: 0 ok, 1 error, 2 usage, 3 the sidecar cannot be reached (the message names the socket).
Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from isolator import config as configmod
from isolator.errors import IsolatorError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> Parser:
    parser = Parser(prog="gpu-isolator", description="GPU isolator sidecar for Apache Mesos agents")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    serve = sub.add_parser("serve", help="run the sidecar on its Unix socket")
    configmod.add_serve_arguments(serve)

    def admin(name: str, help_text: str) -> Parser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--socket", default=configmod.DEFAULT_SOCKET, help="the sidecar's socket")
        p.add_argument("--json", action="store_true", help="print JSON (a stable shape) instead of a table")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
        return p

    admin("gpus", help_text="every GPU, its health and its holder")
    admin("topology", help_text="the interconnect matrix, as nvidia-smi topo -m")
    admin("containers", help_text="every known container and its GPUs")
    describe = admin("describe", help_text="everything about one container")
    describe.add_argument("container", help="container ID, nested as parent.child")
    admin("volume", help_text="the driver volume")
    admin("health", help_text="the sidecar's own health")
    release = admin("release", help_text="release a stuck allocation")
    release.add_argument("container", help="container ID, nested as parent.child")
    release.add_argument("--force", action="store_true", help="release even while processes remain")
    return parser


def _emit(text: str) -> None:
    sys.stdout.write(text)
    if not text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()


def _table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    header = [title for _, title in columns]
    body = [["" if r.get(key) is None else str(r.get(key)) for key, _ in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)).rstrip() for b in body]
    return "\n".join(lines)


def _run_admin(args: argparse.Namespace) -> int:
    import grpc

    from isolator.client import Client, Unreachable, container_id, to_dict
    from isolator.rpc import isolator_pb2 as pb

    calls: dict[str, Callable[[], Any]] = {}
    with Client(args.socket, timeout=args.timeout) as client:
        calls = {
            "gpus": lambda: client.call(client.admin, "ListGpus", pb.ListGpusRequest()),
            "topology": lambda: client.call(client.admin, "Topology", pb.TopologyRequest()),
            "containers": lambda: client.call(client.admin, "ListContainers", pb.ListContainersRequest()),
            "describe": lambda: client.call(
                client.admin,
                "DescribeContainer",
                pb.DescribeContainerRequest(container_id=container_id(args.container)),
            ),
            "volume": lambda: client.call(client.admin, "Volume", pb.VolumeRequest()),
            "health": lambda: client.call(client.admin, "Health", pb.HealthRequest()),
            "release": lambda: client.call(
                client.admin,
                "Release",
                pb.ReleaseRequest(container_id=container_id(args.container), force=args.force),
            ),
        }
        try:
            client.check_reachable()
            reply = calls[args.command]()
        except Unreachable as exc:
            print(f"gpu-isolator: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                print(f"gpu-isolator: cannot reach the sidecar at '{args.socket}': {exc.details()}", file=sys.stderr)
                return EXIT_UNREACHABLE
            print(f"gpu-isolator: {args.command}: {code.name}: {exc.details()}", file=sys.stderr)
            return EXIT_ERROR
    data = to_dict(reply)
    if args.command == "volume":
        data = json.loads(data.get("manifest_json") or "{}")
    if args.json:
        _emit(json.dumps(data, indent=2, sort_keys=True))
    else:
        _emit(render(args.command, data))
    return EXIT_OK


def render(command: str, data: dict[str, Any]) -> str:
    """Tables for people. The JSON form is the stable one; these may change."""
    if command == "gpus":
        return _gpus_table(data)
    if command == "topology":
        return _topology_matrix(data)
    if command == "containers":
        return _table(
            data.get("containers", []),
            [
                ("container_id", "CONTAINER"),
                ("gpu_minors", "GPUS"),
                ("cgroup", "CGROUP"),
                ("mode", "MODE"),
                ("state", "STATE"),
            ],
        )
    if command == "health":
        return _table(data.get("checks", []), [("name", "CHECK"), ("ok", "OK"), ("detail", "DETAIL")])
    return json.dumps(data, indent=2, sort_keys=True)


def _health_text(g: dict[str, Any]) -> str:
    if g.get("healthy"):
        return "healthy"
    xid = int(g.get("last_xid") or 0)
    if xid:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(g.get("last_xid_time") or 0)))
        return f"UNHEALTHY: XID {xid} at {when}"
    return f"UNHEALTHY: {g.get('health_reason') or 'unknown'}"


def _gpus_table(data: dict[str, Any]) -> str:
    rows = []
    for g in data.get("gpus", []):
        numa = int(g.get("numa_node", -1))
        rows.append(
            dict(
                g,
                minor=g.get("minor", 0) if g.get("uuid") else "?",
                memory=f"{int(g.get('memory_total_bytes', 0)) // 2**20} MiB",
                numa="N/A" if numa < 0 else numa,
                health=_health_text(g),
                mig="on" if g.get("mig_enabled") else "",
            )
        )
    header = f"Driver {data.get('driver_version') or 'N/A'}, CUDA {data.get('cuda_driver_version') or 'N/A'}"
    table = _table(
        rows,
        [
            ("index", "INDEX"),
            ("minor", "MINOR"),
            ("uuid", "UUID"),
            ("name", "NAME"),
            ("memory", "MEMORY"),
            ("numa", "NUMA"),
            ("mig", "MIG"),
            ("health", "HEALTH"),
            ("holder", "HOLDER"),
        ],
    )
    return header + "\n" + table


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
    return _table(rows, columns) + legend


def _run_serve(args: argparse.Namespace) -> int:
    from isolator import main as daemon

    config = configmod.resolve(args)
    return daemon.serve(config)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "serve":
            return _run_serve(args)
        return _run_admin(args)
    except IsolatorError as exc:
        print(f"gpu-isolator: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`); say nothing more and do not let Python complain
        # while flushing stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
