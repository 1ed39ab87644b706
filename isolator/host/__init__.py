"""The host's edges: the state store (SQLite), /proc and the filesystem, rootfs paths."""
