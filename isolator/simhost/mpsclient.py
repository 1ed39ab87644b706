"""A stand-in MPS client (a CUDA process) for the simulated host: what a sharer's task runs to see
what CUDA would give it (docs/sharing.md, docs/simhost.md).

``python -m isolator.simhost.mpsclient [--seconds S] [--exit-on-fault] [--sms N]`` connects to the
control daemon at ``$CUDA_MPS_PIPE_DIRECTORY`` (CUDA's default ``/tmp/nvidia-mps`` when unset) as the
real client library does, sending its ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``; the server gives it the lower of its own values and those
(measured: a client can tighten, never raise). It prints one JSON line with what it got, then stays
connected until SIGTERM/SIGINT, ``--seconds`` or its daemon's word, printing each event as a line:

  {"mps": true, "server": 669, "active_thread_percentage": 25.0, "pinned_mem_limit_mib": 2048, ...}
  {"event": "fault", "error": "CUDA_ERROR_ILLEGAL_ADDRESS", "code": 700}

While another user's server holds the GPU it waits before printing anything (the real ``cuInit``
blocks, measured). With no daemon reachable it runs WITHOUT MPS, as CUDA does in the Default compute
mode: ``{"mps": false, "active_thread_percentage": 100.0, "pinned_mem_limit_mib": null}``, the whole GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

from isolator.simhost import mpscontrol, mpsmodel

EXIT_ERROR = 1
ERRORS = {
    mpsmodel.CUDA_ERROR_ILLEGAL_ADDRESS: "CUDA_ERROR_ILLEGAL_ADDRESS",
    mpsmodel.CUDA_ERROR_MPS_SERVER_NOT_READY: "CUDA_ERROR_MPS_SERVER_NOT_READY",
    mpsmodel.CUDA_ERROR_MPS_CLIENT_TERMINATED: "CUDA_ERROR_MPS_CLIENT_TERMINATED",
}


def _print(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record, sort_keys=True) + "\n")
    sys.stdout.flush()


def sm_count(percent: float, sms: int) -> int:
    """The SMs a context gets at ``percent`` on a GPU of ``sms``: rounded down to whole TPCs of two
    SMs (measured on an H200 of 132: 10 % -> 12, 25 % -> 32, 40 % -> 52, 50 % -> 66, 100 % -> 132)."""
    return max(2, int(percent * sms / 100) // 2 * 2)


def _lines(conn: socket.socket):
    buffer = b""
    while True:
        while b"\n" not in buffer:
            chunk = conn.recv(4096)
            if not chunk:
                return
            buffer += chunk
        line, _, buffer = buffer.partition(b"\n")
        yield line.decode(errors="replace")


def run(args: argparse.Namespace) -> int:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", mpscontrol.DEFAULT_PIPE)
    base: dict[str, object] = {"pid": os.getpid(), "uid": os.getuid()}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.path.join(pipe, mpscontrol.CONTROL))
    except OSError as exc:
        record = dict(base, mps=False, active_thread_percentage=100.0, pinned_mem_limit_mib=None, why=str(exc))
        if args.sms:
            record["sm_count"] = args.sms
        _print(record)
        return _hold(None, args)
    env = {k: os.environ[k] for k in (mpsmodel.ENV_THREADS, mpsmodel.ENV_PINNED) if k in os.environ}
    conn.sendall((mpscontrol.CLIENT_HELLO + json.dumps(env) + "\n").encode())
    lines = _lines(conn)
    first = next(lines, "")
    if not first.startswith("READY "):
        code = int(first.split()[1]) if first.startswith("REFUSED ") else mpsmodel.CUDA_ERROR_MPS_SERVER_NOT_READY
        _print(dict(base, mps=True, error=ERRORS.get(code, str(code)), code=code))
        return EXIT_ERROR
    got = json.loads(first[len("READY ") :])
    record = dict(
        base,
        mps=True,
        server=got["server"],
        active_thread_percentage=got["threads"],
        pinned_mem_limit_mib=None if got["pinned"] is None else got["pinned"] // (1 << 20),
    )
    if args.sms:
        record["sm_count"] = sm_count(float(got["threads"]), args.sms)
    _print(record)
    return _hold(lines, args)


def _hold(lines, args: argparse.Namespace) -> int:
    """Stay (connected) until told or killed; print what the daemon says meanwhile."""
    if args.seconds is not None and args.seconds <= 0:
        return 0  # report and go (setitimer(0) would mean no timer: hold forever)
    if args.seconds is not None:
        signal.signal(signal.SIGALRM, lambda *_: sys.exit(0))
        signal.setitimer(signal.ITIMER_REAL, args.seconds)
    if lines is None:
        while True:
            time.sleep(3600)
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "FAULT":
            code = int(rest)
            _print({"event": "fault", "error": ERRORS[code], "code": code})
            if args.exit_on_fault:
                return EXIT_ERROR
        elif word == "TERMINATED":
            code = int(rest)
            _print({"event": "terminated", "error": ERRORS[code], "code": code})
            return EXIT_ERROR
        elif word == "EXIT":
            break
    _print({"event": "server gone"})
    return EXIT_ERROR


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mpsclient", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=None, help="exit 0 after this long (default: never)")
    parser.add_argument("--exit-on-fault", action="store_true", help="exit at a fault of its server")
    parser.add_argument("--sms", type=int, default=0, help="the GPU's SM count: also print the SMs it gets")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return run(args)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
