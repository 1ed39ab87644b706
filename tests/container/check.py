"""Runs inside the container: reports what the container sees, as JSON on stdout (stdlib only).

argv: DEVICE_PATH... — each is opened read-write and the errno reported (0 = opened).
"""

import errno
import json
import os
import sys


def try_open(path):
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    os.close(fd)
    return "OK"


def writable(path):
    try:
        fd = os.open(os.path.join(path, ".probe"), os.O_CREAT | os.O_WRONLY, 0o600)
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    os.close(fd)
    os.unlink(os.path.join(path, ".probe"))
    return "OK"


report = {
    "env": {k: os.environ.get(k) for k in ("PATH", "LD_LIBRARY_PATH", "NVIDIA_VISIBLE_DEVICES")},
    "opens": {p: try_open(p) for p in sys.argv[1:]},
    "nvidia_dir": sorted(os.listdir("/usr/local/nvidia")) if os.path.isdir("/usr/local/nvidia") else None,
    "nvidia_bin": sorted(os.listdir("/usr/local/nvidia/bin")) if os.path.isdir("/usr/local/nvidia/bin") else None,
    "nvidia_lib64": sorted(os.listdir("/usr/local/nvidia/lib64")) if os.path.isdir("/usr/local/nvidia/lib64") else None,
    "nvidia_writable": writable("/usr/local/nvidia") if os.path.isdir("/usr/local/nvidia") else None,
    "dev": sorted(os.listdir("/dev")),
}
json.dump(report, sys.stdout)
