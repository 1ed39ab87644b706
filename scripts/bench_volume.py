#!/usr/bin/env python3
"""Benchmark of the driver volume on the simulated driver root: cold builds (link and copy) and a warm check.

``bench(repeats)`` returns a dict of medians in milliseconds plus the files and bytes that went in;
``make bench`` calls it. The copy path needs a second filesystem, so it mounts a tmpfs (root only)
and is reported as None otherwise.
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
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from isolator.simhost.driver import build_driver_root
from volumes.build import VolumeBuilder
from volumes.discover import Discoverer
from volumes.manager import VolumeManager
from volumes.plan import plan_volume


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(samples), 3)


def bench(repeats: int = 5) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="gi-bench-volume-")
    mounted = False
    try:
        info = build_driver_root(os.path.join(tmp, "driver"))
        discoverer = Discoverer(info.root, path=info.path)

        def cold(root: str) -> Callable[[], Any]:
            def run() -> Any:
                shutil.rmtree(root, ignore_errors=True)
                # A cold build includes discovery and planning, as the first prepare after an upgrade does.
                return VolumeManager(root, info.root, path=info.path).ensure(info.version)

            return run

        link_root = os.path.join(tmp, "volumes")
        out: dict[str, Any] = {"driver_version": info.version}
        out["discover_and_plan_ms"] = _median_ms(lambda: plan_volume(discoverer.discover(), info.version), repeats)
        out["cold_link_ms"] = _median_ms(cold(link_root), repeats)
        manifest = VolumeBuilder(link_root).existing(info.version) or {}
        out["files"] = len(manifest.get("files", []))
        out["links"] = len(manifest.get("links", []))
        out["bytes"] = manifest.get("bytes", 0)
        out["warm_check_ms"] = _median_ms(lambda: VolumeManager(link_root, info.root).ensure(info.version), repeats * 4)
        out["cold_copy_ms"] = None
        if os.geteuid() == 0:
            copy_mnt = os.path.join(tmp, "tmpfs")
            os.makedirs(copy_mnt)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", copy_mnt], check=True)
            mounted = True
            copy_root = os.path.join(copy_mnt, "volumes")
            out["cold_copy_ms"] = _median_ms(cold(copy_root), repeats)
            out["copy_mode"] = (VolumeBuilder(copy_root).existing(info.version) or {}).get("mode")
        return out
    finally:
        if mounted:
            subprocess.run(["umount", os.path.join(tmp, "tmpfs")], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(bench(int(sys.argv[1]) if len(sys.argv) > 1 else 5), indent=2))
