"""Test helpers for device isolation: throwaway cgroups and a child process that reports open() errnos.

The child is forked once and stays alive, so a test can move it into a cgroup, change the rules,
and ask it again; the test runner itself never joins a test cgroup.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator

from isolator.cgroups.detect import read_mounts

TEST_PARENT = "gpu-isolator-test"


def unique_name(tag: str) -> str:
    return f"{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


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


def hierarchy_mounts() -> tuple[str | None, str | None]:
    mounts = read_mounts("/proc/self/mounts")
    return mounts.v1_devices, mounts.v2


def _kill_all(cgroup: str) -> None:
    for root, _dirs, _files in os.walk(cgroup):
        with contextlib.suppress(OSError), open(os.path.join(root, "cgroup.procs")) as fh:
            for line in fh:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(line), signal.SIGKILL)


def remove_cgroup_tree(cgroup: str) -> None:
    """Kill what is left inside, then rmdir bottom-up (cgroup dirs hold only kernel files)."""
    if not os.path.isdir(cgroup):
        return
    _kill_all(cgroup)
    for _ in range(50):
        try:
            for root, dirs, _files in os.walk(cgroup, topdown=False):
                for name in dirs:
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir(os.path.join(root, name))
            os.rmdir(cgroup)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            time.sleep(0.05)  # killed processes leave the cgroup asynchronously
    raise RuntimeError(f"could not remove test cgroup {cgroup}")


@contextlib.contextmanager
def scratch_cgroups_root(mount: str, tag: str) -> Iterator[str]:
    """``<mount>/gpu-isolator-test/<unique>``, removed (with everything below) however the test ends.

    Yields the path relative to the mount, to be used as ``cgroups_root``.
    """
    relative = os.path.join(TEST_PARENT, unique_name(tag))
    path = os.path.join(mount, relative)
    os.makedirs(path)
    try:
        yield relative
    finally:
        remove_cgroup_tree(path)
