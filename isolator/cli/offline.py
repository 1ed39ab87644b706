"""The commands that need no running sidecar: ``serve`` (which is the sidecar), ``resources`` and
``attributes`` (the agent's flags, from NVML), ``cdi generate|list``, ``config check|default`` and
``completion``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from isolator.cli.admin import ask, output_format, resolve_socket
from isolator.cli.exits import EXIT_ERROR, EXIT_OK, UsageError, exit_code_of
from isolator.cli.parser import CDI_SPEC_DIRS, build_parser
from isolator.cli.render import emit, fail, structured
from isolator.daemon import config as configmod
from isolator.daemon.config import Config
from isolator.errors import IsolatorError


@contextmanager
def offline_config(flags: dict[str, Any]) -> Iterator[Config]:
    """The settings of an offline command. It leaves nothing behind unless asked to: with ``--simulate``
    and no work directory given (neither ``--work-dir`` nor the config file's ``work_dir``), the
    simulated host (device nodes, its driver, the driver volume) is laid out in a temporary directory
    removed when the command ends, never under the production ``/var/lib/gpu-isolator``."""
    config = configmod.resolve(flags)
    if not config.simulate or flags.get("work_dir") is not None or _file_names_work_dir(config):
        yield config
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu-isolator-offline-") as scratch:
        yield configmod.resolve({**flags, "work_dir": scratch})


def _file_names_work_dir(config: Config) -> bool:
    if not config.config_file:
        return False
    if config.config_file == configmod.STDIN:  # read once already: judge by the value
        return config.work_dir != os.path.abspath(configmod.DEFAULT_WORK_DIR)
    return "work_dir" in configmod.load_file(config.config_file)


def run_serve(args: argparse.Namespace) -> int:
    if args.config_file == configmod.STDIN:
        raise UsageError(
            "gpu-isolator serve: --config - is not a file; SIGHUP reads the config file again, give its path"
        )
    config = configmod.resolve(args)  # a configuration error stops the start before the daemon is loaded
    from isolator.daemon import main as daemon

    try:
        # SIGHUP reads the same flags and file again (flags still win over the file).
        return daemon.serve(config, reread=lambda: configmod.resolve(args))
    except IsolatorError as exc:
        if config.log_format != "json":
            raise
        # The daemon logs JSON: so is the line saying why it stops (one object, level critical).
        import logging

        from isolator.daemon.logfmt import JsonFormatter

        record = logging.LogRecord("isolator", logging.CRITICAL, __file__, 0, "%s", (exc.message,), None)
        print(JsonFormatter().format(record), file=sys.stderr)
        return exit_code_of(exc)


def run_resources(args: argparse.Namespace) -> int:
    """``resources`` prints the agent's --resources; ``attributes`` its --attributes (docs/operations.md)."""
    from isolator.daemon import main as daemon
    from isolator.policy import attributes

    output = output_format(args)
    if args.running or args.socket is not None:
        asked = _ask_agent_flags(args)
        if isinstance(asked, int):
            return asked
        line, pairs = asked
    else:
        skip = ("command", "json", "output", "running", "socket", "timeout")
        flags = {k: v for k, v in vars(args).items() if k not in skip}
        with offline_config(flags) as config:
            line, pairs = daemon.agent_flags(config)
    if args.command == "attributes":
        text = attributes.render(pairs)
        data: dict[str, Any] = {"attributes": text, "values": attributes.typed(pairs)}
    else:
        text = line
        entries = {name: int(count) for name, _, count in (e.rpartition(":") for e in line.split(";"))}
        data = {"resources": line, "entries": entries, "attributes": attributes.render(pairs)}
        data["shares"] = _shares_of(entries, attributes.typed(pairs))
    emit(structured(data, output) if output in ("json", "yaml") else text)
    return EXIT_OK


def _shares_of(entries: dict[str, int], values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per share unit offered (``gpu-share-<N>``): the units, and the shared GPUs' facts from the
    attributes (``gpu_share_<N>_*``: GPUs, mode, memory per unit), so that ``resources --json``
    describes the shared GPUs as ``attributes`` does, offline and from the running sidecar alike."""
    from isolator.policy import shares

    out: dict[str, dict[str, Any]] = {}
    for name, units in entries.items():
        size = shares.unit_size(name)
        if size is None:
            continue
        facts = {"units": units, "size": size}
        prefix = f"gpu_share_{size}_"
        facts.update({k.removeprefix(prefix): v for k, v in values.items() if k.startswith(prefix)})
        out[name] = facts
    return out


def _ask_agent_flags(args: argparse.Namespace) -> tuple[str, list[tuple[str, str]]] | int:
    """The running sidecar's view (Admin AgentFlags): what it manages now, not what NVML would say
    to a new start; the offline flags describe a host to read and contradict it."""
    from isolator.rpc import isolator_pb2 as pb

    given = [f"--{n.replace('_', '-')}" for n in ("config_file", *configmod.INVENTORY_FLAGS) if getattr(args, n, None)]
    if given:
        flag = "--config" if given[0] == "--config-file" else given[0]
        raise UsageError(f"gpu-isolator {args.command}: --running asks the sidecar; {flag} is for reading NVML offline")
    resolve_socket(args)
    answer = ask(args, "AgentFlags", pb.AgentFlagsRequest())
    if isinstance(answer, int):
        return answer
    return str(answer.get("resources", "")), [(a["name"], a["value"]) for a in answer.get("attributes", [])]


def run_cdi(args: argparse.Namespace) -> int:
    from isolator.exporters import cdi

    if args.cdi_command == "list":
        return _run_cdi_list(args)
    from isolator.daemon import main as daemon

    output = args.output
    fmt = args.format or (cdi.format_of(output) if output.endswith((".json", ".yaml", ".yml")) else "yaml")
    if output != "-" and output.endswith((".json", ".yaml", ".yml")) and fmt != cdi.format_of(output):
        raise UsageError(f"gpu-isolator cdi generate: --format {fmt} contradicts --output '{output}'")
    if output != "-" and not output.endswith((".json", ".yaml")):
        # Runtimes read only *.json and *.yaml (pkg/cdi/spec-dirs.go): another name is never loaded.
        print(f"gpu-isolator: note: CDI runtimes read only *.json and *.yaml, not '{output}'", file=sys.stderr)
    strategies = args.device_name_strategy or ["both"]
    names = list(dict.fromkeys(n for s in strategies for n in (("index", "uuid") if s == "both" else (s,))))
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "cdi_command", "output")}
    with offline_config(flags) as config:
        spec = daemon.generate_cdi(config, names)
    if output == "-":
        emit(cdi.render(spec, fmt).rstrip("\n"))
    else:
        path, _ = cdi.write_spec(spec, os.path.dirname(os.path.abspath(output)), os.path.basename(output), fmt)
        print(f"wrote CDI spec '{path}': {len(spec['devices'])} devices, kind {spec['kind']}", file=sys.stderr)
    return EXIT_OK


def _run_cdi_list(args: argparse.Namespace) -> int:
    """As ``nvidia-ctk cdi list``: every device a CDI runtime would resolve, one qualified name a line;
    each problem that cost devices (an unreadable spec, a conflict) on stderr, and then exit 1."""
    from isolator.exporters import cdi

    output = output_format(args)
    listing = cdi.read_spec_dirs(args.spec_dirs or CDI_SPEC_DIRS)
    for problem in listing.problems:
        fail(f"cdi list: {problem}")
    if output in ("json", "yaml"):
        devices = [{"name": n, "spec": p} for n, p in listing.devices.items()]
        emit(structured({"devices": devices, "problems": list(listing.problems)}, output))
    elif listing.devices:
        emit("\n".join(listing.devices))
    else:
        print(f"gpu-isolator: no CDI devices in {', '.join(args.spec_dirs or CDI_SPEC_DIRS)}", file=sys.stderr)
    return EXIT_ERROR if listing.problems else EXIT_OK


def run_config(args: argparse.Namespace) -> int:
    if args.config_command == "default":
        emit(configmod.default_file_text())
        return EXIT_OK
    config = configmod.resolve({"config_file": args.file})
    warnings = configmod.check_at_start(config)  # what it could not check offline
    changed = configmod.non_defaults(config)
    count = f"{len(changed)} setting{'' if len(changed) == 1 else 's'} differ" + ("s" if len(changed) == 1 else "")
    summary = f"{count} from the defaults" if changed else "every setting is the default"
    lines = [f"config file '{args.file}' is valid: {summary}"]
    lines += [f"  {name} = {value}" for name, value in changed] + [f"warning: {w}" for w in warnings]
    emit("\n".join(lines))
    return EXIT_OK


def run_completion(args: argparse.Namespace) -> int:
    from isolator.cli import completion

    emit(completion.SCRIPTS[args.shell](build_parser()))
    return EXIT_OK
