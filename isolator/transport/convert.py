"""Translation between the generated proto messages and the domain model, in both directions.

The one home of each conversion: the gRPC servicers (isolator.transport.server) and the client
(isolator.transport.client) use these; the core never sees a proto message.
"""

from __future__ import annotations

import json
from typing import Any

from isolator import model
from isolator.errors import InvalidArgument
from isolator.rpc import isolator_pb2 as pb

# ---- proto -> model ---------------------------------------------------------------------------


def container_id_from_proto(msg: pb.ContainerID) -> model.ContainerId:
    chain = []
    node = msg
    while True:
        chain.append(node.value)
        if not node.HasField("parent"):
            break
        node = node.parent
        if len(chain) > model.MAX_NESTING:
            raise InvalidArgument(f"container ID nested deeper than {model.MAX_NESTING} levels")
    return model.ContainerId.from_chain(reversed(chain))


def container_id_to_proto(cid: model.ContainerId) -> pb.ContainerID:
    msg = pb.ContainerID(value=cid.value)
    if cid.parent is not None:
        msg.parent.CopyFrom(container_id_to_proto(cid.parent))
    return msg


def resources_from_proto(items: Any) -> tuple[model.Resource, ...]:
    return tuple(
        model.Resource(
            name=r.name,
            value=r.scalar.value,
            type=pb.Value.Type.Name(r.type) if r.type in pb.Value.Type.values() else str(r.type),
            role=r.role or "*",
        )
        for r in items
    )


def config_from_proto(msg: pb.ContainerConfig) -> model.ContainerConfig:
    cls = msg.container_class
    manifest = msg.docker.manifest.config
    linux = msg.container_info.linux_info
    return model.ContainerConfig(
        resources=resources_from_proto(msg.resources),
        container_class=pb.ContainerClass.Name(cls) if cls in pb.ContainerClass.values() else "UNKNOWN",
        directory=msg.directory,
        user=msg.user,
        rootfs=msg.rootfs,
        image_env=tuple(manifest.Env),
        image_labels=tuple(sorted(manifest.Labels.items())),
        command_task=msg.HasField("task_info"),
        # Mesos declares `[default = true]`; stout writes it whenever linux_info is present.
        share_cgroups=linux.share_cgroups if linux.HasField("share_cgroups") else True,
    )


def launch_info_to_proto(info: model.LaunchInfo) -> pb.ContainerLaunchInfo:
    msg = pb.ContainerLaunchInfo()
    for name, value in info.environment:
        msg.environment.variables.add(name=name, value=value, type=pb.Environment.Variable.VALUE)
    for name, value in info.task_environment:
        msg.task_environment.variables.add(name=name, value=value, type=pb.Environment.Variable.VALUE)
    for m in info.mounts:
        msg.mounts.add(target=m.target, source=m.source, type=m.type, flags=m.flags, options=m.options)
    return msg


# ---- model -> proto -----------------------------------------------------------------------------


def limitation_to_proto(lim: model.Limitation) -> pb.ContainerLimitation:
    # No `role` on these resources: the agent puts them in the executor's terminal status update,
    # whose resources must be in the post-refinement format, and aborts on the deprecated field
    # (CHECK(!resource.has_role()) in Slave::sendExecutorTerminatedStatusUpdate), even on "*".
    msg = pb.ContainerLimitation(message=lim.message, reason=lim.reason)
    if lim.gpus or not lim.mig:
        msg.resources.add(name="gpus", type=pb.Value.SCALAR).scalar.value = lim.gpus
    for name, count in lim.mig:
        msg.resources.add(name=name, type=pb.Value.SCALAR).scalar.value = count
    return msg


def usage_to_proto(usage: model.Usage) -> pb.UsageResponse:
    msg = pb.UsageResponse(statistics=pb.ResourceStatistics(timestamp=usage.timestamp))
    for g in usage.gpus:
        msg.gpus.add(
            uuid=g.uuid,
            minor=g.minor,
            memory_used_bytes=g.memory_used_bytes,
            memory_total_bytes=g.memory_total_bytes,
            utilization_percent=g.utilization_percent,
        )
    msg.devices.extend(device_use_to_proto(d) for d in usage.devices)
    return msg


def device_use_to_proto(d: model.DeviceUse) -> pb.DeviceUsage:
    msg = pb.DeviceUsage(
        uuid=d.uuid,
        minor=d.minor,
        kind=d.kind,
        memory_used_bytes=d.memory_used,
        memory_limit_bytes=d.memory_limit,
        over=d.over,
        pids=d.pids,
        error=d.error,
    )
    if d.sm_utilization is not None:
        msg.sm_utilization_percent = d.sm_utilization
    return msg


def gpu_info_to_proto(g: model.GpuInfo) -> pb.GpuInfo:
    return pb.GpuInfo(
        index=g.index,
        minor=g.minor,
        uuid=g.uuid,
        name=g.name,
        pci_bus_id=g.pci_bus_id,
        memory_total_bytes=g.memory_total_bytes,
        numa_node=g.numa_node,
        cpu_affinity=g.cpu_affinity,
        healthy=g.healthy,
        last_xid=g.last_xid,
        last_xid_time=g.last_xid_time,
        health_reason=g.health_reason,
        holder=g.holder,
        mig_enabled=g.mig_enabled,
        mig_devices=[
            pb.MigDeviceInfo(
                uuid=m.uuid,
                profile=m.profile,
                resource=m.resource,
                gpu_instance_id=m.gpu_instance_id,
                compute_instance_id=m.compute_instance_id,
                memory_total_bytes=m.memory_total_bytes,
                caps_minors=m.caps_minors,
                slot=m.slot,
                holder=m.holder,
            )
            for m in g.mig_devices
        ],
        drain_state=g.drain_state,
        drain_since=g.drain_since,
        drain_pids=g.drain_pids,
        drain_reason=g.drain_reason,
        drain_memory_used_bytes=g.drain_memory_used_bytes,
        last_reset=g.last_reset,
        maintenance=g.maintenance,
        maintenance_reason=g.maintenance_reason,
        maintenance_since=g.maintenance_since,
        maintenance_by=g.maintenance_by,
        shares_total=g.shares_total,
        shares_held=g.shares_held,
        share_mode=g.share_mode,
        share_holders=[pb.ShareHolder(holder=h, shares=n) for h, n in g.share_holders],
        mps_state=g.mps_state,
    )


def maintenance_to_proto(m: model.MaintenanceChange) -> pb.MaintenanceResponse:
    return pb.MaintenanceResponse(
        index=m.index,
        minor=m.minor,
        uuid=m.uuid,
        drained=m.drained,
        was_drained=m.was_drained,
        reason=m.reason,
        since=m.since,
        by=m.by,
        detail=m.detail,
        holders=m.holders,
    )


def undrained_to_proto(u: model.Undrained) -> pb.UndrainResponse:
    return pb.UndrainResponse(
        index=u.index, minor=u.minor, uuid=u.uuid, was=u.was, detail=u.detail, reset=list(u.reset)
    )


def container_info_to_proto(c: model.ContainerInfo) -> pb.ContainerInfo:
    return pb.ContainerInfo(
        container_id=container_id_to_proto(c.container_id),
        id=str(c.container_id),
        nested=c.nested,
        gpu_uuids=c.gpu_uuids,
        gpu_minors=c.gpu_minors,
        gpu_indices=c.gpu_indices,
        cgroup=c.cgroup,
        mode=c.mode,
        volume_version=c.volume_version,
        state=c.state,
        created=c.created,
        mig_uuids=c.mig_uuids,
        shares=c.shares,
        shares_total=c.shares_total,
        share_mode=c.share_mode,
        share_gpu_minor=max(c.share_gpu_minor, 0),
        share_gpu_index=max(c.share_gpu_index, 0),
        share_gpu_uuid=c.share_gpu_uuid,
        usage=[device_use_to_proto(d) for d in c.usage],
    )


def description_to_proto(d: model.Description) -> pb.DescribeContainerResponse:
    return pb.DescribeContainerResponse(
        container=container_info_to_proto(d.container),
        recorded_rules=d.recorded_rules,
        kernel_rules=d.kernel_rules,
        kernel_source=d.kernel_source,
        rules_cgroup=d.rules_cgroup,
        rules_agree=d.rules_agree,
        only_recorded=d.only_recorded,
        only_kernel=d.only_kernel,
        kernel_gpu_minors=d.kernel_gpu_minors,
        pids=d.pids,
        gpus=[gpu_info_to_proto(g) for g in d.gpus],
        nested=[container_info_to_proto(c) for c in d.nested],
        cpu_affinity=d.cpu_affinity,
        local_cpus=d.local_cpus,
        local_numa_nodes=d.local_numa_nodes,
        cpuset_recorded_cpus=d.cpuset_recorded_cpus,
        cpuset_recorded_mems=d.cpuset_recorded_mems,
        cpuset_cpus=d.cpuset_cpus,
        cpuset_mems=d.cpuset_mems,
        cpuset_cgroup=d.cpuset_cgroup,
    )


def topology_to_proto(t: model.TopologyView) -> pb.TopologyResponse:
    return pb.TopologyResponse(
        indices=t.indices,
        links=[pb.TopologyResponse.Link(a=k.a, b=k.b, kind=k.kind, nvlink_lanes=k.nvlink_lanes) for k in t.links],
        numa_nodes=t.numa_nodes,
        cpu_affinity=t.cpu_affinity,
    )


def released_to_proto(r: model.Released) -> pb.ReleaseResponse:
    return pb.ReleaseResponse(
        container=str(r.container),
        released_gpu_uuids=r.released_gpu_uuids,
        released_gpu_minors=r.released_gpu_minors,
        pids=r.pids,
        action=r.action,
        cgroup=r.cgroup,
        detail=r.detail,
    )


def volume_to_proto(v: model.VolumeReport) -> pb.VolumeResponse:
    manifest = {"driver_version": v.driver_version, "volume_root": v.volume_root, "volumes": list(v.volumes)}
    return pb.VolumeResponse(manifest_json=json.dumps(manifest, sort_keys=True))
