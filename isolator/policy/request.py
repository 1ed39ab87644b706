"""What a container asks for, read once from its resources: whole GPUs (``gpus``), MIG units
(``mig-<profile>``) and shares of a GPU (``gpu_shares``), and the rules on the kinds it may hold.

Pure: resources in, a ``Request`` or a typed error out. Prepare reads a request with the one-kind
rule (``for_prepare``), Update with the rule that a container's kinds are fixed at launch
(``check_update``); both rules are written here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from isolator.errors import FailedPrecondition, InvalidArgument
from isolator.model import ContainerId, Holding, Resource, gpu_count
from isolator.policy import mig as migunits
from isolator.policy import shares as sharing


@dataclass(frozen=True)
class Request:
    """Counts asked for: whole GPUs, MIG units per ``mig-<profile>`` resource, shares (0: none)."""

    gpus: int = 0
    mig: Mapping[str, int] = field(default_factory=dict)
    shares: int = 0

    @property
    def empty(self) -> bool:
        return not (self.gpus or self.mig or self.shares)


def read(resources: Iterable[Resource]) -> Request:
    """Each kind's count, refused as Mesos refuses it (InvalidGpuCount, InvalidMigRequest,
    InvalidShareCount); no rule on how kinds combine."""
    resources = tuple(resources)
    return Request(gpu_count(resources), migunits.requests(resources), sharing.share_request(resources))


def for_prepare(container_id: ContainerId, resources: Iterable[Resource]) -> Request:
    """A new container's request: shares of one GPU, or whole GPUs and MIG units, never both."""
    request = read(resources)
    if request.shares and (request.gpus or request.mig):
        # One kind per container: under MPS its CUDA would reach every GPU through the MPS
        # daemon of its shared one, and a whole GPU beside a share gains nothing (docs/sharing.md).
        raise InvalidArgument(
            f"container {container_id} asks for {sharing.RESOURCE} together with whole GPUs or MIG devices;"
            " a container holds shares of one GPU, or whole GPUs and MIG devices, not both"
        )
    return request


def check_update(container_id: ContainerId, holding: Holding, held_mig: Mapping[str, int], request: Request) -> None:
    """A running container's new request (``read``) may change its whole GPUs only: its shares and its
    MIG units (``held_mig``: its units per resource name) are fixed at launch, and shares are never
    mixed with whole GPUs (FailedPrecondition otherwise)."""
    if request.shares != holding.shares or (holding.shares and request.gpus):
        raise FailedPrecondition(
            f"container {container_id} holds {holding.shares} {sharing.RESOURCE}; shares are fixed at launch"
            f" and never mixed with whole GPUs (update asks for {request.shares} {sharing.RESOURCE},"
            f" {request.gpus} gpus)"
        )
    if dict(request.mig) != dict(held_mig):
        raise FailedPrecondition(
            f"container {container_id} holds MIG devices {dict(held_mig) or '{}'}; MIG holdings are fixed at "
            f"launch (update asks for {dict(request.mig) or '{}'})"
        )
