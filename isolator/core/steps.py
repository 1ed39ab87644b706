"""A handler's own time, step by step (issue 45: where a hook's milliseconds go), for the line it
logs when it ends: "prepared ..." and "isolated ..." (the agent bench reads them)."""

from __future__ import annotations

from collections.abc import Callable


class Steps:
    """Each ``mark`` ends the step named since the previous one (or since the start)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._last = now()
        self._start = self._last
        self.spent: list[tuple[str, float]] = []

    def mark(self, step: str) -> None:
        now = self._now()
        self.spent.append((step, now - self._last))
        self._last = now

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {seconds * 1000:.2f}" for name, seconds in self.spent)
        return f"{(self._last - self._start) * 1000:.2f} ms ({parts})"
