"""The hooks' handlers, shared by both routes: a request message and the call's facts in, a response
message or an ``IsolatorError`` out.

Each handler converts proto <-> model (isolator/transport/convert.py) and calls the core's API; it
holds no logic and knows no protocol. ``Handlers.handle`` is the one entry of both routes: it sets
the hook and container for the call's log lines, logs a failure once, tells the observer (metrics,
job mapping) and turns an unexpected exception into ``errors.Internal``, so that each route maps
exactly one error type, once, in its own protocol: gRPC statuses (isolator/transport/serving.py),
the bridge's ``ERROR``/``RETRY`` lines (isolator/transport/bridge.py).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from isolator import __version__, model
from isolator.core.api import UPDATE_READS, IsolatorApi
from isolator.errors import ContainerGone, DeadlineExceeded, Internal, IsolatorError
from isolator.model import LaunchInfo
from isolator.rpc import isolator_pb2 as pb
from isolator.transport import peergate
from isolator.transport.convert import (
    config_from_proto,
    container_id_from_proto,
    container_info_to_proto,
    description_to_proto,
    gpu_info_to_proto,
    launch_info_to_proto,
    limitation_to_proto,
    maintenance_to_proto,
    released_to_proto,
    resources_from_proto,
    topology_to_proto,
    undrained_to_proto,
    usage_to_proto,
    volume_to_proto,
)
from isolator.transport.logcontext import hook_context

LOG = logging.getLogger(__name__)

# Told of every call once it is answered: (hook, status code name, seconds, response or None).
Observer = Callable[[str, str, float, Any], None]

GRPC = "grpc"
BRIDGE = "bridge"

# Calls run even when their caller's deadline has passed: Cleanup only frees (late is better than
# never, and a container ID is never reused), and Watch only reads and answers at its deadline itself.
# Every other call found expired when a worker would start it is answered DEADLINE_EXCEEDED unserved
# (docs/operations.md, "Stale hooks").
NEVER_EXPIRED = frozenset({"Cleanup", "Watch"})


@dataclass(frozen=True)
class CallFacts:
    """What a route knows of a call besides its request."""

    # The caller as the gate names it (isolator/transport/peergate.py, from SO_PEERCRED): Isolate
    # moves only the caller's processes.
    peer: str
    # ``time.monotonic()`` by which the caller gives up; None: it set no deadline.
    deadline: float | None
    route: str  # GRPC or BRIDGE
    # Where a handler may send its answer before it ends (gRPC's Prepare: serving.Dispatcher.run);
    # None: the answer is what the handler returns.
    early: Callable[[Any], None] | None = None

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def expired(self, hook: str, container: str) -> DeadlineExceeded | None:
        """The refusal of a call whose caller's deadline has passed, or None when it may run."""
        if self.deadline is None or hook in NEVER_EXPIRED:
            return None
        late = time.monotonic() - self.deadline
        if late < 0:
            return None
        whose = f" of container {container}" if container else ""
        return DeadlineExceeded(
            f"{hook}{whose} not run: its caller's deadline passed {late:.3f} s before it could start"
            " (the caller gave up; the sidecar was stopped or overloaded)"
        )


def container_text(request: Any) -> str:
    """The request's container ID as ``parent.child`` for logs ("" when it has none)."""
    node = getattr(request, "container_id", None)
    chain: list[str] = []
    while node is not None and len(chain) <= model.MAX_NESTING:
        chain.append(getattr(node, "value", ""))
        node = node.parent if node.HasField("parent") else None
    return ".".join(reversed(chain)) if any(chain) else ""


def observe(observer: Observer | None, hook: str, code: str, seconds: float, response: Any) -> None:
    """Tell ``observer`` of a call; its failure is logged, never the call's."""
    if observer is None:
        return
    try:
        observer(hook, code, seconds, response)
    except Exception:
        LOG.exception("observer of %s failed", hook)


def _level(exc: IsolatorError) -> int:
    # A gone container is routine (the module polls Watch after Cleanup); an expired call means the
    # sidecar was stopped or overloaded past its callers' deadlines: an operator should hear of it.
    if isinstance(exc, ContainerGone):
        return logging.DEBUG
    return logging.WARNING if isinstance(exc, DeadlineExceeded) else logging.INFO


class Handlers:
    """One service's handlers (methods named as its RPCs) and the one entry both routes call them by."""

    def __init__(self, observer: Observer | None) -> None:
        self.observer = observer

    def handle(self, hook: str, request: Any, call: CallFacts) -> Any:
        """Run the handler of ``hook``: its response, or an ``IsolatorError`` (never anything else)."""
        started = time.perf_counter()
        code, response = "OK", None
        container = container_text(request)
        with hook_context(hook, container):
            try:
                # The one place both routes expire a call, as a worker starts it: whatever held it
                # (a stopped process, a queue), it must not act for a caller that gave up.
                stale = call.expired(hook, container)
                if stale is not None:
                    raise stale
                response = getattr(self, hook)(request, call)
                return response
            except IsolatorError as exc:
                # A Watch of a container Mesos cleaned up lately ends NOT_FOUND on gRPC but is nobody's
                # error (the module's Watch may arrive after the Cleanup it raced): observed as routine,
                # not counted in gpu_isolator_errors_total.
                code = "OK" if isinstance(exc, ContainerGone) else exc.code
                LOG.log(_level(exc), "%s failed: %s", hook, exc.message)
                raise
            except Exception as exc:
                code = "INTERNAL"
                LOG.exception("%s failed with an unexpected error", hook)
                raise Internal(f"internal error in {hook}: {exc}") from exc
            finally:
                observe(self.observer, hook, code, time.perf_counter() - started, response)


def _prepared(info: LaunchInfo | None, *, unawaited: bool) -> pb.PrepareResponse:
    if info is None:
        return pb.PrepareResponse(update_reads=UPDATE_READS, isolate_unawaited=unawaited)
    return pb.PrepareResponse(
        launch_info=launch_info_to_proto(info), update_reads=UPDATE_READS, isolate_unawaited=unawaited
    )


class IsolatorHandlers(Handlers):
    """The Isolator service's hooks (include/mesos/slave/isolator.hpp)."""

    def __init__(self, service: IsolatorApi, observer: Observer | None = None) -> None:
        super().__init__(observer)
        self._service = service

    def Recover(self, request: pb.RecoverRequest, call: CallFacts) -> pb.RecoverResponse:
        states = [
            model.ContainerState(container_id_from_proto(s.container_id), pid=s.pid, directory=s.directory)
            for s in request.states
        ]
        orphans = [container_id_from_proto(o) for o in request.orphans]
        result = self._service.recover(states, orphans)
        return pb.RecoverResponse(recovered=result.recovered, released=result.released)

    def Prepare(self, request: pb.PrepareRequest, call: CallFacts) -> pb.PrepareResponse:
        cid = container_id_from_proto(request.container_id)
        config = config_from_proto(request.container_config)
        early = call.early
        if early is None:
            info = self._service.prepare(cid, config)
            # With the answer, what an Update acts on (the module answers itself one that changes
            # none of it), and whether the launch must wait for the Isolate.
            return _prepared(info, unawaited=not self._service.isolate_awaited(cid))
        answered: list[pb.PrepareResponse] = []

        def answer(info: LaunchInfo | None) -> None:
            # Before the grant is durable and in force: the launch must wait for the Isolate, which
            # answers once it is (docs/mesos-agent.md, "Prepare answers before its grant is in force").
            answered.append(_prepared(info, unawaited=False))
            early(answered[0])

        info = self._service.prepare_early(cid, config, answer)
        if answered:
            return answered[0]
        return _prepared(info, unawaited=not self._service.isolate_awaited(cid))

    def Isolate(self, request: pb.IsolateRequest, call: CallFacts) -> pb.IsolateResponse:
        caller = peergate.caller_pid(call.peer)  # the gate's SO_PEERCRED: whose pid may be moved
        self._service.isolate(container_id_from_proto(request.container_id), request.pid, caller)
        return pb.IsolateResponse()

    def Watch(self, request: pb.WatchRequest, call: CallFacts) -> pb.WatchResponse:
        """Is there a limitation now? Never waits: an open gRPC Watch waits in the transport
        (serving.watch_handler) and asks again on each change; the command module polls."""
        try:
            limitation = self._service.watch(container_id_from_proto(request.container_id))
        except ContainerGone:
            if call.route == BRIDGE:
                # criteo's module polls once more after each Cleanup: a gone container has no
                # limitation, and an error here would be a line in both logs per container.
                return pb.WatchResponse()
            raise
        if limitation is None:
            return pb.WatchResponse()
        return pb.WatchResponse(limitation=limitation_to_proto(limitation))

    def Update(self, request: pb.UpdateRequest, call: CallFacts) -> pb.UpdateResponse:
        cid = container_id_from_proto(request.container_id)
        self._service.update(cid, list(resources_from_proto(request.resource_requests)))
        return pb.UpdateResponse()

    def Usage(self, request: pb.UsageRequest, call: CallFacts) -> pb.UsageResponse:
        return usage_to_proto(self._service.usage(container_id_from_proto(request.container_id)))

    def Status(self, request: pb.StatusRequest, call: CallFacts) -> pb.StatusResponse:
        status = self._service.status(container_id_from_proto(request.container_id))
        return pb.StatusResponse(gpu_uuids=status.gpu_uuids, state=status.state)

    def Cleanup(self, request: pb.CleanupRequest, call: CallFacts) -> pb.CleanupResponse:
        self._service.cleanup(container_id_from_proto(request.container_id))
        return pb.CleanupResponse()


class AdminHandlers(Handlers):
    """The Admin service (docs/cli.md)."""

    def __init__(self, service: IsolatorApi, observer: Observer | None = None, mode: str = "") -> None:
        super().__init__(observer)
        self._service = service
        self._mode = mode  # for Health: which mode the answering sidecar runs in

    def ListGpus(self, request: pb.ListGpusRequest, call: CallFacts) -> pb.ListGpusResponse:
        gpus = self._service.list_gpus()
        return pb.ListGpusResponse(
            driver_version=gpus.driver_version,
            cuda_driver_version=gpus.cuda_driver_version,
            gpus=[gpu_info_to_proto(g) for g in gpus.gpus],
            sidecar_version=__version__,
        )

    def Topology(self, request: pb.TopologyRequest, call: CallFacts) -> pb.TopologyResponse:
        return topology_to_proto(self._service.topology())

    def AgentFlags(self, request: pb.AgentFlagsRequest, call: CallFacts) -> pb.AgentFlagsResponse:
        resources, pairs = self._service.agent_flags()
        attributes = [pb.AgentFlagsResponse.Attribute(name=n, value=v) for n, v in pairs]
        return pb.AgentFlagsResponse(resources=resources, attributes=attributes)

    def ListContainers(self, request: pb.ListContainersRequest, call: CallFacts) -> pb.ListContainersResponse:
        containers = self._service.list_containers()
        return pb.ListContainersResponse(containers=[container_info_to_proto(c) for c in containers])

    def DescribeContainer(self, request: pb.DescribeContainerRequest, call: CallFacts) -> pb.DescribeContainerResponse:
        return description_to_proto(self._service.describe_container(container_id_from_proto(request.container_id)))

    def Volume(self, request: pb.VolumeRequest, call: CallFacts) -> pb.VolumeResponse:
        return volume_to_proto(self._service.volume())

    def Health(self, request: pb.HealthRequest, call: CallFacts) -> pb.HealthResponse:
        checks = self._service.health()
        return pb.HealthResponse(
            checks=[pb.HealthResponse.Check(name=c.name, ok=c.ok, detail=c.detail) for c in checks],
            version=__version__,
            mode=self._mode,
            hostname=socket.gethostname(),
        )

    def Release(self, request: pb.ReleaseRequest, call: CallFacts) -> pb.ReleaseResponse:
        released = self._service.release(container_id_from_proto(request.container_id), request.force)
        return released_to_proto(released)

    def Audit(self, request: pb.AuditRequest, call: CallFacts) -> pb.AuditResponse:
        report = self._service.audit()
        return pb.AuditResponse(checked=report.checked, repaired=report.repaired, repairs_total=report.repairs_total)

    def Undrain(self, request: pb.UndrainRequest, call: CallFacts) -> pb.UndrainResponse:
        return undrained_to_proto(self._service.undrain(request.gpu))

    def MaintenanceDrain(self, request: pb.MaintenanceDrainRequest, call: CallFacts) -> pb.MaintenanceResponse:
        caller = peergate.caller_text(call.peer)  # the gate's SO_PEERCRED: who took it out of service
        return maintenance_to_proto(self._service.maintenance_drain(request.gpu, request.reason, caller))

    def MaintenanceUndrain(self, request: pb.MaintenanceUndrainRequest, call: CallFacts) -> pb.MaintenanceResponse:
        caller = peergate.caller_text(call.peer)
        return maintenance_to_proto(self._service.maintenance_undrain(request.gpu, caller, request.reason))

    def MaintenanceHistory(
        self, request: pb.MaintenanceHistoryRequest, call: CallFacts
    ) -> pb.MaintenanceHistoryResponse:
        drains = [
            pb.MaintenanceHistoryResponse.Drain(
                uuid=d.uuid,
                reason=d.reason,
                since=d.since,
                by=d.by,
                ended=d.ended,
                ended_by=d.ended_by,
                end_reason=d.end_reason,
            )
            for d in self._service.maintenance_history()
        ]
        return pb.MaintenanceHistoryResponse(drains=drains)
