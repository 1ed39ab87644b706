"""What an operator's hands expect of a CLI (issue 33, item 12): usage and the command list when a
command line is incomplete, ``-o json|yaml|wide``, a quiet exit 0 when the reader of a pipe goes
away, shell completion generated from the parser, and "1 container" rather than "1 containers".

No sidecar here: everything runs before a socket would be touched, offline, or on rendering alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import yaml

from isolator.cli import main as cli
from isolator.testing import fake_service

ADMIN = sorted(cli.ADMIN_CALLS)
OUTPUT_FORMATS = ("json", "yaml", "wide")


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "isolator", *argv], text=True, timeout=120, **kw)


def _commands() -> list[str]:
    parser = cli.build_parser()
    return sorted(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


def test_gpu_isolator_alone_prints_the_usage_and_every_command_and_exits_0():
    result = _run([], capture_output=True)
    assert result.returncode == cli.EXIT_OK, result.stderr
    assert result.stdout.startswith("usage: gpu-isolator")
    listed = result.stdout.split("positional arguments:", 1)[1]
    missing = [c for c in _commands() if f"\n    {c} " not in listed and f"\n    {c}\n" not in listed]
    assert missing == [], result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("argv", "usage", "names"),
    [
        (["describe"], "usage: gpu-isolator describe", ["container", "--socket", "--output"]),
        (["cdi"], "usage: gpu-isolator cdi", ["generate"]),
        (["config"], "usage: gpu-isolator config", ["check", "default"]),
    ],
)
def test_a_command_missing_its_argument_shows_its_usage_and_choices_and_exits_2(argv, usage, names):
    result = _run(argv, capture_output=True)
    assert result.returncode == cli.EXIT_USAGE
    first, rest = result.stderr.split("\n", 1)
    assert "the following arguments are required" in first
    assert usage in rest and all(n in rest for n in names), result.stderr
    assert result.stdout == ""


def test_other_usage_errors_stay_one_line():
    result = _run(["gpus", "--bogus"], capture_output=True)
    assert result.returncode == cli.EXIT_USAGE
    assert result.stderr.strip().count("\n") == 0, result.stderr


@pytest.mark.parametrize("argv", [["--help"], ["completion", "bash"], ["config", "default"], []])
def test_a_reader_that_went_away_ends_the_command_quietly_with_exit_0(argv):
    read, write = os.pipe()
    os.close(read)  # gone before anything is written, as with `| head -0`
    try:
        result = _run(argv, stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (cli.EXIT_OK, "")


def test_gpus_piped_into_head_ends_quietly(tmp_path):
    # The shell's own pipe: head reads one line and exits while the rest is still being written.
    script = f'{sys.executable} -m isolator completion bash | head -1; echo "${{PIPESTATUS[0]}}"'
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    lines = result.stdout.splitlines()
    assert lines[-1] == "0" and result.stderr == "", result


@pytest.mark.parametrize("command", ADMIN)
def test_every_admin_command_takes_o_json_yaml_wide(command):
    parser = cli.build_parser()
    # An ADMIN_CALLS key is the command and its flags ("undrain --handover"); each takes its arguments.
    sub, *flags = command.split()
    needs = {"describe": ["x"], "release": ["x"], "undrain": ["x"], "drain": ["x", "--reason", "r"]}
    argv = [sub, *needs.get(sub, []), *flags]
    for fmt in OUTPUT_FORMATS:
        args = parser.parse_args([*argv, "-o", fmt])
        assert cli._output_format(args) == fmt
    assert cli._output_format(parser.parse_args([*argv, "--json"])) == "json"
    assert cli._output_format(parser.parse_args(argv)) == ""


def test_json_and_a_different_o_contradict_before_anything_is_sent(short_tmp):
    result = _run(
        ["gpus", "--json", "-o", "yaml", "--socket", os.path.join(short_tmp, "none.sock")], capture_output=True
    )
    assert result.returncode == cli.EXIT_USAGE, result.stderr  # not 3: no socket was tried
    assert "--json and -o yaml contradict" in result.stderr


def test_yaml_carries_the_same_shape_as_json():
    data = {"gpus": [{"index": 0, "uuid": "GPU-1", "memory_total_bytes": "17179869184", "mig_devices": []}]}
    assert yaml.safe_load(cli.formatted("gpus", data, "yaml", now=0.0)) == data
    assert json.loads(cli.formatted("gpus", data, "json", now=0.0)) == data


def test_wide_adds_columns_to_gpus_and_containers():
    gpu = {"index": 0, "minor": 0, "uuid": "GPU-1", "name": "Tesla V100", "cpu_affinity": "0-19,40-59"}
    narrow = cli.formatted("gpus", {"gpus": [gpu]}, "", now=0.0)
    wide = cli.formatted("gpus", {"gpus": [gpu]}, "wide", now=0.0)
    assert "CPU AFFINITY" not in narrow and "CPU AFFINITY" in wide and "0-19,40-59" in wide
    container = {"id": "a", "container_id": {"value": "a"}, "gpu_indices": [1], "gpu_minors": [3]}
    container["gpu_uuids"] = ["GPU-3"]
    data = {"containers": [container]}
    assert "GPU-3" not in cli.formatted("containers", data, "", now=0.0)
    assert "GPU-3" in cli.formatted("containers", data, "wide", now=0.0)


def test_one_container_is_one_container_not_one_containers():
    assert cli.render("audit", {"checked": 1}, now=0.0).startswith("checked 1 container: ")
    assert cli.render("audit", {"checked": 2}, now=0.0).startswith("checked 2 containers: ")
    rig = fake_service("single")
    rig.service.prepare(*_one_gpu("a"))
    checks = {c.name: c.detail for c in rig.service.health()}
    assert checks["state"].endswith("; 1 container"), checks["state"]
    assert ", 1 GPU managed," in checks["nvml"], checks["nvml"]


def _one_gpu(name: str) -> tuple[Any, Any]:
    from isolator.model import ContainerConfig, ContainerId, Resource

    return ContainerId.from_chain([name]), ContainerConfig(resources=(Resource("gpus", 1.0),))


# ---- shell completion -------------------------------------------------------------------------------


def _complete(script: str, words: list[str]) -> list[str]:
    """COMPREPLY for the command line ``words`` (the cursor on the last word), from a real bash."""
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    call = "_gpu_isolator\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n"
    program = f"{script}\nCOMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}\n" + call
    result = subprocess.run(["bash", "--norc", "-c", program], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line]


@pytest.fixture(scope="module")
def script() -> str:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed: the completion script cannot be run")
    result = _run(["completion", "bash"], capture_output=True)
    assert result.returncode == 0, result.stderr
    assert "complete -o default -F _gpu_isolator gpu-isolator" in result.stdout
    return result.stdout


def test_completion_offers_every_command_of_the_parser(script):
    assert sorted(_complete(script, ["gpu-isolator", ""])) == sorted([*_commands(), "--help", "--version", "-h"])
    assert _complete(script, ["gpu-isolator", "desc"]) == ["describe"]


def test_completion_offers_a_commands_flags_and_a_flags_choices(script):
    flags = _complete(script, ["gpu-isolator", "gpus", "--"])
    assert {"--socket", "--json", "--output", "--timeout"} <= set(flags)
    assert sorted(_complete(script, ["gpu-isolator", "gpus", "-o", ""])) == ["json", "wide", "yaml"]
    assert sorted(_complete(script, ["gpu-isolator", "serve", "--mode", ""])) == ["mesos", "standalone"]
    assert _complete(script, ["gpu-isolator", "cdi", "gen"]) == ["generate"]
    assert "--format" in _complete(script, ["gpu-isolator", "cdi", "generate", "--f"])


def test_completion_offers_file_names_where_a_command_takes_a_path_and_flags_after_a_dash(script, tmp_path):
    (tmp_path / "sidecar.toml").write_text("")
    (tmp_path / "sidecar.d").mkdir()
    offered = _complete(script, ["gpu-isolator", "config", "check", str(tmp_path / "side")])
    assert sorted(offered) == [str(tmp_path / "sidecar.d"), str(tmp_path / "sidecar.toml")]
    assert _complete(script, ["gpu-isolator", "config", "check", "--h"]) == ["--help"]


def test_completion_offers_file_names_after_a_flag_that_takes_a_path(script, tmp_path):
    (tmp_path / "isolator.sock").touch()
    offered = _complete(script, ["gpu-isolator", "gpus", "--socket", str(tmp_path / "iso")])
    assert offered == [str(tmp_path / "isolator.sock")]
