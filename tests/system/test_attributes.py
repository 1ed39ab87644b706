"""The agent's ``--attributes`` (issue 33, item 8): model, memory, driver, CUDA and MIG capability in
values that Mesos's attribute parser reads as intended (text stays text, numbers are scalars, no
space is silently dropped), the same on every run, on every shipped host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from isolator.model import Gpu, GpuRecord
from isolator.policy import attributes as attrs
from isolator.simhost.host import shipped_hosts

# What each attribute must be to Mesos: frameworks' constraints depend on the type.
TYPES = {
    "gpu_count": "scalar",
    "gpu_model": "text",
    "gpu_memory_mib": "scalar",
    "gpu_mig_capable": "text",
    "nvidia_driver": "text",
    "nvidia_driver_major": "scalar",
    "cuda_version": "scalar",
    "cuda_version_major": "scalar",
}


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("12.2", "scalar"),
        ("16160", "scalar"),
        ("1e5", "scalar"),
        ("inf", "invalid"),  # Mesos 1.11 aborts on it, 1.12 reads text
        ("-1", "invalid"),  # "Negative values not supported" (1.11)
        ("+1", "scalar"),
        (".5", "scalar"),
        ("0x10", "text"),
        ("535.104.05", "text"),
        ("Tesla-V100-SXM2-16GB", "text"),
        ("Tesla V100", "text"),  # Mesos removes the space: "TeslaV100"
        ("[1000-1500]", "ranges"),
        ("{a,b}", "invalid"),  # a set: refused for an attribute
        ("a[1]", "invalid"),
        ("(x", "invalid"),
        ("", "invalid"),
    ],
)
def test_the_model_of_mesos_value_parse(value, kind):
    assert attrs.mesos_type(value) == kind


@pytest.mark.parametrize(
    ("nvml_name", "text"),
    [
        ("Tesla V100-SXM2-16GB", "Tesla-V100-SXM2-16GB"),
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
        ("NVIDIA GeForce RTX 4090 (D)", "NVIDIA-GeForce-RTX-4090-D"),
        ("  ", "unknown"),
    ],
)
def test_a_model_name_becomes_text_in_mesos_alphabet_without_losing_its_words(nvml_name, text):
    assert attrs.text_value(nvml_name) == text
    assert attrs.TEXT_ALPHABET.fullmatch(text) and attrs.mesos_type(text) == "text"


@pytest.mark.parametrize(
    ("nvml_name", "text"), [("1080", "gpu-1080"), ("1e5", "gpu-1e5"), ("-5", "gpu-5"), ("inf", "gpu-inf"), ("A1", "A1")]
)
def test_a_model_name_that_mesos_would_read_as_a_number_stays_text(nvml_name, text):
    pairs = attrs.attributes([_record(0, nvml_name, 1024)], "550.54.15", "12.4")
    assert dict(pairs)["gpu_model"] == text
    assert attrs.typed(pairs)["gpu_model"] == text
    attrs.render(pairs)


def _record(index: int, name: str, mib: int, mig: bool = False) -> GpuRecord:
    gpu = Gpu(index=index, minor=index, uuid=f"GPU-{index}", name=name, memory_total=mib * 2**20)
    return GpuRecord(gpu=gpu, mig_capable=mig)


def test_a_mixed_node_promises_no_model_the_smallest_memory_and_says_mig_is_mixed():
    records = [_record(0, "NVIDIA A100-SXM4-80GB", 81920, True), _record(1, "NVIDIA A100-SXM4-40GB", 40960, True)]
    records.append(_record(2, "NVIDIA L4", 23034))
    pairs = dict(attrs.attributes(records, "550.54.15", "12.4"))
    assert pairs["gpu_model"] == "mixed" and pairs["gpu_memory_mib"] == "23034"
    assert pairs["gpu_mig_capable"] == "mixed" and pairs["gpu_count"] == "3"
    reordered = attrs.attributes(list(reversed(records)), "550.54.15", "12.4")
    assert reordered == attrs.attributes(records, "550.54.15", "12.4")


def test_no_gpus_is_gpu_count_0_alone():
    assert attrs.render(attrs.attributes([], "", "")) == "gpu_count:0"


def test_render_refuses_what_mesos_would_misread():
    with pytest.raises(ValueError):
        attrs.render([("gpu_model", "Tesla V100")])
    with pytest.raises(ValueError):
        attrs.render([("gpu:model", "x")])


def _attributes(host: str, work: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "isolator", "attributes", "--simulate", host, "--work-dir", work, "--json"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("host", shipped_hosts())
def test_every_shipped_host_gets_attributes_of_the_intended_types_every_time(host, short_tmp):
    first = _attributes(host, os.path.join(short_tmp, "w"))
    assert first.returncode == 0, first.stderr
    data = json.loads(first.stdout)
    line = data["attributes"]
    pairs = [tuple(p.split(":", 1)) for p in line.split(";")]
    assert [name for name, _ in pairs] == list(TYPES)
    assert {name: attrs.mesos_type(value) for name, value in pairs} == TYPES
    assert " " not in line and all(attrs.TEXT_ALPHABET.fullmatch(v) for _, v in pairs)
    assert data["values"]["gpu_count"] >= 1 and isinstance(data["values"]["gpu_model"], str)
    again = _attributes(host, os.path.join(short_tmp, "w2"))
    assert again.stdout == first.stdout  # deterministic: nothing depends on time or order of discovery


def test_resources_json_carries_the_attributes_too(short_tmp):
    argv = [sys.executable, "-m", "isolator", "resources", "--simulate", "dgx-1", "--json"]
    result = subprocess.run([*argv, "--work-dir", short_tmp], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["resources"] == "gpus:8"
    assert data["attributes"].startswith("gpu_count:8;gpu_model:Tesla-V100-SXM2-16GB;gpu_memory_mib:16160;")


# ---- the shared GPUs (issue 42 item 4) ----------------------------------------------------------------


def test_shared_gpus_are_described_per_size_gpus_mode_and_memory_per_unit():
    from isolator.model import ShareMode
    from isolator.policy.shares import SharedGpu

    records = [_record(i, "NVIDIA L4", 23034 if i < 3 else 16384) for i in range(5)]
    shared = {
        1: SharedGpu(1, 1, 4, ShareMode.MPS),
        2: SharedGpu(2, 2, 2, ShareMode.MPS),
        3: SharedGpu(3, 3, 2, ShareMode.TIME_SLICE),
        4: SharedGpu(4, 4, 4, ShareMode.MPS),
    }
    assert attrs.share_attributes(records, shared) == [
        ("gpu_share_2_gpus", "2"),
        ("gpu_share_2_mode", "mixed"),
        ("gpu_share_2_memory_mib", str(16384 // 2)),  # the smallest GPU of that size
        ("gpu_share_4_gpus", "2"),
        ("gpu_share_4_mode", "mps"),
        ("gpu_share_4_memory_mib", str(16384 // 4)),
    ]
    assert attrs.share_attributes(records, {}) == []
    line, pairs = attrs.agent_flags(records, shared, "550.54.15", "12.4")
    assert line == "gpus:1;gpu-share-2:4;gpu-share-4:8"
    rendered = attrs.render(pairs)  # every pair one Mesos parses as written
    assert rendered.endswith(";gpu_share_4_memory_mib:4096")
    assert attrs.typed(pairs)["gpu_share_4_gpus"] == 2 and attrs.typed(pairs)["gpu_share_2_mode"] == "mixed"


def test_resources_and_attributes_describe_the_shared_gpus_offline(short_tmp):
    argv = [sys.executable, "-m", "isolator", "resources", "--simulate", "dgx-1", "--json"]
    argv += ["--work-dir", short_tmp, "--shared-gpus", "4:4:mps,5-7:2"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["shares"] == {
        "gpu-share-2": {"units": 6, "size": 2, "gpus": 3, "mode": "time-slice", "memory_mib": 16160 // 2},
        "gpu-share-4": {"units": 4, "size": 4, "gpus": 1, "mode": "mps", "memory_mib": 16160 // 4},
    }
    assert data["attributes"].endswith(
        "gpu_share_2_gpus:3;gpu_share_2_mode:time-slice;gpu_share_2_memory_mib:8080;"
        "gpu_share_4_gpus:1;gpu_share_4_mode:mps;gpu_share_4_memory_mib:4040"
    )


def test_the_running_sidecars_view_follows_a_reload_of_shared_gpus(short_tmp):
    import contextlib
    import io
    from dataclasses import replace

    from isolator.cli import main as cli
    from isolator.policy.shares import parse_shared_gpus
    from isolator.testing import fake_service
    from isolator.transport.server import SidecarServer
    from isolator.transport.settings import ServerSettings

    def ask(command: str) -> dict:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main([command, "--socket", os.path.join(short_tmp, "s.sock"), "--json"]) == cli.EXIT_OK
        return json.loads(out.getvalue())

    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4-7:4:mps"))
    rig.restart()
    server = SidecarServer(ServerSettings(socket=os.path.join(short_tmp, "s.sock"), bridge_socket=""), rig.service)
    server.start()
    try:
        before = ask("resources")
        rig.service.share_gpus(parse_shared_gpus("4:4:mps,5-6:2"))  # what a SIGHUP does
        after, values = ask("resources"), ask("attributes")["values"]
    finally:
        server.stop(grace=0)
    assert before["resources"] == "gpus:4;gpu-share-4:16" and before["shares"]["gpu-share-4"]["mode"] == "mps"
    assert after["resources"] == "gpus:5;gpu-share-2:4;gpu-share-4:4"
    assert after["shares"]["gpu-share-2"] == {
        "units": 4,
        "size": 2,
        "gpus": 2,
        "mode": "time-slice",
        "memory_mib": 8080,
    }
    assert values["gpu_share_4_gpus"] == 1 and values["gpu_share_2_mode"] == "time-slice"
