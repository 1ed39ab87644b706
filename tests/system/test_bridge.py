"""The bridge executables against a real sidecar, called as criteo/mesos-command-modules calls them.

Each test runs the installed launcher (through its ``gpu-isolator-<method>`` symlink) as a
subprocess with real IN/OUT/ERR files, against a real SidecarServer whose Service is a small
recording implementation (the real hooks are built elsewhere). stdout must stay empty every time:
it is the agent's log.

Every test that runs an executable runs twice, against the Python bridge (isolator/bridge/command.py)
and the compiled one (isolator/bridge/bridge.c, build/gpu-isolator-bridge from `make build`): one
protocol suite holds both to the same behaviour, byte for byte in OUT, ERR and stderr.
"""

from __future__ import annotations

import functools
import grp
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from isolator.bridge import command as bridge
from isolator.daemon import config
from isolator.daemon.config import Config
from isolator.errors import AlreadyExists, ContainerGone, GpusExhausted, Internal, NotFound, SocketError
from isolator.model import ContainerConfig, ContainerId, GpuUsage, LaunchInfo, Limitation, Mount, Usage, gpu_count
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing import StubService, mesos_json
from isolator.transport.server import SidecarServer
from isolator.transport.settings import ServerSettings

MS_RDONLY, MS_BIND, MS_REC = 1, 4096, 16384

# What a Mesos 1.11 agent writes for a command task with 2 GPUs (our composition, after
# apache/mesos:include/mesos/slave/containerizer.proto): many fields the sidecar does not know.
MESOS_PREPARE_INPUT: dict[str, Any] = {
    "container_id": {"value": "5d8f2a3c-2b4e-4c1a-9d3e-1f2a3b4c5d6e"},
    "container_config": {
        "executor_info": {
            "executor_id": {"value": "task-1"},
            "framework_id": {"value": "fw-0001"},
            "command": {"shell": True, "value": "nvidia-smi", "uris": []},
            "resources": [{"name": "cpus", "type": "SCALAR", "scalar": {"value": 0.1}, "role": "*"}],
        },
        "command_info": {
            "shell": True,
            "value": "nvidia-smi",
            "environment": {"variables": [{"name": "X", "type": "VALUE", "value": "1"}]},
        },
        "resources": [
            {"name": "gpus", "type": "SCALAR", "scalar": {"value": 2}, "role": "*", "allocation_info": {"role": "*"}},
            {"name": "cpus", "type": "SCALAR", "scalar": {"value": 1.5}, "role": "*"},
            {"name": "ports", "type": "RANGES", "ranges": {"range": [{"begin": 31000, "end": 31001}]}, "role": "*"},
        ],
        "limits": {"cpus": {"value": 2.0}},
        "container_class": "DEFAULT",
        "directory": "/var/lib/mesos/slaves/S0/frameworks/fw-0001/executors/task-1/runs/5d8f2a3c",
        "user": "nobody",
        "some_field_from_a_newer_agent": {"x": [1, 2, 3]},
    },
}

# ContainerLaunchInfo's fields in apache/mesos:include/mesos/slave/containerizer.proto, minus the
# ones the containerizer refuses from an isolator (rootfs, user).
LAUNCH_INFO_FIELDS = {
    "pre_exec_commands",
    "environment",
    "working_directory",
    "capabilities",
    "effective_capabilities",
    "bounding_capabilities",
    "namespaces",
    "clone_namespaces",
    "enter_namespaces",
    "command",
    "task_environment",
    "rlimits",
    "tty_slave_path",
    "mounts",
    "file_operations",
    "masked_paths",
    "supplementary_groups",
    "seccomp",
}


class RecordingService(StubService):
    """Enough of the hooks to exercise the protocol: records what arrives, answers in kind."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, Any]] = []
        self.callers: list[int | None] = []  # Isolate's caller pid as the server passed it
        self.prepared: set[str] = set()
        self.limitations: dict[str, Limitation] = {}
        self.timestamp = 1700000000.25
        self.cleanup_error: Exception | None = None
        self.gate: threading.Event | None = None  # when set, prepare blocks until the gate opens
        self.entered = threading.Event()

    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        self.calls.append(("prepare", str(container_id), config))
        if self.gate is not None:
            self.entered.set()
            self.gate.wait(60)
        if str(container_id) in self.prepared:
            raise AlreadyExists(f"container '{container_id}' is already prepared")
        self.prepared.add(str(container_id))
        gpus = gpu_count(config.resources)
        if gpus == 0:
            return None
        return LaunchInfo(
            environment=(("NVIDIA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))), ("EMPTY", "")),
            mounts=(
                Mount(
                    target=os.path.join(config.directory, ".gpu-isolator", "nvidia"),
                    source="/var/run/mesos/isolators/gpu/nvidia_550.54.15",
                    flags=MS_BIND | MS_REC | MS_RDONLY,
                ),
            ),
        )

    def isolate(self, container_id: ContainerId, pid: int, caller: int | None = None) -> None:
        self.calls.append(("isolate", str(container_id), pid))
        self.callers.append(caller)

    def watch(self, container_id: ContainerId) -> Limitation | None:
        self.calls.append(("watch", str(container_id)))
        if str(container_id).startswith("gone"):
            raise ContainerGone(container=str(container_id))
        if str(container_id).startswith("unknown"):
            raise NotFound(f"unknown container {container_id}")
        return self.limitations.get(str(container_id))

    def usage(self, container_id: ContainerId) -> Usage:
        self.calls.append(("usage", str(container_id), None))
        gpu = GpuUsage("GPU-0", 0, memory_used_bytes=1 << 30, memory_total_bytes=0, utilization_percent=40)
        return Usage(timestamp=self.timestamp, gpus=(gpu,))

    def cleanup(self, container_id: ContainerId) -> None:
        self.calls.append(("cleanup", str(container_id), None))
        if self.cleanup_error is not None:
            raise self.cleanup_error
        if str(container_id) not in self.prepared:
            raise NotFound(f"container '{container_id}' is not known to the sidecar")
        self.prepared.discard(str(container_id))


@dataclass
class Run:
    returncode: int
    out: str
    err: str
    stderr: str


@pytest.fixture
def service() -> RecordingService:
    return RecordingService()


@pytest.fixture
def sidecar(short_tmp, service):
    srv = SidecarServer(
        ServerSettings(socket=os.path.join(short_tmp, "run", "s.sock"), max_message_bytes=64 * 1024), service
    )
    srv.start()
    try:
        yield srv
    finally:
        if service.gate is not None:
            service.gate.set()
        srv.stop(grace=0)


@pytest.fixture(params=["python", "c"])
def install_bridge(request) -> Callable[..., list[str]]:
    """``bridge.install`` for the executable under test: the Python launcher or the compiled bridge."""
    if request.param == "python":
        return bridge.install
    compiled = bridge.compiled_bridge()
    if compiled is None:
        pytest.fail("build/gpu-isolator-bridge is missing: run `make build` (it needs gcc)")
    return functools.partial(bridge.install, compiled=compiled)


@pytest.fixture
def bin_dir(short_tmp, sidecar, install_bridge) -> str:
    directory = os.path.join(short_tmp, "bin")
    install_bridge(directory, socket_path=sidecar.settings.bridge_path)
    return directory


def call(
    bin_dir: str,
    method: str,
    payload: Any,
    env: dict[str, str] | None = None,
    stdin: bytes = b"",
) -> Run:
    """Run ``gpu-isolator-<method> IN OUT ERR`` as the module does (temp files, stdin = IN)."""
    with tempfile.TemporaryDirectory(prefix="criteo-mesos-", dir="/tmp") as tmp:
        paths = [os.path.join(tmp, name) for name in ("in", "out", "err")]
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        with open(paths[0], "wb") as fh:
            fh.write(data)
        for p in paths[1:]:
            open(p, "wb").close()
        result = subprocess.run(
            [os.path.join(bin_dir, f"gpu-isolator-{method}"), *paths],
            input=stdin,
            capture_output=True,
            env={**os.environ, **(env or {})},
            timeout=60,
        )
        with open(paths[1]) as fh:
            out = fh.read()
        with open(paths[2]) as fh:
            err = fh.read()
    assert result.stdout == b"", "the bridge wrote to stdout, which is the agent's log"
    return Run(result.returncode, out, err, result.stderr.decode())


def one_line(text: str) -> str:
    assert text, "ERR is empty"
    assert "\n" not in text, f"ERR is not one line: {text!r}"
    return text


# ---- each method ------------------------------------------------------------------------------


def test_prepare_writes_a_launch_info_with_mesos_field_names_and_no_rootfs_or_user(bin_dir, service):
    run = call(bin_dir, "prepare", MESOS_PREPARE_INPUT)

    assert run.returncode == 0, run.err
    info = json.loads(run.out)
    assert set(info) <= LAUNCH_INFO_FIELDS
    assert {"rootfs", "user"}.isdisjoint(info)
    assert info["environment"]["variables"] == [
        {"name": "NVIDIA_VISIBLE_DEVICES", "type": "VALUE", "value": "0,1"},
        {"name": "EMPTY", "type": "VALUE", "value": ""},
    ]
    [mount] = info["mounts"]
    assert mount["flags"] == MS_BIND | MS_REC | MS_RDONLY  # a number, as stout writes uint32
    assert mount["target"].endswith("/.gpu-isolator/nvidia")
    assert mount["source"] == "/var/run/mesos/isolators/gpu/nvidia_550.54.15"


def test_prepare_hands_the_service_what_mesos_sent_ignoring_fields_it_does_not_know(bin_dir, service):
    call(bin_dir, "prepare", MESOS_PREPARE_INPUT)

    [(hook, cid, cfg)] = service.calls
    assert (hook, cid) == ("prepare", "5d8f2a3c-2b4e-4c1a-9d3e-1f2a3b4c5d6e")
    assert gpu_count(cfg.resources) == 2
    assert [r.name for r in cfg.resources] == ["gpus", "cpus", "ports"]
    assert cfg.resources[2].type == "RANGES"
    assert cfg.container_class == "DEFAULT"
    assert cfg.directory == MESOS_PREPARE_INPUT["container_config"]["directory"]
    assert cfg.user == "nobody"


def test_prepare_leaves_out_empty_when_the_service_adds_nothing(bin_dir):
    payload = {"container_id": {"value": "no-gpus"}, "container_config": {"directory": "/sandbox"}}
    run = call(bin_dir, "prepare", payload)
    assert (run.returncode, run.out, run.err) == (0, "", "")


def test_prepare_of_a_nested_container_passes_its_parent_chain(bin_dir, service):
    payload = {"container_id": {"value": "child", "parent": {"value": "parent"}}, "container_config": {}}
    assert call(bin_dir, "prepare", payload).returncode == 0
    assert service.calls[0][1] == "parent.child"


def test_prepare_refused_by_the_service_exits_1_with_its_status_and_message(bin_dir):
    assert call(bin_dir, "prepare", MESOS_PREPARE_INPUT).returncode == 0
    run = call(bin_dir, "prepare", MESOS_PREPARE_INPUT)
    assert run.returncode == bridge.EXIT_REFUSED
    assert one_line(run.err).startswith("gpu-isolator prepare: ALREADY_EXISTS: container '5d8f2a3c")
    assert run.out == ""


@pytest.mark.parametrize("pid", [4242, "4242"], ids=["number", "numeric-string"])
def test_isolate_passes_the_pid_given_as_a_number_or_a_numeric_string(bin_dir, service, pid):
    run = call(bin_dir, "isolate", {"container_id": {"value": "c1"}, "pid": pid, "container_config": {}})
    assert (run.returncode, run.out) == (0, "")
    assert service.calls == [("isolate", "c1", 4242)]
    # The caller is the bridge executable: its pid (SO_PEERCRED), a child of this test, now gone.
    assert len(service.callers) == 1 and service.callers[0] not in (None, 0, os.getpid())


def test_cleanup_of_a_container_the_sidecar_never_knew_exits_0(bin_dir, service):
    run = call(bin_dir, "cleanup", {"container_id": {"value": "never-prepared"}})
    assert (run.returncode, run.out) == (0, "")
    assert service.calls == [("cleanup", "never-prepared", None)]
    assert "NOT_FOUND" in run.stderr  # noted in the agent's log, not turned into a failure


def test_cleanup_after_prepare_releases_the_container(bin_dir, service):
    call(bin_dir, "prepare", MESOS_PREPARE_INPUT)
    run = call(bin_dir, "cleanup", {"container_id": MESOS_PREPARE_INPUT["container_id"]})
    assert (run.returncode, run.err, run.stderr) == (0, "", "")
    assert service.prepared == set()


def test_cleanup_the_sidecar_cannot_complete_exits_non_zero(bin_dir, service):
    service.cleanup_error = Internal("failed to detach device program '/sys/fs/cgroup/x': Device or resource busy")
    run = call(bin_dir, "cleanup", {"container_id": {"value": "c1"}})
    assert run.returncode == bridge.EXIT_REFUSED
    assert "INTERNAL: failed to detach device program" in one_line(run.err)


def test_cleanup_while_the_sidecar_is_down_exits_0_and_says_so_in_the_agent_log(short_tmp, install_bridge):
    directory = os.path.join(short_tmp, "bin")
    absent = os.path.join(short_tmp, "absent.sock.bridge")
    install_bridge(directory, socket_path=absent)
    run = call(directory, "cleanup", {"container_id": {"value": "c1"}})
    assert run.returncode == 0
    assert absent in run.stderr


def test_watch_writes_nothing_while_there_is_no_limitation_and_does_not_block(bin_dir, service):
    run = call(bin_dir, "watch", {"container_id": {"value": "c1"}, "container_config": {}})
    assert (run.returncode, run.out, run.err) == (0, "", "")
    assert service.calls == [("watch", "c1")]  # a poll: the module calls again every period


def test_watch_writes_the_limitation_with_the_fields_mesos_requires(bin_dir, service):
    service.limitations["c1"] = Limitation(gpus=1, message="GPU-5c3f (minor 1) became unhealthy: XID 79")
    run = call(bin_dir, "watch", {"container_id": {"value": "c1"}, "container_config": {}})
    assert run.returncode == 0
    limitation = json.loads(run.out)
    assert limitation["message"] == "GPU-5c3f (minor 1) became unhealthy: XID 79"
    assert limitation["reason"] == "REASON_CONTAINER_LIMITATION"
    # Resource.type is `required` in Mesos; proto3 would drop SCALAR, its zero value.
    # No deprecated `role`: a real agent aborts on it (CHECK(!resource.has_role()) in
    # Slave::sendExecutorTerminatedStatusUpdate), killing every task on the node.
    assert limitation["resources"] == [{"name": "gpus", "type": "SCALAR", "scalar": {"value": 1.0}}]
    mesos_json.check_limitation(limitation)


def test_usage_writes_resource_statistics_with_its_timestamp(bin_dir, service):
    run = call(bin_dir, "usage", {"container_id": {"value": "c1"}, "container_config": {}})
    assert run.returncode == 0
    assert json.loads(run.out) == {"timestamp": 1700000000.25}


def test_usage_without_a_timestamp_from_the_service_gets_one(bin_dir, service):
    service.timestamp = 0.0
    run = call(bin_dir, "usage", {"container_id": {"value": "c1"}})
    assert run.returncode == 0
    assert json.loads(run.out)["timestamp"] > 1.6e9


def test_input_comes_from_the_file_in_argv_never_from_stdin(bin_dir, service):
    # watch runs through system() with the agent's stdin (reference §A.1.4, point 3).
    stdin = json.dumps({"container_id": {"value": "from-stdin"}}).encode()
    call(bin_dir, "watch", {"container_id": {"value": "from-argv"}}, stdin=stdin)
    assert [c[1] for c in service.calls] == ["from-argv"]


# ---- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "payload", "expected"),
    [
        ("prepare", b'{"container_id": {"value": "c1"', "input is not valid JSON"),
        ("prepare", b"", "input is empty"),
        ("prepare", b"\xff\xfe{}", "input is not UTF-8"),
        ("prepare", [{"container_id": {"value": "c1"}}], "input must be a JSON object, not an array"),
        ("prepare", "c1", "input must be a JSON object, not a string"),
        ("prepare", {"container_id": "c1"}, "input.container_id must be a JSON object, not a string"),
        ("prepare", {"container_id": {"value": 7}}, "Failed to parse value field"),
        (
            "prepare",
            {"container_id": {"value": "c1"}, "container_config": {"resources": {"name": "gpus"}}},
            "input.container_config.resources must be a JSON array, not an object",
        ),
        (
            "prepare",
            {"container_id": {"value": "c1"}, "container_config": {"resources": [{"scalar": {"value": "two"}}]}},
            "Couldn't parse float",
        ),
        ("prepare", {"container_id": {"value": "../etc"}}, "invalid container ID '../etc'"),
        ("prepare", {"container_config": {}}, "invalid container ID '': must not be empty"),
        (
            "prepare",
            {
                "container_id": {"value": "c1"},
                "container_config": {"docker": {"manifest": {"config": {"Labels": [{"key": "a", "value": "b"}]}}}},
            },
            "input.container_config.docker.manifest.config.Labels must be a JSON object, not an array",
        ),
        ("isolate", {"container_id": {"value": "c1"}, "pid": "abc"}, "Failed to parse pid field"),
        ("isolate", {"container_id": {"value": "c1"}, "pid": -5}, "Value out of range: -5"),
        ("isolate", {"container_id": {"value": "c1"}, "pid": True}, "input.pid must be a number, not a boolean"),
    ],
    ids=[
        "truncated-json",
        "empty",
        "not-utf8",
        "array",
        "string",
        "id-not-object",
        "id-value-number",
        "resources-not-array",
        "scalar-not-number",
        "id-escapes",
        "id-missing",
        "labels-map-as-array",
        "pid-word",
        "pid-negative",
        "pid-bool",
    ],
)
def test_malformed_input_fails_with_invalid_argument_and_reaches_no_hook(bin_dir, service, method, payload, expected):
    run = call(bin_dir, method, payload)
    assert run.returncode == bridge.EXIT_REFUSED
    err = one_line(run.err)
    assert err.startswith(f"gpu-isolator {method}: INVALID_ARGUMENT: ")
    assert expected in err
    assert run.out == ""
    assert service.calls == []


def test_input_larger_than_the_limit_is_refused_with_the_reason(bin_dir, service):
    payload = {"container_id": {"value": "c1"}, "padding": "x" * (128 * 1024)}
    run = call(bin_dir, "prepare", payload)
    assert run.returncode == bridge.EXIT_REFUSED
    assert "INVALID_ARGUMENT: request larger than 65536 bytes" in one_line(run.err)
    assert service.calls == []


def test_missing_input_file_exits_2_naming_it(bin_dir, short_tmp):
    err = os.path.join(short_tmp, "err")
    missing = os.path.join(short_tmp, "no-such-input")
    result = subprocess.run(
        [os.path.join(bin_dir, "gpu-isolator-prepare"), missing, os.path.join(short_tmp, "out"), err],
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == bridge.EXIT_USAGE
    assert result.stdout == b""
    with open(err) as fh:
        assert one_line(fh.read()) == (
            f"gpu-isolator prepare: failed to read input file '{missing}': No such file or directory"
        )


def test_wrong_number_of_arguments_exits_2_with_usage_on_stderr(bin_dir):
    result = subprocess.run([os.path.join(bin_dir, "gpu-isolator-prepare"), "only-one"], capture_output=True)
    assert result.returncode == bridge.EXIT_USAGE
    assert result.stdout == b""
    assert "usage: gpu-isolator-<method> IN OUT ERR" in result.stderr.decode()


def test_launcher_takes_the_method_as_a_first_argument_for_people(bin_dir, service, short_tmp):
    path = os.path.join(short_tmp, "in.json")
    with open(path, "w") as fh:
        json.dump({"container_id": {"value": "c9"}}, fh)
    out, err = os.path.join(short_tmp, "out"), os.path.join(short_tmp, "err")
    launcher = os.path.join(bin_dir, bridge.LAUNCHER)
    result = subprocess.run([launcher, "watch", path, out, err], capture_output=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, b"")
    assert service.calls == [("watch", "c9")]


def test_a_bad_timeout_setting_exits_2(bin_dir):
    run = call(bin_dir, "prepare", {"container_id": {"value": "c1"}}, env={bridge.TIMEOUT_ENV: "soon"})
    assert run.returncode == bridge.EXIT_USAGE
    assert one_line(run.err) == "gpu-isolator prepare: GPU_ISOLATOR_BRIDGE_TIMEOUT='soon' is not a number of seconds"


# ---- the sidecar down, slow, or the module giving up --------------------------------------------


def test_sidecar_down_fails_with_a_line_naming_the_socket(short_tmp, install_bridge):
    directory = os.path.join(short_tmp, "bin")
    absent = os.path.join(short_tmp, "absent.sock.bridge")
    install_bridge(directory, socket_path=absent)
    run = call(directory, "prepare", MESOS_PREPARE_INPUT)
    assert run.returncode == bridge.EXIT_UNREACHABLE
    assert one_line(run.err) == (
        f"gpu-isolator prepare: cannot reach the sidecar at '{absent}': No such file or directory"
        " (is 'gpu-isolator serve' running?)"
    )


# What the module writes for watch: the ContainerID and the ContainerConfig it saved at prepare
# (criteo CommandIsolator::watch), here a Mesos 1.11 command task's as stout writes it.
WATCH_INPUT: dict[str, Any] = {
    "container_id": {"value": "5d8f2a3c-2b4e-4c1a-9d3e-1f2a3b4c5d6e"},
    "container_config": {
        "command_info": {"shell": True, "value": "nvidia-smi"},
        "resources": [{"name": "gpus", "type": "SCALAR", "scalar": {"value": 1.0}}],
        "container_class": "DEFAULT",
        "directory": "/var/lib/mesos/slaves/S0/frameworks/fw/executors/e/runs/5d8f2a3c",
    },
}


def test_watch_while_the_sidecar_is_down_exits_0_with_no_limitation_and_one_line_in_the_agent_log(
    short_tmp, install_bridge
):
    # The module returns before deleting IN/OUT/ERR on a non-zero watch exit, once per container
    # per poll: exit 0 with OUT empty ("keep waiting") lets it delete them and poll again.
    directory = os.path.join(short_tmp, "bin")
    absent = os.path.join(short_tmp, "absent.sock.bridge")
    install_bridge(directory, socket_path=absent)
    run = call(directory, "watch", WATCH_INPUT)
    assert (run.returncode, run.out, run.err) == (0, "", "")
    line = run.stderr.removesuffix("\n")
    assert "\n" not in line
    assert line == (
        f"gpu-isolator watch: cannot reach the sidecar at '{absent}': No such file or directory"
        " (is 'gpu-isolator serve' running?); no limitation reported, the module polls again"
    )


def test_watch_refused_by_the_sidecar_also_exits_0_and_logs_why(bin_dir, service):
    run = call(bin_dir, "watch", {"container_id": "not-an-object"})
    assert (run.returncode, run.out, run.err) == (0, "", "")
    assert run.stderr.startswith("gpu-isolator watch: INVALID_ARGUMENT: input.container_id must be a JSON object")
    assert run.stderr.count("\n") == 1
    assert service.calls == []


def test_environment_names_another_socket(bin_dir, short_tmp):
    other = os.path.join(short_tmp, "other.sock")
    run = call(bin_dir, "prepare", MESOS_PREPARE_INPUT, env={bridge.SOCKET_ENV: other})
    assert run.returncode == bridge.EXIT_UNREACHABLE
    assert f"'{other}'" in run.err


def test_a_call_slower_than_the_deadline_fails_without_waiting_for_the_service(bin_dir, sidecar, service):
    service.gate = threading.Event()
    run = call(bin_dir, "prepare", MESOS_PREPARE_INPUT, env={bridge.TIMEOUT_ENV: "0.5"})
    # The gate is still closed: the bridge gave up on its own deadline, not on the service's answer.
    # The request did reach the service (which then blocks on the gate); on a loaded machine the
    # server's thread may get to it only after the bridge's 0.5 s, so that is waited for.
    assert not service.gate.is_set()
    assert service.entered.wait(30), "the call never reached the service"
    assert run.returncode == bridge.EXIT_DEADLINE
    assert one_line(run.err) == (
        f"gpu-isolator prepare: no answer from the sidecar at '{sidecar.settings.bridge_path}' within 0.5 s"
    )


def test_sigterm_from_the_module_makes_the_bridge_exit_non_zero_at_once(bin_dir, service, short_tmp):
    service.gate = threading.Event()
    paths = [os.path.join(short_tmp, name) for name in ("in", "out", "err")]
    with open(paths[0], "w") as fh:
        json.dump(MESOS_PREPARE_INPUT, fh)
    proc = subprocess.Popen(
        [os.path.join(bin_dir, "gpu-isolator-prepare"), *paths], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert service.entered.wait(30), "the call never reached the service"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not service.gate.is_set()
    assert proc.returncode == bridge.EXIT_SIGNAL
    assert stdout == b""
    with open(paths[2]) as fh:
        assert "gpu-isolator prepare: interrupted by SIGTERM after" in one_line(fh.read())
    # The module never reads ERR after its timeout's SIGTERM: the agent's log gets the line too.
    assert stderr.decode().startswith("gpu-isolator prepare: interrupted by SIGTERM after")


# ---- the socket and the protocol ----------------------------------------------------------------


def raw_call(path: str, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    ("data", "reply"),
    [
        (
            b"gpu-isolator-bridge/1 update 1000\n{}",
            b"ERROR UNIMPLEMENTED method 'update' is not served over the bridge",
        ),
        (b"gpu-isolator-bridge/1 recover 1000\n{}", b"ERROR UNIMPLEMENTED method 'recover'"),
        (
            b"gpu-isolator-bridge/9 prepare 1000\n{}",
            b"ERROR FAILED_PRECONDITION bridge protocol 'gpu-isolator-bridge/9'",
        ),
        (b"gpu-isolator-bridge/1 prepare\n{}", b"ERROR INVALID_ARGUMENT malformed bridge request header"),
        (b'{"container_id": {"value": "c1"}}', b"ERROR INVALID_ARGUMENT malformed bridge request: no header line"),
    ],
    ids=["update", "recover", "version", "no-timeout", "no-header"],
)
def test_requests_outside_the_protocol_get_an_error_reply(sidecar, service, data, reply):
    answer = raw_call(sidecar.settings.bridge_path, data)
    assert answer.startswith(reply)
    assert answer.endswith(b"\n") and answer.count(b"\n") == 1
    assert service.calls == []


def test_bridge_socket_is_born_0600_next_to_the_grpc_socket_and_removed_at_stop(short_tmp):
    srv = SidecarServer(ServerSettings(socket=os.path.join(short_tmp, "s.sock")), RecordingService())
    srv.start()
    try:
        st = os.stat(os.path.join(short_tmp, "s.sock.bridge"))
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
    finally:
        srv.stop(grace=0)
    assert os.listdir(short_tmp) == []


def test_empty_bridge_setting_serves_no_bridge(short_tmp):
    srv = SidecarServer(ServerSettings(socket=os.path.join(short_tmp, "s.sock"), bridge_socket=""), RecordingService())
    srv.start()
    try:
        assert sorted(os.listdir(short_tmp)) == ["s.sock", "s.sock.d", "s.sock.lock"]
    finally:
        srv.stop(grace=0)


def test_a_live_bridge_socket_is_not_stolen_and_the_second_server_leaves_nothing(short_tmp):
    bridge_path = os.path.join(short_tmp, "shared.bridge")
    first = SidecarServer(
        ServerSettings(socket=os.path.join(short_tmp, "a.sock"), bridge_socket=bridge_path), StubService()
    )
    first.start()
    try:
        second = SidecarServer(
            ServerSettings(socket=os.path.join(short_tmp, "b.sock"), bridge_socket=bridge_path), StubService()
        )
        with pytest.raises(SocketError, match="holds it and serves there"):
            second.start()
        assert not os.path.exists(os.path.join(short_tmp, "b.sock"))
        assert os.path.exists(bridge_path)
        assert raw_call(bridge_path, b"gpu-isolator-bridge/1 update 1\n").startswith(b"ERROR UNIMPLEMENTED")
    finally:
        first.stop(grace=0)


@pytest.mark.root
def test_a_caller_outside_the_allowed_uids_and_gids_is_refused(short_tmp):
    os.chmod(short_tmp, 0o755)
    nogroup = grp.getgrnam("nogroup").gr_gid
    # The socket lets the group in (0660, group nogroup), so the refusal below is the sidecar's own.
    cfg = ServerSettings(socket=os.path.join(short_tmp, "s.sock"), socket_mode=0o660, socket_group="nogroup")
    service = RecordingService()
    srv = SidecarServer(cfg, service)
    srv.start()
    try:
        answer = _call_as(65534, nogroup, cfg.bridge_path, b'gpu-isolator-bridge/1 cleanup 1000\n{"container_id": {}}')
    finally:
        srv.stop(grace=0)
    assert answer.startswith(b"ERROR PERMISSION_DENIED uid 65534"), answer
    assert service.calls == []


def _call_as(uid: int, gid: int, path: str, data: bytes) -> bytes:
    """raw_call from a forked child that dropped to uid/gid (the interpreter may not be theirs to run)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only syscalls, then _exit
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.write(write_end, raw_call(path, data))
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        answer = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, answer
    return answer


# ---- the client stays cheap and in step with the daemon ------------------------------------------


def test_bridge_client_loads_no_json_grpc_or_protobuf(bin_dir):
    probe = (
        "import sys; sys.path.append(sys.argv[1]); import isolator.bridge.command;"
        " sys.stderr.write(' '.join(sorted(sys.modules)))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(bridge.__file__))))
    result = subprocess.run([sys.executable, "-I", "-S", "-c", probe, root], capture_output=True, text=True)
    loaded = set(result.stderr.split())
    assert "isolator.bridge.command" in loaded
    assert loaded.isdisjoint({"json", "grpc", "google", "google.protobuf", "socket", "os", "enum", "re"})


def test_bridge_default_socket_is_the_daemons_default():
    assert bridge.DEFAULT_SOCKET == config.DEFAULT_SOCKET + config.BRIDGE_SUFFIX
    assert Config().bridge_path == bridge.DEFAULT_SOCKET


def test_install_writes_a_launcher_that_skips_site_and_one_link_per_method(short_tmp):
    paths = bridge.install(os.path.join(short_tmp, "bin"), socket_path="/run/x.bridge", timeout=12)
    assert [os.path.basename(p) for p in paths] == [
        "gpu-isolator-bridge",
        "gpu-isolator-prepare",
        "gpu-isolator-isolate",
        "gpu-isolator-watch",
        "gpu-isolator-usage",
        "gpu-isolator-cleanup",
    ]
    with open(paths[0]) as fh:
        text = fh.read()
    assert text.startswith(f"#!{sys.executable} -IS\n")
    assert "socket_path='/run/x.bridge', timeout=12.0" in text
    assert os.access(paths[0], os.X_OK)
    assert all(os.readlink(p) == "gpu-isolator-bridge" for p in paths[1:])
    # Installing again replaces everything in place.
    assert bridge.install(os.path.join(short_tmp, "bin")) == paths


@pytest.mark.parametrize(
    ("request_type", "payload", "where"),
    [
        ("IsolateRequest", '{"container_id": {"value": "a"}, "pid": true}', "input.pid"),
        (
            "UpdateRequest",
            '{"container_id": {"value": "a"}, '
            '"resource_requests": [{"name": "gpus", "type": "SCALAR", "scalar": {"value": true}}]}',
            "input.resource_requests[0].scalar.value",
        ),
    ],
)
def test_the_bridge_refuses_a_boolean_where_mesos_writes_a_number(request_type: str, payload: str, where: str) -> None:
    from isolator.errors import InvalidArgument
    from isolator.rpc import isolator_pb2
    from isolator.transport.bridge import decode_input

    with pytest.raises(InvalidArgument, match=rf"{re.escape(where)} must be a number, not a boolean"):
        decode_input(payload.encode(), getattr(isolator_pb2, request_type))


def test_install_compiled_copies_the_binary_with_its_settings_beside_it_and_python_removes_them(short_tmp):
    compiled = bridge.compiled_bridge()
    assert compiled is not None, "build/gpu-isolator-bridge is missing: run `make build`"
    directory = os.path.join(short_tmp, "bin")
    paths = bridge.install(directory, socket_path="/run/x.bridge", timeout=12, compiled=compiled)
    with open(paths[0], "rb") as fh, open(compiled, "rb") as built:
        assert fh.read() == built.read()
    assert os.access(paths[0], os.X_OK)
    assert all(os.readlink(p) == "gpu-isolator-bridge" for p in paths[1:])
    with open(os.path.join(directory, bridge.CONF_NAME)) as fh:
        settings = [line for line in fh.read().splitlines() if not line.startswith("#")]
    assert settings == ["socket=/run/x.bridge", "timeout=12.0"]
    # The Python launcher in its place takes the settings file away with the binary.
    assert bridge.install(directory) == paths
    assert not os.path.exists(os.path.join(directory, bridge.CONF_NAME))


def test_install_compiled_where_no_compiler_ran_builds_the_shipped_bridge_c(short_tmp):
    """Before issue 33 it fell back to the Python launcher (and said so on stderr): asked for the
    compiled bridge, an install now builds it from the package's bridge.c or fails
    (tests/system/test_wheel_install.py: from a real wheel, and without a compiler)."""
    # A copy of the package without build/ beside it, as a wheel installs it.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(bridge.__file__))))
    copy = os.path.join(short_tmp, "pkg")
    shutil.copytree(os.path.join(root, "isolator"), os.path.join(copy, "isolator"))
    directory = os.path.join(short_tmp, "bin")
    result = subprocess.run(
        [sys.executable, "-m", "isolator.bridge", "install", directory, "--compiled"],
        capture_output=True,
        text=True,
        cwd=copy,
        env={**os.environ, "PYTHONPATH": copy},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    with open(os.path.join(directory, bridge.LAUNCHER), "rb") as fh:
        assert fh.read(4) == b"\x7fELF"
    assert sorted(os.listdir(directory)) == sorted(
        [bridge.LAUNCHER, bridge.CONF_NAME, *(f"gpu-isolator-{m}" for m in bridge.METHODS)]
    )  # the scratch build directory is gone


def test_a_malformed_settings_file_beside_the_compiled_bridge_fails_the_call(short_tmp, sidecar):
    directory = os.path.join(short_tmp, "bin")
    compiled = bridge.compiled_bridge()
    assert compiled is not None
    bridge.install(directory, socket_path=sidecar.settings.bridge_path, compiled=compiled)
    conf = os.path.join(directory, bridge.CONF_NAME)
    with open(conf, "a") as fh:
        fh.write("sockte=/elsewhere\n")
    run = call(directory, "prepare", {"container_id": {"value": "c1"}})
    assert run.returncode == bridge.EXIT_USAGE
    assert one_line(run.err) == (
        f"gpu-isolator prepare: bad bridge settings in '{conf}' line 6: expected 'socket=<path>' or 'timeout=<seconds>'"
    )


# ---- the two executables, byte for byte ---------------------------------------------------------


def _run_both(short_tmp: str, socket_path: str, argv_tail: list[str], env: dict[str, str], payload: bytes) -> list:
    """(returncode, OUT, ERR, stderr) of the Python and the compiled bridge for the same call."""
    compiled = bridge.compiled_bridge()
    assert compiled is not None, "build/gpu-isolator-bridge is missing: run `make build`"
    results = []
    for kind, binary in (("python", None), ("c", compiled)):
        directory = os.path.join(short_tmp, kind)
        bridge.install(directory, socket_path=socket_path, compiled=binary)
        paths = [os.path.join(short_tmp, f"{kind}.{name}") for name in ("in", "out", "err")]
        with open(paths[0], "wb") as fh:
            fh.write(payload)
        for p in paths[1:]:
            open(p, "wb").close()
        argv = [os.path.join(directory, argv_tail[0]), *[paths[int(a)] if a.isdigit() else a for a in argv_tail[1:]]]
        result = subprocess.run(argv, capture_output=True, env={**os.environ, **env}, timeout=60)
        with open(paths[1], "rb") as fh:
            out = fh.read()
        with open(paths[2], "rb") as fh:
            err = fh.read().replace(paths[0].encode(), b"IN")
        assert result.stdout == b""
        results.append((result.returncode, out, err, result.stderr.replace(paths[0].encode(), b"IN")))
    return results


@pytest.mark.parametrize(
    "timeout",
    [
        "1e20",
        "'x",
        '"',
        "-0",
        "nan",
        "-inf",
        " 2_5 ",
        "2__5",
        "_1",
        "0x10",
        "1e-300",
        "86400",
        "1.e3",
        ".5e",
        "",
        "1e400",
        "\tsoon\n",
        "ünïcode",
        "12345678901234567890",
    ],
)
def test_both_executables_read_a_timeout_setting_alike(short_tmp, timeout):
    absent = os.path.join(short_tmp, "absent.sock")
    python, c = _run_both(
        short_tmp, absent, ["gpu-isolator-prepare", "0", "1", "2"], {bridge.TIMEOUT_ENV: timeout}, b"{}"
    )
    assert python == c


@pytest.mark.parametrize(
    "argv",
    [
        ["gpu-isolator-bridge", "0", "1", "2"],
        ["gpu-isolator-bridge", "prepare", "0", "1"],
        ["gpu-isolator-prepare", "cleanup", "0", "1", "2"],
        ["gpu-isolator-watch", "0", "1"],
        ["gpu-isolator-bridge", "update", "0", "1", "2"],
        ["gpu-isolator-prepare", "0", "/nonexistent/dir/out", "2"],
        ["gpu-isolator-prepare", "/", "1", "2"],
        ["gpu-isolator-watch", "/nonexistent", "1", "2"],
        ["gpu-isolator-cleanup", "0", "1", "/nonexistent/err"],
    ],
)
def test_both_executables_treat_arguments_and_files_alike(short_tmp, argv):
    absent = os.path.join(short_tmp, "absent.sock")
    python, c = _run_both(short_tmp, absent, argv, {}, b"{}")
    assert python == c


def test_both_executables_print_the_same_version_and_help():
    compiled = bridge.compiled_bridge()
    assert compiled is not None
    for flag in ("--version", "--help"):
        outputs = [
            subprocess.run([*argv, flag], capture_output=True, timeout=60).stdout
            for argv in ([sys.executable, "-I", "-m", "isolator.bridge"], [compiled])
        ]
        assert outputs[0] == outputs[1] and outputs[0], flag


class ScriptedPeer:
    """A Unix socket that answers every connection with the same bytes: how a sidecar of another
    version, or a broken one, could answer; the executables must read it alike."""

    def __init__(self, path: str, reply: bytes) -> None:
        self.reply = reply
        self.connections = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.connections += 1
                conn.settimeout(10)
                while conn.recv(65536):
                    pass
                conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(10)


@pytest.mark.parametrize(
    "reply",
    [
        b"",
        b"OK",
        b"OK\n",
        b'OK\n{"a": 1}\n\xff',
        b"ok\n",
        b"HELLO 'there' \x00\x7f\xff\t\r",
        b"x" * 100,
        b"ERROR",
        b"ERROR X",
        b"ERROR NOT_FOUND gone",
        b"ERROR INVALID_ARGUMENT caf\xc3\xa9 \xe2\x80\x83wide\xa0\xff\xe2\x80 end\n",
        b"ERROR RESOURCE_EXHAUSTED Requested 4 gpus but only 2 available\n",
        b"RETRY abc RESOURCE_EXHAUSTED busy\n",
        b"RETRY 5\n",
        b"RETRY 5 X\n",
        b"RETRY 1234567890 RESOURCE_EXHAUSTED busy\n",
        b"RETRY 300 RESOURCE_EXHAUSTED too many bridge calls in flight; try again\n",
        b"RETRY 1 NOT_FOUND shed\n",
    ],
)
@pytest.mark.parametrize("method", ["prepare", "watch", "cleanup"])
def test_both_executables_read_any_reply_alike(short_tmp, reply, method):
    path = os.path.join(short_tmp, "peer.sock")
    peer = ScriptedPeer(path, reply)
    try:
        python, c = _run_both(
            short_tmp, path, [f"gpu-isolator-{method}", "0", "1", "2"], {bridge.TIMEOUT_ENV: "1"}, b"{}"
        )
    finally:
        peer.close()
    # A RETRY's elapsed time is not in any message; everything else must match byte for byte.
    assert python == c


# ---- RETRY (load shed, the call never ran) against ERROR (final) -----------------------------------


def _popen(bin_dir: str, method: str, payload: Any, short_tmp: str, name: str, env: dict[str, str] | None = None):
    paths = [os.path.join(short_tmp, f"{name}.{part}") for part in ("in", "out", "err")]
    with open(paths[0], "w") as fh:
        json.dump(payload, fh)
    proc = subprocess.Popen(
        [os.path.join(bin_dir, f"gpu-isolator-{method}"), *paths],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    return proc, paths


def _wait_for(predicate: Callable[[], bool], budget: float = 30.0) -> None:
    deadline = time.monotonic() + budget
    while not predicate():
        assert time.monotonic() < deadline, "the awaited event never happened"
        time.sleep(0.01)


@pytest.fixture
def one_slot(short_tmp, service):
    """A sidecar admitting one call at a time (both routes), so that a second call while a first one runs is shed."""
    cfg = ServerSettings(socket=os.path.join(short_tmp, "run", "s.sock"), max_concurrent_rpcs=1)
    srv = SidecarServer(cfg, service)
    srv.start()
    try:
        yield srv
    finally:
        if service.gate is not None:
            service.gate.set()
        srv.stop(grace=0)


def test_a_shed_call_is_answered_retry_and_never_reaches_the_service(one_slot, service, short_tmp, install_bridge):
    service.gate = threading.Event()
    directory = os.path.join(short_tmp, "bin")
    install_bridge(directory, socket_path=one_slot.settings.bridge_path)
    first, _ = _popen(directory, "prepare", {"container_id": {"value": "first"}}, short_tmp, "first")
    try:
        assert service.entered.wait(30), "the first call never reached the service"
        answer = raw_call(one_slot.settings.bridge_path, b'gpu-isolator-bridge/1 prepare 1000\n{"container_id": {}}')
        assert answer.startswith(b"RETRY 20 RESOURCE_EXHAUSTED the sidecar is busy: 1 calls in flight"), answer
        assert answer.count(b"\n") == 1
        # Shed until the deadline: the reason comes back as for an ERROR, and the call never ran.
        second = call(directory, "prepare", {"container_id": {"value": "second"}}, env={bridge.TIMEOUT_ENV: "0.3"})
        assert second.returncode == bridge.EXIT_REFUSED
        assert one_line(second.err).startswith("gpu-isolator prepare: RESOURCE_EXHAUSTED: the sidecar is busy")
        assert [c[1] for c in service.calls] == ["first"]
    finally:
        service.gate.set()
        first.communicate(timeout=30)
    assert first.returncode == 0


def test_a_shed_call_is_asked_again_and_succeeds_once_a_slot_is_free(one_slot, service, short_tmp, install_bridge):
    service.gate = threading.Event()
    directory = os.path.join(short_tmp, "bin")
    install_bridge(directory, socket_path=one_slot.settings.bridge_path)
    listener = one_slot._bridge
    assert listener is not None
    first, _ = _popen(directory, "prepare", {"container_id": {"value": "first"}}, short_tmp, "first")
    second = None
    try:
        assert service.entered.wait(30), "the first call never reached the service"
        second, paths = _popen(directory, "prepare", MESOS_PREPARE_INPUT, short_tmp, "second")
        _wait_for(lambda: listener.shed >= 2)  # shed, asked again, shed again
        assert [c[1] for c in service.calls] == ["first"]
        service.gate.set()
        stdout, _ = second.communicate(timeout=30)
    finally:
        service.gate.set()
        first.communicate(timeout=30)
        if second is not None and second.poll() is None:
            second.kill()
            second.wait()
    assert (second.returncode, stdout) == (0, b"")
    with open(paths[1]) as fh:
        assert json.loads(fh.read())["environment"]["variables"][0]["name"] == "NVIDIA_VISIBLE_DEVICES"
    assert [c[1] for c in service.calls] == ["first", MESOS_PREPARE_INPUT["container_id"]["value"]]


# ---- final errors and load shedding on the wire (docs/mesos-agent.md section 6) -------------------


class GpusGone(RecordingService):
    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        self.calls.append(("prepare", str(container_id), config))
        raise GpusExhausted(requested=9, available=8)


def test_no_free_gpu_is_final_the_bridge_fails_at_once_without_retrying(short_tmp, install_bridge):
    gone = GpusGone()
    srv = SidecarServer(ServerSettings(socket=os.path.join(short_tmp, "run", "s.sock")), gone)
    srv.start()
    try:
        directory = os.path.join(short_tmp, "bin")
        install_bridge(directory, socket_path=srv.settings.bridge_path, timeout=20)
        assert raw_call(
            srv.settings.bridge_path, b"gpu-isolator-bridge/1 prepare 1000\n" + json.dumps(MESOS_PREPARE_INPUT).encode()
        ) == (b"ERROR RESOURCE_EXHAUSTED Requested 9 gpus but only 8 available\n")
        gone.calls.clear()
        run = call(directory, "prepare", MESOS_PREPARE_INPUT)
    finally:
        srv.stop(grace=0)
    assert (run.returncode, run.err) == (
        1,
        "gpu-isolator prepare: RESOURCE_EXHAUSTED: Requested 9 gpus but only 8 available",
    )
    # One call: the old bridge retried every RESOURCE_EXHAUSTED until its deadline (here 20 s),
    # holding the agent's one-hook-at-a-time for everyone, including the cleanup that frees GPUs.
    assert [c[0] for c in gone.calls] == ["prepare"]


class ScriptedListener:
    """A bridge socket that answers each connection with the next scripted reply (then the last).

    ``requests`` holds what ``record`` makes of each request's bytes (the bytes themselves here)."""

    def __init__(self, path: str, replies: list[bytes]) -> None:
        self.replies = replies
        self.requests: list[Any] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while chunk := conn.recv(65536):
                    data += chunk
                self.requests.append(self.record(data))
                conn.sendall(self.replies[min(len(self.requests), len(self.replies)) - 1])

    def record(self, data: bytes) -> Any:
        return data

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.mark.parametrize(
    ("replies", "calls", "code", "err"),
    [
        # load shedding twice, then the answer: the call goes through
        ([b"RETRY 10 RESOURCE_EXHAUSTED busy\n", b"RETRY 10 RESOURCE_EXHAUSTED busy\n", b"OK\n{}"], 3, 0, ""),
        # a final answer is never retried, whatever its code
        (
            [b"ERROR RESOURCE_EXHAUSTED Requested 2 gpus but only 1 available\n", b"OK\n{}"],
            1,
            1,
            "gpu-isolator prepare: RESOURCE_EXHAUSTED: Requested 2 gpus but only 1 available",
        ),
        (
            [b"ERROR UNAVAILABLE the store is read-only\n", b"OK\n{}"],
            1,
            1,
            "gpu-isolator prepare: UNAVAILABLE: the store is read-only",
        ),
        # a malformed RETRY is not a retry
        ([b"RETRY soon RESOURCE_EXHAUSTED busy\n", b"OK\n{}"], 1, 3, None),
    ],
)
def test_the_bridge_retries_only_retry_answers(short_tmp, install_bridge, replies, calls, code, err):
    path = os.path.join(short_tmp, "b.sock")
    listener = ScriptedListener(path, replies)
    try:
        directory = os.path.join(short_tmp, "bin")
        install_bridge(directory, socket_path=path, timeout=10)
        run = call(directory, "prepare", MESOS_PREPARE_INPUT)
    finally:
        listener.close()
    assert len(listener.requests) == calls, listener.requests
    assert run.returncode == code, run
    if err is not None:
        assert run.err == err


def test_load_shedding_until_the_deadline_reports_the_code_and_message(short_tmp, install_bridge):
    path = os.path.join(short_tmp, "b.sock")
    listener = ScriptedListener(path, [b"RETRY 50 RESOURCE_EXHAUSTED too many bridge calls in flight; try again\n"])
    try:
        directory = os.path.join(short_tmp, "bin")
        install_bridge(directory, socket_path=path, timeout=1.5)
        run = call(directory, "prepare", MESOS_PREPARE_INPUT)
    finally:
        listener.close()
    assert (run.returncode, run.err) == (
        1,
        "gpu-isolator prepare: RESOURCE_EXHAUSTED: too many bridge calls in flight; try again",
    )
    # 50 ms, then doubling up to 500 ms, within 1.5 s: a handful of tries, not one, not hundreds.
    assert 3 <= len(listener.requests) <= 8, len(listener.requests)


def test_a_bridge_call_turned_away_for_load_is_answered_retry_and_a_final_refusal_error(short_tmp):
    service = RecordingService()
    service.gate = threading.Event()
    srv = SidecarServer(ServerSettings(socket=os.path.join(short_tmp, "run", "s.sock"), max_concurrent_rpcs=1), service)
    srv.start()
    try:
        path = srv.settings.bridge_path
        request = b"gpu-isolator-bridge/1 prepare 5000\n" + json.dumps(MESOS_PREPARE_INPUT).encode()
        held = threading.Thread(target=raw_call, args=(path, request), daemon=True)
        held.start()
        assert service.entered.wait(30)
        # The one call in flight is the limit (--max-concurrent-rpcs, shared with gRPC): load
        # shedding, retryable, the call did not run.
        reply = raw_call(path, request)
        assert reply.startswith(b"RETRY 20 RESOURCE_EXHAUSTED the sidecar is busy: 1 calls in flight"), reply
        assert len(service.calls) == 1
        service.gate.set()
        held.join(30)
        assert srv._bridge is not None
        deadline = time.monotonic() + 30
        while srv._bridge.slots()["connection"]:  # the slot is given back once the call is admitted
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # A refusal that is not load stays final.
        assert raw_call(path, b"gpu-isolator-bridge/1 update 1\n").startswith(b"ERROR UNIMPLEMENTED")
    finally:
        service.gate.set()
        srv.stop(grace=0)


def test_the_modules_watch_poll_after_cleanup_is_quiet_and_an_unknown_container_is_not(bin_dir, service, sidecar):
    # After each Cleanup criteo's module polls Watch once more: "no limitation", nothing in either log.
    run = call(bin_dir, "watch", {"container_id": {"value": "gone-1"}, "container_config": {}})
    assert (run.returncode, run.out, run.err, run.stderr) == (0, "", "", "")
    # A container never seen: still exit 0 (watch never fails) but one line on the agent's log.
    run = call(bin_dir, "watch", {"container_id": {"value": "unknown-1"}, "container_config": {}})
    assert (run.returncode, run.out) == (0, "")
    assert "NOT_FOUND: unknown container unknown-1" in run.stderr
    # gRPC: an open Watch on a container that is gone ends NOT_FOUND.
    with grpc.insecure_channel("unix:" + sidecar.settings.socket) as channel, pytest.raises(grpc.RpcError) as gone:
        pb_grpc.IsolatorStub(channel).Watch(pb.WatchRequest(container_id=pb.ContainerID(value="gone-2")), timeout=10)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
