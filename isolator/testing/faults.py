"""Named fault points for the fakes: ``fake.faults.fail_at("apply")`` makes the next ``apply`` raise.

Each fake names its steps after the Protocol methods (FakeCgroups: prepare, apply, recover, add_pid,
pids, cleanup...; FakeStore: record, add_gpus, remove_gpus, update, remove, get, load...). A fault
fires ``times`` times (default once, ``times=None`` for ever), optionally only for one container,
and raises the error given or the fake's own typed error for that step (CgroupError, StateError),
the way the real edge fails. ``pause_at`` holds a step until the test opens a gate (a slow fsync,
a slow volume build), for concurrency tests. ``hits`` counts the calls per step, faulty or not.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from isolator.model import ContainerId


@dataclass
class _Fault:
    error: BaseException | None
    times: int | None
    container: ContainerId | None


class Faults:
    def __init__(self, default_error: Callable[[str, ContainerId | None], BaseException]) -> None:
        self._default = default_error
        self._faults: dict[str, list[_Fault]] = {}
        self._pauses: dict[str, tuple[ContainerId | None, threading.Event, threading.Event]] = {}
        self._lock = threading.Lock()
        self.hits: Counter[str] = Counter()

    def fail_at(
        self,
        step: str,
        error: BaseException | None = None,
        *,
        times: int | None = 1,
        container: ContainerId | None = None,
    ) -> None:
        with self._lock:
            self._faults.setdefault(step, []).append(_Fault(error, times, container))

    def pause_at(self, step: str, *, container: ContainerId | None = None) -> tuple[threading.Event, threading.Event]:
        """Hold the next ``step`` (of ``container``) until ``gate`` is set; returns (entered, gate)."""
        entered, gate = threading.Event(), threading.Event()
        with self._lock:
            self._pauses[step] = (container, entered, gate)
        return entered, gate

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self._pauses.clear()

    def check(self, step: str, container: ContainerId | None = None) -> None:
        """Called by the fake at the start of ``step``: raise if a fault is armed for it."""
        with self._lock:
            self.hits[step] += 1
            pause = self._pauses.get(step)
            if pause is not None and pause[0] in (None, container):
                del self._pauses[step]
            else:
                pause = None
        if pause is not None:
            pause[1].set()
            pause[2].wait(30)
        with self._lock:
            for fault in self._faults.get(step, []):
                if fault.container is not None and fault.container != container:
                    continue
                if fault.times is not None:
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults[step].remove(fault)
                error = fault.error if fault.error is not None else self._default(step, container)
                raise error
