"""Issue 44, a new operator's try of the CLI: what each of its items asked, as tests that failed on
the code before (offline commands leave nothing behind, the bridge executables name themselves, ...).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from isolator import __version__
from isolator.bridge import command as bridge

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
