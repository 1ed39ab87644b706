"""Mesos's own JSON code on our bytes (issue 25, deliverable 2).

``stout_json.cpp`` beside this file is compiled at test time against ``MESOS_HOME/include`` (stout's
``JSON::protobuf`` and ``protobuf::parse``) and linked with libmesos and Debian's protobuf. It:

* writes every hook input our fixtures (isolator/testing/mesos_json.py) claim the agent sends, the way
  criteo's module composes it (a JSON object of ``JSON::protobuf`` of Mesos's ContainerID and
  ContainerConfig): the fixture must be exactly what stout writes, or our model of the agent is wrong;
* reads every OUT our executables (the Python and the compiled bridge) print against a real sidecar
  on a simulated host, the way the module reads it (``JSON::parse``, an object, ``protobuf::parse``
  of ContainerLaunchInfo, ContainerLimitation, ResourceStatistics): it must parse, and what the agent
  then holds, written back, must be exactly what we wrote (nothing dropped, nothing changed).

Compiling needs g++ and the headers ``../shared/mesos/setup.sh --dev`` installs, plus rapidjson
(Debian's rapidjson-dev), which stout's jsonify includes; the binary is cached in build/ by source
and Mesos version. Needs no agent, so it runs in seconds once compiled.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import libmesos_helper

from isolator.bridge import command as bridge
from isolator.testing import mesos_json
from isolator.testing.sidecar import TEST_PARENT, Sidecar

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "stout_json.cpp")

# The agent tree of ../shared/mesos is apache/mesos c1b42f79 (1.12.0-dev): what mesos_json calls
# "master". 1.10 and 1.11 write the same fields for every fixture (share_cgroups and limits since
# 1.10); older versions lack fields these headers have, so they cannot be checked here.
VERSIONS = ("1.10", "1.11", "master")


class Stout:
    """The compiled helper: (True, the JSON stout wrote) or (False, stout's error message)."""

    def __init__(self, binary: str) -> None:
        self.binary = binary

    def lines(self, data: bytes, *args: str) -> list[tuple[bool, Any]]:
        result = subprocess.run([self.binary, *args], input=data, capture_output=True, timeout=300)
        assert result.returncode in (0, 1), result
        answers: list[tuple[bool, Any]] = []
        for line in result.stdout.decode().splitlines():
            assert line.startswith(("OK ", "ERROR ")), line
            answers.append((True, json.loads(line[3:])) if line.startswith("OK ") else (False, line[6:].strip()))
        return answers

    def __call__(self, data: bytes, *args: str) -> tuple[bool, Any]:
        [answer] = self.lines(data, *args)
        return answer


@pytest.fixture(scope="session")
def stout(mesos_home: str) -> Stout:
    return Stout(libmesos_helper(SOURCE, mesos_home))


# ---- inputs: our fixtures are what stout writes --------------------------------------------------


def _fixture_cases() -> list[tuple[str, dict[str, Any]]]:
    cases = []
    for version in VERSIONS:
        for kind in mesos_json.KINDS:
            for gpus in (None, 0, 1, 2.0, 0.5):
                config = mesos_json.container_config(
                    kind,
                    directory="/var/lib/mesos/slaves/S/sandbox",
                    gpu_count=gpus,
                    check_command="nvidia-smi",
                    version=version,
                )
                cases.append((f"{version}-{kind}-gpus{gpus}", config))
            for share in (True, False):
                config = mesos_json.container_config(
                    kind,
                    directory="/sandbox",
                    gpu_count=1,
                    check_command="true",
                    rootfs="/var/lib/mesos/provisioner/rootfs",
                    env=["PATH=/usr/bin", "NVIDIA_VISIBLE_DEVICES=all", "CUDA_VERSION=12.4.1"],
                    labels={"com.nvidia.volumes.needed": "nvidia_driver", "maintainer": "x"},
                    share_cgroups=share,
                    user=None,
                    version=version,
                )
                cases.append((f"{version}-{kind}-image-share{share}", config))
    return cases


CASES = _fixture_cases()


def _inputs(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The hook inputs the module composes around one ContainerConfig: prepare, watch, usage and
    cleanup send the ID and the config, isolate the pid too; top-level and nested IDs."""
    ids = [{"value": "5d8f2a3c"}, {"value": "child-1", "parent": {"value": "5d8f2a3c"}}]
    return [{"container_id": i, "container_config": config, **extra} for i in ids for extra in ({}, {"pid": 4242})]


@pytest.fixture(scope="module")
def written(stout) -> dict[str, list[tuple[bool, Any]]]:
    """stout's answer for every input of every case, from one run of the helper."""
    inputs = [(name, ours) for name, config in CASES for ours in _inputs(config)]
    data = "".join(json.dumps(ours) + "\n" for _, ours in inputs).encode()
    answers = stout.lines(data, "input")
    assert len(answers) == len(inputs), answers[-3:]
    out: dict[str, list[tuple[bool, Any]]] = {}
    for (name, _), answer in zip(inputs, answers, strict=True):
        out.setdefault(name, []).append(answer)
    return out


@pytest.mark.parametrize(("name", "config"), CASES, ids=[c[0] for c in CASES])
def test_every_fixture_is_exactly_what_the_module_writes_through_stout(written, name, config):
    for ours, (ok, theirs) in zip(_inputs(config), written[name], strict=True):
        assert ok, f"stout refused our fixture {name}: {theirs}"
        assert theirs == ours, _diff(ours, theirs)


def _diff(ours: Any, theirs: Any, path: str = "input") -> str:
    """The first place where our JSON and stout's differ, for the failure message."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs)):
            if key not in theirs:
                return f"{path}.{key}: we write {ours[key]!r}, stout does not write it"
            if key not in ours:
                return f"{path}.{key}: stout writes {theirs[key]!r}, our fixture leaves it out"
            if ours[key] != theirs[key]:
                return _diff(ours[key], theirs[key], f"{path}.{key}")
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if a != b:
                return _diff(a, b, f"{path}[{i}]")
    return f"{path}: we write {ours!r}, stout writes {theirs!r}"


# ---- outputs: what our executables print reads back unchanged in stout ----------------------------


@pytest.fixture(scope="module")
def sidecar() -> Iterator[Sidecar]:
    """A real sidecar in mesos mode (what the agent's module talks to) on a simulated DGX-1."""
    work = tempfile.mkdtemp(prefix="gi-stout-", dir="/tmp")
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    s = Sidecar(work=work, host="dgx-1", cgroup_version="v1", cgroups_root=root, mode="mesos")
    try:
        yield s.start()
    finally:
        s.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(params=["python", "c"])
def bin_dir(request, sidecar: Sidecar) -> str:
    compiled = None
    if request.param == "c":
        compiled = bridge.compiled_bridge()
        if compiled is None:
            pytest.fail("build/gpu-isolator-bridge is missing: run `make build`", pytrace=False)
    directory = os.path.join(sidecar.work, f"bin-{request.param}")
    bridge.install(directory, socket_path=sidecar.bridge_socket, compiled=compiled)
    return directory


def hook(bin_dir: str, method: str, payload: dict[str, Any]) -> bytes:
    """Run ``gpu-isolator-<method> IN OUT ERR`` as the module does; OUT's bytes (exit 0 required)."""
    work = os.path.dirname(bin_dir)
    paths = [os.path.join(work, f"{method}.{name}") for name in ("in", "out", "err")]
    with open(paths[0], "w") as fh:
        json.dump(payload, fh)
    for p in paths[1:]:
        open(p, "wb").close()
    result = subprocess.run([os.path.join(bin_dir, f"gpu-isolator-{method}"), *paths], capture_output=True, timeout=60)
    with open(paths[1], "rb") as fh:
        out = fh.read()
    with open(paths[2], "rb") as fh:
        err = fh.read()
    assert result.stdout == b""
    assert result.returncode == 0, (method, err, result.stderr)
    return out


def read_as_the_module(stout: Stout, method: str, out: bytes) -> None:
    ok, held = stout(out, "output", method)
    assert ok, f"the module would refuse our {method} output: {held}\n{out[:2000]!r}"
    ours = json.loads(out)
    assert held == ours, _diff(ours, held, method)


def test_every_output_of_our_executables_reads_back_unchanged_through_stout(stout, sidecar, bin_dir):
    tag = os.path.basename(bin_dir)
    sandbox = os.path.join(sidecar.work, f"sandbox-{tag}")
    rootfs = os.path.join(sidecar.work, f"rootfs-{tag}")
    os.makedirs(sandbox, exist_ok=True)
    os.makedirs(os.path.join(rootfs, "usr", "local"), exist_ok=True)
    containers = {
        f"{tag}-cmd": mesos_json.container_config("command", directory=sandbox, gpu_count=2, check_command="true"),
        f"{tag}-image": mesos_json.container_config(
            "command",
            directory=sandbox,
            gpu_count=1,
            check_command="true",
            rootfs=rootfs,
            env=["PATH=/usr/bin", "NVIDIA_VISIBLE_DEVICES=all"],
            labels={"com.nvidia.volumes.needed": "nvidia_driver"},
            user=None,
        ),
        f"{tag}-none": mesos_json.container_config("command", directory=sandbox, gpu_count=0, check_command="true"),
    }
    for name in containers:
        # The agent makes a container's cgroup before prepare, and its cgroups/devices isolator turns
        # it into a whitelist (removed with the sidecar's cgroups root).
        cgroup = os.path.join(sidecar.cgroup_parent, name)
        os.makedirs(cgroup, exist_ok=True)
        with open(os.path.join(cgroup, "devices.deny"), "w") as fh:
            fh.write("a")
    try:
        outputs = {}
        for name, config in containers.items():
            outputs[name] = hook(bin_dir, "prepare", {"container_id": {"value": name}, "container_config": config})
        # A task without an image (and gpus:0) gets nothing added: empty OUT, which the module takes
        # for None before it parses anything. The image task gets the volume's mount and environment.
        assert outputs[f"{tag}-image"], "the image task's prepare added nothing"
        for out in outputs.values():
            if out:
                read_as_the_module(stout, "prepare", out)
        name = f"{tag}-cmd"
        payload = {"container_id": {"value": name}, "container_config": containers[name]}
        grants = granted(sidecar, name)
        sidecar.sim.set_usage(grants[0], 3 << 30, 55, 20)
        read_as_the_module(stout, "usage", hook(bin_dir, "usage", payload))
        assert hook(bin_dir, "watch", payload) == b""  # no limitation: the module polls again
        sidecar.sim.inject_xid(grants[0], 79)
        deadline = time.monotonic() + 30
        while not (limitation := hook(bin_dir, "watch", payload)):
            assert time.monotonic() < deadline, "the XID never became a limitation"
            time.sleep(0.05)
        read_as_the_module(stout, "watch", limitation)
    finally:
        for name, config in containers.items():
            hook(bin_dir, "cleanup", {"container_id": {"value": name}, "container_config": config})


def granted(sidecar: Sidecar, name: str) -> list[int]:
    """The GPU indices the sidecar says ``name`` holds (``gpu-isolator gpus --json``)."""
    result = subprocess.run(
        [sys.executable, "-m", "isolator", "gpus", "--json", "--socket", sidecar.socket],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    held = sorted(int(g["index"]) for g in json.loads(result.stdout)["gpus"] if str(g.get("holder") or "") == name)
    assert held, f"{name} holds no GPU: {result.stdout}"
    return held
