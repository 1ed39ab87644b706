"""Our Mesos module (mesos/) built from what this package installed, against a given Mesos:
``gpu-isolator-module build --mesos-home DIR --out FILE``. It copies the shipped sources into a build
directory and runs their own makefile (mesos/module.mk) there; it never installs anything on the host
(the makefile names a missing build dependency and stops).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence

SHARE_SUBDIR = "share/gpu-isolator"  # setup.cfg [options.data_files]: mesos/ and proto/ below it
MODULE_FILE = "libgpu_isolator_module.so"
# What the makefile reads, relative to the directory it runs in (the checkout's layout).
SOURCES = ("mesos", "proto")


class ModuleBuildError(Exception):
    """The module cannot be built here: no sources, no Mesos, or the build failed (its reason)."""


def sources_dir() -> str:
    """Where ``mesos/`` and ``proto/`` are: the checkout beside the package (a clone, an editable
    install), else what the wheel installed under ``<prefix>/share/gpu-isolator`` (found in the
    installed files' record, whatever the install scheme)."""
    from importlib import metadata

    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(checkout, "mesos", "module.mk")):
        return checkout
    try:
        for f in metadata.distribution("gpu-isolator").files or ():
            if str(f).replace(os.sep, "/").endswith(f"{SHARE_SUBDIR}/mesos/module.mk"):
                return os.path.dirname(os.path.dirname(os.path.abspath(str(f.locate()))))
    except metadata.PackageNotFoundError:
        pass
    return os.path.join(sysconfig.get_paths()["data"], SHARE_SUBDIR)


def mesos_version(mesos_home: str) -> str:
    """The version of ``mesos_home``'s libmesos (``lib/libmesos-<version>.so``), as make module reads it."""
    lib = os.path.join(mesos_home, "lib")
    try:
        names = os.listdir(lib)
    except OSError as exc:
        raise ModuleBuildError(f"failed to read '{lib}': {exc.strerror or exc}") from exc
    versions = [n[len("libmesos-") : -len(".so")] for n in names if n.startswith("libmesos-") and n.endswith(".so")]
    if len(versions) != 1:
        raise ModuleBuildError(
            f"'{lib}' holds {len(versions)} libmesos-<version>.so (expected one): not a Mesos install"
        )
    if not os.path.isdir(os.path.join(mesos_home, "include", "mesos")):
        raise ModuleBuildError(f"'{mesos_home}/include/mesos' is missing: the Mesos headers are needed to build")
    return versions[0]


def build(mesos_home: str, output: str, build_dir: str | None = None, dry_run: bool = False) -> str:
    """Build the module for ``mesos_home`` into ``output`` (written whole or not at all); returns the
    Mesos version. ``build_dir``: where to copy the sources and compile (default: a temporary one,
    removed after); ``dry_run``: print the makefile's commands only (``make -n``)."""
    src = sources_dir()
    for name in SOURCES:
        if not os.path.isdir(os.path.join(src, name)):
            raise ModuleBuildError(
                f"the module's sources '{os.path.join(src, name)}' are not installed with this package"
            )
    home = os.path.abspath(mesos_home)
    version = mesos_version(home)
    if shutil.which("make") is None:
        raise ModuleBuildError("'make' was not found on PATH (install make)")
    work = build_dir or tempfile.mkdtemp(prefix="gpu-isolator-module-")
    try:
        for name in SOURCES:
            shutil.copytree(os.path.join(src, name), os.path.join(work, name), dirs_exist_ok=True)
        argv = ["make", "--no-print-directory", "-f", "mesos/module.mk", *(["-n"] if dry_run else []), "module"]
        result = subprocess.run([*argv, f"MESOS_HOME={home}"], cwd=work, check=False)
        if result.returncode != 0:
            raise ModuleBuildError(
                f"'{' '.join(argv)} MESOS_HOME={home}' failed in '{work}' (exit {result.returncode})"
            )
        if dry_run:
            return version
        built = os.path.join(work, "build", f"mesos-{version}", MODULE_FILE)
        partial = f"{output}.tmp{os.getpid()}"
        try:
            shutil.copyfile(built, partial)
            os.chmod(partial, 0o755)
            os.replace(partial, output)
        except OSError as exc:
            if os.path.exists(partial):
                os.unlink(partial)
            raise ModuleBuildError(f"failed to write '{output}': {exc.strerror or exc}") from exc
    finally:
        if build_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return version


def modules_json(module: str, socket: str) -> str:
    """The agent's ``--modules`` file for ``module`` (the built .so) and the sidecar's ``socket``, from
    the shipped template (mesos/modules.json.in)."""
    path = os.path.join(sources_dir(), "mesos", "modules.json.in")
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as exc:
        raise ModuleBuildError(f"failed to read '{path}': {exc.strerror or exc}") from exc
    return text.replace("@MODULE@", os.path.abspath(module)).replace("@SOCKET@", socket)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpu-isolator-module",
        description="Build our Mesos isolator module from this package's sources (docs/deploy.md).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the module against a Mesos install (its headers and libmesos)")
    b.add_argument("--mesos-home", required=True, help="the Mesos install: lib/libmesos-<version>.so, include/")
    b.add_argument("--out", default=MODULE_FILE, help=f"where to write the module (default ./{MODULE_FILE})")
    b.add_argument("--build-dir", help="where to compile (default: a temporary directory, removed after)")
    b.add_argument("--dry-run", action="store_true", help="print the build's commands only")
    j = sub.add_parser("modules-json", help="print the agent's --modules file for the built module")
    j.add_argument("--module", required=True, help="the built module (an absolute path goes in the file)")
    j.add_argument("--socket", required=True, help="the sidecar's gRPC socket (its --socket)")
    sub.add_parser("sources", help="print where the module's sources are")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            version = build(args.mesos_home, args.out, args.build_dir, args.dry_run)
            if not args.dry_run:
                print(f"built {os.path.abspath(args.out)} for Mesos {version}")
        elif args.command == "modules-json":
            sys.stdout.write(modules_json(args.module, args.socket))
        else:
            print(sources_dir())
    except ModuleBuildError as exc:
        print(f"gpu-isolator-module: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
