"""One error tree for the whole sidecar.

Each error carries a message template, its structured fields and the gRPC status code it maps to
(as the code's name, so that nothing below the server imports grpc). Only the server turns errors
into statuses; edges raise them ``from`` the OSError or NVMLError they caught. Messages follow one
grammar: ``failed to <op> '<path>': <cause>``.
"""

from __future__ import annotations

from typing import Any, ClassVar


class IsolatorError(Exception):
    """Base of every error the sidecar raises on purpose."""

    code: ClassVar[str] = "INTERNAL"
    msg_fmt: ClassVar[str] = "{message}"

    def __init__(self, message: str | None = None, **fields: Any) -> None:
        self.fields = fields
        if message is None:
            try:
                message = self.msg_fmt.format(**fields)
            except (KeyError, IndexError) as exc:  # a template bug must not hide the real error
                message = f"{type(self).__name__}: {fields} (bad template: {exc})"
        self.message = message
        super().__init__(message)


# ---- Status-code families ---------------------------------------------------------------------


class InvalidArgument(IsolatorError):
    code = "INVALID_ARGUMENT"


class NotFound(IsolatorError):
    code = "NOT_FOUND"


class AlreadyExists(IsolatorError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(IsolatorError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(IsolatorError):
    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(IsolatorError):
    code = "PERMISSION_DENIED"


class Unavailable(IsolatorError):
    code = "UNAVAILABLE"


class Unimplemented(IsolatorError):
    code = "UNIMPLEMENTED"
    msg_fmt = "{hook} is not implemented by this sidecar yet"


class Internal(IsolatorError):
    code = "INTERNAL"


# ---- Specific errors ----------------------------------------------------------------------------


class InvalidContainerId(InvalidArgument):
    msg_fmt = "invalid container ID {value!r}: {reason}"


class ConfigError(IsolatorError):
    """A flag, a config file or a combination of them that the daemon cannot start with."""

    code = "INVALID_ARGUMENT"


class SocketError(IsolatorError):
    """The Unix socket cannot be created or is held by a live sidecar."""

    code = "UNAVAILABLE"


class NvmlError(IsolatorError):
    """An NVML call failed. ``nvml_code`` is NVML's nvmlReturn_t value, ``call`` the function."""

    code = "UNAVAILABLE"
    msg_fmt = "failed to {op} '{target}': {cause}"


class NvmlNotFound(NvmlError):
    """libnvidia-ml cannot be loaded or initialised: no driver, or NVML in an unexpected place."""

    code = "FAILED_PRECONDITION"
    msg_fmt = "failed to load NVML '{target}': {cause}"


class GpuNotFound(NvmlError):
    """An index, UUID or minor names no GPU that NVML reports."""

    code = "NOT_FOUND"


class HostFileError(ConfigError):
    """A simulated host description that is malformed or inconsistent."""

    msg_fmt = "failed to load host file '{path}': {where}{reason}"
