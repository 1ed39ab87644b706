"""The manifest of a built volume: its JSON shape on disk and the admin view's text. Pure, no I/O.

It lives inside the volume as ``.manifest.json`` so that it appears with the volume in one rename.
"""

from __future__ import annotations

import json
from typing import Any

from volumes.catalog import Group

MANIFEST_NAME = ".manifest.json"
SCHEMA = 1


def dumps(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def loads(text: str) -> dict[str, Any] | None:
    """The manifest, or None when the text is not a manifest of this schema."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("files"), list):
        return None
    return data


def describe(manifest: dict[str, Any]) -> str:
    """The text of ``gpu-isolator volume``: path, version, files per group, link or copy, skips."""
    lines = [
        f"volume:          {manifest['path']}",
        f"driver version:  {manifest['driver_version']}",
        f"driver root:     {manifest['driver_root']}",
        f"ld.so.cache:     {manifest['ldcache']} ({manifest['ldcache_format']} format)",
        f"files:           {len(manifest['files'])} ({manifest['bytes']} bytes), {len(manifest['links'])} links",
        f"method:          {manifest['mode']}"
        + (" (tmpfs over a noexec volume root)" if manifest.get("tmpfs") else ""),
        f"built at:        {manifest['built_at']}",
        "files per group: " + ", ".join(f"{g.value} {manifest['counts'].get(g.value, 0)}" for g in Group),
    ]
    users = manifest.get("users")
    if users is not None:
        lines.append(f"users:           {len(users)}" + (f" ({', '.join(users)})" if users else ""))
    if manifest["skipped"]:
        lines.append("skipped:")
        lines += [f"  {s['path']}: {s['reason']}: {s['detail']}" for s in manifest["skipped"]]
    required = [m["component"] for m in manifest["missing"] if not m["optional"]]
    if required:
        lines.append("missing:         " + ", ".join(required))
    return "\n".join(lines) + "\n"
