#!/usr/bin/env python3
"""`make demo`: the sidecar on a simulated DGX-1, driven the way a Mesos agent drives it.

It starts `gpu-isolator serve --simulate dgx-1 --mode standalone`, launches two containers through
the conformance harness (one with 2 GPUs, one with 0) — each a real process in a real devices
cgroup, inside a small rootfs in its own mount namespace — shows what each can open and what the
admin CLI says, cleans up and stops the sidecar. Everything it makes is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from isolator.testing.mesos import Containerizer, GrpcIsolator, Launched, container_id
from isolator.testing.sidecar import cgroup_mount, running_sidecar

BOLD, DIM, RESET = ("\033[1m", "\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "", "")
DEMO_PARENT = "gpu-isolator-demo"


def step(text: str) -> None:
    print(f"\n{BOLD}== {text}{RESET}", flush=True)


def cli(sock: str, *argv: str) -> None:
    print(f"{DIM}$ gpu-isolator {' '.join(argv)}{RESET}", flush=True)
    subprocess.run([sys.executable, "-m", "isolator", *argv, "--socket", sock], check=False)


def serve_line(argv: list[str]) -> str:
    """The daemon's command line as an operator types it (``python -m isolator`` is ``gpu-isolator``)."""
    assert argv[1:3] == ["-m", "isolator"], argv
    return "$ gpu-isolator " + " ".join(shlex.quote(word) for word in argv[3:])


def explain(errno_name: str) -> str:
    return {
        "ENXIO": "opens (past the cgroup; no driver behind a simulated node)",
        "EPERM": "denied by the devices cgroup",
        "ENOENT": "not in the container's /dev",
        "OK": "opens",
    }.get(errno_name, errno_name)


def show(name: str, launched: Launched) -> None:
    report = launched.report
    print(f"{BOLD}{name}{RESET}: exit {launched.exit_code}")
    if launched.exit_code != 0:
        print(launched.stderr)
        return
    for path, result in report["opens"].items():
        shown = path if path.startswith("/dev/") else "host " + path.split("/simhost")[-1]
        print(f"  {shown:<22} {explain(result)}")
    print(f"  /usr/local/nvidia/bin  {report['nvidia_bin']}")
    print(f"  volume writable?       {report['nvidia_writable'] or 'no volume'}")
    print(f"  LD_LIBRARY_PATH        {report['env']['LD_LIBRARY_PATH']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="dgx-1", help="simulated host (isolator/simhost/hosts/)")
    parser.add_argument("--cgroup-version", default="v1", choices=("v1", "v2"))
    opts = parser.parse_args()
    if os.geteuid() != 0:
        print("make demo needs root: it creates devices cgroups, device nodes and mount namespaces.")
        return 1
    work = tempfile.mkdtemp(prefix="gi-demo-", dir="/tmp")
    try:
        step(f"start the sidecar on a simulated {opts.host} (cgroup {opts.cgroup_version}, standalone mode)")
        with running_sidecar(opts.host, opts.cgroup_version, work=work, parent=DEMO_PARENT) as sidecar:
            print(f"{DIM}{serve_line(sidecar.argv())}{RESET}", flush=True)
            cli(sidecar.socket, "gpus")
            cli(sidecar.socket, "topology")

            isolator = GrpcIsolator(sidecar.socket)
            containerizer = Containerizer(isolator, work)
            containerizer.recover()
            step(
                "prepare containers as a Mesos agent would: image containers 'train' (2 GPUs) and 'etl' "
                "(0 GPUs), and 'batch' (1 GPU) on the host filesystem, where only the cgroup stands guard"
            )
            image_paths = [f"/dev/nvidia{i}" for i in range(8)] + ["/dev/nvidiactl", "/dev/null"]
            host_paths = [f"{sidecar.dev_root}/nvidia{i}" for i in range(8)]
            runs = {}
            for name, gpus, image in (("train", 2, True), ("etl", 0, True), ("batch", 1, False)):
                cid = container_id(name)
                config = containerizer.config(gpus=gpus, image=image)
                runs[name] = (cid, config, Launched(cid, isolator.prepare(cid, config)), image)
            cli(sidecar.socket, "containers")
            cli(sidecar.socket, "gpus")

            step("run each container: isolate its pid, exec a program that tries to open every GPU")
            for name, (_cid, config, launched, image) in runs.items():
                containerizer.run(launched, config, image_paths if image else host_paths)
                show(name, launched)

            step("clean up, as the agent does when the containers end")
            for cid, *_rest in runs.values():
                isolator.cleanup(cid)
            cli(sidecar.socket, "containers")
            isolator.close()
            step("stop the sidecar (SIGTERM)")
        print("stopped; nothing of ours is left in the cgroup hierarchy or under", work)
        print(
            "\nUnder a Mesos agent, load our own isolator module: docs/deploy.md, step by step;"
            "\nor, with no build of ours, criteo's command module running the bridge (docs/mesos-agent.md)."
        )
        return 0
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            os.rmdir(os.path.join(cgroup_mount(opts.cgroup_version), DEMO_PARENT))
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
