"""What a container asks for, read once from its resources: whole GPUs (``gpus``), MIG units
(``mig-<profile>``) and shares of a GPU (a ``gpu-share-<N>`` unit, or the pooled ``gpu_shares`` of
earlier releases), and the rules on the kinds it may hold.

Pure: resources in, a ``Request`` or a typed error out. Prepare reads a request with the one-kind
rule (``for_prepare``), Update with the rule that a container's kinds never mix and that shares are
placed at launch (``check_update``); both rules are written here and nowhere else.
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
    """Counts asked for: whole GPUs, MIG units per ``mig-<profile>`` resource, shares of one GPU
    (0: none) and ``share_size``, the ways that GPU is cut when a ``gpu-share-<N>`` unit was asked
    (``shares`` is then 1), 0 for the pooled ``gpu_shares`` (any shared GPU)."""

    gpus: int = 0
    mig: Mapping[str, int] = field(default_factory=dict)
    shares: int = 0
    share_size: int = 0

    @property
    def empty(self) -> bool:
        return not (self.gpus or self.mig or self.shares)


# What ``read`` looks at in a container's resources, all an Update acts on: exact names, and a name
# prefix written "<prefix>*". The sidecar says it on Prepare's answer (PrepareResponse.update_reads), so
# that a caller may answer itself an Update whose resources of these names are those it last sent.
UPDATE_READS = ("gpus", sharing.RESOURCE, sharing.UNIT_PREFIX + "*", migunits.PREFIX + "*")


def read(resources: Iterable[Resource]) -> Request:
    """Each kind's count, refused as Mesos refuses it (InvalidGpuCount, InvalidMigRequest,
    InvalidShareCount) or as one GPU could not hold it (InvalidShareUnit: more than one unit); no
    rule on how kinds combine."""
    resources = tuple(resources)
    ask = sharing.share_ask(resources)
    return Request(gpu_count(resources), migunits.requests(resources), ask.count, ask.size)


def for_prepare(container_id: ContainerId, resources: Iterable[Resource]) -> Request:
    """A new container's request: shares of one GPU, or whole GPUs and MIG units, never both."""
    request = read(resources)
    if request.shares and (request.gpus or request.mig):
        # One kind per container: under MPS its CUDA would reach every GPU through the MPS
        # daemon of its shared one, and a whole GPU beside a share gains nothing (docs/sharing.md).
        named = sharing.unit_name(request.share_size) if request.share_size else sharing.RESOURCE
        raise InvalidArgument(
            f"container {container_id} asks for {named} together with whole GPUs or MIG devices;"
            " a container holds shares of one GPU, or whole GPUs and MIG devices, not both"
        )
    return request


def check_update(container_id: ContainerId, holding: Holding, request: Request) -> None:
    """A running container's new request (``read``) may change each kind it holds, never mix them:
    a sharer asks for shares only (0 releases them, the same count keeps them, another count is
    booked on the same GPU by ``Booking.resize``), and a container without shares is never given
    some on the fly: they are placed at launch, where its MPS client is set up (docs/sharing.md).
    Whole GPUs and MIG units change freely (docs/mig.md). FailedPrecondition otherwise."""
    if holding.shares and (request.gpus or request.mig):
        raise FailedPrecondition(
            f"container {container_id} holds {holding.shares} {sharing.RESOURCE}; shares are never mixed with"
            f" whole GPUs or MIG devices (update asks for {request.gpus} gpus, MIG {dict(request.mig) or '{}'})"
        )
    if request.shares and not holding.shares:
        raise FailedPrecondition(
            f"container {container_id} holds no {sharing.RESOURCE}; shares are placed at launch"
            f" (update asks for {request.shares} {sharing.RESOURCE})"
        )
