"""The CDI spec: valid against the CDI JSON schema, and it names every GPU, MIG device and ``all``."""

from __future__ import annotations

import json
import os
import queue
import re
import stat
import subprocess
import sys
import time

import paths
import pytest
from jsonschema import Draft7Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from isolator.daemon.config import Config
from isolator.daemon.main import CdiKeeper, generate_cdi
from isolator.errors import FailedPrecondition, InvalidArgument
from isolator.exporters import cdi
from isolator.gpu.nvml import Inventory
from isolator.simhost.sim import SimulatedHost
from volumes.manager import VolumeManager

SCHEMA_DIR = os.path.join(paths.DATA, "cdi-schema")
# The Go loader refuses unknown fields (specs-go/config.go at spec 1.1.0): the keys it knows.
SPEC_KEYS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
DEVICE_KEYS = {"name", "annotations", "containerEdits"}
EDIT_KEYS = {"env", "deviceNodes", "netDevices", "hooks", "mounts", "intelRdt", "additionalGids"}
NODE_KEYS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
MOUNT_KEYS = {"hostPath", "containerPath", "options", "type"}
# pkg/parser ValidateDeviceName: starts and ends with a letter or digit; '_', '-', '.', ':' inside.
DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


def _validator() -> Draft7Validator:
    def load(name: str) -> dict:
        with open(os.path.join(SCHEMA_DIR, name)) as fh:
            return json.load(fh)

    registry = Registry().with_resource("defs.json", Resource.from_contents(load("defs.json"), DRAFT7))
    return Draft7Validator(load("schema.json"), registry=registry)


def check_spec(spec: dict) -> None:
    """Everything a CDI loader checks that we can check here; raises AssertionError on a defect."""
    errors = sorted(_validator().iter_errors(spec), key=lambda e: list(e.path))
    assert not errors, "; ".join(f"{list(e.path)}: {e.message}" for e in errors)
    assert set(spec) <= SPEC_KEYS
    assert spec["devices"], "a spec needs at least one device"
    names = [d["name"] for d in spec["devices"]]
    assert len(names) == len(set(names)), "device names must be unique"
    for edits in [spec.get("containerEdits", {})] + [d["containerEdits"] for d in spec["devices"]]:
        assert set(edits) <= EDIT_KEYS
        for node in edits.get("deviceNodes", []):
            assert set(node) <= NODE_KEYS and node["path"].startswith("/dev/")
        for mount in edits.get("mounts", []):
            assert set(mount) <= MOUNT_KEYS
        for entry in edits.get("env", []):
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", entry), entry
    for dev in spec["devices"]:
        assert set(dev) <= DEVICE_KEYS and DEVICE_NAME.fullmatch(dev["name"]), dev["name"]


@pytest.fixture
def a100(short_tmp):
    return SimulatedHost("dgx-a100", os.path.join(short_tmp, "w", "simhost")).setup()


def _config(short_tmp: str, **kw) -> Config:
    return Config(
        simulate="dgx-a100",
        work_dir=os.path.join(short_tmp, "w"),
        volume_root=os.path.join(short_tmp, "vol"),
        **kw,
    )


# ---- the schema catches what it should (so that passing means something) ---------------------------


def test_the_checker_refuses_broken_specs():
    good = {"cdiVersion": "1.1.0", "kind": "nvidia.com/gpu", "devices": [{"name": "0", "containerEdits": {}}]}
    check_spec(good)
    for broken in (
        {k: v for k, v in good.items() if k != "devices"},  # schema: required
        {**good, "devices": [{"name": "0"}]},  # schema: containerEdits required
        {**good, "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"hostPath": "/dev/x"}]}}]},
        {**good, "devices": [{"name": "0", "containerEdits": {"mounts": [{"hostPath": "/x"}]}}]},
        {**good, "devices": [{"name": "-0", "containerEdits": {}}]},  # name rule
        {**good, "devices": []},
        {**good, "colour": "red"},  # unknown field
        {**good, "containerEdits": {"env": ["=x"]}},
    ):
        with pytest.raises(AssertionError):
            check_spec(broken)


# ---- the spec of the simulated DGX A100 --------------------------------------------------------------


@pytest.mark.root
def test_generated_spec_validates_and_lists_every_gpu_mig_device_and_all(short_tmp):
    config = _config(short_tmp)
    spec = generate_cdi(config)
    check_spec(spec)
    host = SimulatedHost("dgx-a100", os.path.join(config.work_dir, "simhost"))
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "nvidia.com/gpu"
    devices = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    expected = {"all"}
    for g in host.spec.gpus:
        expected |= {str(g.index), g.uuid}
        for slot, m in enumerate(g.mig_devices):
            expected |= {f"{g.index}:{slot}", m.uuid}
    assert set(devices) == expected
    assert len(devices) == 1 + 2 * 8 + 2 * 15

    def paths(name: str) -> list[str]:
        return [n["path"] for n in devices[name]["deviceNodes"]]

    # A MIG device: its parent's node and its GI and CI access caps, nothing else.
    g1 = host.spec.gpus[1]
    from isolator.simhost.host import mig_caps_minors

    gi, ci = mig_caps_minors(g1.minor, g1.mig_devices[0].gpu_instance, 0)
    want = ["/dev/nvidia1", f"/dev/nvidia-caps/nvidia-cap{gi}", f"/dev/nvidia-caps/nvidia-cap{ci}"]
    assert paths("1:0") == paths(g1.mig_devices[0].uuid) == want
    # A whole GPU without MIG: its node; a whole GPU in MIG mode: its node and all its devices' caps.
    assert paths("5") == ["/dev/nvidia5"]
    assert len(paths("1")) == 1 + 2 * 7
    assert set(paths("all")) == {p for name in devices if name != "all" for p in paths(name)}
    # Host paths are the simulated host's nodes, and they exist (made with mknod as root).
    for node in devices["all"]["deviceNodes"]:
        assert node["hostPath"] == os.path.join(host.dev_root, node["path"][len("/dev/") :])
        assert stat.S_ISCHR(os.stat(node["hostPath"]).st_mode)
    # Every device gets the control nodes and the driver volume, read-only at /usr/local/nvidia.
    edits = spec["containerEdits"]
    assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    (mount,) = edits["mounts"]
    assert mount["containerPath"] == "/usr/local/nvidia" and "ro" in mount["options"]
    assert mount["hostPath"] == os.path.join(config.volume_root, f"nvidia_{host.spec.driver_version}")
    assert os.path.isdir(os.path.join(mount["hostPath"], "lib64"))
    assert "NVIDIA_VISIBLE_DEVICES=void" in edits["env"]
    assert any(e.startswith("LD_LIBRARY_PATH=") and "/usr/local/nvidia/lib64" in e for e in edits["env"])


def _entries(**override):
    base = dict(index=0, minor=0, uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000")
    return [cdi.GpuEntry(**{**base, **override})]


def _build(gpus, **kw):
    args = dict(dev_root="/dev", control_nodes=["nvidiactl"], volume_path="/v/nvidia_1.0", volume_env=[], **kw)
    return cdi.build_spec(gpus, **args)


def test_unhealthy_gpus_are_left_out_and_a_spec_without_devices_is_refused():
    sick = cdi.GpuEntry(index=1, minor=1, uuid="GPU-bbbbbbbb-0000-0000-0000-000000000000", usable=False)
    two = [*_entries(), sick]
    spec = _build(two)
    check_spec(spec)
    assert [d["name"] for d in spec["devices"]] == ["0", "GPU-aaaaaaaa-0000-0000-0000-000000000000", "all"]
    assert "hostPath" not in spec["devices"][0]["containerEdits"]["deviceNodes"][0]  # /dev on the host too
    with pytest.raises(FailedPrecondition, match="needs at least one device"):
        _build(_entries(usable=False))


def test_kind_is_checked():
    assert cdi.check_kind("example.com/gpu") == "example.com/gpu"
    for bad in ("gpu", "nvidia.com/", "nvidia.com/gpu/x", "1vendor.com/gpu", "nvidia.com/g pu"):
        with pytest.raises(InvalidArgument):
            cdi.check_kind(bad)
    spec = _build(_entries(), kind="gpu-isolator.example.org/gpu")
    check_spec(spec)


def test_write_is_atomic_0644_and_skips_an_unchanged_spec(short_tmp):
    spec = _build(_entries())
    path, changed = cdi.write_spec(spec, short_tmp)
    assert changed and stat.S_IMODE(os.stat(path).st_mode) == 0o644
    with open(path) as fh:
        assert json.load(fh) == spec
    before = os.stat(path).st_mtime_ns
    assert cdi.write_spec(spec, short_tmp) == (path, False)
    assert os.stat(path).st_mtime_ns == before
    assert [n for n in os.listdir(short_tmp) if n.startswith(".tmp-")] == []


# ---- the command and the daemon's --cdi-dir ---------------------------------------------------------


@pytest.mark.root
def test_cdi_generate_command_writes_the_file(short_tmp):
    out = os.path.join(short_tmp, "cdi", "nvidia.json")
    cmd = [sys.executable, "-m", "isolator", "cdi", "generate", "--simulate", "dgx-a100"]
    cmd += ["--work-dir", os.path.join(short_tmp, "w"), "--volume-root", os.path.join(short_tmp, "v")]
    proc = subprocess.run([*cmd, "--output", out], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote CDI spec '{out}': 47 devices, kind nvidia.com/gpu" in proc.stderr
    with open(out) as fh:
        check_spec(json.load(fh))
    bad = subprocess.run([*cmd, "--cdi-kind", "nvidia"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 78 and "invalid CDI kind 'nvidia'" in bad.stderr and not bad.stdout


@pytest.mark.root
def test_cdi_dir_keeps_the_spec_current_when_a_gpu_turns_unhealthy(short_tmp, a100):
    inv = Inventory(library=a100.library_path, proc_root=a100.proc_root, sys_root=os.path.join(a100.root, "sys"))
    inv.open()
    try:
        inv.read()
        inv.start_health_watch()
        from isolator.simhost.driver import build_driver_root

        driver = build_driver_root(a100.driver_root, a100.spec.driver_version)
        volumes = VolumeManager(os.path.join(short_tmp, "vol"), driver_root=a100.driver_root, path=driver.path)
        keeper = CdiKeeper(inv, a100.dev_root, volumes, os.path.join(short_tmp, "cdi"), "nvidia.com/gpu")
        path = keeper.update()
        assert path is not None
        with open(path) as fh:
            names = {d["name"] for d in json.load(fh)["devices"]}
        assert {"3", "3:0", "all"} <= names
        changed: queue.Queue[object] = queue.Queue()
        inv.on_health_change(lambda event: (keeper.update(), changed.put(event)))
        a100.inject_xid(3, 79)
        changed.get(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(path) as fh:
                spec = json.load(fh)
            if "3" not in {d["name"] for d in spec["devices"]}:
                break
            time.sleep(0.05)
        check_spec(spec)
        names = {d["name"] for d in spec["devices"]}
        assert "3" not in names and "3:0" not in names and "2" in names
    finally:
        inv.close()


def test_resources_command_prints_the_agent_entries(short_tmp, capsys):
    from isolator.cli.main import main

    args = ["resources", "--simulate", "dgx-a100", "--work-dir", os.path.join(short_tmp, "w")]
    assert main(args) == 0
    line = capsys.readouterr().out.strip()
    assert line == "gpus:3;mig-1g.10gb:1;mig-1g.5gb:8;mig-2g.10gb:2;mig-3g.20gb:3;mig-4g.20gb:1"
    assert main(["resources", "--simulate", "dgx-1", "--work-dir", os.path.join(short_tmp, "w1")]) == 0
    assert capsys.readouterr().out.strip() == "gpus:8"


# ---- cdiVersion: the lowest version the content needs (as nvidia-ctk writes) -------------------------
# The CDI spec's version table (SPEC.md "Released versions", specs-go/version.go requiresV0x0 at spec
# 1.1.0): a runtime on an older CDI library refuses any version it does not know, and every library
# refuses a spec whose declared version is below what its fields need.

_NODE = {"path": "/dev/nvidia0"}
_BASE_EDITS = {"deviceNodes": [_NODE]}


def _spec(devices=None, edits=None, kind="nvidia.com/gpu", **top):
    devices = devices if devices is not None else [{"name": "gpu", "containerEdits": _BASE_EDITS}]
    spec = {"cdiVersion": "0.3.0", "kind": kind, "devices": devices, "containerEdits": edits or {}}
    return {**spec, **top}


def _dev(name="gpu", **edits):
    return {"name": name, "containerEdits": {**_BASE_EDITS, **edits}}


@pytest.mark.parametrize(
    ("feature", "spec", "minimum"),
    [
        ("nothing newer than the first tagged release", _spec(), "0.3.0"),
        ("mount type", _spec(edits={"mounts": [{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]}), "0.4.0"),
        (
            "mount type on a device",
            _spec([_dev(mounts=[{"hostPath": "/a", "containerPath": "/a", "type": "b"}])]),
            "0.4.0",
        ),
        ("a mount without type", _spec(edits={"mounts": [{"hostPath": "/a", "containerPath": "/a"}]}), "0.3.0"),
        ("device node hostPath", _spec(edits={"deviceNodes": [{"path": "/dev/x", "hostPath": "/h/x"}]}), "0.5.0"),
        ("hostPath on a device", _spec([_dev(deviceNodes=[{"path": "/dev/x", "hostPath": "/h/x"}])]), "0.5.0"),
        ("device name starting with a digit", _spec([_dev("0")]), "0.5.0"),
        ("device name with a digit inside", _spec([_dev("gpu0:1")]), "0.3.0"),
        ("spec annotations", _spec(annotations={"a": "b"}), "0.6.0"),
        ("device annotations", _spec([{**_dev(), "annotations": {"a": "b"}}]), "0.6.0"),
        ("empty annotations", _spec([{**_dev(), "annotations": {}}], annotations={}), "0.3.0"),
        ("a dot in the kind's class", _spec(kind="nvidia.com/gpu.mig"), "0.6.0"),
        ("dots only in the kind's vendor", _spec(kind="a.b.c/gpu"), "0.3.0"),
        ("intelRdt", _spec(edits={"intelRdt": {"closID": "c"}}), "0.7.0"),
        ("intelRdt on a device", _spec([_dev(intelRdt={"closID": "c"})]), "0.7.0"),
        ("additionalGids", _spec(edits={"additionalGids": [5]}), "0.7.0"),
        ("additionalGids on a device", _spec([_dev(additionalGids=[5])]), "0.7.0"),
        ("intelRdt schemata", _spec(edits={"intelRdt": {"schemata": ["L3:0=f"]}}), "1.1.0"),
        ("intelRdt enableMonitoring", _spec([_dev(intelRdt={"enableMonitoring": True})]), "1.1.0"),
        ("netDevices", _spec(edits={"netDevices": [{"hostInterfaceName": "e", "name": "e"}]}), "1.1.0"),
        ("netDevices on a device", _spec([_dev(netDevices=[{"hostInterfaceName": "e", "name": "e"}])]), "1.1.0"),
        ("the highest feature wins", _spec([_dev("0")], annotations={"a": "b"}, kind="v.com/c.d"), "0.6.0"),
    ],
)
def test_minimum_version_follows_the_cdi_version_table(feature, spec, minimum):
    assert cdi.minimum_version(spec) == minimum, feature


def test_known_versions_are_the_released_ones_and_none_needs_08_or_10():
    # 0.8.0 and 1.0.0 changed only the Go API (SPEC.md): no spec content requires them.
    assert cdi.VERSIONS == ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")


def test_built_spec_declares_the_minimum_its_content_needs():
    spec = _build(_entries())
    assert spec["cdiVersion"] == cdi.minimum_version(spec) == "0.5.0"  # digit-first names
    dotted = _build(_entries(), kind="example.com/gpu.v2")
    assert dotted["cdiVersion"] == "0.6.0"


@pytest.mark.parametrize("host", ["dgx-1", "dgx-2", "dgx-a100", "hgx-h100", "single", "workstation-4"])
def test_every_shipped_host_gets_cdi_version_050(short_tmp, host):
    config = Config(simulate=host, work_dir=os.path.join(short_tmp, "w"), volume_root=os.path.join(short_tmp, "v"))
    spec = generate_cdi(config)
    check_spec(spec)
    # GPU index names start with a digit and the device nodes carry hostPath: both need 0.5.0, nothing more.
    assert spec["cdiVersion"] == cdi.minimum_version(spec) == "0.5.0"
