"""Run inside a Mesos task: what this container can open, and what it was given.

``python3 probe.py DEVDIR [SECONDS [PATH,...]]`` prints one ``dev <name> <ok|EPERM|ENXIO|...>`` line per
``DEVDIR/nvidia*`` node (ENXIO: the device cgroup let the open through and the missing driver
refused it; EPERM: the device cgroup refused it), one ``env NAME=VALUE`` line per NVIDIA_*/CUDA_*
variable, ``cgroup <path>`` (its v1 devices cgroup), ``cgroup2 <path>`` (its cgroup2 one),
``probed``, then sleeps SECONDS (default 0) so that the task keeps its GPUs; ``start``/``end``
lines carry the wall-clock times around all that.
"""

import errno
import os
import sys
import time

print(f"start {time.time():.3f}", flush=True)

devdir = sys.argv[1]
for name in sorted(os.listdir(devdir)):
    if not name.startswith("nvidia"):
        continue
    path = os.path.join(devdir, name)
    if os.path.isdir(path):
        continue
    try:
        os.close(os.open(path, os.O_RDWR))
        result = "ok"
    except OSError as exc:
        result = errno.errorcode.get(exc.errno, str(exc.errno))
    print(f"dev {name} {result}")
# Other nodes to try (the agent's default whitelist, and beyond it): ``path <path> <result>``.
for path in filter(None, (sys.argv[3] if len(sys.argv) > 3 else "").split(",")):
    try:
        os.close(os.open(path, os.O_RDWR))
        result = "ok"
    except OSError as exc:
        result = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    print(f"path {path} {result}")
for key, value in sorted(os.environ.items()):
    if key.startswith(("NVIDIA_", "CUDA_")):
        print(f"env {key}={value}")
with open("/proc/self/cgroup") as fh:
    for line in fh:
        _, controllers, path = line.rstrip("\n").split(":", 2)
        if "devices" in controllers.split(","):
            print(f"cgroup {path}")
        elif _ == "0" and not controllers:
            print(f"cgroup2 {path}")
print("probed", flush=True)
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
print(f"end {time.time():.3f}", flush=True)
