"""The Mesos command-module route's client side: the executable an agent runs per hook and its installer.

    command.py   the executable (stdlib built-ins only); bridge.c is its compiled twin
    build.py     builds bridge.c with the machine's C compiler, for ``install --compiled``

The sidecar's end is isolator/transport/bridge.py. The package's face is the executable's:
``from isolator.bridge import main, install``. Importing it loads ``command`` only (no json, no
grpc), so the per-call start stays cheap.
"""

from isolator.bridge.command import METHODS, PROTOCOL, _install_main, install, main

__all__ = ["METHODS", "PROTOCOL", "_install_main", "install", "main"]
