"""What CPUs and memory nodes this machine really has, and which CPUs a process may use: reads only.

``<sys_root>/devices/system/{cpu,node}`` and ``<proc_root>/<pid>/status``; both roots are given to
the constructor, so tests can point it at a temp tree. Decides nothing (isolator/policy/affinity.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator, Mapping

from isolator.errors import CgroupError, IsolatorError
from isolator.host.system import read_text
from isolator.policy.affinity import Machine, parse_list

SYSFS_MAX = 1 << 16  # a sysfs attribute prints at most a page


class SysCpus:
    def __init__(self, sys_root: str = "/sys", proc_root: str = "/proc") -> None:
        self.sys_root = sys_root
        self.proc_root = proc_root
        self._system = os.path.join(sys_root, "devices", "system")
        # Which files the kernel has (a NUMA build has ``node``, and ``node/has_memory`` in it) cannot
        # change while it runs: looked up once. What they hold (hotplug) is read at every call.
        self._layout: tuple[bool, bool] | None = None
        # cpu/online, node/online and node/has_memory, read at every call through a descriptor kept
        # open (``_read_kept``); closed with this object.
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()
        weakref.finalize(self, _close_all, self._fds)

    def machine(self) -> Machine:
        """Online CPUs (``cpu/online``), memory nodes (``node/has_memory``, else ``node/online``) and
        each online node's CPUs. A kernel built without NUMA has no ``node`` directory: one node, 0.
        A node's CPUs (``node<N>/cpulist``) are read only if asked for (``affinity.decide`` needs them
        only when no GPU's own node is a memory node), once per answer."""
        cpus = self._list(os.path.join(self._system, "cpu", "online"), kept=True)
        numa, has_memory = self._files()
        if not numa:
            return Machine(cpus=cpus, mems=frozenset({0}), node_cpus={0: cpus})
        node_dir = os.path.join(self._system, "node")
        online = self._list(os.path.join(node_dir, "online"), kept=True)
        mems = self._list(os.path.join(node_dir, "has_memory"), kept=True) if has_memory else online
        return Machine(cpus=cpus, mems=mems & online, node_cpus=_NodeCpus(self, node_dir, online, cpus))

    def _files(self) -> tuple[bool, bool]:
        if self._layout is None:
            node_dir = os.path.join(self._system, "node")
            numa = os.path.isdir(node_dir)
            self._layout = (numa, numa and os.path.exists(os.path.join(node_dir, "has_memory")))
        return self._layout

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

    def _list(self, path: str, kept: bool = False) -> frozenset[int]:
        try:
            if kept:
                return parse_list(self._read_kept(path))
            return parse_list(read_text(path))
        except OSError as exc:
            raise CgroupError(op="read", path=path, cause=exc.strerror or str(exc)) from exc
        except IsolatorError as exc:
            raise CgroupError(op="parse", path=path, cause=exc.message) from exc

    def _read_kept(self, path: str) -> str:
        """``path`` read now through a descriptor opened once. A read at offset 0 makes sysfs print
        the attribute again (seq_file starts over at 0, as ``top`` re-reads /proc/stat), so the text
        is as fresh as with open, read and close, for one syscall instead of three (2 us against
        30 us here). A descriptor that fails is closed and the file opened again, once."""
        for attempt in (1, 2):
            with self._fds_lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                return os.pread(fd, SYSFS_MAX, 0).decode()
            except OSError:
                with self._fds_lock:
                    if self._fds.get(path) == fd:
                        del self._fds[path]
                        os.close(fd)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class _NodeCpus(Mapping[int, frozenset[int]]):
    """Each online node's online CPUs, read from ``node<N>/cpulist`` on first use, then kept (one answer)."""

    def __init__(self, cpus_edge: SysCpus, node_dir: str, online: frozenset[int], cpus: frozenset[int]) -> None:
        self._edge = cpus_edge
        self._node_dir = node_dir
        self._online = online
        self._cpus = cpus
        self._read: dict[int, frozenset[int]] | None = None

    def _nodes(self) -> dict[int, frozenset[int]]:
        if self._read is None:
            self._read = {
                n: self._edge._list(os.path.join(self._node_dir, f"node{n}", "cpulist")) & self._cpus
                for n in sorted(self._online)
            }
        return self._read

    def __getitem__(self, node: int) -> frozenset[int]:
        return self._nodes()[node]

    def __iter__(self) -> Iterator[int]:
        return iter(self._nodes())

    def __len__(self) -> int:
        return len(self._online)

    def __repr__(self) -> str:
        return repr(self._nodes())
