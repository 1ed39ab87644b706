"""CDI as nvidia-ctk writes and lists it (issue 33, item 9): YAML by default and JSON on request, the
device name strategies (index, uuid, type-index; both = index and uuid), and ``cdi list`` with the
CDI library's rules for the spec directories (priority, conflicts, refused specs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from isolator.cli import main as cli
from isolator.errors import InvalidArgument
from isolator.exporters import cdi
from isolator.model import MigDevice
from system.test_cdi import check_spec

UUID0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
UUID1 = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
MIG = "MIG-cccccccc-0000-0000-0000-000000000000"


def _gpus() -> list[cdi.GpuEntry]:
    mig = MigDevice(parent_uuid=UUID1, uuid=MIG, gpu_instance_id=1, compute_instance_id=0, caps_minors=(21, 22))
    mig = MigDevice(**{**mig.__dict__, "slot": 0})
    return [
        cdi.GpuEntry(index=0, minor=0, uuid=UUID0),
        cdi.GpuEntry(index=1, minor=1, uuid=UUID1, mig_enabled=True, mig_devices=(mig,)),
    ]


def _build(**kw):
    args = dict(dev_root="/dev", control_nodes=["nvidiactl"], volume_path="/v/nvidia_1.0", volume_env=[], **kw)
    return cdi.build_spec(_gpus(), **args)


def _names(spec) -> list[str]:
    return [d["name"] for d in spec["devices"]]


def test_the_python_constants_of_the_cli_agree_with_the_exporter():
    assert cli.CDI_FORMATS == cdi.FORMATS
    assert cli.CDI_NAME_STRATEGIES == cdi.NAME_STRATEGIES
    assert cli.CDI_SPEC_DIRS == cdi.SPEC_DIRS


@pytest.mark.parametrize(
    ("strategies", "names"),
    [
        (("index", "uuid"), ["0", UUID0, "1", UUID1, "1:0", MIG, "all"]),
        (("index",), ["0", "1", "1:0", "all"]),
        (("uuid",), [UUID0, UUID1, MIG, "all"]),
        (("type-index",), ["gpu0", "gpu1", "mig1:0", "all"]),
        (("uuid", "type-index"), [UUID0, "gpu0", UUID1, "gpu1", MIG, "mig1:0", "all"]),
    ],
)
def test_each_device_name_strategy_names_devices_as_nvidia_ctk(strategies, names):
    spec = _build(names=strategies)
    check_spec(spec)
    assert _names(spec) == names
    # A digit-first name needs CDI 0.5.0; without one (and without hostPath) 0.3.0 is enough.
    assert spec["cdiVersion"] == ("0.5.0" if "index" in strategies else "0.3.0")


def test_an_unknown_strategy_is_refused():
    with pytest.raises(InvalidArgument, match="unknown device name strategy"):
        _build(names=("serial",))


@pytest.mark.parametrize("strategies", [("index", "uuid"), ("type-index",)])
def test_the_yaml_reads_back_as_exactly_the_spec(strategies):
    spec = _build(names=strategies)
    text = cdi.render(spec, "yaml")
    assert yaml.safe_load(text) == spec
    assert "&id" not in text and "*id" not in text  # no anchors: each device's edits written out
    # Names a YAML 1.1 reader would take for numbers are quoted ('1' and '1:0', base 60 in YAML 1.1).
    assert "- name: '0'" in text or "index" not in strategies
    assert json.loads(cdi.render(spec, "json")) == spec


def test_write_spec_writes_the_format_the_file_name_says(short_tmp):
    spec = _build()
    path, _ = cdi.write_spec(spec, short_tmp, "gpu.yaml")
    with open(path) as fh:
        text = fh.read()
    assert text.startswith("cdiVersion: 0.5.0\n") and yaml.safe_load(text) == spec
    path, _ = cdi.write_spec(spec, short_tmp, "gpu.json")
    with open(path) as fh:
        assert json.load(fh) == spec


def _generate(short_tmp: str, *argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "isolator", "cdi", "generate", "--simulate", "single"]
    cmd += ["--work-dir", os.path.join(short_tmp, "w"), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.root
def test_cdi_generate_writes_yaml_by_default_and_json_on_request(short_tmp):
    default = _generate(short_tmp)
    assert default.returncode == 0, default.stderr
    assert default.stdout.startswith("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")
    spec = yaml.safe_load(default.stdout)
    check_spec(spec)
    as_json = _generate(short_tmp, "--format", "json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == spec
    index = _generate(short_tmp, "--device-name-strategy", "index")
    assert [d["name"] for d in yaml.safe_load(index.stdout)["devices"]] == ["0", "all"]
    both = _generate(short_tmp, "--device-name-strategy", "both")
    assert yaml.safe_load(both.stdout) == spec


@pytest.mark.root
def test_cdi_generate_refuses_a_format_its_output_file_contradicts(short_tmp):
    result = _generate(short_tmp, "--format", "yaml", "--output", os.path.join(short_tmp, "nvidia.json"))
    assert result.returncode == cli.EXIT_USAGE
    assert "--format yaml contradicts --output" in result.stderr


# ---- cdi list ----------------------------------------------------------------------------------------


def _spec(kind: str, *names: str) -> dict:
    devices = [{"name": n, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}} for n in names]
    return {"cdiVersion": "0.5.0", "kind": kind, "devices": devices}


def _list(*dirs: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "isolator", "cdi", "list"]
    for d in dirs:
        argv += ["--spec-dir", d]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_cdi_list_prints_every_device_of_the_yaml_and_json_specs(tmp_path):
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "ours.yaml").write_text(cdi.render(_build(), "yaml"))
    (etc / "other.json").write_text(json.dumps(_spec("example.com/nic", "eth0")))
    (etc / "notes.txt").write_text("not a spec: runtimes read *.json and *.yaml only")
    result = _list(str(etc), str(tmp_path / "missing"))
    assert result.returncode == 0, result.stderr
    expected = [f"nvidia.com/gpu={n}" for n in _names(_build())] + ["example.com/nic=eth0"]
    assert result.stdout.splitlines() == sorted(expected)
    listed = json.loads(_list_json(str(etc)))
    assert {d["name"]: os.path.basename(d["spec"]) for d in listed["devices"]}["example.com/nic=eth0"] == "other.json"


def _list_json(*dirs: str) -> str:
    argv = [sys.executable, "-m", "isolator", "cdi", "list", "--json"]
    for d in dirs:
        argv += ["--spec-dir", d]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout


def test_cdi_list_follows_the_cdi_library_on_priority_conflicts_and_refused_specs():
    low = [
        (0, "/etc/cdi/a.yaml", _spec("nvidia.com/gpu", "0", "1")),
        (0, "/etc/cdi/b.yaml", _spec("nvidia.com/gpu", "1", "2")),  # "1" twice at one priority
        (0, "/etc/cdi/bad.yaml", {"kind": "nvidia.com/gpu", "devices": [{"name": 0}]}),  # a YAML int: refused
    ]
    high = [(1, "/var/run/cdi/c.yaml", _spec("nvidia.com/gpu", "2"))]  # overrides /etc/cdi's "2"
    listing = cdi.list_specs([*low, *high])
    assert listing.devices == {"nvidia.com/gpu=0": "/etc/cdi/a.yaml", "nvidia.com/gpu=2": "/var/run/cdi/c.yaml"}
    assert any("conflicting device nvidia.com/gpu=1" in p for p in listing.problems)
    assert any(p.startswith("'/etc/cdi/bad.yaml': invalid CDI device name 0") for p in listing.problems)


def test_cdi_list_names_a_spec_it_cannot_parse_and_exits_1(tmp_path):
    (tmp_path / "broken.yaml").write_text("kind: [unclosed\n")
    (tmp_path / "good.json").write_text(json.dumps(_spec("nvidia.com/gpu", "0")))
    result = _list(str(tmp_path))
    assert result.returncode == cli.EXIT_ERROR
    assert result.stdout.splitlines() == ["nvidia.com/gpu=0"]
    assert f"cannot parse '{tmp_path / 'broken.yaml'}'" in result.stderr
