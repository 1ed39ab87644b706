"""A one-layer image of Debian's ``busybox-static`` in ``docker save`` layout, for Mesos's local
Docker registry (``--docker_registry=<dir>`` holding ``<name>.tar``): what the image scenarios of
``make test-mesos`` and ``make test-node`` run their tasks in."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterable, Mapping

BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "ls", "cat", "grep", "echo", "touch", "env", "test", "[", "sleep")
DIRS = ("bin", "dev", "proc", "sys", "tmp", "etc", "usr", "usr/local")


def busybox_image(
    path: str, name: str, labels: Mapping[str, str], *, dirs: Iterable[str] = DIRS, applets: Iterable[str] = APPLETS
) -> None:
    """Write the image ``name`` (tag ``latest``) to ``path``: ``dirs`` (``tmp`` 1777, the rest 0755),
    busybox at /bin/busybox with a link per applet, and ``labels`` in its config (e.g. the NVIDIA
    driver volume's ``com.nvidia.volumes.needed``)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(BUSYBOX, arcname="bin/busybox")
        for applet in applets:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    data = layer.getvalue()
    layer_id = hashlib.sha256(data + json.dumps(dict(labels), sort_keys=True).encode()).hexdigest()
    config = {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "Cmd": ["/bin/sh"], "Labels": dict(labels)}
    meta = {"id": layer_id, "created": "2026-11-25T00:00:00Z", "config": config, "container_config": config}
    meta |= {"architecture": "amd64", "os": "linux"}
    with tarfile.open(path, "w") as tar:
        for member, body in (
            ("repositories", json.dumps({name: {"latest": layer_id}}).encode()),
            (f"{layer_id}/VERSION", b"1.0"),
            (f"{layer_id}/json", json.dumps(meta).encode()),
            (f"{layer_id}/layer.tar", data),
        ):
            info = tarfile.TarInfo(member)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
