"""Which mount holds a path (a pure parse of /proc/<pid>/mountinfo), and the tmpfs mount edge.

Mesos mounts a tmpfs over the volume when its filesystem is ``noexec`` (MESOS-5923), since binaries
in bin/ must run in containers; we do the same over the volume root.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from volumes.errors import VolumeBuildError


@dataclass(frozen=True)
class MountEntry:
    mount_point: str
    fstype: str
    options: frozenset[str]  # per-mount options (field 6) plus superblock options

    @property
    def noexec(self) -> bool:
        return "noexec" in self.options


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[MountEntry]:
    entries = []
    for line in text.splitlines():
        parts = line.split()
        if "-" not in parts or len(parts) < 10:
            continue
        sep = parts.index("-")
        opts = set(parts[5].split(",")) | set(parts[sep + 3].split(",") if len(parts) > sep + 3 else ())
        entries.append(MountEntry(_unescape(parts[4]), parts[sep + 1], frozenset(opts)))
    return entries


def mount_of(path: str, entries: list[MountEntry]) -> MountEntry | None:
    """The mount that holds ``path`` (already a real path): the longest prefix, the later of equals."""
    best: MountEntry | None = None
    for entry in entries:
        mp = entry.mount_point
        holds = mp == "/" or path == mp or path.startswith(mp + "/")
        # Later lines are mounted on top of earlier ones at the same point, hence >=.
        if holds and (best is None or len(mp) >= len(best.mount_point)):
            best = entry
    return best


def mount_tmpfs(target: str) -> None:
    """Mount a tmpfs at ``target`` as Mesos does: mode=755, nosuid, nodev (and exec)."""
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "mode=755,nosuid,nodev,exec", "tmpfs", target],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise VolumeBuildError(
            op="mount a tmpfs on", path=target, cause=proc.stderr.strip() or f"exit {proc.returncode}"
        )


def read_mountinfo(path: str) -> list[MountEntry]:
    try:
        with open(path) as fh:
            return parse_mountinfo(fh.read())
    except OSError as exc:
        raise VolumeBuildError(op="read", path=path, cause=exc.strerror or str(exc)) from exc
