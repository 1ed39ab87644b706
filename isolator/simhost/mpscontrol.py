"""A stand-in ``nvidia-cuda-mps-control`` for the simulated host (docs/sharing.md, docs/simhost.md).

Started the way the real one is: ``nvidia-cuda-mps-control -d [-multiuser-server]`` with
``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY`` and ``CUDA_VISIBLE_DEVICES`` in its
environment forks a control daemon and returns; ``echo CMD | nvidia-cuda-mps-control`` (same
environment) sends control commands and prints the answers. The daemon keeps its pid in
``<pipe dir>/nvidia-cuda-mps-control.pid`` and listens at ``<pipe dir>/control`` (a Unix socket, 0666
as the real one's), for control commands and for MPS clients (simhost/mpsclient.py), whose uid and
pid it takes from the socket's credentials (SO_PEERCRED), never from what they say. What it knows
and answers is simhost/mpsmodel.py's: servers (a real process each, ``nvidia-cuda-mps-server`` run
as the server's uid), clients, limits, users queueing, FAULT (``sim_fault <server pid>``, a command
the real daemon does not have). Its logs: ``<log dir>/control.log`` and ``server.log``.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import time

# What only the daemon uses is imported where the daemon uses it: every control command is a process
# of this module of its own (dozens in one MPS test), and those imports (typing too) cost it twice
# its start. TYPE_CHECKING as typing's, which mypy takes for true whatever it is bound to.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import selectors

    from isolator.simhost import mpsmodel

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL = "control"
DEFAULT_PIPE = "/tmp/nvidia-mps"
DEFAULT_LOG = "/var/log/nvidia-mps"
# The first line of an MPS client's connection (simhost/mpsclient.py), then its environment as JSON.
CLIENT_HELLO = "\0client "
MULTIUSER_FLAGS = ("-multiuser-server", "-M", "--multiuser-server")
SLEEP = "/bin/sleep"
PR_SET_PDEATHSIG = 1


def _dirs() -> tuple[str, str]:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE), os.environ.get(
        "CUDA_MPS_LOG_DIRECTORY", DEFAULT_LOG
    )


def _log(log_dir: str, name: str, line: str) -> None:
    with open(os.path.join(log_dir, name), "a") as fh:
        fh.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")


class _ServerProcess:
    """A real process in the server's place, ``nvidia-cuda-mps-server`` in ps, run as its uid."""

    def __init__(self, uid: int) -> None:
        import ctypes
        import pwd
        import subprocess

        # Loaded before the fork: the child, of the server's uid by then, may not read the interpreter's files.
        libc = ctypes.CDLL(None, use_errno=True)

        def die_with_parent() -> None:
            # A server must not outlive a stand-in daemon killed by a test (the real servers are the
            # real daemon's children too). Set after the uid change, which clears it.
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

        drop = os.geteuid() == 0 and uid != 0
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError:
            gid = uid
        self._proc = subprocess.Popen(
            ["nvidia-cuda-mps-server", "infinity"],
            executable=SLEEP,
            user=uid if drop else None,
            group=gid if drop else None,
            extra_groups=[] if drop else None,
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        self.pid = self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
        self._proc.wait()


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, from the kernel."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def _describe(pid: int) -> tuple[str, str]:
    """(command, pid namespace) of a client, as ``ps`` shows them."""
    try:
        command = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        command = "?"
    try:
        namespace = os.readlink(f"/proc/{pid}/ns/pid").split("[")[-1].rstrip("]")
    except OSError:
        namespace = "?"
    return command, namespace


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").rstrip("\n")


def _send(conn: socket.socket, text: str) -> None:
    try:
        conn.sendall((text + "\n").encode())
    except OSError:
        pass


def _serve(pipe: str, log_dir: str, listener: socket.socket, multiuser: bool) -> None:
    """The control daemon's loop: control commands (one per connection) and MPS clients (held open
    while they live), until ``quit`` and its last client, or until its control endpoint is gone."""
    import selectors

    from isolator.simhost import mpsmodel

    device = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    model = mpsmodel.Daemon(
        device,
        _ServerProcess,
        lambda name, line: _log(log_dir, name, line),
        owner_uid=os.geteuid(),
        multiuser=multiuser,
    )
    _log(log_dir, "control.log", f"Startup: CUDA_VISIBLE_DEVICES={device}" + (" multiuser" if multiuser else ""))
    control = os.path.join(pipe, CONTROL)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    try:
        while not (model.quitting and not model.clients()):
            events = selector.select(timeout=0.1)
            for key, _mask in events:
                if key.data is None:
                    _accept(model, selector, listener)
                    continue
                conn, pid = key.fileobj, key.data
                assert isinstance(conn, socket.socket)
                try:
                    gone = not conn.recv(4096)
                except OSError:
                    gone = True
                if gone:
                    selector.unregister(conn)
                    conn.close()
                    model.disconnect(pid)
            model.tick()
            # Unlike the real one, the stand-in never outlives its simulated host: once its control
            # endpoint is gone (the host's directory removed by a test's teardown), it exits.
            if not os.path.exists(control):
                return
    finally:
        model.stop_all()
        _log(log_dir, "control.log", "Shutdown")


def _accept(model: mpsmodel.Daemon, selector: selectors.BaseSelector, listener: socket.socket) -> None:
    import json
    import selectors

    from isolator.simhost import mpsmodel

    try:
        conn, _ = listener.accept()
    except OSError:
        return
    conn.settimeout(2.0)
    try:
        first = _read_line(conn)
        pid, uid = _peer(conn)
    except OSError:
        conn.close()
        return
    if not first.startswith(CLIENT_HELLO):
        _send(conn, model.command(first, peer_uid=uid))
        conn.close()
        return
    try:
        env = {k: str(v) for k, v in json.loads(first[len(CLIENT_HELLO) :]).items()}
    except (ValueError, AttributeError):
        env = {}
    command, namespace = _describe(pid)
    client = mpsmodel.Client(pid, uid, env, lambda line: _send(conn, line), command=command, namespace=namespace)
    outcome = model.connect(client)
    if outcome == "refused":
        _send(conn, f"REFUSED {mpsmodel.CUDA_ERROR_MPS_SERVER_NOT_READY}")
        conn.close()
        return
    if outcome == "ready":
        _send(conn, model.ready_line(client))
    conn.settimeout(None)
    selector.register(conn, selectors.EVENT_READ, pid)


def daemon(multiuser: bool = False) -> int:
    """``-d``: fork the control daemon, return once it listens (the real one returns at once)."""
    import contextlib

    if multiuser and os.geteuid() != 0:
        sys.stderr.write("Only root user may enable -multiuser-server!\n")  # the binary's string
        return 1
    pipe, log_dir = _dirs()
    os.makedirs(pipe, exist_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(pipe, CONTROL)
    if _ask(pipe, "get_server_list") is not None:
        sys.stderr.write("An instance of this daemon is already running\n")
        return 1
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o666)  # as the real one's: any user's client connects (measured)
    listener.listen(64)
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        listener.close()
        os.close(write)
        os.read(read, 1)  # the daemon wrote its pid file
        os.close(read)
        return 0
    os.close(read)
    os.setsid()
    if os.fork():
        os._exit(0)
    with open(os.path.join(pipe, PID_FILE), "w") as fh:
        fh.write(f"{os.getpid()}\n")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.write(write, b"1")
    os.close(write)
    try:
        _serve(pipe, log_dir, listener, multiuser)
        for name in (CONTROL, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(pipe, name))
    finally:
        os._exit(0)


def _ask(pipe: str, command: str) -> str | None:
    """The daemon's answer to ``command``, None when no daemon listens."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(10)
        conn.connect(os.path.join(pipe, CONTROL))
        conn.sendall((command.strip() + "\n").encode())
        data = b""
        while chunk := conn.recv(4096):  # the daemon closes after its answer, which may be lines
            data += chunk
        return data.decode(errors="replace").rstrip("\n")
    except OSError:
        return None
    finally:
        conn.close()


def client() -> int:
    """Without ``-d``: each line of stdin is a command for the running daemon."""
    pipe, _log_dir = _dirs()
    for line in sys.stdin.read().splitlines():
        if not line.strip():
            continue
        reply = _ask(pipe, line)
        if reply is None:
            sys.stderr.write("Cannot find MPS control daemon process\n")
            return 1
        if reply:
            sys.stdout.write(reply + "\n")
    return 0


def install(path: str) -> str:
    """Write an executable ``nvidia-cuda-mps-control`` at ``path`` that runs this stand-in."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        # A script of this interpreter (not a shell wrapper that execs it): its daemon's /proc/<pid>/exe
        # is the interpreter its #! line names, which is how host/mps.py recognises a script's daemon.
        fh.write(f"#!{sys.executable}\nimport sys\n\nfrom isolator.simhost.mpscontrol import main\n\n")
        fh.write("sys.exit(main(sys.argv[1:]))\n")
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


def main(argv: list[str]) -> int:
    if argv and argv[0] == "-d" and all(a in MULTIUSER_FLAGS for a in argv[1:]):
        return daemon(multiuser=len(argv) > 1)
    if not argv:
        return client()
    sys.stderr.write(f"usage: nvidia-cuda-mps-control [-d [-multiuser-server]] (got {' '.join(argv)})\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
