"""A stand-in ``nvidia-cuda-mps-control`` for the simulated host (docs/sharing.md, docs/simhost.md).

Started the way the real one is: ``nvidia-cuda-mps-control -d`` with ``CUDA_MPS_PIPE_DIRECTORY``,
``CUDA_MPS_LOG_DIRECTORY`` and ``CUDA_VISIBLE_DEVICES`` in its environment forks a control daemon
and returns; ``echo CMD | nvidia-cuda-mps-control`` (same environment) sends one control command
and prints the answer. The daemon keeps its pid in ``<pipe dir>/nvidia-cuda-mps-control.pid``, its
control endpoint at ``<pipe dir>/control`` (a Unix socket here; a FIFO in the real one) and logs
every command it is told to ``<log dir>/control.log``. Commands answered: ``get_server_list``,
``get_default_active_thread_percentage``, ``set_default_active_thread_percentage P``,
``get_default_device_pinned_mem_limit DEV``, ``set_default_device_pinned_mem_limit DEV LIMIT``,
``quit``. Anything else is answered as the real one answers an unknown command and logged.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL = "control"
DEFAULT_PIPE = "/tmp/nvidia-mps"
DEFAULT_LOG = "/var/log/nvidia-mps"


def _dirs() -> tuple[str, str]:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE), os.environ.get(
        "CUDA_MPS_LOG_DIRECTORY", DEFAULT_LOG
    )


def _log(log_dir: str, line: str) -> None:
    with open(os.path.join(log_dir, "control.log"), "a") as fh:
        fh.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")


def _percentage(text: str, current: str) -> str:
    """``text`` as the daemon keeps a thread percentage (``25.0``), or ``current`` when it is not one."""
    try:
        value = float(text)
    except ValueError:
        return current
    return f"{value:.1f}" if 0 < value <= 100 else current


def _serve(pipe: str, log_dir: str, listener: socket.socket) -> None:
    """The control daemon's loop: one command per connection, until ``quit``."""
    settings = {"threads": "100.0"}
    limits: dict[str, str] = {}
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    _log(log_dir, f"Startup: CUDA_VISIBLE_DEVICES={devices}")
    control = os.path.join(pipe, CONTROL)
    listener.settimeout(1.0)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            # Unlike the real one, the stand-in never outlives its simulated host: once its control
            # endpoint is gone (the host's directory removed by a test's teardown), it exits.
            if not os.path.exists(control):
                return
            continue
        conn.settimeout(None)
        with conn:
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            words = data.decode(errors="replace").split()
            command = " ".join(words)
            _log(log_dir, f"Control: {command}")
            reply, done = "", False
            if words == ["get_server_list"]:
                reply = ""  # no client has started an MPS server on the simulated GPU
            elif words == ["get_default_active_thread_percentage"]:
                reply = settings["threads"]
            elif len(words) == 2 and words[0] == "set_default_active_thread_percentage":
                # As the real daemon (driver 580): a percentage outside (0, 100] or not a number is
                # no error; the value in force is echoed, so a caller tells success by the echo.
                settings["threads"] = _percentage(words[1], settings["threads"])
                reply = settings["threads"]
            elif len(words) == 2 and words[0] == "get_default_device_pinned_mem_limit":
                reply = limits.get(words[1], "")  # the real one prints nothing for an unset limit
            elif len(words) == 3 and words[0] == "set_default_device_pinned_mem_limit":
                limits[words[1]] = words[2]
            elif words == ["quit"]:
                done = True
            else:
                reply = f'Unknown command "{command}"'
            conn.sendall((reply + "\n").encode())
        if done:
            _log(log_dir, "Shutdown")
            for name in (CONTROL, PID_FILE):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(pipe, name))
            return


def daemon() -> int:
    """``-d``: fork the control daemon, return once it listens (the real one returns at once)."""
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
    listener.listen(16)
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
        _serve(pipe, log_dir, listener)
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
        while not data.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                break
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
    if argv == ["-d"]:
        return daemon()
    if not argv:
        return client()
    sys.stderr.write(f"usage: nvidia-cuda-mps-control [-d] (got {' '.join(argv)})\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
