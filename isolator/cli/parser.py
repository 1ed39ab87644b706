"""The command line: ``build_parser`` is the one description of every command and flag, which
help, usage errors, shell completion (``isolator.cli.completion``) and docs/cli.md's drift test read.
The admin commands come from their rows (``isolator.cli.admin.COMMANDS``)."""

from __future__ import annotations

import argparse
import os
from typing import NoReturn

from isolator import __version__
from isolator.cli import admin
from isolator.cli.exits import UsageError
from isolator.daemon import config as configmod
from isolator.model import Mode

# As isolator.exporters.cdi.FORMATS and NAME_STRATEGIES (a test keeps them equal); not imported from
# there so that building the parser (every command) imports no exporter.
CDI_FORMATS = ("yaml", "json")
CDI_NAME_STRATEGIES = ("index", "uuid", "type-index")
CDI_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
SHELLS = ("bash", "zsh", "fish")
HIDDEN_VALUES = "__complete"  # isolator.cli.completion.HIDDEN


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2; a command missing what it needs (``describe``
    without a container, ``cdi`` without an action) also shows that command's usage and choices."""

    def error(self, message: str) -> NoReturn:
        missing = message.startswith("the following arguments are required")
        raise UsageError(f"{self.prog}: {message}", self.format_help() if missing else "")


def build_parser() -> Parser:
    parser = Parser(
        prog="gpu-isolator",
        description="GPU isolator sidecar for Apache Mesos agents",
        epilog=docs_epilog(),  # the docs/<page>.md that help texts cite are there
        formatter_class=_PathFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpu-isolator {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    serve = sub.add_parser(
        "serve", help="run the sidecar on its Unix socket", epilog=docs_epilog(), formatter_class=_PathFormatter
    )
    configmod.add_serve_arguments(serve)

    unit = sub.add_parser(
        "install-unit",
        help="install the systemd unit (Type=notify, watchdog, hardening) for this executable",
        description="Write gpu-isolator.service into DIR with ExecStart pointing at this installation, and a"
        " config file if there is none. Then: systemctl daemon-reload && systemctl enable --now gpu-isolator",
    )
    unit.add_argument("--dir", default="/etc/systemd/system", help="where units go (default /etc/systemd/system)")
    unit.add_argument(
        "--config",
        dest="unit_config",
        default="/etc/gpu-isolator/config.toml",
        help=f'the config file ExecStart names; written with mode = "{Mode.MESOS}" if missing'
        " (default /etc/gpu-isolator/config.toml)",
    )

    _add_cdi(sub)
    _add_inventory(sub)
    for command in admin.COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        admin.add_common_arguments(p)
        command.arguments(p)

    completion = sub.add_parser(
        "completion",
        help="print the shell completion script (bash, zsh or fish)",
        description="Print a completion script generated from this command's own parser; container IDs and"
        " GPU indices are asked of the running sidecar as you type. Install: gpu-isolator completion bash >"
        " /etc/bash_completion.d/gpu-isolator; zsh and fish: docs/cli.md, 'Shell completion'",
    )
    completion.add_argument("shell", choices=SHELLS, help="the shell: bash, zsh or fish")

    config = sub.add_parser("config", help="check a config file, or print the default one (docs/operations.md)")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", parser_class=Parser)
    config_sub.required = True
    check = config_sub.add_parser(
        "check",
        help="validate FILE as serve would read it (exit 0: valid, 78: not) and print what it changes",
    )
    check.add_argument("file", metavar="FILE", help="the TOML config file; - reads standard input")
    config_sub.add_parser("default", help="print the full default config file, every key commented")
    return parser


def build_values_parser() -> Parser:
    """``gpu-isolator __complete containers|gpus [--socket PATH]``: what the completion scripts run for
    the sidecar's values. Hidden: not a subcommand of ``build_parser`` (so no help, completion or docs
    list it); ``main`` routes a command line starting with it here."""
    values = Parser(prog=f"gpu-isolator {HIDDEN_VALUES}", add_help=False)
    values.add_argument("kind", choices=("containers", "gpus"))
    values.add_argument("--socket", default=None)
    values.set_defaults(command=HIDDEN_VALUES)
    return values


def _add_cdi(sub: argparse._SubParsersAction[Parser]) -> None:
    cdi = sub.add_parser("cdi", help="Container Device Interface spec of the managed GPUs")
    cdi_sub = cdi.add_subparsers(dest="cdi_command", metavar="ACTION", parser_class=Parser)
    cdi_sub.required = True
    generate = cdi_sub.add_parser(
        "generate", help="write the CDI spec (offline: reads NVML and builds the driver volume; no sidecar needed)"
    )
    configmod.add_serve_arguments(generate, configmod.CDI_FLAGS)
    generate.add_argument("--output", default="-", help="file to write (default: stdout); mode 0644")
    generate.add_argument(
        "--format",
        choices=CDI_FORMATS,
        default=None,
        help="yaml (default, as nvidia-ctk) or json; a --output FILE ending in .json or .yaml says it too",
    )
    generate.add_argument(
        "--device-name-strategy",
        dest="device_name_strategy",
        action="append",
        choices=(*CDI_NAME_STRATEGIES, "both"),
        default=None,
        help="how devices are named, as nvidia-ctk: index (0, 0:1), uuid (GPU-...), type-index (gpu0, mig0:1);"
        " repeat for several; both = index and uuid (the default)",
    )
    listing = cdi_sub.add_parser(
        "list",
        help="the CDI devices a runtime finds in the spec directories, as nvidia-ctk cdi list (offline)",
    )
    listing.add_argument(
        "--spec-dir",
        dest="spec_dirs",
        action="append",
        default=None,
        metavar="DIR",
        help="a spec directory, lowest priority first; repeat for several (default /etc/cdi then /var/run/cdi)",
    )
    listing.add_argument("--json", action="store_true", help="print JSON: each device and the spec defining it")
    admin.add_output(listing)


def _add_inventory(sub: argparse._SubParsersAction[Parser]) -> None:
    resources = sub.add_parser(
        "resources",
        help="the agent's --resources entries for the GPUs and MIG devices (offline: reads NVML;"
        " --running: the running sidecar's)",
    )
    configmod.add_serve_arguments(resources, configmod.INVENTORY_FLAGS)
    resources.add_argument(
        "--json", action="store_true", help="print JSON: the string and each entry's count, and the attributes"
    )
    admin.add_output(resources)
    _add_running(resources)
    attributes = sub.add_parser(
        "attributes",
        help="the agent's --attributes for its GPUs: model, memory, driver, CUDA, MIG (offline: reads NVML;"
        " --running: the running sidecar's)",
    )
    configmod.add_serve_arguments(attributes, configmod.INVENTORY_FLAGS)
    attributes.add_argument("--json", action="store_true", help="print JSON: the string and each value, typed")
    admin.add_output(attributes)
    _add_running(attributes)


def _add_running(parser: argparse.ArgumentParser) -> None:
    """Ask the running sidecar (its GPUs and --shared-gpus now) instead of reading NVML offline."""
    parser.add_argument(
        "--running",
        action="store_true",
        help="ask the running sidecar instead of reading NVML (its socket: --socket, else $"
        f"{admin.SOCKET_ENV}, else {configmod.DEFAULT_SOCKET})",
    )
    parser.add_argument("--socket", default=None, help="the running sidecar's socket (implies --running)")
    parser.add_argument(
        "--timeout", type=admin.seconds, default=10.0, help="seconds to wait for the sidecar (default 10)"
    )


DOCS_SUBDIR = "share/doc/gpu-isolator"  # setup.cfg [options.data_files]


def docs_dir() -> str:
    """Where this installation's README.md and docs/ are, laid out as in the checkout, so that the
    ``docs/<page>.md`` the help texts cite is relative to it: the checkout beside the package (a
    clone, an editable install), else what the wheel installed under ``<prefix>/share/doc/gpu-isolator``
    (found in the installed files' record, whatever the install scheme). The project has no public URL."""
    import isolator

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(isolator.__file__)))
    if os.path.isfile(os.path.join(checkout, "README.md")):
        return checkout
    # Only here: importing it costs a checkout's every command and daemon start 30-60 ms of CPU.
    from importlib import metadata

    try:
        files = metadata.distribution("gpu-isolator").files or ()
        for f in files:
            if f.name == "README.md" and str(f).replace(os.sep, "/").endswith(f"{DOCS_SUBDIR}/README.md"):
                return os.path.dirname(os.path.abspath(str(f.locate())))
    except metadata.PackageNotFoundError:
        pass
    import sysconfig

    return os.path.join(sysconfig.get_paths()["data"], DOCS_SUBDIR)


def docs_epilog() -> str:
    return f"documentation: {docs_dir()}"


class _PathFormatter(argparse.HelpFormatter):
    """argparse's, but a path (the epilog's documentation directory) is never cut at a hyphen or
    inside a long word, so that it can be copied from the terminal."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        text = " ".join(text.split())
        return textwrap.fill(
            text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False
        )
