"""Test helpers for device isolation: a child process that reports open() errnos, and the throwaway
cgroups of isolator/testing/cgroupfs.py.

The child is forked once and stays alive, so a test can move it into a cgroup, change the rules,
and ask it again; the test runner itself never joins a test cgroup.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal

from isolator.testing.cgroupfs import hierarchy_mounts, scratch_cgroups_root

__all__ = ["Prober", "hierarchy_mounts", "scratch_cgroups_root"]


class Prober:
    """A forked child that opens paths on request and answers with errno names ('OK' on success)."""

    def __init__(self) -> None:
        cmd_r, self._cmd_w = os.pipe()
        self._reply_r, reply_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: no pytest machinery from here on, and never return
            try:
                os.close(self._cmd_w)
                os.close(self._reply_r)
                _serve(cmd_r, reply_w)
            finally:
                os._exit(0)
        os.close(cmd_r)
        os.close(reply_w)
        self.pid = pid
        self._reader = os.fdopen(self._reply_r, "r")

    def open_errnos(self, paths: list[str], flags: int = os.O_RDWR) -> dict[str, str]:
        os.write(self._cmd_w, (json.dumps({"paths": paths, "flags": flags}) + "\n").encode())
        line = self._reader.readline()
        if not line:
            raise RuntimeError("the probe child died")
        return dict(json.loads(line))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._cmd_w)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self._reader.close()


def _serve(cmd_r: int, reply_w: int) -> None:
    with os.fdopen(cmd_r, "r") as commands:
        for line in commands:
            request = json.loads(line)
            result = {}
            for path in request["paths"]:
                try:
                    os.close(os.open(path, request["flags"]))
                    result[path] = "OK"
                except OSError as exc:
                    result[path] = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            os.write(reply_w, (json.dumps(result) + "\n").encode())
