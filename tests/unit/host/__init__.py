"""The state store (isolator/host/state/) on a temporary directory."""
