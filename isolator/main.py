"""Composition root: configuration -> real edges -> service -> server.

The one place that builds concrete classes and configures logging handlers for the daemon.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

from isolator.config import Config
from isolator.server import SidecarServer
from isolator.service import Service

LOG = logging.getLogger("isolator")


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def build_service(config: Config) -> Service:
    return Service()


def serve(config: Config) -> int:
    """Run the sidecar until SIGTERM or SIGINT. Raises IsolatorError if it cannot start."""
    configure_logging(config.log_level)
    service = build_service(config)
    server = SidecarServer(config, service)
    try:
        server.start()
    except BaseException:
        service.close()
        raise
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        LOG.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Wake periodically so that signals are handled promptly whatever the platform's lock waits do.
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0
