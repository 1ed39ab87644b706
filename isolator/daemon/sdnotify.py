"""systemd's notify protocol (sd_notify(3)) without libsystemd: readiness, status, watchdog pings.

Under ``Type=notify`` systemd passes ``NOTIFY_SOCKET`` (a datagram socket path, ``@`` for the
abstract namespace) and, with ``WatchdogSec=``, ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``). Outside
systemd nothing is set and every call is a no-op. The unit shipped with the package is
``isolator/data/gpu-isolator.service`` (``gpu-isolator install-unit``).
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + path[1:] if path.startswith("@") else path
        self.watchdog_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; False when not under systemd or it failed."""
        if not self._address:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.sendto("\n".join(fields).encode(), self._address)
        except OSError:
            return False
        finally:
            sock.close()
        return True

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1", "STATUS=stopping")
