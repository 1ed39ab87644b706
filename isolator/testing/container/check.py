"""Runs inside the container: reports what the container sees, as JSON on stdout (stdlib only).

argv: DEVICE_PATH... — each is opened read-write and the errno reported (0 = opened).
With GI_CHECK_GPU=1 in the environment it also runs ``nvidia-smi -L`` and counts CUDA devices
through the driver API (cuInit, cuDeviceGetCount), for the real-GPU suite.
"""

import ctypes
import errno
import json
import os
import subprocess
import sys


def try_open(path):
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    os.close(fd)
    return "OK"


def writable(path):
    try:
        fd = os.open(os.path.join(path, ".probe"), os.O_CREAT | os.O_WRONLY, 0o600)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    os.close(fd)
    os.unlink(os.path.join(path, ".probe"))
    return "OK"


def cuda_device_count():
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"no libcuda: {exc}"
    rc = cuda.cuInit(0)
    if rc != 0:
        return f"cuInit failed: {rc}"
    count = ctypes.c_int(0)
    rc = cuda.cuDeviceGetCount(ctypes.byref(count))
    return count.value if rc == 0 else f"cuDeviceGetCount failed: {rc}"


def nvidia_smi():
    try:
        result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        return {"returncode": None, "stdout": "", "stderr": str(exc)}
    return {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}


report = {
    "env": {k: os.environ.get(k) for k in ("PATH", "LD_LIBRARY_PATH", "NVIDIA_VISIBLE_DEVICES")},
    "opens": {p: try_open(p) for p in sys.argv[1:]},
    "nvidia_dir": sorted(os.listdir("/usr/local/nvidia")) if os.path.isdir("/usr/local/nvidia") else None,
    "nvidia_bin": sorted(os.listdir("/usr/local/nvidia/bin")) if os.path.isdir("/usr/local/nvidia/bin") else None,
    "nvidia_lib64": sorted(os.listdir("/usr/local/nvidia/lib64")) if os.path.isdir("/usr/local/nvidia/lib64") else None,
    "nvidia_writable": writable("/usr/local/nvidia") if os.path.isdir("/usr/local/nvidia") else None,
    "dev": sorted(os.listdir("/dev")),
}
if os.environ.get("GI_CHECK_GPU") == "1":
    report["nvidia_smi"] = nvidia_smi()
    report["cuda_devices"] = cuda_device_count()
json.dump(report, sys.stdout)
