"""What a SIGHUP may change: the settings the running daemon can take over without a restart, and
the difference between the configuration it runs with and the one it re-read. Pure: applying the
change is the serving lifecycle's (``Reloader`` in isolator/daemon/main.py)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from isolator.daemon.options import OPTIONS, Config

# The options declared ``reloadable`` (isolator/daemon/options.py). Each is read afresh where it is used,
# so a new value takes effect at once or at the next pass: the log level (the root logger's), the
# audit period (the audit job is restarted), the GPU probe period and the ignored XIDs (read by the
# health watch on each probe and event), the allow-lists (checked per new connection by the gate and
# the bridge). Everything else is wired into objects built once at start (sockets, cgroup hierarchy
# and mode, state and volume paths, the NVML library, GPU selection, server bounds, the log format,
# the metrics and job-mapping exporters, the reaper's and the CDI keeper's period), so a change there
# needs a restart. --shared-gpus too, through the booking (docs/sharing.md): a change that would
# switch a held GPU between whole and shared is refused and the old value kept.
RELOADABLE = tuple(name for name, o in OPTIONS.items() if o.reloadable)
_NOT_SETTINGS = ("config_file", "extra")


def difference(old: Config, new: Config) -> tuple[dict[str, tuple[Any, Any]], list[str]]:
    """(reloadable settings that changed, as name -> (old, new); names of other settings that changed)."""
    changed = {
        f.name: (getattr(old, f.name), getattr(new, f.name))
        for f in fields(Config)
        if f.name not in _NOT_SETTINGS and getattr(old, f.name) != getattr(new, f.name)
    }
    reloadable = {name: values for name, values in changed.items() if name in RELOADABLE}
    return reloadable, sorted(name for name in changed if name not in RELOADABLE)


def describe(value: Any) -> str:
    """A setting's value as the reload log line shows it (lists comma-separated, ``none`` if empty)."""
    if isinstance(value, tuple):
        from isolator.policy.shares import ShareSpec, format_shared_gpus

        if value and all(isinstance(v, ShareSpec) for v in value):
            return format_shared_gpus(value)
        return ",".join(str(v) for v in value) or "none"
    return f"{value:g}" if isinstance(value, float) else str(value)
