"""Null objects for the optional edges: no volume root, no CPU view, no cpuset hierarchy, no MPS
control daemon.

The core is always handed an object for each port; where the machine has none of these (or the
operator turned it off), one of these stands in and answers as "nothing here", so the core asks no
``is None`` questions. Each refuses what cannot be done without the real edge (fail closed): a
container that needs the driver volume is refused, never started without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from isolator.core.ports import Volume
from isolator.errors import CgroupError, FailedPrecondition
from isolator.model import ContainerId
from isolator.policy.affinity import Affinity, Machine


class NoVolumes:
    """No volume root is configured: nobody uses a volume, and none can be built."""

    volume_root = ""  # the port's "none configured"

    def acquire(self, container_id: str, driver_version: str) -> Volume:
        raise FailedPrecondition("the image asks for the driver volume but no volume root is configured")

    def release(self, container_id: str, driver_version: str | None = None) -> tuple[str, ...]:
        return ()

    def reconcile(self, live: Iterable[str]) -> tuple[str, ...]:
        return ()

    def volumes(self) -> list[dict[str, Any]]:
        return []


class NoCpus:
    """No view of the machine's CPUs (``--cpu-affinity off``): an empty machine, no process's CPUs."""

    def machine(self) -> Machine:
        return Machine(frozenset(), frozenset())

    def allowed_of(self, pid: int) -> frozenset[int] | None:
        return None


class NoCpusets:
    """No cpuset hierarchy is bound: no container has a cpuset, and none can be made."""

    version = ""

    def path(self, container: ContainerId) -> str:
        return ""

    def exists(self, container: ContainerId) -> bool:
        return False

    def containers(self) -> tuple[ContainerId, ...]:
        return ()

    def current(self, container: ContainerId) -> Affinity | None:
        return None

    def allowed(self, container: ContainerId) -> frozenset[int]:
        return frozenset()

    def pids(self, container: ContainerId) -> tuple[int, ...]:
        return ()

    def apply(self, container: ContainerId, cpus: frozenset[int], mems: frozenset[int]) -> None:
        raise CgroupError(op="create the cpuset of", path=str(container), cause="no cpuset hierarchy is bound")

    def join(self, container: ContainerId, pid: int) -> None:
        return None  # no cpuset to join: the process keeps the CPUs it has

    def remove(self, container: ContainerId) -> None:
        return None  # nothing to remove


class NoMpsDaemons:
    """No ``nvidia-cuda-mps-control`` (docs/sharing.md): no daemon runs, and none can be started, so
    a GPU shared in mps mode gets no sharer (fail closed)."""

    def _refuse(self, uuid: str) -> FailedPrecondition:
        return FailedPrecondition(f"{uuid} is shared in mps mode but this sidecar has no nvidia-cuda-mps-control")

    def pipe_dir(self, uuid: str) -> str:
        raise self._refuse(uuid)

    def start(self, uuid: str, multiuser: bool = False) -> int:
        raise self._refuse(uuid)

    def command(self, uuid: str, text: str) -> str:
        raise self._refuse(uuid)

    def alive(self, uuid: str) -> bool:
        return False

    def pid(self, uuid: str) -> int | None:
        return None

    def multiuser(self, uuid: str) -> bool | None:
        return None

    def stop(self, uuid: str) -> None:
        return None  # nothing runs: nothing to stop


class NoUsers:
    """No user database: no name resolves, so a named sharer is never placed on a single-user MPS GPU
    (fail closed). The daemon wires the host's (host/system.py)."""

    def uid(self, name: str) -> int | None:
        return None
