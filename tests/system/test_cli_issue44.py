"""Issue 44, a new operator's try of the CLI: what each of its items asked, as tests that failed on
the code before (offline commands leave nothing behind, the bridge executables name themselves, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import paths
import pytest
import yaml

from isolator import __version__
from isolator.bridge import command as bridge
from isolator.cli import main as cli

# ---- item 6e: every bridge executable names itself in --version ------------------------------------


@pytest.mark.parametrize("method", bridge.METHODS)
def test_the_compiled_bridge_names_itself_as_the_command_it_was_run_as(tmp_path, method):
    compiled = bridge.compiled_bridge()
    if compiled is None:
        pytest.skip("no compiled bridge in build/ (run `make build`)")
    link = tmp_path / f"gpu-isolator-{method}"
    link.symlink_to(compiled)
    out = subprocess.run([str(link), "--version"], capture_output=True, text=True, timeout=60).stdout
    assert out == f"gpu-isolator-{method} {__version__}\n"


def test_the_compiled_bridge_under_another_name_is_the_launcher(tmp_path):
    compiled = bridge.compiled_bridge()
    if compiled is None:
        pytest.skip("no compiled bridge in build/ (run `make build`)")
    for name in ("gpu-isolator-bridge", "gpu-isolator-nosuch", "prepare"):
        link = tmp_path / name
        link.symlink_to(compiled)
        out = subprocess.run([str(link), "--version"], capture_output=True, text=True, timeout=60).stdout
        assert out == f"{bridge.LAUNCHER} {__version__}\n", name


def test_the_python_and_compiled_bridges_name_a_method_alike(tmp_path, capsys):
    compiled = bridge.compiled_bridge()
    if compiled is None:
        pytest.skip("no compiled bridge in build/ (run `make build`)")
    link = os.path.join(tmp_path, "gpu-isolator-cleanup")
    os.symlink(compiled, link)
    c = subprocess.run([link, "--version"], capture_output=True, text=True, timeout=60).stdout
    assert bridge.main([link, "--version"]) == 0
    assert capsys.readouterr().out == c


# ---- item 3: an offline command leaves nothing behind unless asked to ------------------------------

OFFLINE_SIMULATED = [
    ["resources", "--simulate", "dgx-1"],
    ["attributes", "--simulate", "dgx-1"],
    ["attributes", "--simulate", "dgx-1", "--json"],
    ["cdi", "generate", "--simulate", "dgx-1"],
]


def _in_sandbox(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``gpu-isolator ARGV`` in a mount namespace where /var/lib and /tmp are empty tmpfs: the real
    ones are never written, and what the command left there is listed after it (one path a line),
    but for the simulated driver's build cache (a per-user cache in the temp dir, kept on purpose:
    building the tree takes seconds, docs/simhost.md)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private mount namespace")
    command = " ".join(shlex.quote(w) for w in [sys.executable, "-m", "isolator", *argv])
    # A checkout under /tmp or /var/lib (a fresh clone in /tmp, say) would vanish under the tmpfs with
    # its venv: it is kept open before and bound back after, and it and the directories above it are
    # not counted as left behind.
    root = os.path.realpath(paths.ROOT)
    keep, back, mine = "", "", []
    if root.startswith(("/tmp/", "/var/lib/")):
        keep = f"exec 3<{shlex.quote(root)} || exit 98; "
        back = f" && mkdir -p {shlex.quote(root)} && mount --no-canonicalize --bind /proc/self/fd/3 {shlex.quote(root)}"
        up = root
        while up not in ("/tmp", "/var/lib"):
            mine.append(f" -not -path {shlex.quote(up)}")
            up = os.path.dirname(up)
        mine.append(f" -not -path {shlex.quote(root + '/*')}")
    script = (
        f"{keep}mount -t tmpfs tmpfs /var/lib && mount -t tmpfs tmpfs /tmp{back} || exit 99; "
        f"{command} >/dev/null || exit $?; find /var/lib /tmp -mindepth 1 -maxdepth 3"
        f" -not -path '/tmp/gpu-isolator-simdriver-{os.getuid()}*'{''.join(mine)}"
    )
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.root
@pytest.mark.parametrize("argv", OFFLINE_SIMULATED, ids=lambda a: " ".join(a))
def test_an_offline_command_with_simulate_leaves_nothing_under_the_default_work_dir(argv):
    result = _in_sandbox(argv)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "", f"left behind:\n{result.stdout}"


@pytest.mark.root
def test_an_offline_command_keeps_the_simulated_host_where_work_dir_asks():
    result = _in_sandbox(["attributes", "--simulate", "dgx-1", "--work-dir", "/var/lib/gpu-isolator"])
    assert result.returncode == 0, result.stderr
    assert "/var/lib/gpu-isolator/simhost" in result.stdout.splitlines()


# ---- item 6d: times in ISO 8601 UTC in every output format --------------------------------------------

_CREATED = 1795244423.1992323  # 2026-11-21T07:00:23Z
_CONTAINERS = {"containers": [{"id": "a", "container_id": {"value": "a"}, "gpu_indices": [], "created": _CREATED}]}
_GPUS = {
    "gpus": [
        {"index": 0, "uuid": "GPU-1", "healthy": False, "last_xid": "79", "last_xid_time": _CREATED},
        {"index": 1, "uuid": "GPU-2", "healthy": True, "last_xid_time": 0},
        {"index": 2, "uuid": "GPU-3", "healthy": True, "maintenance": True, "maintenance_since": 60},
    ]
}


@pytest.mark.parametrize("output", ["json", "yaml"])
def test_structured_output_writes_times_as_iso_8601_utc(output):
    load = json.loads if output == "json" else yaml.safe_load
    containers = load(cli.formatted("containers", _CONTAINERS, output, now=_CREATED))["containers"]
    assert containers[0]["created"] == "2026-11-21T07:00:23Z"
    gpus = load(cli.formatted("gpus", _GPUS, output, now=_CREATED))["gpus"]
    assert gpus[0]["last_xid_time"] == "2026-11-21T07:00:23Z"
    assert gpus[1]["last_xid_time"] is None  # 0: never
    assert gpus[2]["maintenance_since"] == "1970-01-01T00:01:00Z"


def test_tables_write_the_same_iso_8601_utc_times():
    table = cli.formatted("gpus", _GPUS, "", now=_CREATED)
    assert "UNHEALTHY: XID 79 at 2026-11-21T07:00:23Z" in table
    assert "since 1970-01-01T00:01:00Z" in table
    describe = cli.formatted("describe", {"container": _CONTAINERS["containers"][0]}, "", now=_CREATED + 3)
    assert "2026-11-21T07:00:23Z (3s ago)" in describe


# ---- item 4: names that say what they count, alike in the exporter, alerts, dashboard and docs ------


def _renamed() -> dict[str, str]:
    """docs/metrics.md's "Renamed" table: old name -> new name."""
    text = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    body = text[text.index("**Renamed (issue 44") :].split("**Label change:**", 1)[0]
    return dict(re.findall(r"^\| `(gpu_isolator_[a-z_]+)` \| `(gpu_isolator_[a-z_]+)` \|$", body, re.M))


def test_renamed_series_are_exported_under_their_new_names_only():
    from prometheus_client import generate_latest

    from isolator.exporters.metrics import Metrics
    from isolator.model import ContainerConfig, ContainerId, Resource
    from isolator.testing import fake_service

    renamed = _renamed()
    assert len(renamed) == 6
    rig = fake_service("dgx-1")
    rig.service.prepare(ContainerId("a"), ContainerConfig(resources=(Resource("gpus", 8.0),)))
    rig.inventory.start_process(3, 33)
    rig.service.cleanup(ContainerId("a"))  # GPU 3 is held for the handover check
    rig.service.maintenance_drain("5", "board swap", "uid 0")
    text = generate_latest(Metrics(rig.service).registry).decode()
    exported = set(re.findall(r"^(gpu_isolator_[a-z_]+)[{ ]", text, re.M))
    assert set(renamed.values()) <= exported
    assert set(renamed) & exported == set()
    # The command drain moves *_drained; the handover check *_held_for_handover.
    assert re.search(r'^gpu_isolator_gpu_drained\{.*gpu="5".*\} 1\.0$', text, re.M)
    assert re.search(r'^gpu_isolator_gpu_held_for_handover\{.*gpu="3".*state="draining"\} 1\.0$', text, re.M)


@pytest.mark.parametrize(
    "path",
    [
        "isolator/data/prometheus-rules.yml",
        "isolator/data/grafana-dashboard.json",
        "tests/data/prometheus-rules-test.yml",
        "docs/handover.md",
        "docs/operations.md",
        "docs/cli.md",
    ],
)
def test_no_shipped_rule_dashboard_or_doc_names_a_series_by_its_old_name(path):
    text = (Path(__file__).parents[2] / path).read_text()
    old = [name for name in _renamed() if re.search(rf"\b{name}\b", text)]
    assert old == [], f"{path} still names {old}"


# ---- item 6b: completion for bash, zsh and fish, with the running sidecar's values --------------------

VENV_BIN = os.path.dirname(sys.executable)  # where `gpu-isolator` is, for the scripts' hidden command


@pytest.fixture(scope="module")
def sidecar() -> Iterator[str]:
    """A real gRPC sidecar on a Unix socket over the core with shipped fakes (the simulated DGX-1):
    containers ``train-a`` (two GPUs) and ``etl`` (none)."""
    from isolator.model import ContainerConfig, ContainerId, Resource
    from isolator.testing import fake_service
    from isolator.transport.server import SidecarServer
    from isolator.transport.settings import ServerSettings

    rig = fake_service("dgx-1")
    rig.service.prepare(ContainerId("train-a"), ContainerConfig(resources=(Resource("gpus", 2.0),)))
    rig.service.prepare(ContainerId("etl"), ContainerConfig())
    work = tempfile.mkdtemp(prefix="gi-", dir="/tmp")
    server = SidecarServer(ServerSettings(socket=os.path.join(work, "s.sock"), bridge_socket=""), rig.service)
    server.start()
    try:
        yield os.path.join(work, "s.sock")
    finally:
        server.stop(grace=0)
        shutil.rmtree(work, ignore_errors=True)


def _script(shell: str) -> str:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed: its completion script cannot be run (apt-get install {shell})")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["completion", shell]) == 0
    return out.getvalue()


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", "")}


def _bash(words: list[str]) -> list[str]:
    quoted = " ".join(shlex.quote(w) for w in words)
    program = f"{_script('bash')}\nCOMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}\n"
    program += "_gpu_isolator\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n"
    result = subprocess.run(["bash", "--norc", "-c", program], capture_output=True, text=True, timeout=60, env=_env())
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line]


def _zsh(words: list[str]) -> list[str]:
    """What the zsh function hands compadd (zsh filters by the prefix itself), and <files> for _files."""
    quoted = " ".join(shlex.quote(w) for w in words)
    program = (
        'compadd() { [[ "$1" == -- ]] && shift; (( $# )) && print -l -- "$@"; return 0 }\n'
        "_files() { print -- '<files>' }\ncompdef() { : }\n"
        f"{_script('zsh')}\nwords=({quoted}); CURRENT={len(words)}\n_gpu_isolator\n"
    )
    result = subprocess.run(["zsh", "-f", "-c", program], capture_output=True, text=True, timeout=60, env=_env())
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line]


def _fish(line: str) -> list[str]:
    path = os.path.join(tempfile.mkdtemp(prefix="gi-"), "gpu-isolator.fish")
    with open(path, "w") as fh:
        fh.write(_script("fish"))
    try:
        program = f"source {shlex.quote(path)}; complete -C {shlex.quote(line)}"
        result = subprocess.run(
            ["fish", "--no-config", "-c", program], capture_output=True, text=True, timeout=60, env=_env()
        )
    finally:
        shutil.rmtree(os.path.dirname(path))
    assert result.returncode == 0, result.stderr
    return [entry.split("\t", 1)[0] for entry in result.stdout.splitlines() if entry]


def _commands() -> list[str]:
    parser = cli.build_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return sorted(c for c in choices if not c.startswith("__"))


def test_the_completion_command_takes_bash_zsh_and_fish():
    for shell in ("bash", "zsh", "fish"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["completion", shell]) == cli.EXIT_OK
        assert f"generated by `gpu-isolator completion {shell}`" in out.getvalue()


def test_zsh_and_fish_offer_every_command_of_the_parser_and_a_flags_choices():
    assert set(_zsh(["gpu-isolator", ""])) >= set(_commands())
    assert set(_fish("gpu-isolator ")) >= set(_commands())
    assert sorted(_zsh(["gpu-isolator", "gpus", "-o", ""])) == ["json", "wide", "yaml"]
    assert sorted(_fish("gpu-isolator gpus -o ")) == ["json", "wide", "yaml"]
    assert sorted(_fish("gpu-isolator serve --mode ")) == ["mesos", "standalone"]
    assert _zsh(["gpu-isolator", "config", "check", ""]) == ["<files>"]
    assert "--socket" in _fish("gpu-isolator describe --")
    assert "__complete" not in _zsh(["gpu-isolator", ""]) + _fish("gpu-isolator ") + _bash(["gpu-isolator", ""])


def test_every_shell_completes_container_ids_and_gpu_indices_from_the_running_sidecar(sidecar):
    ids = ["etl", "train-a"]
    assert sorted(_bash(["gpu-isolator", "describe", "--socket", sidecar, ""])) == ids
    assert _bash(["gpu-isolator", "describe", "--socket", sidecar, "tr"]) == ["train-a"]
    assert sorted(_zsh(["gpu-isolator", "release", "--socket", sidecar, ""])) == ids
    assert sorted(_fish(f"gpu-isolator describe --socket {sidecar} ")) == ids
    gpus = [str(i) for i in range(8)]
    assert sorted(_bash(["gpu-isolator", "drain", "--socket", sidecar, ""])) == gpus
    assert sorted(_zsh(["gpu-isolator", "undrain", "--socket", sidecar, ""])) == gpus
    assert sorted(_fish(f"gpu-isolator drain --socket {sidecar} ")) == gpus


def test_the_hidden_values_command_is_quiet_and_quick_when_no_sidecar_answers(short_tmp):
    for kind in ("containers", "gpus"):
        argv = [sys.executable, "-m", "isolator", "__complete", kind, "--socket", os.path.join(short_tmp, "none.sock")]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    # And a shell offers nothing rather than an error.
    none = os.path.join(short_tmp, "none.sock")
    assert _bash(["gpu-isolator", "describe", "--socket", none, ""]) == []
    assert _zsh(["gpu-isolator", "describe", "--socket", none, ""]) == []
    assert _fish(f"gpu-isolator describe --socket {none} ") == []


def test_the_hidden_values_command_is_not_in_the_help():
    result = subprocess.run([sys.executable, "-m", "isolator", "--help"], capture_output=True, text=True, timeout=60)
    assert "__complete" not in result.stdout


# ---- item 6c: resources and attributes ask the running sidecar -------------------------------------


def _main(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(argv))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("command", ["resources", "attributes"])
def test_resources_and_attributes_read_the_running_sidecars_view_as_offline_reads_the_host(sidecar, command):
    rc, asked, err = _main(command, "--socket", sidecar)
    assert rc == cli.EXIT_OK, err
    rc, offline, err = _main(command, "--simulate", "dgx-1")
    assert rc == cli.EXIT_OK, err
    assert asked == offline and asked.strip()
    rc, asked_json, err = _main(command, "--running", "--json", env={cli.SOCKET_ENV: sidecar})
    assert rc == cli.EXIT_OK, err
    assert json.loads(asked_json) == json.loads(_main(command, "--simulate", "dgx-1", "--json")[1])


def test_resources_of_the_running_sidecar_counts_its_shared_gpus(short_tmp):
    from dataclasses import replace

    from isolator.policy.shares import parse_shared_gpus
    from isolator.testing import fake_service
    from isolator.transport.server import SidecarServer
    from isolator.transport.settings import ServerSettings

    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4-7:4"))
    rig.restart()
    server = SidecarServer(ServerSettings(socket=os.path.join(short_tmp, "s.sock"), bridge_socket=""), rig.service)
    server.start()
    try:
        rc, out, err = _main("resources", "--socket", os.path.join(short_tmp, "s.sock"))
    finally:
        server.stop(grace=0)
    assert (rc, out.strip()) == (cli.EXIT_OK, "gpus:4;gpu-share-4:16"), err


def test_running_and_an_offline_flag_contradict(short_tmp):
    rc, _out, err = _main("resources", "--running", "--simulate", "dgx-1")
    assert rc == cli.EXIT_USAGE and "--simulate is for reading NVML offline" in err


def test_resources_running_without_a_sidecar_exits_3_naming_the_socket(short_tmp):
    sock = os.path.join(short_tmp, "none.sock")
    rc, out, err = _main("attributes", "--socket", sock)
    assert (rc, out) == (cli.EXIT_UNREACHABLE, "") and sock in err


# ---- item 6a: undrain --reason, and the ended drains kept as history -----------------------------------


@pytest.fixture
def fresh_sidecar(short_tmp) -> Iterator[str]:
    """A real gRPC sidecar over the core with shipped fakes (the simulated DGX-1), for one test."""
    from isolator.testing import fake_service
    from isolator.transport.server import SidecarServer
    from isolator.transport.settings import ServerSettings

    rig = fake_service("dgx-1")
    sock = os.path.join(short_tmp, "s.sock")
    server = SidecarServer(ServerSettings(socket=sock, bridge_socket=""), rig.service)
    server.start()
    try:
        yield sock
    finally:
        server.stop(grace=0)


def test_undrain_takes_a_reason_and_drain_history_shows_who_drained_why_and_who_ended_it(fresh_sidecar):
    sock = fresh_sidecar
    assert _main("drain", "3", "--reason", "board swap, OPS-12", "--socket", sock)[0] == cli.EXIT_OK
    rc, out, err = _main("undrain", "3", "--reason", "board replaced", "--socket", sock)
    assert rc == cli.EXIT_OK, err
    assert "back in service" in out and "ended: board replaced" in out
    rc, out, err = _main("drain-history", "--json", "--socket", sock)
    assert rc == cli.EXIT_OK, err
    (entry,) = json.loads(out)["drains"]
    me = f"uid {os.getuid()}, pid {os.getpid()}"
    assert (entry["reason"], entry["by"], entry["ended_by"], entry["end_reason"]) == (
        "board swap, OPS-12",
        me,
        me,
        "board replaced",
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", entry["since"]) and entry["ended"] >= entry["since"]
    rc, table, _ = _main("drain-history", "--socket", sock)
    header, row = table.splitlines()
    assert header.split()[:3] == ["GPU", "DRAINED", "BY"] and "board replaced" in row and entry["uuid"] in row


def test_drain_history_is_empty_until_a_drain_ends(fresh_sidecar):
    _main("drain", "1", "--reason", "still on", "--socket", fresh_sidecar)
    rc, out, _ = _main("drain-history", "--socket", fresh_sidecar)
    assert (rc, out.strip()) == (cli.EXIT_OK, "No maintenance drain has ended.")


def test_undrain_handover_takes_no_reason():
    rc, _out, err = _main("undrain", "3", "--handover", "--reason", "x", "--socket", "/nonexistent.sock")
    assert rc == cli.EXIT_USAGE and "--handover ends none" in err
