"""Packaging: the wheel `make dist` builds carries the license, the systemd unit, the alert rules and
dashboard, the simulated hosts and the bridge executables, and building it warns about no package data."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import paths

ROOT = paths.ROOT


def test_the_wheel_holds_license_unit_hosts_and_bridge_executables(tmp_path):
    pip = [sys.executable, "-m", "pip", "wheel", "-v", "--disable-pip-version-check", "--no-deps"]
    result = subprocess.run(
        [*pip, "--no-build-isolation", "-w", str(tmp_path), ROOT],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "absent from the `packages` configuration" not in output, "package data outside any package"
    [wheel] = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    with zipfile.ZipFile(tmp_path / wheel) as z:
        names = set(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert f"{info}/licenses/LICENSE" in names
    assert "License: Apache-2.0" in metadata or "License-Expression: Apache-2.0" in metadata
    assert "isolator/data/gpu-isolator.service" in names
    # The operator's alert rules and dashboard (docs/operations.md) ship with the package.
    assert {"isolator/data/prometheus-rules.yml", "isolator/data/grafana-dashboard.json"} <= names
    assert "isolator/simhost/hosts/dgx-1.toml" in names and "isolator/simhost/fakenvml.c" in names
    for method in ("bridge", "prepare", "isolate", "watch", "usage", "cleanup"):
        assert f"gpu-isolator-{method} = isolator.bridge.command:main" in entry_points
    # What building our Mesos module needs (issue 44, item 2), and the command that builds it.
    data = f"{info.removesuffix('.dist-info')}.data/data/share/gpu-isolator"
    shipped = {n.removeprefix(data + "/") for n in names if n.startswith(data + "/")}
    module_sources = {f"mesos/{n}" for n in os.listdir(os.path.join(ROOT, "mesos")) if n.endswith((".cpp", ".hpp"))}
    needed = {"mesos/module.mk", "mesos/modules.json.in", "proto/gpuisolator/v1/isolator.proto"} | module_sources
    assert needed <= shipped, sorted(needed - shipped)
    assert "gpu-isolator-module = isolator.bridge.module:main" in entry_points
    assert not any("__pycache__" in n or n.startswith("tests/") for n in names)


def test_the_installed_bridge_console_scripts_run():
    bindir = os.path.dirname(sys.executable)
    prepare = os.path.join(bindir, "gpu-isolator-prepare")
    assert os.access(prepare, os.X_OK), "reinstall the package (make install) to get the console scripts"
    result = subprocess.run([prepare, "--version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.startswith("gpu-isolator-prepare ")  # names itself (issue 26)
    wrong = subprocess.run([prepare, "only-one-argument"], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "usage: gpu-isolator-<method> IN OUT ERR" in wrong.stderr


def test_make_test_gpu_fails_without_a_gpu_unless_skipping_is_allowed():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from gpu_present import gpu_count
    finally:
        sys.path.pop(0)
    if gpu_count()[0]:
        import pytest

        pytest.skip("this machine has a GPU: make test-gpu runs the suite for real")
    env = {k: v for k, v in os.environ.items() if k != "ALLOW_NO_GPU"}
    make = [
        "make",
        "-s",
        "-C",
        ROOT,
        f"PYTHON={sys.executable}",
        f"VENV={os.path.dirname(os.path.dirname(sys.executable))}",
    ]
    refused = subprocess.run([*make, "test-gpu"], capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode != 0
    assert "make test-gpu: no NVIDIA GPU on this machine" in refused.stderr and "ALLOW_NO_GPU=1" in refused.stderr
    allowed = subprocess.run(
        # The GPU tests' own file: the target's exit status is what is tested, not collecting the whole suite.
        [*make, "test-gpu", "ALLOW_NO_GPU=1", "PYTEST_ARGS=-q -p no:cacheprovider tests/system/test_gpu_host.py"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert allowed.returncode == 0, allowed.stdout[-2000:] + allowed.stderr[-2000:]
    assert "skipped" in allowed.stdout


def test_every_relative_link_in_the_docs_points_inside_the_repository():
    import re

    pages = ["README.md"] + [
        os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")
    ]
    bad = []
    for page in pages:
        with open(os.path.join(ROOT, page)) as fh:
            text = fh.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target.split("#")[0]))
            if not path.startswith(ROOT + os.sep) or not os.path.exists(path):
                bad.append(f"{page}: {target}")
    assert not bad, bad


def _module_deps(tmp_path, *make_args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """``make -f mesos/module.mk module-deps`` with an apt-get on PATH that only records its calls."""
    calls = tmp_path / "apt-get.calls"
    fake = tmp_path / "bin" / "apt-get"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'case " $* " in *" -s "*) for p; do case $p in -*|install) ;;\n'
        '  *) echo "Inst $p (1.0 fake)";; esac; done;; esac\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    result = subprocess.run(
        # MESOS_HOME set: the makefile does not look for ../shared/mesos.
        ["make", "--no-print-directory", "-f", "mesos/module.mk", "module-deps", "MESOS_HOME=/nonexistent",
         "MODULE_BUILD_DEPS=gpu-isolator-absent-package", *make_args],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
    )  # fmt: skip
    return result, calls.read_text() if calls.exists() else ""


def test_make_module_names_a_missing_build_dependency_and_stops_without_touching_the_host(tmp_path):
    """Issue 44, item 2: `make module` ran apt-get and upgraded curl and libcurl without saying so."""
    result, calls = _module_deps(tmp_path)
    assert result.returncode != 0
    assert "gpu-isolator-absent-package" in result.stderr and "MODULE_INSTALL_DEPS=1" in result.stderr
    assert calls == "", f"apt-get ran unasked: {calls}"


def test_make_module_installs_only_what_it_named_when_asked_and_says_what_it_did(tmp_path):
    result, calls = _module_deps(tmp_path, "MODULE_INSTALL_DEPS=1")
    assert result.returncode == 0, result.stderr
    installs = [line.split() for line in calls.splitlines() if "install" in line.split()]
    assert installs and all(words[-1] == "gpu-isolator-absent-package" for words in installs), calls
    assert "plan" in result.stderr and "gpu-isolator-absent-package (1.0 fake)" in result.stderr
    assert "installed gpu-isolator-absent-package" in result.stderr
