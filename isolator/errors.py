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


class Overloaded(ResourceExhausted):
    """Load shedding: the sidecar did not run the call and it may be sent again after
    ``retry_after_ms``. Still RESOURCE_EXHAUSTED, but marked as retryable on the wire: ``RETRY`` on the
    bridge socket, trailing metadata ``grpc-retry-pushback-ms`` on gRPC (docs/reliability.md). Every
    other RESOURCE_EXHAUSTED (no free GPU, a full disk) is final: retrying cannot help."""

    retry_after_ms: ClassVar[int] = 20


class PermissionDenied(IsolatorError):
    code = "PERMISSION_DENIED"


class Unavailable(IsolatorError):
    code = "UNAVAILABLE"


class Unimplemented(IsolatorError):
    code = "UNIMPLEMENTED"
    msg_fmt = "{hook} is not implemented by this sidecar yet"


class Internal(IsolatorError):
    code = "INTERNAL"


class DeadlineExceeded(IsolatorError):
    """The caller's deadline passed before a worker could start its call: it was not run (its caller
    gave up; running it would act for nobody, docs/operations.md "Stale hooks")."""

    code = "DEADLINE_EXCEEDED"


# ---- Specific errors ----------------------------------------------------------------------------


class InvalidContainerId(InvalidArgument):
    msg_fmt = "invalid container ID {value!r}: {reason}"


class ConfigError(IsolatorError):
    """A flag, a config file or a combination of them that the daemon cannot start with."""

    code = "INVALID_ARGUMENT"


class GpusUnavailable(ConfigError):
    """The node was not told it has no GPUs, yet NVML is missing or reports fewer GPUs than
    configured: the daemon refuses to start (``gpu-isolator serve`` exits 4) rather than serve a
    GPU node without its GPUs."""

    code = "FAILED_PRECONDITION"


class OwnershipHeld(Unavailable):
    """Another live sidecar holds what this one would own (isolator/host/pidlock.py): its work
    directory, its (hierarchy, cgroups root) or one of its sockets. ``serve`` exits 75 (EX_TEMPFAIL)."""

    msg_fmt = "failed to lock {what}: {holder} holds it (lock file '{lock}')"


class WorkDirHeld(OwnershipHeld):
    """Another live process holds the work directory's lock: one sidecar per state directory."""

    msg_fmt = (
        "failed to lock work directory '{path}': {holder} holds it; one sidecar per state directory"
        " (stop that one, or give this one another --work-dir)"
    )


class SocketError(IsolatorError):
    """The Unix socket cannot be created or is held by a live sidecar."""

    code = "UNAVAILABLE"


class SocketHeld(OwnershipHeld, SocketError):
    """Another live sidecar holds the socket's lock (``<socket>.lock``) and serves on it."""

    msg_fmt = (
        "failed to lock socket '{path}': {holder} holds it and serves there; one sidecar per socket"
        " (stop that one, or give this one another {flag})"
    )


class CgroupsRootHeld(OwnershipHeld):
    """Another live sidecar manages the same cgroups root of the same hierarchy."""

    msg_fmt = (
        "failed to lock cgroups root '{root}' of the {version} hierarchy '{mount}': {holder} manages it;"
        " one sidecar per cgroups root (stop that one, or give this one another --cgroups-root)"
    )


# ---- Devices, cgroups and bpf(2) --------------------------------------------------------------


class RuleParseError(InvalidArgument):
    """A device rule string that is not the kernel's ``<type> <major>:<minor> <access>`` form."""

    msg_fmt = "invalid device rule {value!r}: {reason}"


class DeviceNodeError(FailedPrecondition):
    """A device node the whitelist needs is missing or is not a character device."""

    msg_fmt = "failed to stat device node '{path}': {cause}"


class UvmLoadError(FailedPrecondition):
    """``/dev/nvidia-uvm`` is missing and loading it (``nvidia-modprobe -u -c 0``) did not help."""

    msg_fmt = "failed to load '{path}': {cause}"


class HierarchyError(FailedPrecondition):
    """No usable cgroup hierarchy for device isolation, or the override names one that is absent."""

    msg_fmt = "failed to find a cgroup hierarchy for device isolation in '{path}': {cause}"


class CgroupVersionAbsent(HierarchyError, ConfigError):
    """The configured cgroup version (``--cgroup-version``, not ``auto``) names a hierarchy this host
    does not mount. A booted host's layout does not change, so it is a configuration error:
    ``serve`` exits 78 and the unit does not restart it (exit 1 was restarted until the start limit)."""


class CgroupError(Internal):
    """A cgroup file could not be read or written, or the kernel holds something we did not ask for."""

    msg_fmt = "failed to {op} '{path}': {cause}"


class CgroupVanished(NotFound):
    """The container's cgroup is gone (the container was destroyed underneath us)."""

    msg_fmt = "failed to {op} '{path}': the cgroup no longer exists"


class CgroupBusy(FailedPrecondition):
    """A cgroup we were asked to remove still holds processes."""

    msg_fmt = "failed to {op} '{path}': still holds processes {pids}"


class BpfError(Internal):
    """bpf(2) failed; ``verifier_log`` holds the kernel verifier's output when a load was refused."""

    msg_fmt = "failed to {op} '{path}': {cause}"

    @property
    def verifier_log(self) -> str:
        return str(self.fields.get("verifier_log", ""))


class DeviceProgramConflict(FailedPrecondition):
    """Another device program on the container's cgroup or an ancestor would deny our devices."""

    msg_fmt = (
        "failed to {op} '{path}': device program id {prog_id} (name {prog_name!r}) attached to '{at}' "
        "denies {denied}; programs on a cgroup and its ancestors must all allow a device, so {remedy}"
    )


# ---- Allocation and allocation state (isolator/policy/allocator.py, isolator/host/state/) ----------------


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


class StateIncompatible(StateError):
    """The store was written by a newer sidecar with changes this one cannot read or write safely."""

    code = "FAILED_PRECONDITION"


class ContainerAlreadyRecorded(AlreadyExists):
    msg_fmt = "container {container} is already recorded"


class ContainerGone(NotFound):
    """Watch of a container Mesos cleaned up lately: NOT_FOUND on gRPC (an open Watch ends), "no
    limitation" to the command module's poll after each Cleanup (docs/mesos-agent.md, section 4)."""

    msg_fmt = "container {container} was cleaned up"


class ContainerNotRecorded(NotFound):
    msg_fmt = "container {container} is not recorded"


class GpuAlreadyHeld(FailedPrecondition):
    """The store refused to record a GPU twice: the last line of defence against double allocation.

    The allocator had the GPU free, so someone else wrote the state: the caller did not ask to
    create something that exists (ALREADY_EXISTS), and retrying picks the same GPU again (so not
    ABORTED) until the sidecar re-reads its state. FAILED_PRECONDITION, naming the holder
    (docs/reliability.md, "One daemon per state directory")."""

    msg_fmt = (
        "failed to record GPU {gpu} for container {container}: it is already held by {holder}"
        " in the state store, though this sidecar counted it free (another writer shares its state?)"
    )


# ---- Mapping foreign errors by code name ---------------------------------------------------------

_FAMILIES: dict[str, type[IsolatorError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        PermissionDenied,
        Unavailable,
        Unimplemented,
        Internal,
    )
}


def from_code(code: str, message: str) -> IsolatorError:
    """An error of the family named by ``code`` (e.g. the volumes package's errors, which carry
    the same gRPC code names but cannot import this module)."""
    return _FAMILIES.get(code, Internal)(message)


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


class AffinityEmpty(FailedPrecondition):
    """The CPUs or memory nodes local to a container's GPUs are none of this machine's: refused, never "all"."""

    msg_fmt = (
        "failed to place GPUs {gpus} on their local {what}: they are local to {local}, this machine has "
        "{machine} online; nothing is left, and a container is never given every CPU instead "
        "(docs/affinity.md; --cpu-affinity hint or off does not enforce)"
    )


class AffinityUnknown(FailedPrecondition):
    """NVML did not report a GPU's CPU affinity, so its locality cannot be enforced."""

    msg_fmt = (
        "failed to place GPUs {gpus} on their local CPUs: NVML reports no CPU affinity for them "
        "(nvidia-smi topo -m, 'CPU Affinity'); --cpu-affinity enforce cannot honour it (docs/affinity.md)"
    )
