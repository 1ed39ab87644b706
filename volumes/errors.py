"""Errors of the driver volume package, kept apart from ``isolator.errors`` so ``volumes`` imports alone.

Each error names the gRPC status code it should map to (``code``, the same names ``isolator.errors``
uses), so the lead's adapter converts by name. Messages follow ``failed to <op> '<path>': <cause>``.
"""

from __future__ import annotations

from typing import Any, ClassVar


class VolumeError(Exception):
    """Base of every error raised on purpose by ``volumes``."""

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


class LdCacheError(VolumeError):
    """The ld.so.cache is missing, truncated or of an unknown format."""

    code = "FAILED_PRECONDITION"
    msg_fmt = "failed to parse ld.so.cache '{path}': {cause}"


class ElfError(VolumeError):
    """A file is not an ELF object we can read."""

    code = "FAILED_PRECONDITION"
    msg_fmt = "failed to read ELF '{path}': {cause}"


class InvalidDriverVersion(VolumeError):
    """A driver version that cannot name a volume directory (it would escape or collide)."""

    code = "INVALID_ARGUMENT"
    msg_fmt = "failed to use driver version {version!r}: {cause}"


class InvalidUser(VolumeError):
    """A container id that cannot be recorded as a volume user."""

    code = "INVALID_ARGUMENT"
    msg_fmt = "failed to record volume user {user!r}: {cause}"


class VolumeBuildError(VolumeError):
    """The filesystem refused a step of building, mounting or removing a volume."""

    code = "INTERNAL"
    msg_fmt = "failed to {op} '{path}': {cause}"


class CudaVersionUnsupported(VolumeError):
    """The image needs a newer CUDA than the host driver supports (nvidia-docker v1's refusal)."""

    code = "FAILED_PRECONDITION"
    msg_fmt = (
        "failed to inject the driver volume into '{rootfs}': the image needs CUDA {required} "
        "({source}) but driver {driver_version} supports CUDA {driver_cuda}"
    )


class InvalidImageConfig(VolumeError):
    """An image config value we must read (a CUDA requirement) does not parse."""

    code = "INVALID_ARGUMENT"
    msg_fmt = "failed to read image {field} {value!r}: {cause}"
