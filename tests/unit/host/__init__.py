"""The state store (isolator/host/state.py) on a temporary directory."""
