"""What CPUs and memory nodes this machine really has, and which CPUs a process may use: reads only.

``<sys_root>/devices/system/{cpu,node}`` and ``<proc_root>/<pid>/status``; both roots are given to
the constructor, so tests can point it at a temp tree. Decides nothing (isolator/policy/affinity.py).
"""

from __future__ import annotations

import os

from isolator.errors import CgroupError, IsolatorError
from isolator.policy.affinity import Machine, parse_list


class SysCpus:
    def __init__(self, sys_root: str = "/sys", proc_root: str = "/proc") -> None:
        self.sys_root = sys_root
        self.proc_root = proc_root

    def machine(self) -> Machine:
        """Online CPUs (``cpu/online``), memory nodes (``node/has_memory``, else ``node/online``) and
        each online node's CPUs. A kernel built without NUMA has no ``node`` directory: one node, 0."""
        system = os.path.join(self.sys_root, "devices", "system")
        cpus = self._list(os.path.join(system, "cpu", "online"))
        node_dir = os.path.join(system, "node")
        if not os.path.isdir(node_dir):
            return Machine(cpus=cpus, mems=frozenset({0}), node_cpus={0: cpus})
        online = self._list(os.path.join(node_dir, "online"))
        has_memory = os.path.join(node_dir, "has_memory")
        mems = self._list(has_memory) if os.path.exists(has_memory) else online
        node_cpus = {n: self._list(os.path.join(node_dir, f"node{n}", "cpulist")) & cpus for n in sorted(online)}
        return Machine(cpus=cpus, mems=mems & online, node_cpus=node_cpus)

    def allowed_of(self, pid: int) -> frozenset[int] | None:
        """The CPUs ``pid`` may run on now (``Cpus_allowed_list``); None when it is gone."""
        path = os.path.join(self.proc_root, str(pid), "status")
        try:
            with open(path) as fh:
                for line in fh:
                    if line.startswith("Cpus_allowed_list:"):
                        return parse_list(line.split(":", 1)[1])
        except (FileNotFoundError, ProcessLookupError):
            return None
        except OSError as exc:
            raise CgroupError(op="read", path=path, cause=exc.strerror or str(exc)) from exc
        return None

    def _list(self, path: str) -> frozenset[int]:
        try:
            with open(path) as fh:
                return parse_list(fh.read())
        except OSError as exc:
            raise CgroupError(op="read", path=path, cause=exc.strerror or str(exc)) from exc
        except IsolatorError as exc:
            raise CgroupError(op="parse", path=path, cause=exc.message) from exc
