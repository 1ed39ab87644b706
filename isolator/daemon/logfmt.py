"""Log formats of the daemon: ``text`` (the default) and ``json`` (``--log-format json``).

JSON is one object per line with stable keys, always all present: ``time`` (RFC 3339, UTC),
``level``, ``logger``, ``message``, ``container_id`` (the container the current hook is about, ""
outside hooks), ``hook`` ("" outside hooks), ``thread``, and ``exception`` (the traceback, "" when
none). The server's error mapping sets the hook and container for the duration of each call
(``hook_context``), so every line a hook logs carries them.
"""

from __future__ import annotations

import json
import logging
import time

from isolator.transport.logcontext import CONTAINER, HOOK, hook_context

__all__ = ["KEYS", "JsonFormatter", "TextFormatter", "hook_context"]

KEYS = ("time", "level", "logger", "message", "container_id", "hook", "thread", "exception")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "container_id": CONTAINER.get(),
            "hook": HOOK.get(),
            "thread": record.threadName or "",
            "exception": self.formatException(record.exc_info) if record.exc_info else "",
        }
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """The plain format, with ``[container]`` after the logger inside a hook."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        container = CONTAINER.get()
        if container:
            head, sep, rest = text.partition(": ")
            text = f"{head} [{container}]{sep}{rest}"
        return text
