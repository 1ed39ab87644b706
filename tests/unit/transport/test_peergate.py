"""The gate's splice over real Unix sockets: bytes both ways, back-pressure, half-close, and one
thread for every connection (the gRPC-level refusals are in tests/system/test_security.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import pytest

from isolator.transport import peergate


class EchoUpstream:
    """Stands where gRPC listens: echoes each connection's bytes, then says "bye" and closes once
    the caller half-closes. ``release`` cleared holds back reading, to fill the splice."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(path)
        self.listener.listen(64)
        self.release = threading.Event()
        self.release.set()
        self.peers: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self.listener.accept()
            except OSError:
                return
            self.peers.append(addr.decode() if isinstance(addr, bytes) else addr)
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # a caller that closed at once resets its side
            self.release.wait()
            while data := conn.recv(1 << 16):
                conn.sendall(data)
            conn.sendall(b"bye")


@pytest.fixture
def gate(short_tmp):
    upstream = EchoUpstream(os.path.join(short_tmp, "grpc"))
    denied = EchoUpstream(os.path.join(short_tmp, "deny"))
    public = os.path.join(short_tmp, "s.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(public)
    listener.listen(64)
    g = peergate.PeerGate(
        listener,
        os.path.join(short_tmp, "grpc"),
        os.path.join(short_tmp, "deny"),
        peergate.Allowlist.of((), ()),
        max_connections=256,
    )
    g.start()
    yield g, public, upstream, denied
    g.stop()
    upstream.listener.close()
    denied.listener.close()


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(20)
    s.connect(path)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = bytearray()
    while chunk := s.recv(1 << 16):
        out += chunk
    return bytes(out)


def test_bytes_cross_both_ways_intact_under_back_pressure_and_the_half_close_is_passed_on(gate):
    _g, public, upstream, _ = gate
    upstream.release.clear()  # the upstream reads nothing yet: the splice must hold back, not drop
    payload = os.urandom(8 * 1024 * 1024)
    s = _connect(public)

    def send() -> None:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    threading.Timer(0.3, upstream.release.set).start()
    got = _read_all(s)
    sender.join()
    s.close()
    assert got == payload + b"bye"


def test_one_thread_splices_every_connection(gate):
    _g, public, _, _ = gate
    before = threading.active_count()
    conns = [_connect(public) for _ in range(40)]
    for i, c in enumerate(conns):
        c.sendall(b"%d" % i)
    for i, c in enumerate(conns):
        assert c.recv(16) == b"%d" % i
    # The echo upstream's own threads are 40; the gate added none per connection (it added 80 before).
    assert threading.active_count() - before == 40
    for c in conns:
        c.shutdown(socket.SHUT_WR)
        assert _read_all(c) == b"bye"
        c.close()


def test_a_closed_connection_gives_its_slot_back(gate):
    g, public, _, _ = gate
    s = _connect(public)
    s.sendall(b"x")
    assert s.recv(1) == b"x"
    assert g.connections() == (1, 0)
    s.close()  # a full close, not a half-close: the upstream's answer has nowhere to go
    for _ in range(500):
        if g.connections() == (0, 0):
            break
        threading.Event().wait(0.01)
    assert g.connections() == (0, 0)


def test_the_upstream_learns_the_caller_from_the_name_the_gate_binds(gate):
    _g, public, upstream, _ = gate
    s = _connect(public)
    s.sendall(b"x")
    assert s.recv(1) == b"x"
    s.close()
    (peer,) = upstream.peers
    assert peergate.caller_pid("unix-abstract:" + peer.lstrip("\0")) == os.getpid()


def test_stop_cuts_connections_still_spliced(gate):
    g, public, _, _ = gate
    s = _connect(public)
    s.sendall(b"x")
    assert s.recv(1) == b"x"
    g.stop()
    assert s.recv(1) == b""
    s.close()
