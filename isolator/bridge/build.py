"""Building the compiled bridge (bridge.c, shipped in the package) with the machine's C compiler,
for ``python -m isolator.bridge install DIR --compiled``. It builds or fails with the reason; it never
chooses another launcher (the caller asked for this one)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess

from isolator import __version__

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bridge.c")
# The Makefile's CFLAGS_BRIDGE less -Werror (a newer compiler's new warning must not stop an install;
# `make build` keeps it for us) and the version define; tests/system/test_wheel_install.py keeps them equal.
CFLAGS = [
    "-std=c11",
    "-O2",
    "-g",
    "-Wall",
    "-Wextra",
    "-Wpedantic",
    "-Wshadow",
    "-Wconversion",
    "-Wformat=2",
    "-Wstrict-prototypes",
    "-Wmissing-prototypes",
    "-Wundef",
    "-Wcast-qual",
    "-Wwrite-strings",
    "-fstack-protector-strong",
    "-D_FORTIFY_SOURCE=2",
]


class BuildError(Exception):
    """The compiled bridge cannot be built here: no compiler, no source, or the compiler failed."""


def compiler(environ: dict[str, str] | None = None) -> list[str]:
    """``$CC`` split as a shell would (a bare name or a path, with its own arguments as make takes
    them: ``CC="ccache gcc"``, ``CC="gcc -m64"``), else gcc; its program found on ``$PATH``."""
    env = os.environ if environ is None else environ
    text = env.get("CC", "").strip() or "gcc"
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise BuildError(f"CC={text!r} cannot be split into words: {exc}") from None
    if not words:
        words = ["gcc"]
    found = shutil.which(words[0], path=env.get("PATH", os.defpath))
    if found is None:
        raise BuildError(f"the C compiler '{words[0]}' was not found on PATH (install gcc, or set CC)")
    return [found, *words[1:]]


def build(output: str, environ: dict[str, str] | None = None) -> str:
    """Compile bridge.c into ``output`` (written whole or not at all); returns the compiler used (its
    command line)."""
    if not os.path.isfile(SOURCE):
        raise BuildError(f"the bridge's source '{SOURCE}' is not installed with this package")
    command = compiler(environ)
    cc = " ".join(command)
    partial = f"{output}.tmp{os.getpid()}"
    argv = [*command, *CFLAGS, f'-DBRIDGE_VERSION="{__version__}"', "-o", partial, SOURCE]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=environ)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"failed to run '{cc}': {exc}") from exc
    if result.returncode != 0:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BuildError(f"'{cc}' failed to build '{SOURCE}' (exit {result.returncode}): {last}")
    os.replace(partial, output)
    return cc
