#!/usr/bin/env python3
"""Per-call cost of the command-module bridge, against the bare interpreter it runs on.

The agent forks one bridge per isolator call, so what matters is the wall time of a whole call:
interpreter start, IN -> sidecar -> OUT, exit. ``measure`` runs a real sidecar in-process (with a
service that answers prepare at once, so the figure is the bridge's own cost) and returns medians.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from isolator.bridge import command as bridge
from isolator.model import ContainerConfig, ContainerId, LaunchInfo
from isolator.testing import StubService
from isolator.transport.server import SidecarServer
from isolator.transport.settings import ServerSettings

PREPARE_INPUT = {
    "container_id": {"value": "bench"},
    "container_config": {
        "resources": [{"name": "gpus", "type": "SCALAR", "scalar": {"value": 1}, "role": "*"}],
        "command_info": {"shell": True, "value": "true"},
        "directory": "/tmp",
    },
}

# How pip writes a console script: the venv's interpreter with site enabled.
CONSOLE_SCRIPT = """\
#!{python}
import sys
from isolator.bridge.command import main
sys.exit(main(socket_path={socket!r}))
"""


class _InstantService(StubService):
    def prepare(self, container_id: ContainerId, config: ContainerConfig) -> LaunchInfo | None:
        return LaunchInfo(environment=(("NVIDIA_VISIBLE_DEVICES", "0"),))


def _median_wall(argv: list[str], calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True)
        times.append(time.perf_counter() - started)
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited {result.returncode}: {result.stderr!r}")
    return statistics.median(times)


def measure(calls: int = 50) -> dict[str, Any]:
    """Median seconds per call: the bridge's prepare, `python3 -I -S -c pass`, and a console script."""
    tmp = tempfile.mkdtemp(prefix="gi-bench-", dir="/tmp")
    server = SidecarServer(ServerSettings(socket=os.path.join(tmp, "s.sock")), _InstantService())
    server.start()
    try:
        paths = bridge.install(os.path.join(tmp, "bin"), socket_path=server.settings.bridge_path)
        console_dir = os.path.join(tmp, "console")
        os.mkdir(console_dir)
        console = os.path.join(console_dir, "gpu-isolator-prepare")
        with open(console, "w") as fh:
            fh.write(CONSOLE_SCRIPT.format(python=sys.executable, socket=server.settings.bridge_path))
        os.chmod(console, 0o755)
        files = [os.path.join(tmp, name) for name in ("in", "out", "err")]
        with open(files[0], "w") as fh:
            json.dump(PREPARE_INPUT, fh)
        bridge_argv = [paths[1], *files]  # gpu-isolator-prepare
        _median_wall(bridge_argv, 3)  # warm the bytecode caches
        bare = _median_wall([sys.executable, "-I", "-S", "-c", "pass"], calls)
        bridged = _median_wall(bridge_argv, calls)
        console_s = _median_wall([console, *files], calls)
        # The compiled bridge (isolator/bridge/bridge.c), where `make build` made one.
        compiled = bridge.compiled_bridge()
        compiled_s = None
        if compiled is not None:
            c_paths = bridge.install(
                os.path.join(tmp, "bin-c"), socket_path=server.settings.bridge_path, compiled=compiled
            )
            compiled_s = _median_wall([c_paths[1], *files], calls)
    finally:
        server.stop(grace=0)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "calls": calls,
        "bare_interpreter_s": bare,
        "bridge_prepare_s": bridged,
        "bridge_over_bare": bridged / bare,
        "console_script_prepare_s": console_s,
        **({"compiled_prepare_s": compiled_s} if compiled_s is not None else {}),
    }


def main() -> int:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    print(json.dumps(measure(calls), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
