"""The Mesos command-module route: the executable an agent runs per hook (command) and the
sidecar's listener for it (listener)."""
