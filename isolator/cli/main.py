"""``gpu-isolator``: the daemon (``serve``) and the admin commands: parse, dispatch, and turn what
goes wrong into one line on stderr and an exit code (``isolator.cli.exits``), never a traceback.

The pieces: ``parser`` (every command and flag), ``admin`` (the admin commands' table and the one
path they take to the sidecar), ``render`` (the tables; the only code that prints), ``offline``
(the commands that need no sidecar), ``unit`` (``install-unit``), ``completion``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from isolator.cli import admin, offline, unit
from isolator.cli.admin import SOCKET_ENV, formatted, output_format, with_socket_check
from isolator.cli.admin import render_table as render
from isolator.cli.exits import (
    EXIT_CONFIG,
    EXIT_DRIFT,
    EXIT_ERROR,
    EXIT_NO_GPUS,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    EXIT_WORK_DIR_HELD,
    UsageError,
    exit_code_of,
)
from isolator.cli.parser import (
    CDI_FORMATS,
    CDI_NAME_STRATEGIES,
    CDI_SPEC_DIRS,
    HIDDEN_VALUES,
    build_parser,
    build_values_parser,
)
from isolator.cli.render import fail
from isolator.cli.unit import docs_url, unit_text
from isolator.errors import IsolatorError

# The names other areas' tests and the forkserver import from here (isolator.cli.main was one module).
__all__ = [
    "ADMIN_CALLS",
    "CDI_FORMATS",
    "CDI_NAME_STRATEGIES",
    "CDI_SPEC_DIRS",
    "EXIT_CONFIG",
    "EXIT_DRIFT",
    "EXIT_ERROR",
    "EXIT_NO_GPUS",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "EXIT_WORK_DIR_HELD",
    "SOCKET_ENV",
    "build_parser",
    "docs_url",
    "exit_code_of",
    "formatted",
    "main",
    "render",
    "unit_text",
]
ADMIN_CALLS = admin.BY_NAME
_output_format = output_format
_with_socket_check = with_socket_check

OFFLINE = {
    "completion": offline.run_completion,
    "config": offline.run_config,
    "serve": offline.run_serve,
    "cdi": offline.run_cdi,
    "resources": offline.run_resources,
    "attributes": offline.run_resources,
    "install-unit": unit.run,
}


def _usage_error(exc: UsageError) -> int:
    print(str(exc), file=sys.stderr)
    if exc.help_text:
        print(exc.help_text.rstrip("\n"), file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except BrokenPipeError:
        # The reader went away before all the output was written (`gpu-isolator gpus | head -1`): as
        # for other CLIs under a pager or head, that is the reader's choice, not an error. Point stdout
        # at /dev/null so that Python's flush at exit does not complain a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _main(argv: list[str]) -> int:
    parser = build_parser()
    if not argv:
        # `gpu-isolator` alone asks what there is: the usage and the command list, as kubectl and docker.
        offline.emit(parser.format_help())
        return EXIT_OK
    try:
        if argv[0] == HIDDEN_VALUES:  # the completion scripts' question (isolator.cli.completion)
            return admin.run_values(build_values_parser().parse_args(argv[1:]))
        args = parser.parse_args(argv)
    except UsageError as exc:
        return _usage_error(exc)
    try:
        if args.command in OFFLINE:
            return OFFLINE[args.command](args)
        try:
            return admin.run(args)
        except (UsageError, BrokenPipeError, KeyboardInterrupt):
            raise
        except Exception as exc:  # a bug here must still be one line for the operator, not a traceback
            fail(f"{args.command}: unexpected {type(exc).__name__}: {exc}")
            return EXIT_ERROR
    except IsolatorError as exc:
        print(f"gpu-isolator: {exc.message}", file=sys.stderr)
        return exit_code_of(exc)
    except KeyboardInterrupt:
        return 130
    except UsageError as exc:
        return _usage_error(exc)


if __name__ == "__main__":
    sys.exit(main())
