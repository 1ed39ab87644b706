"""Cases the first tests of issue 33 (items 1, 3-13) left out, each found by attacking what was built:
a metrics ``unix:`` path equal to the daemon's own socket, the CLI given the socket's private ``.d``
directory, ``-o`` on the offline commands that take ``--json``, ``cdi list`` on specs a CDI runtime
refuses for their ``cdiVersion`` or an unknown field, ``config default | config check -``, and a
maintenance drain of a GPU that a changed ``--nvidia-gpu-devices`` no longer manages."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import paths
import pytest
import yaml

from isolator.cli import main as cli
from isolator.daemon import config as configmod
from isolator.errors import ConfigError
from isolator.exporters import cdi
from isolator.testing.cgroupfs import TEST_PARENT
from isolator.testing.sidecar import Sidecar


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "isolator", *argv], text=True, timeout=120, capture_output=True, **kw)


# ---- item 1: a metrics unix: path that is the daemon's own gRPC or bridge socket ---------------------


@pytest.mark.parametrize("which", ["socket", "bridge"])
def test_a_metrics_path_equal_to_the_daemons_own_socket_is_a_config_error_not_another_holder(tmp_path, which):
    """Before: the daemon locked its own socket twice and refused with exit 75, naming its own pid as
    "another" holder ("stop that one")."""
    sock = str(tmp_path / "s.sock")
    target = sock if which == "socket" else sock + ".bridge"
    with pytest.raises(ConfigError) as err:
        configmod.resolve({"socket": sock, "metrics_address": f"unix:{target}"})
    flag = "--socket" if which == "socket" else "--bridge-socket"
    assert f"--metrics-address 'unix:{target}' must differ from {flag}" in err.value.message


def test_a_metrics_path_reaching_the_socket_through_a_symlinked_directory_is_refused_too(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(ConfigError, match="must differ from --socket"):
        configmod.resolve(
            {"socket": str(tmp_path / "real" / "s.sock"), "metrics_address": f"unix:{tmp_path / 'link' / 's.sock'}"}
        )


def test_a_metrics_path_of_its_own_is_taken(tmp_path):
    config = configmod.resolve({"socket": str(tmp_path / "s.sock"), "metrics_address": f"unix:{tmp_path / 'm.sock'}"})
    assert config.metrics_address == f"unix:{tmp_path / 'm.sock'}"


# ---- item 6: the CLI given the socket's private directory ---------------------------------------------


@pytest.fixture(scope="module")
def sidecar() -> Iterator[Sidecar]:
    work = tempfile.mkdtemp(prefix="gi-a33-", dir="/tmp")
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    running = Sidecar(work=work, host="dgx-1", cgroup_version="v1", cgroups_root=root)
    running.start()
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(work, ignore_errors=True)


def _cli(sock: str, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([*argv, "--socket", sock])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.root
@pytest.mark.cgroup_v1
@pytest.mark.parametrize("inside", ["", "deny", "grpc"])
def test_the_sockets_private_directory_and_its_sockets_point_to_the_public_socket(sidecar, inside):
    """Before: '<socket>.d' was answered "use --socket '<socket>.d/deny'", the socket of the peer
    gate's refusals, which then said "uid -1 (gid -1) is not allowed"; '<socket>.d/grpc' answered as if
    it were the socket to use, behind the peer gate's back."""
    private = sidecar.socket + ".d"
    path = os.path.join(private, inside) if inside else private
    rc, _out, err = _cli(path, "gpus")
    assert rc == cli.EXIT_UNREACHABLE, err
    assert "use --socket '" + private not in err and "uid -1" not in err, err
    assert f"use --socket '{sidecar.socket}'" in err, err
    assert "private" in err and len(err.strip().splitlines()) == 1, err


# ---- item 7: a drain of a GPU no longer managed --------------------------------------------------------


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_drain_of_a_gpu_left_out_by_nvidia_gpu_devices_is_shown_and_can_be_ended_by_uuid():
    """Before: after a restart with a --nvidia-gpu-devices that leaves a drained GPU out, health said
    "no GPU drained for maintenance" and ``undrain UUID`` answered NOT_FOUND, so the drain could
    neither be seen nor ended until the GPU was managed again, when it came back drained."""
    work = tempfile.mkdtemp(prefix="gi-a33-", dir="/tmp")
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sc = Sidecar(work=work, host="dgx-1", cgroup_version="v1", cgroups_root=root).start()
    try:
        rc, out, err = _cli(sc.socket, "gpus", "--json")
        gone = json.loads(out)["gpus"][7]["uuid"]
        rc, out, err = _cli(sc.socket, "drain", "7", "--reason", "board swap OPS-7")
        assert rc == 0, err
        sc.terminate()
        sc.extra = ("--nvidia-gpu-devices", "0,1,2,3", "--resources", "gpus:4")
        sc.start()
        rc, out, err = _cli(sc.socket, "health")
        assert rc == 0, err
        assert gone in out and "not managed here" in out and "board swap OPS-7" in out, out
        rc, out, err = _cli(sc.socket, "undrain", gone)
        assert rc == 0, err
        assert "drain of GPU " + gone in out and "ended" in out, out
        sc.terminate()
        sc.extra = ()
        sc.start()
        rc, out, err = _cli(sc.socket, "gpus", "--json")
        assert [g["index"] for g in json.loads(out)["gpus"] if g.get("maintenance")] == [], out
    finally:
        sc.stop()
        shutil.rmtree(work, ignore_errors=True)


# ---- item 9: cdi list on specs a CDI runtime refuses ---------------------------------------------------


def _spec(version: Any, kind: str = "example.com/gpu", name: str = "0", **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"kind": kind, "devices": [{"name": name, "containerEdits": {"env": ["A=1"]}}]}
    if version is not None:
        spec["cdiVersion"] = version
    spec.update(extra)
    return spec


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (_spec("0.3.0"), "cdiVersion 0.3.0 is below 0.5.0"),  # a digit-first name needs 0.5.0
        (_spec(None), "no cdiVersion"),
        (_spec("9.9.9"), "unknown cdiVersion '9.9.9'"),
        (_spec("0.6.0", containerEdit={"env": ["A=1"]}), "unknown field 'containerEdit'"),
        (
            {"cdiVersion": "0.5.0", "kind": "example.com/gpu", "devices": [{"name": "0", "containerEdit": {}}]},
            "unknown field 'containerEdit' in device '0'",
        ),
        (
            _spec("0.6.0", containerEdits={"deviceNode": [{"path": "/dev/x"}]}),
            "unknown field 'deviceNode' in containerEdits",
        ),
    ],
)
def test_cdi_list_refuses_what_the_cdi_library_refuses_when_loading_a_spec(spec, why):
    """Before: the devices of each of these specs were listed, although a runtime loads none of them
    (a version below what the fields need, an unknown version or field: shared/reference/nvidia-volume-cdi.md §3.1)."""
    listing = cdi.list_specs([(0, "/etc/cdi/x.yaml", spec)])
    assert listing.devices == {}
    assert len(listing.problems) == 1 and why in listing.problems[0], listing.problems


def test_cdi_list_takes_the_specs_we_write_and_a_spec_that_declares_more_than_it_needs():
    ours = cdi.build_spec(
        [cdi.GpuEntry(index=0, minor=0, uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000")],
        dev_root="/dev",
        control_nodes=["nvidiactl"],
        volume_path="/v/nvidia_1.0",
        volume_env=[],
    )
    parsed = yaml.safe_load(cdi.render(ours, "yaml"))
    listing = cdi.list_specs([(0, "/etc/cdi/ours.yaml", parsed), (0, "/etc/cdi/b.json", _spec("1.0.0", name="b"))])
    assert listing.problems == ()
    assert "example.com/gpu=b" in listing.devices and "nvidia.com/gpu=0" in listing.devices


# ---- item 10: config default | config check - ----------------------------------------------------------


def test_config_check_reads_standard_input_for_dash():
    default = _run(["config", "default"])
    assert default.returncode == 0, default.stderr
    checked = _run(["config", "check", "-"], input=default.stdout)
    assert checked.returncode == cli.EXIT_OK, checked.stderr
    assert checked.stdout.startswith("config file '-' is valid: every setting is the default"), checked.stdout
    bad = _run(["config", "check", "-"], input='max-workers = "many"\n')
    assert bad.returncode == cli.EXIT_CONFIG, bad.stderr
    assert "line 1 value for max-workers: 'many' is not an integer" in bad.stderr, bad.stderr


# ---- item 12: -o on every command that takes --json ----------------------------------------------------


@pytest.mark.parametrize("argv", [["resources", "--simulate", "dgx-1"], ["attributes", "--simulate", "dgx-1"]])
def test_the_offline_commands_with_json_take_o_json_and_yaml_with_the_same_shape(argv, short_tmp):
    argv = [*argv, "--work-dir", short_tmp]
    as_json = _run([*argv, "--json"])
    assert as_json.returncode == 0, as_json.stderr
    for fmt, load in (("json", json.loads), ("yaml", yaml.safe_load)):
        result = _run([*argv, "-o", fmt])
        assert result.returncode == 0, result.stderr
        assert load(result.stdout) == json.loads(as_json.stdout)
    plain = _run(argv)
    assert _run([*argv, "-o", "wide"]).stdout == plain.stdout
    contradiction = _run([*argv, "--json", "-o", "yaml"])
    assert contradiction.returncode == cli.EXIT_USAGE and "--json and -o yaml contradict" in contradiction.stderr


def test_cdi_list_takes_o_yaml(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(_spec("0.5.0")))
    as_json = _run(["cdi", "list", "--spec-dir", str(tmp_path), "--json"])
    as_yaml = _run(["cdi", "list", "--spec-dir", str(tmp_path), "-o", "yaml"])
    assert as_yaml.returncode == 0, as_yaml.stderr
    assert yaml.safe_load(as_yaml.stdout) == json.loads(as_json.stdout)


def test_serve_refuses_config_from_standard_input_which_sighup_could_not_read_again():
    result = _run(["serve", "--config", "-"], input="")
    assert result.returncode == cli.EXIT_USAGE, result.stderr
    assert "--config - is not a file" in result.stderr


# ---- item 13: the CLI's own flags in docs/cli.md -------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]


def _cli_md() -> str:
    with open(os.path.join(paths.ROOT, "docs", "cli.md")) as fh:
        return fh.read()


def test_cli_md_names_every_flag_of_every_command_but_serve():
    """Before: a flag added to drain, release, cdi list... failed no drift test (only serve's flags,
    in the README, were checked). serve's own are the README flags table's (tests/system/test_doc_drift.py)."""
    text = _cli_md()
    missing = []
    for name, parser in _subparsers(cli.build_parser()).items():
        if name == "serve":
            continue
        for full, sub in [(name, parser), *((f"{name} {s}", p) for s, p in _subparsers(parser).items())]:
            own = set(_flags(sub)) - {"--" + n.replace("_", "-") for n in configmod.PARSERS}
            missing += [
                f"{full} {f}" for f in sorted(own) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)
            ]
    assert missing == [], "flags missing from docs/cli.md"


def test_cli_md_options_table_names_every_option_the_admin_commands_share():
    text = _cli_md()
    body = text[text.index("## Options every admin command takes") :].split("\n## ", 1)[0]
    rows = {f for line in body.splitlines() if line.startswith("| `") for f in re.findall(r"`(--?[a-z][a-z-]*)", line)}
    commands = _subparsers(cli.build_parser())
    shared = set.intersection(*(set(_flags(commands[c.split()[0]])) for c in cli.ADMIN_CALLS))
    assert sorted(shared - rows) == [], "options every admin command takes, missing from docs/cli.md's table"


# ---- item 6: a socket that accepts and never answers (a stopped sidecar) --------------------------------


class _Recording:
    def __init__(self) -> None:
        self.timeouts: list[float] = []
        self.metadata: list[Any] = []

    def Health(self, request: Any, timeout: float, metadata: Any = ()) -> str:  # a gRPC stub's method name
        self.timeouts.append(timeout)
        self.metadata.append(metadata)
        return "answer"


def test_the_probes_wait_counts_against_the_timeout_of_the_call_after_it(tmp_path, monkeypatch):
    """Before: a socket that accepted and never answered cost the probe's 5 s and then the call's whole
    --timeout, 15 s for "did not answer within 10 s". The clock is stepped by hand: the probe "took" 4 s."""
    from isolator.transport import client as clientmod

    path = str(tmp_path / "silent.sock")
    now = [1000.0]
    monkeypatch.setattr(clientmod.time, "monotonic", lambda: now[0])

    def probe(socket_path: str, timeout: float) -> None:
        now[0] += 4.0

    monkeypatch.setattr(clientmod, "probe", probe)
    stub = _Recording()
    with clientmod.Client(path, timeout=10.0) as client:
        client.check_reachable()
        assert client.call(stub, "Health", None) == "answer"
    assert stub.timeouts == [6.0]
    # The absolute deadline sent beside it (docs/operations.md, "Stale hooks") is the same 6 s away.
    assert stub.metadata == [((clientmod.DEADLINE_METADATA, str(int((1004.0 + 6.0) * 1000))),)]


# ---- item 7: a drain reason that is not one line of printable text ------------------------------------


@pytest.mark.parametrize(
    "reason",
    ["next\x85line", "split\u2028here", "CSI \x9b31m red", "\u202eOPS-1 reversed", "zero\u200bwidth"],
)
def test_a_drain_reason_with_a_unicode_line_break_control_or_format_character_is_refused(reason):
    """Before: only C0 controls and DEL were refused, so NEL and U+2028 (str.splitlines splits at both),
    8-bit CSI and a right-to-left override reached gpus, describe, health and the log."""
    from isolator.errors import InvalidArgument
    from isolator.testing import fake_service

    rig = fake_service("dgx-1")
    with pytest.raises(InvalidArgument, match="one line of printable text"):
        rig.service.maintenance_drain("1", reason, "uid 0, pid 1")
    assert rig.store.maintenance() == {}


def test_a_drain_reason_in_any_script_with_spaces_is_taken():
    from isolator.testing import fake_service

    rig = fake_service("dgx-1")
    change = rig.service.maintenance_drain("1", "carte à changer — ticket OPS-12 (ファン)", "uid 0, pid 1")
    assert change.reason == "carte à changer — ticket OPS-12 (ファン)"


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_symlink_to_the_bridge_socket_elsewhere_points_to_the_grpc_socket_beside_its_target(sidecar, tmp_path):
    """Before: a link to '<socket>.bridge' in another directory was named the bridge's socket, with no
    socket to use (nothing answering gRPC beside the link)."""
    link = tmp_path / "isolator"
    os.symlink(sidecar.bridge_socket, link)
    rc, _out, err = _cli(str(link), "gpus")
    assert rc == cli.EXIT_UNREACHABLE, err
    assert "command-module bridge's socket" in err and f"use --socket '{sidecar.socket}'" in err, err


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("unix:relative.sock", "a unix socket path must be absolute"),
        ("localhost:99999", "expected HOST:PORT, :PORT or unix:/path"),
        ("nonsense", "expected HOST:PORT, :PORT or unix:/path"),
        ("[]:9416", "an empty host"),
    ],
)
def test_config_check_refuses_a_metrics_address_serve_would_refuse(tmp_path, value, why):
    """Before: config check called such a file valid (exit 0) and serve then refused it (exit 78)."""
    path = tmp_path / "c.toml"
    path.write_text(f'# metrics\nmetrics-address = "{value}"\n')
    result = _run(["config", "check", str(path)])
    assert result.returncode == cli.EXIT_CONFIG, result.stdout
    assert f"--metrics-address '{value}': {why}" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        (
            'cgroups_hierarchy = "relative/path"',
            "cgroups_hierarchy (config file '{path}', line 2) 'relative/path' must be an absolute path",
        ),
        (
            "nvidia-gpu-devices = [0]",
            "'--nvidia-gpu-devices' cannot be set without also setting 'gpus' in '--resources'",
        ),
        ('resources = "gpus:abc"', "The 'gpus' resource must be a scalar, got 'abc'"),
        ('resources = "cpus:4;gpus:2"', "The 'gpus' resource cannot be set without also setting"),
        ('socket_group = "no-such-group-a33"', "--socket-group 'no-such-group-a33': no group of that name"),
    ],
)
def test_config_check_refuses_gpu_flags_and_a_hierarchy_serve_would_refuse(tmp_path, settings, why):
    """Before: config check called these valid; serve then refused the GPU flags (78) and stopped on a
    relative --cgroups-hierarchy with a ValueError traceback (exit 1)."""
    path = tmp_path / "c.toml"
    path.write_text(f"# x\n{settings}\n")
    result = _run(["config", "check", str(path)])
    assert result.returncode == cli.EXIT_CONFIG, result.stdout
    assert why.format(path=path) in result.stderr and "Traceback" not in result.stderr, result.stderr
