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


# ---- Allocation and allocation state (isolator/allocator.py, isolator/state.py) ----------------


class InvalidGpuCount(InvalidArgument, ValueError):
    """A GPU count Mesos would refuse. The default text is Mesos's own (isolator.cpp, update())."""

    msg_fmt = "The 'gpus' resource must be an unsigned integer"


class InvalidTopology(InvalidArgument):
    msg_fmt = "invalid GPU topology: {reason}"


class GpusExhausted(ResourceExhausted):
    # Mesos's wording in NvidiaGpuAllocator::allocate, plus what is free but unhealthy.
    msg_fmt = "Requested {requested} gpus but only {available} available"


class UnknownGpus(NotFound):
    msg_fmt = "GPUs {gpus} are not on this host (known minors: {known})"


class GpusNotAvailable(FailedPrecondition):
    msg_fmt = "GPUs {gpus} are not available: {reason}"


class GpusNotAllocated(FailedPrecondition):
    msg_fmt = "GPUs {gpus} are not allocated"


class StateError(IsolatorError):
    """The allocation store failed; the operation was rolled back and nothing was recorded."""

    code = "INTERNAL"
    msg_fmt = "failed to {op} '{path}': {cause}"


class StateStorageFull(StateError):
    code = "RESOURCE_EXHAUSTED"


class StateReadOnly(StateError):
    code = "UNAVAILABLE"


class StateCorrupt(StateError):
    code = "DATA_LOSS"


class ContainerAlreadyRecorded(AlreadyExists):
    msg_fmt = "container {container} is already recorded"


class ContainerNotRecorded(NotFound):
    msg_fmt = "container {container} is not recorded"


class GpuAlreadyHeld(AlreadyExists):
    """The store refused to record a GPU twice: the last line of defence against double allocation."""

    msg_fmt = "failed to record GPU {gpu} for container {container}: it is already held by {holder}"
