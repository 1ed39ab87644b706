"""The hook and container a log line is about, set where a request enters (servicers, bridge).

Every line a hook logs carries them; the daemon's formatters (``isolator.daemon.logfmt``) read them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

CONTAINER: contextvars.ContextVar[str] = contextvars.ContextVar("container_id", default="")
HOOK: contextvars.ContextVar[str] = contextvars.ContextVar("hook", default="")


@contextlib.contextmanager
def hook_context(hook: str, container_id: str) -> Iterator[None]:
    tokens = (HOOK.set(hook), CONTAINER.set(container_id))
    try:
        yield
    finally:
        HOOK.reset(tokens[0])
        CONTAINER.reset(tokens[1])
