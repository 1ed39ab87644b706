"""The wheel as an operator installs it (issue 33, defect 5): built with pip, installed into a fresh
venv, then ``python -m isolator.bridge install DIR --compiled`` builds the compiled bridge from the
shipped bridge.c with gcc, or fails loudly where no compiler is found (never the Python launcher in
its place); and the docs the help texts and the unit's ``Documentation=`` cite exist after install.

Before issue 33 the wheel shipped neither bridge.c nor a binary: ``--compiled`` said "no compiled
bridge was built" and quietly installed the Python launcher; ``Documentation=`` pointed into the
dist-info's METADATA and no docs/ page was installed anywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

import paths
import pytest

ROOT = paths.ROOT
# Every test here shares one wheel and one venv (building them is most of the time).
pytestmark = [pytest.mark.xdist_group("wheel_install")]


@dataclass
class Installed:
    python: str
    bindir: str
    site: str
    cwd: str  # outside the checkout: python -c and -m put the working directory first on sys.path


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    if shutil.which("gcc") is None:
        pytest.skip("[gcc] no gcc on this machine: the compiled bridge cannot be built")
    base = tmp_path_factory.mktemp("wheel")
    wheels = base / "dist"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps"]
    built = subprocess.run(
        [*pip, "--no-build-isolation", "-w", str(wheels), ROOT], capture_output=True, text=True, timeout=300
    )
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = [str(wheels / n) for n in os.listdir(wheels) if n.endswith(".whl")]
    venv = base / "venv"
    # No pip of its own (ensurepip is 3 to 4 s of CPU): this venv's pip installs into it (--python),
    # as the venv's own pip would, into its site-packages and bin/.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    # The dependencies (grpcio, protobuf, ...) from this venv, offline; the package only from the wheel.
    with open(os.path.join(site, "zz_test_dependencies.pth"), "w") as fh:
        fh.write(sysconfig.get_paths()["purelib"] + "\n")
    install = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--disable-pip-version-check"]
    install += ["--no-deps", "--no-index"]
    done = subprocess.run([*install, wheel], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    where = subprocess.run(
        [python, "-c", "import isolator; print(isolator.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(base),
    )
    assert where.stdout.startswith(site), f"isolator comes from {where.stdout!r}, not the wheel: {where.stderr}"
    yield Installed(python, str(venv / "bin"), site, str(base))


def _bridge_install(inst: Installed, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [inst.python, "-m", "isolator.bridge", "install", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=inst.cwd,
    )


def test_install_compiled_from_the_wheel_builds_bridge_c_with_gcc(installed, tmp_path):
    target = str(tmp_path / "bridge")
    result = _bridge_install(installed, target, "--compiled", "--socket", "/run/x/isolator.sock.bridge")
    assert result.returncode == 0, result.stderr
    launcher = os.path.join(target, "gpu-isolator-bridge")
    with open(launcher, "rb") as fh:
        assert fh.read(4) == b"\x7fELF", "the launcher is not a compiled executable"
    with open(os.path.join(target, "gpu-isolator-bridge.conf")) as fh:
        assert "socket=/run/x/isolator.sock.bridge" in fh.read()
    version = subprocess.run(
        [os.path.join(target, "gpu-isolator-prepare"), "--version"], capture_output=True, text=True, timeout=30
    )
    import isolator

    assert version.returncode == 0 and version.stdout.endswith(f" {isolator.__version__}\n"), version


def test_install_compiled_without_a_compiler_fails_loudly_and_installs_nothing(installed, tmp_path):
    target = str(tmp_path / "bridge")
    env = {**os.environ, "PATH": installed.bindir}  # no gcc, no cc on this PATH
    env.pop("CC", None)
    result = _bridge_install(installed, target, "--compiled", env=env)
    assert result.returncode != 0, result.stderr
    assert "--compiled" in result.stderr and "gcc" in result.stderr and "not found" in result.stderr, result.stderr
    assert "Python launcher" in result.stderr  # says how to do without, instead of doing it
    assert not os.path.exists(os.path.join(target, "gpu-isolator-bridge")), "fell back to another launcher"


def _module_command(inst: Installed, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [os.path.join(inst.bindir, "gpu-isolator-module"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=inst.cwd,
    )


def test_the_module_builds_from_the_installed_package_with_its_own_makefile(installed, tmp_path):
    """Issue 44, item 2: the wheel carried neither mesos/ nor modules.json.in. A Mesos install stood in
    by its layout (lib/libmesos-<version>.so, include/mesos): the dry run shows the shipped makefile
    compiling the shipped sources for that version; the real build is docs/deploy.md's (tests/mesos)."""
    sources = _module_command(installed, "sources")
    assert sources.returncode == 0 and sources.stdout.strip().startswith(os.path.dirname(installed.bindir)), sources
    home = tmp_path / "mesos"
    (home / "lib").mkdir(parents=True)
    (home / "lib" / "libmesos-1.12.0.so").write_bytes(b"")
    (home / "include" / "mesos").mkdir(parents=True)
    dry = _module_command(installed, "build", "--mesos-home", str(home), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    for source in ("mesos/gpu_isolator.cpp", "mesos/runtime.cpp", "mesos/module.cpp", "isolator.proto"):
        assert source in dry.stdout, dry.stdout
    assert f"-isystem {home}/include" in dry.stdout and "build/mesos-1.12.0/libgpu_isolator_module.so" in dry.stdout
    missing = _module_command(installed, "build", "--mesos-home", str(tmp_path / "nothing"))
    assert missing.returncode == 1 and "failed to read" in missing.stderr and "nothing/lib" in missing.stderr
    module = str(tmp_path / "libgpu_isolator_module.so")
    conf = _module_command(installed, "modules-json", "--module", module, "--socket", "/run/gpu-isolator/isolator.sock")
    assert conf.returncode == 0, conf.stderr
    import json

    [library] = json.loads(conf.stdout)["libraries"]
    assert library["file"] == module and library["modules"][0]["name"] == "org_gpuisolator_GpuIsolator"
    assert {"key": "socket", "value": "/run/gpu-isolator/isolator.sock"} in library["modules"][0]["parameters"]


def test_the_docs_the_help_texts_and_the_unit_cite_exist_after_install(installed, tmp_path):
    helped = subprocess.run(
        [installed.python, "-m", "isolator", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=installed.cwd,
    )
    assert helped.returncode == 0, helped.stderr
    docs = [word.strip("(),.;'\"") for word in helped.stdout.split() if "docs/" in word and word.endswith(".md")]
    assert docs, "serve --help cites no docs page"
    words = helped.stdout.split()
    assert "documentation:" in words, f"serve --help does not say where the documentation is:\n{helped.stdout[-800:]}"
    root = words[words.index("documentation:") + 1]  # a path is never cut (the help's formatter)
    for page in docs:
        assert os.path.isfile(os.path.join(root, page[page.index("docs/") :])), (root, page)
    assert os.path.isfile(os.path.join(root, "README.md"))

    unit = subprocess.run(
        [
            installed.python,
            "-m",
            "isolator",
            "install-unit",
            "--dir",
            str(tmp_path),
            "--config",
            str(tmp_path / "x.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=installed.cwd,
    )
    assert unit.returncode == 0, unit.stderr
    [name] = [n for n in os.listdir(tmp_path) if n.endswith(".service")]
    with open(tmp_path / name) as fh:
        [doc] = [line.split("=", 1)[1].strip() for line in fh if line.startswith("Documentation=")]
    path = unquote(urlparse(doc).path)
    assert doc.startswith("file://") and os.path.isfile(path) and ".dist-info" not in path, doc
    assert path.endswith("README.md"), doc


def test_the_install_time_flags_are_the_makefiles_less_werror():
    """One set of warnings and hardening flags for the compiled bridge, wherever it is built."""
    import re

    from isolator.bridge.build import CFLAGS

    with open(os.path.join(ROOT, "Makefile")) as fh:
        text = fh.read().replace("\\\n", " ")
    [line] = re.findall(r"^CFLAGS_BRIDGE := (.*)$", text, re.M)
    makefile = [flag for flag in line.split() if flag != "-Werror" and not flag.startswith("-DBRIDGE_VERSION")]
    assert makefile == CFLAGS
