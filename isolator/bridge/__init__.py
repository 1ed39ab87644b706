"""The Mesos command-module route's client side: the executable an agent runs per hook (command,
and bridge.c, its compiled twin) and its installer. The sidecar's end is isolator/transport/bridge.py.

The package's face is the executable's: ``from isolator.bridge import main, install``. Importing it
loads ``command`` only (stdlib built-ins, no json, no grpc), so the per-call start stays cheap.
"""

from isolator.bridge.command import METHODS, PROTOCOL, _install_main, install, main

__all__ = ["METHODS", "PROTOCOL", "_install_main", "install", "main"]
