"""Kernel device events (NETLINK_KOBJECT_UEVENT) that change what NVML can see.

A GPU's PCI function bound to or unbound from its driver, a GPU hot-removed or added, the nvidia
kernel modules loaded or unloaded (a driver reload): each means the inventory must be read again
through NVML, after which GPUs are marked unhealthy or healthy again (isolator/gpu/nvml.py, ``rescan``).

``relevant`` is pure: a uevent's properties in, a ``Change`` (why to rescan, and whether it reset
a GPU) or None out. A ``Source`` yields uevents as property dicts; the real one reads the kernel's
NETLINK_KOBJECT_UEVENT socket with the standard library's ``socket`` (pyroute2's UeventSocket was
measured and left out: docs/dependencies.md); the simulated host's appends kernel-format messages
to a file (isolator/simhost/sim.py). The watch runs on its own thread and
calls ``on_change(reason)``; it never decides health itself.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Protocol

LOG = logging.getLogger(__name__)

# PCI vendor ID of NVIDIA in the uevent's PCI_ID ("10DE:20B0").
NVIDIA_VENDOR = "10DE"
# Kernel modules whose load or unload is a driver (re)load.
NVIDIA_MODULES = frozenset({"nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm"})
PCI_ACTIONS = frozenset({"bind", "unbind", "add", "remove", "change"})
# Actions after which the GPU is a fresh device (its XIDs are history): it left the driver or the bus.
RESET_ACTIONS = frozenset({"bind", "unbind", "add", "remove"})

NETLINK_KOBJECT_UEVENT = 15  # linux/netlink.h
KERNEL_GROUP = 1  # the kernel's multicast group (2 is udevd's re-broadcast)
MAX_MESSAGE = 8192  # UEVENT_BUFFER_SIZE is 2048; leave room
RECEIVE_BUFFER = 1 << 20  # bursts (a driver reload sends hundreds of events)


@dataclass(frozen=True)
class Change:
    """Why the GPUs must be read again. ``reset_bus``: the PCI address of a GPU that was reset
    (unbound, rebound, removed, added); ``reset_all``: the driver itself went away or came back."""

    reason: str
    reset_bus: str = ""
    reset_all: bool = False


def parse(message: bytes) -> dict[str, str]:
    """A kernel uevent message (``ACTION@DEVPATH\\0KEY=VALUE\\0...``) as its properties."""
    parts = message.split(b"\0")
    out: dict[str, str] = {}
    for part in parts[1:]:
        key, sep, value = part.partition(b"=")
        if sep and key:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    if "ACTION" not in out and b"@" in parts[0]:
        action, _, devpath = parts[0].decode(errors="replace").partition("@")
        out.setdefault("ACTION", action)
        out.setdefault("DEVPATH", devpath)
    return out


def format_message(props: dict[str, str]) -> bytes:
    """The kernel's wire format for these properties (what ``parse`` reads)."""
    head = f"{props.get('ACTION', '')}@{props.get('DEVPATH', '')}"
    return b"\0".join([head.encode()] + [f"{k}={v}".encode() for k, v in props.items()])


def relevant(event: dict[str, str], bus_ids: Collection[str]) -> Change | None:
    """What this uevent means for the GPUs, or None when it does not concern them.

    ``bus_ids`` are the managed GPUs' PCI addresses in sysfs form (``0000:06:00.0``).
    """
    action = event.get("ACTION", "")
    subsystem = event.get("SUBSYSTEM", "")
    if subsystem == "module":
        name = event.get("DEVPATH", "").rsplit("/", 1)[-1]
        if name in NVIDIA_MODULES and action in ("add", "remove"):
            return Change(f"kernel module {name} {'loaded' if action == 'add' else 'unloaded'}", reset_all=True)
        return None
    if subsystem == "pci" and action in PCI_ACTIONS:
        slot = event.get("PCI_SLOT_NAME", "").lower() or event.get("DEVPATH", "").rsplit("/", 1)[-1].lower()
        vendor = event.get("PCI_ID", "").split(":", 1)[0].upper()
        if slot in bus_ids or vendor == NVIDIA_VENDOR:
            driver = event.get("DRIVER", "")
            via = f" (driver {driver})" if driver else ""
            return Change(f"PCI device {slot} {action}{via}", reset_bus=slot if action in RESET_ACTIONS else "")
    return None


class Source(Protocol):
    """Uevents as property dicts. ``events`` yields until ``close``; it may yield nothing for a while."""

    def events(self, stop: threading.Event) -> Iterator[dict[str, str]]: ...

    def close(self) -> None: ...


class NetlinkSource:
    """The kernel's uevent multicast group (group 1 of NETLINK_KOBJECT_UEVENT): what udevd itself
    listens to. Any process may listen; no capability is needed. Messages from anything but the
    kernel (port id 0) are ignored, so a local process cannot forge a GPU event."""

    def __init__(self, poll_s: float = 0.5) -> None:
        self.poll_s = poll_s
        self._sock: socket.socket | None = None

    def open(self) -> NetlinkSource:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_KOBJECT_UEVENT)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            sock.bind((0, KERNEL_GROUP))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        return self

    def events(self, stop: threading.Event) -> Iterator[dict[str, str]]:
        if self._sock is None:
            self.open()
        sock = self._sock
        assert sock is not None
        while not stop.is_set():
            ready, _, _ = select.select([sock], [], [], self.poll_s)
            if not ready:
                continue
            try:
                data, (sender, _groups) = sock.recvfrom(MAX_MESSAGE)
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # the kernel dropped events: read everything again
                    LOG.warning("kernel device events were dropped (ENOBUFS); reading the GPUs again")
                    yield {"ACTION": "change", "SUBSYSTEM": "pci", "PCI_ID": f"{NVIDIA_VENDOR}:0000"}
                    continue
                raise
            if sender != 0 or data.startswith(b"libudev\0"):
                continue  # only the kernel's own messages
            yield parse(data)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class FileSource:
    """Kernel-format uevent messages appended to a file, one per line (the simulated host's)."""

    def __init__(self, path: str, poll_s: float = 0.05) -> None:
        self.path = path
        self.poll_s = poll_s
        try:
            self._offset = os.path.getsize(path)  # as a socket: only what comes after opening
        except OSError:
            self._offset = 0

    def events(self, stop: threading.Event) -> Iterator[dict[str, str]]:
        pending = b""
        while not stop.is_set():
            try:
                if os.stat(self.path).st_size == self._offset:  # nothing new: one stat, no open and read
                    stop.wait(self.poll_s)
                    continue
                with open(self.path, "rb") as fh:
                    fh.seek(self._offset)
                    data = fh.read()
            except FileNotFoundError:
                data = b""
            self._offset += len(data)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line:
                    yield parse(line)
            if not lines:
                stop.wait(self.poll_s)

    def close(self) -> None:
        pass


class UeventWatch:
    """Calls ``on_change(change)`` for every uevent that ``relevant`` picks out, on its own thread.

    A source that fails (no netlink, pyroute2 missing) is retried with a growing pause; the
    inventory's periodic probe still notices what the uevents would have said, only later.
    """

    def __init__(
        self,
        source_factory: Callable[[], Source],
        bus_ids: Callable[[], Collection[str]],
        on_change: Callable[[Change], None],
        retry_s: float = 5.0,
    ) -> None:
        self._factory = source_factory
        self._bus_ids = bus_ids
        self._on_change = on_change
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._source: Source | None = None
        self.started = threading.Event()  # set once the source listens

    def start(self) -> UeventWatch:
        self._thread = threading.Thread(target=self._run, name="uevents", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        pause = self._retry_s
        while not self._stop.is_set():
            try:
                self._source = self._factory()
                if isinstance(self._source, NetlinkSource):
                    self._source.open()
                self.started.set()
                pause = self._retry_s
                for event in self._source.events(self._stop):
                    change = relevant(event, self._bus_ids())
                    if change is not None:
                        LOG.info("device event: %s; reading the GPUs again", change.reason)
                        self._on_change(change)
            except Exception as exc:
                LOG.warning("kernel device events unavailable (%s); retrying in %.0f s", exc, pause)
                self._stop.wait(pause)
                pause = min(pause * 2, 300.0)
            finally:
                if self._source is not None:
                    self._source.close()
                    self._source = None

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
