"""The Mesos command-module route: the executable an agent runs per hook (command) and the
sidecar's listener for it (listener).

The package's face is the executable's: ``from isolator.bridge import main, install``. Importing it
loads ``command`` only (stdlib built-ins, no json, no grpc), so the per-call start stays cheap.
"""

from isolator.bridge.command import METHODS, PROTOCOL, _install_main, install, main

__all__ = ["METHODS", "PROTOCOL", "_install_main", "install", "main"]
