"""``FakeVolumes``: the driver volume builder (isolator.core.ports.DriverVolumes) in memory.

``acquire`` "builds" ``<volume_root>/nvidia_<version>`` and records the user; ``faults`` fails a
step by name with the volumes package's own error (a build that runs out of space, say).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from isolator.testing.faults import Faults
from volumes.errors import VolumeError


@dataclass(frozen=True)
class FakeVolume:
    path: str
    driver_version: str


class FakeVolumes:
    def __init__(self, volume_root: str = "/fake/volumes") -> None:
        self.volume_root = volume_root
        self._lock = threading.Lock()
        self.users: dict[str, set[str]] = {}  # driver version -> container ids
        self.built: list[str] = []
        self.faults = Faults(lambda step, cid: VolumeError(f"failed to {step} the driver volume: injected fault"))

    def acquire(self, container_id: str, driver_version: str) -> FakeVolume:
        self.faults.check("acquire")
        with self._lock:
            if driver_version not in self.users:
                self.built.append(driver_version)
            self.users.setdefault(driver_version, set()).add(container_id)
        return FakeVolume(f"{self.volume_root}/nvidia_{driver_version}", driver_version)

    def release(self, container_id: str, driver_version: str | None = None) -> tuple[str, ...]:
        self.faults.check("release")
        removed = []
        with self._lock:
            for version in sorted(self.users):
                self.users[version].discard(container_id)
                if not self.users[version] and driver_version is not None and version != driver_version:
                    del self.users[version]
                    removed.append(f"nvidia_{version}")
        return tuple(removed)

    def reconcile(self, live: Iterable[str]) -> tuple[str, ...]:
        keep = set(live)
        dropped = set()
        with self._lock:
            for users in self.users.values():
                dropped |= users - keep
                users &= keep
        return tuple(sorted(dropped))

    def volumes(self) -> list[dict[str, Any]]:
        self.faults.check("volumes")
        with self._lock:
            return [
                {"driver_version": v, "path": f"{self.volume_root}/nvidia_{v}", "users": sorted(u)}
                for v, u in sorted(self.users.items())
            ]

    def in_use_by(self, container_id: str) -> bool:
        with self._lock:
            return any(container_id in u for u in self.users.values())
