"""The CLI's exit codes and its usage error: what every command returns, in one place.

0 ok, 1 error, 2 usage, 3 the sidecar cannot be reached (the message names the socket);
``serve`` exits 4 when the node's GPUs are unavailable (no usable NVML, fewer GPUs than configured);
78 (EX_CONFIG) for a configuration error: a flag, a config file or a combination that cannot work;
75 (EX_TEMPFAIL) when another live sidecar holds the work directory, the cgroups root or a socket.
``audit`` follows diff(1): 0 no drift, 1 drift found and repaired, 2 and above trouble.
"""

from __future__ import annotations

from isolator.errors import ConfigError, GpusUnavailable, IsolatorError, OwnershipHeld

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NO_GPUS = 0, 1, 2, 3, 4
# audit only, as diff(1): 1 says "drift was found (and repaired)", so an error answered is 2 there.
EXIT_DRIFT = 1
# sysexits.h's EX_CONFIG: a configuration error does not heal by itself, so it has its own code,
# which the systemd unit lists in RestartPreventExitStatus (1 stays "a runtime failure: retry").
EXIT_CONFIG = 78
# sysexits.h's EX_TEMPFAIL: another live sidecar holds the work directory, the cgroups root or a socket;
# the conflict ends when it stops, so systemd may retry (within the unit's start limit).
EXIT_WORK_DIR_HELD = 75


def exit_code_of(exc: IsolatorError) -> int:
    """The exit code an error that stops a command (``serve`` above all) stands for."""
    if isinstance(exc, GpusUnavailable):
        return EXIT_NO_GPUS
    if isinstance(exc, ConfigError):
        return EXIT_CONFIG
    if isinstance(exc, OwnershipHeld):
        return EXIT_WORK_DIR_HELD
    return EXIT_ERROR


class UsageError(Exception):
    """A command line the CLI does not take: one line on stderr (and the command's usage when it misses
    an argument), exit 2."""

    def __init__(self, message: str, help_text: str = "") -> None:
        super().__init__(message)
        self.help_text = help_text
