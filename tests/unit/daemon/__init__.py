"""The daemon's configuration (isolator/daemon/config.py)."""
