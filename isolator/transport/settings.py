"""What the server side of both routes is told at start: its sockets, who may call, its bounds.

The daemon builds it from its configuration (``isolator.daemon.config.Config.server_settings``), as it
builds the core's ``Settings``; the transport reads nothing else of the daemon's. Stdlib and the vocabulary only.
"""

from __future__ import annotations

from dataclasses import dataclass

from isolator.model import Mode

# The command-module bridge listens next to the gRPC socket unless told otherwise (the bridge
# executable's default in isolator/bridge/command.py must agree).
BRIDGE_SUFFIX = ".bridge"


@dataclass(frozen=True)
class ServerSettings:
    socket: str
    # None: ``<socket>.bridge``; "": no bridge listener.
    bridge_socket: str | None = None
    socket_mode: int = 0o600
    socket_group: str = ""
    allowed_uids: tuple[int, ...] = (0,)
    allowed_gids: tuple[int, ...] = ()
    max_workers: int = 16
    max_concurrent_rpcs: int = 256
    max_connections: int = 256
    max_message_bytes: int = 256 * 1024
    mode: Mode = Mode.MESOS  # what Health says the answering sidecar runs as

    @property
    def bridge_path(self) -> str:
        """Where the command-module bridge listens; empty when it is disabled."""
        return self.socket + BRIDGE_SUFFIX if self.bridge_socket is None else self.bridge_socket
