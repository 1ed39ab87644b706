"""The Mesos command-module route: the executable an agent runs per hook (command) and the
sidecar's listener for it (listener)."""

# The executable's entry points, where they were before the layout change (installed launchers,
# scripts and tests import them from here); command imports nothing beyond what the interpreter has
# loaded, so this costs the launcher nothing.
from isolator.bridge.command import _install_main, install, main

__all__ = ["_install_main", "install", "main"]
