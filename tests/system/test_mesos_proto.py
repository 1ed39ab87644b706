"""Our proto's Mesos-shaped messages against Mesos's own, and stout-shaped JSON through the translation.

MESOS below is transcribed from apache/mesos (include/mesos/mesos.proto,
include/mesos/slave/containerizer.proto, include/mesos/docker/v1.proto at master c1b42f79, checked
against the 1.6.0 to 1.11.0 tags): for every field we declare, Mesos's name, number and type. A field
of ours that Mesos does not have, or has under another number or type, fails here. Differences
by version are in docs/mesos-agent.md.
"""

from __future__ import annotations

import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from isolator.rpc import isolator_pb2 as pb
from isolator.testing.mesos_json import container_config
from isolator.transport.convert import config_from_proto

F = FieldDescriptor
# (our message, Mesos's message): {field: (number, type, repeated)}; maps are repeated entries.
MESOS: dict[tuple[str, str], dict[str, tuple[int, int, bool]]] = {
    ("ContainerID", "mesos.ContainerID"): {"value": (1, F.TYPE_STRING, False), "parent": (2, F.TYPE_MESSAGE, False)},
    ("Value.Scalar", "mesos.Value.Scalar"): {"value": (1, F.TYPE_DOUBLE, False)},
    ("Resource", "mesos.Resource"): {
        "name": (1, F.TYPE_STRING, False),
        "type": (2, F.TYPE_ENUM, False),
        "scalar": (3, F.TYPE_MESSAGE, False),
        "role": (6, F.TYPE_STRING, False),
    },
    ("Label", "mesos.Label"): {"key": (1, F.TYPE_STRING, False), "value": (2, F.TYPE_STRING, False)},
    ("Environment", "mesos.Environment"): {"variables": (1, F.TYPE_MESSAGE, True)},
    ("Environment.Variable", "mesos.Environment.Variable"): {
        "name": (1, F.TYPE_STRING, False),
        "value": (2, F.TYPE_STRING, False),
        "type": (3, F.TYPE_ENUM, False),
    },
    ("CommandInfo", "mesos.CommandInfo"): {"value": (3, F.TYPE_STRING, False), "shell": (6, F.TYPE_BOOL, False)},
    ("DockerImageManifest", "docker.spec.v1.ImageManifest"): {"config": (9, F.TYPE_MESSAGE, False)},
    ("DockerImageManifest.Config", "docker.spec.v1.ImageManifest.Config"): {
        "Env": (3, F.TYPE_STRING, True),
        "Labels": (9, F.TYPE_MESSAGE, True),  # map<string, string>, since 1.6.0
    },
    ("TaskID", "mesos.TaskID"): {"value": (1, F.TYPE_STRING, False)},
    ("TaskInfo", "mesos.TaskInfo"): {"name": (1, F.TYPE_STRING, False), "task_id": (2, F.TYPE_MESSAGE, False)},
    ("LinuxInfo", "mesos.LinuxInfo"): {"share_cgroups": (8, F.TYPE_BOOL, False)},  # since 1.10.0
    ("MesosContainerInfo", "mesos.ContainerInfo"): {
        "type": (1, F.TYPE_ENUM, False),
        "linux_info": (8, F.TYPE_MESSAGE, False),
    },
    ("ContainerConfig", "mesos.slave.ContainerConfig"): {
        "directory": (3, F.TYPE_STRING, False),
        "user": (4, F.TYPE_STRING, False),
        "rootfs": (5, F.TYPE_STRING, False),
        "docker": (7, F.TYPE_MESSAGE, False),
        "task_info": (9, F.TYPE_MESSAGE, False),
        "command_info": (11, F.TYPE_MESSAGE, False),
        "container_info": (12, F.TYPE_MESSAGE, False),
        "resources": (13, F.TYPE_MESSAGE, True),
        "container_class": (14, F.TYPE_ENUM, False),
    },
    ("ContainerConfig.Docker", "mesos.slave.ContainerConfig.Docker"): {"manifest": (1, F.TYPE_MESSAGE, False)},
    ("ContainerMountInfo", "mesos.slave.ContainerMountInfo"): {
        "target": (1, F.TYPE_STRING, False),
        "source": (2, F.TYPE_STRING, False),
        "type": (3, F.TYPE_STRING, False),
        "flags": (4, F.TYPE_UINT32, False),
        "options": (5, F.TYPE_STRING, False),
    },
    ("ContainerFileOperation", "mesos.slave.ContainerFileOperation"): {  # since 1.9.0
        "operation": (1, F.TYPE_ENUM, False),
        "symlink": (2, F.TYPE_MESSAGE, False),
        "mkdir": (3, F.TYPE_MESSAGE, False),
        "rename": (4, F.TYPE_MESSAGE, False),
        "mount": (5, F.TYPE_MESSAGE, False),
    },
    ("ContainerFileOperation.Symlink", "mesos.slave.ContainerFileOperation.Symlink"): {
        "source": (1, F.TYPE_STRING, False),
        "target": (2, F.TYPE_STRING, False),
    },
    ("ContainerFileOperation.Rename", "mesos.slave.ContainerFileOperation.Rename"): {
        "source": (1, F.TYPE_STRING, False),
        "target": (2, F.TYPE_STRING, False),
    },
    ("ContainerFileOperation.Mkdir", "mesos.slave.ContainerFileOperation.Mkdir"): {
        "target": (1, F.TYPE_STRING, False),
        "recursive": (2, F.TYPE_BOOL, False),
    },
    ("ContainerLaunchInfo", "mesos.slave.ContainerLaunchInfo"): {
        "environment": (2, F.TYPE_MESSAGE, False),
        "task_environment": (15, F.TYPE_MESSAGE, False),
        "mounts": (17, F.TYPE_MESSAGE, True),
        "file_operations": (22, F.TYPE_MESSAGE, True),
    },
    ("ContainerLimitation", "mesos.slave.ContainerLimitation"): {
        "resources": (1, F.TYPE_MESSAGE, True),
        "message": (2, F.TYPE_STRING, False),
        "reason": (3, F.TYPE_ENUM, False),
    },
    ("ContainerState", "mesos.slave.ContainerState"): {
        "container_id": (2, F.TYPE_MESSAGE, False),
        "pid": (3, F.TYPE_UINT64, False),
        "directory": (4, F.TYPE_STRING, False),
    },
    ("ResourceStatistics", "mesos.ResourceStatistics"): {"timestamp": (1, F.TYPE_DOUBLE, False)},
}

# Enum values Mesos defines, by name; ours may add only a zero that Mesos (proto2) does not have.
MESOS_ENUMS = {
    "ContainerClass": {"DEFAULT": 1, "DEBUG": 2},
    "Value.Type": {"SCALAR": 0, "RANGES": 1, "SET": 2, "TEXT": 3},
    "Environment.Variable.Type": {"UNKNOWN": 0, "VALUE": 1, "SECRET": 2},
    "MesosContainerInfo.Type": {"DOCKER": 1, "MESOS": 2},
    "ContainerFileOperation.Operation": {"SYMLINK": 1, "MOUNT": 2, "RENAME": 3, "MKDIR": 4},
    "Reason": {"REASON_CONTAINER_LIMITATION": 19},  # mesos.TaskStatus.Reason
}


def _descriptor(path: str):
    node = pb.DESCRIPTOR.message_types_by_name[path.split(".")[0]]
    for part in path.split(".")[1:]:
        node = node.nested_types_by_name[part]
    return node


@pytest.mark.parametrize("ours", [k[0] for k in MESOS], ids=[f"{a}={b}" for a, b in MESOS])
def test_every_field_of_a_mesos_shaped_message_has_mesos_name_number_and_type(ours):
    mesos = next(v for k, v in MESOS.items() if k[0] == ours)
    descriptor = _descriptor(ours)
    have = {f.name: (f.number, f.type, f.is_repeated) for f in descriptor.fields}
    assert have == mesos


def test_docker_labels_are_a_string_to_string_map():
    field = _descriptor("DockerImageManifest.Config").fields_by_name["Labels"]
    assert field.message_type.GetOptions().map_entry
    assert [f.type for f in field.message_type.fields] == [F.TYPE_STRING, F.TYPE_STRING]


@pytest.mark.parametrize("name", sorted(MESOS_ENUMS))
def test_enum_values_are_mesos_numbers_plus_at_most_a_proto3_zero(name):
    parts = name.split(".")
    if len(parts) == 1:
        enum = pb.DESCRIPTOR.enum_types_by_name[name]
    else:
        enum = _descriptor(".".join(parts[:-1])).enum_types_by_name[parts[-1]]
    ours = {v.name: v.number for v in enum.values}
    extra = {k: v for k, v in ours.items() if k not in MESOS_ENUMS[name]}
    assert {k: ours.get(k) for k in MESOS_ENUMS[name]} == MESOS_ENUMS[name]
    assert all(v == 0 for v in extra.values()) and len(extra) <= 1, extra


def test_share_cgroups_tracks_presence_so_unset_reads_as_mesos_default_true():
    assert _descriptor("LinuxInfo").fields_by_name["share_cgroups"].has_presence


# ---- stout-shaped JSON -> model -------------------------------------------------------------


def _model(config: dict):
    msg = json_format.ParseDict(config, pb.ContainerConfig(), ignore_unknown_fields=True)
    return config_from_proto(msg)


@pytest.mark.parametrize("version", ["1.6", "1.9", "1.10", "1.11", "master"])
@pytest.mark.parametrize(
    ("kind", "command_task", "debug"),
    [
        ("command", True, False),
        ("default-executor", False, False),
        ("custom", False, False),
        ("task", False, False),
        ("debug", False, True),
    ],
)
def test_every_kind_of_agent_container_translates(kind, command_task, debug, version):
    labels = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}
    config = container_config(
        kind,
        directory="/var/lib/mesos/slaves/S3/frameworks/F/executors/e/runs/r",
        gpu_count=2,
        check_command="nvidia-smi",
        rootfs="/var/lib/mesos/provisioner/containers/r/backends/overlay/rootfses/x",
        env=["NVIDIA_VISIBLE_DEVICES=all"],
        labels=labels,
        version=version,
    )
    model = _model(config)
    assert model.command_task is command_task
    assert (model.container_class == "DEBUG") is debug
    assert model.share_cgroups is True
    if kind != "debug":
        assert dict(model.image_labels) == labels
        assert model.image_env == ("NVIDIA_VISIBLE_DEVICES=all",)
        task_group_before_1_9 = kind == "default-executor" and version in ("1.6",)
        assert sum(r.value for r in model.resources if r.name == "gpus") == (0 if task_group_before_1_9 else 2)


@pytest.mark.parametrize(
    ("linux_info", "expected"),
    [(None, True), ({}, True), ({"share_cgroups": True}, True), ({"share_cgroups": False}, False)],
    ids=["no-linux-info", "pre-1.10-empty", "1.10-default-written", "own-cgroups"],
)
def test_share_cgroups_absent_or_unset_is_true_as_mesos_declares(linux_info, expected):
    config = {
        "directory": "/sandbox",
        "command_info": {"shell": True, "value": "x"},
        "container_info": {"type": "MESOS"},
    }
    if linux_info is not None:
        config["container_info"]["linux_info"] = linux_info
    assert _model(config).share_cgroups is expected


def test_pre_1_6_label_list_is_not_read():
    # `repeated Label labels = 9` before 1.6: an unknown key now, so the label is not seen.
    config = {
        "directory": "/s",
        "docker": {"manifest": {"config": {"labels": [{"key": "com.nvidia.volumes.needed", "value": "x"}]}}},
    }
    assert _model(config).image_labels == ()
