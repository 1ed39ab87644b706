"""The executable a Mesos agent runs through criteo/mesos-command-modules: ``<command> IN OUT ERR``.

It forwards IN's bytes to the sidecar's bridge socket (isolator/transport/bridge.py) and writes the
answer to OUT, or one line to ERR with a non-zero exit. The agent starts one per call, so it imports
only what the interpreter has already loaded or builds in (``_socket``, ``_signal``, ``time``): no
json, no grpc, nothing else of this package. It must never write to stdout (the agent's log).
"""

from __future__ import annotations

import _signal
import _socket
import posix  # os's C half, already loaded at start; importing os would cost a module load
import sys
import time

# The methods the module forwards (reference: bridge-and-cgroup2.md §A.1.3).
METHODS = ("prepare", "isolate", "watch", "usage", "cleanup")
# The framing's names: proto/gpuisolator/v1/wire.proto's BridgeToken, spelled here because this
# executable imports nothing of ours (tests/unit/transport/test_wire_names.py keeps them equal).
# Version 2 carries the deadline, absolute (isolator/transport/bridge.py; docs/mesos-agent.md section 6).
PROTOCOL = b"gpu-isolator-bridge/2"
REPLY_OK = b"OK"
REPLY_ERROR = b"ERROR"
REPLY_RETRY = b"RETRY"
# isolator.daemon.config.DEFAULT_SOCKET + BRIDGE_SUFFIX; not imported, to keep the start cheap (a test
# keeps the two in step).
DEFAULT_SOCKET = "/run/gpu-isolator/isolator.sock.bridge"
# The module SIGTERMs a command after `isolator_<method>_timeout` seconds (default 30). Giving up a
# few seconds earlier lets the reason reach ERR instead of "took too long to execute".
DEFAULT_TIMEOUT = 25.0
SOCKET_ENV = "GPU_ISOLATOR_BRIDGE_SOCKET"
TIMEOUT_ENV = "GPU_ISOLATOR_BRIDGE_TIMEOUT"
LAUNCHER = "gpu-isolator-bridge"

# Exit statuses, all below 128 so that they never read as a death by signal.
EXIT_OK = 0
EXIT_REFUSED = 1  # the sidecar answered with an error; its code and message are in ERR
EXIT_USAGE = 2  # wrong arguments, an unreadable IN, an unwritable OUT, a bad setting
EXIT_UNREACHABLE = 3  # no sidecar on the socket, or it broke the connection
EXIT_DEADLINE = 4  # no answer before the deadline
EXIT_SIGNAL = 5  # SIGTERM (the module's timeout) or SIGINT
EXIT_INTERNAL = 6  # a bug in the bridge itself


class Failure(Exception):
    """Ends the call with ``status`` and ``message`` in ERR.

    ``harmless_for_cleanup``: the failure cannot leave anything held that the sidecar will not
    release on its own, so cleanup reports success (a failed cleanup leaves the container stuck in
    DESTROYING for the rest of the agent's run; reference §A.1.8 pitfall 3).
    """

    def __init__(
        self, status: int, message: str, harmless_for_cleanup: bool = False, retry_ms: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.harmless_for_cleanup = harmless_for_cleanup
        # Set on a RETRY answer (load shedding): the call did not run; send it again after this pause.
        self.retry_ms = retry_ms


class Terminated(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.name = "SIGTERM" if signum == _signal.SIGTERM else "SIGINT"


def _on_signal(signum: int, frame: object) -> None:
    # Ignore repeats so that reporting the first one is not interrupted.
    _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    raise Terminated(signum)


def parse_argv(argv: list[str]) -> tuple[str, str, str, str]:
    """(method, IN, OUT, ERR) from ``<name> IN OUT ERR`` or ``<launcher> METHOD IN OUT ERR``.

    The module passes no arguments of its own, so the method comes from the executable's name
    (``gpu-isolator-prepare``, a symlink to the launcher), or from a first argument for people.
    """
    name = argv[0].rsplit("/", 1)[-1] if argv else ""
    method = name.rsplit("-", 1)[-1]
    if method in METHODS and len(argv) == 4:
        return method, argv[1], argv[2], argv[3]
    if len(argv) == 5 and argv[1] in METHODS:
        return argv[1], argv[2], argv[3], argv[4]
    raise Failure(
        EXIT_USAGE,
        f"usage: gpu-isolator-<method> IN OUT ERR, or {LAUNCHER} METHOD IN OUT ERR; METHOD is one of"
        f" {', '.join(METHODS)} (got {len(argv) - 1} argument(s) to '{name}')",
    )


def settings(socket_path: str | None, timeout: float | None, environ: dict[bytes, bytes]) -> tuple[str, float]:
    """The socket and deadline: the environment wins over the launcher's values over the defaults."""
    path = environ.get(SOCKET_ENV.encode(), b"").decode("utf-8", "surrogateescape") or socket_path or DEFAULT_SOCKET
    raw = environ.get(TIMEOUT_ENV.encode(), b"").decode("utf-8", "replace")
    if raw:
        try:
            timeout = float(raw)
        except ValueError:
            raise Failure(EXIT_USAGE, f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    if not 0 < timeout < 86400:
        raise Failure(EXIT_USAGE, f"bridge timeout {timeout} s must be above 0 and below a day")
    return path, timeout


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise Failure(EXIT_USAGE, f"failed to read input file '{path}': {exc.strerror}") from None


def _write(path: str, data: bytes) -> None:
    try:
        with open(path, "wb") as fh:
            fh.write(data)
    except OSError as exc:
        raise Failure(EXIT_USAGE, f"failed to write output file '{path}': {exc.strerror}") from None


def call(path: str, method: str, payload: bytes, timeout: float) -> bytes:
    """Send one request to the bridge socket; the bytes for OUT, or Failure.

    Only a ``RETRY <pause_ms> <CODE> <message>`` answer (load shedding: the sidecar did not run the
    call) is sent again, after pause_ms and then doubling up to 500 ms, until the deadline; then the
    last answer is reported as ``<CODE>: <message>``. ``ERROR`` answers are final (no free GPU is
    permanent: retrying it would hold the agent's one hook at a time for the whole deadline).
    """
    deadline = time.monotonic() + timeout
    pause: float | None = None
    while True:
        try:
            return _call_once(path, method, payload, deadline, timeout)
        except Failure as failure:
            if failure.retry_ms is None:
                raise
            pause = failure.retry_ms / 1000.0 if pause is None else min(max(pause * 2, failure.retry_ms / 1000.0), 0.5)
            pause = max(pause, 0.001)  # "RETRY 0 ...": never a busy loop against a shedding sidecar
            if deadline - time.monotonic() < pause * 2:
                raise
        time.sleep(pause)


def _call_once(path: str, method: str, payload: bytes, deadline: float, total: float) -> bytes:
    timeout = deadline - time.monotonic()
    late = Failure(EXIT_DEADLINE, f"no answer from the sidecar at '{path}' within {total:g} s")
    if timeout <= 0:
        raise late  # a deadline too short to reach the sidecar at all (socket timeouts must be positive)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except TimeoutError:
            raise late from None
        except OSError as exc:
            down = isinstance(exc, (FileNotFoundError, ConnectionRefusedError))
            hint = " (is 'gpu-isolator serve' running?)" if down else ""
            raise Failure(
                EXIT_UNREACHABLE, f"cannot reach the sidecar at '{path}': {exc.strerror}{hint}", down
            ) from None
        # The timeout left and the deadline itself, on CLOCK_MONOTONIC: the sidecar answers a call
        # it reads after the deadline (it was stopped meanwhile) DEADLINE_EXCEEDED without running it.
        header = b"%s %s %d %d\n" % (PROTOCOL, method.encode(), int(timeout * 1000), int(deadline * 1000))
        try:
            sock.sendall(header + payload)
            sock.shutdown(_socket.SHUT_WR)
        except TimeoutError:
            raise late from None
        except OSError:
            pass  # it may have answered early (a request over its size limit): read the answer
        chunks = []
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise late from None
            except OSError as exc:
                raise Failure(EXIT_UNREACHABLE, f"the sidecar at '{path}' dropped the call: {exc.strerror}") from None
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        sock.close()
    reply = b"".join(chunks)
    status, _, rest = reply.partition(b"\n")
    if status == REPLY_OK:
        return rest
    if status.startswith(REPLY_ERROR + b" "):
        code, _, message = status[len(REPLY_ERROR) + 1 :].decode("utf-8", "replace").partition(" ")
        raise Failure(EXIT_REFUSED, f"{code}: {message}", code in ("NOT_FOUND", "INVALID_ARGUMENT"))
    if status.startswith(REPLY_RETRY + b" "):
        pause_ms, _, coded = status[len(REPLY_RETRY) + 1 :].decode("utf-8", "replace").partition(" ")
        code, _, message = coded.partition(" ")
        if pause_ms.isascii() and pause_ms.isdigit() and code:
            raise Failure(EXIT_REFUSED, f"{code}: {message}", retry_ms=min(int(pause_ms), 500))
    if not reply:
        raise Failure(EXIT_UNREACHABLE, f"the sidecar at '{path}' closed the connection without an answer")
    raise Failure(EXIT_UNREACHABLE, f"the sidecar at '{path}' answered something unintelligible: {status[:60]!r}")


def _report(err_path: str | None, line: str) -> None:
    # One line without a newline: the module appends ERR to its Failure verbatim
    # ("... exited with return code N. Cause: <ERR>").
    data = " ".join(line.split()).encode("utf-8", "replace")
    if err_path is not None:
        try:
            with open(err_path, "wb") as fh:
                fh.write(data)
            return
        except OSError:
            pass
    sys.stderr.buffer.write(data + b"\n")


HELP = """\
usage: gpu-isolator-<method> IN OUT ERR
       gpu-isolator-bridge METHOD IN OUT ERR      (METHOD: prepare, isolate, watch, usage, cleanup)

Forwards one isolator call of a Mesos agent (criteo/mesos-command-modules) to the gpu-isolator
sidecar's bridge socket: reads the request from IN, writes the answer to OUT, or one line to ERR
and a non-zero exit status (1 refused, 2 usage, 3 unreachable, 4 deadline, 5 signal, 6 bug).

Install it for an agent with
    python -m isolator.bridge install /usr/libexec/gpu-isolator [--socket PATH] [--timeout S] [--compiled]
which writes this launcher and one gpu-isolator-<method> link per method; name those paths in the
agent's modules.json (docs/mesos-agent.md, "The two routes in brief" and section 3).

Environment: GPU_ISOLATOR_BRIDGE_SOCKET (default /run/gpu-isolator/isolator.sock.bridge),
GPU_ISOLATOR_BRIDGE_TIMEOUT (seconds, default 25).
"""


def _log(line: str) -> None:
    sys.stderr.buffer.write(" ".join(line.split()).encode("utf-8", "replace") + b"\n")


def _quiet_watch(message: str) -> int:
    """A watch poll that could not ask the sidecar: no limitation, one line in the agent's log, exit 0.

    The module's watch loop only logs a non-zero exit and polls again, but it returns before
    deleting its three temp files (criteo CommandRunner::runWithoutTimeout), once per container
    per period while the sidecar is down. Exit 0 with OUT left empty means "keep waiting": the
    files are deleted and the next poll asks again. ERR is not read on success, so the reason
    goes to stderr, which ``system()`` leaves on the agent's log.
    """
    _log(f"gpu-isolator watch: {message}; no limitation reported, the module polls again")
    return EXIT_OK


def main(argv: list[str] | None = None, socket_path: str | None = None, timeout: float | None = None) -> int:
    argv = sys.argv if argv is None else argv
    if argv[1:] == ["--version"]:
        from isolator import __version__  # the package's __init__: already imported by the launcher

        # As every tool: its own name (``gpu-isolator-prepare``, the symlink it was run as), then
        # the version. Any other name (``__main__.py`` under ``python -m``) is the launcher's.
        name = argv[0].rsplit("/", 1)[-1] if argv else ""
        name = name if name.startswith("gpu-isolator-") and name.rsplit("-", 1)[-1] in METHODS else LAUNCHER
        sys.stdout.write(f"{name} {__version__}\n")
        return EXIT_OK
    if argv[1:] in (["--help"], ["-h"]):
        sys.stdout.write(HELP)
        return EXIT_OK
    _signal.signal(_signal.SIGTERM, _on_signal)
    _signal.signal(_signal.SIGINT, _on_signal)
    started = time.monotonic()
    method = "bridge"
    err_path: str | None = None
    try:
        try:
            method, in_path, out_path, err_path = parse_argv(argv)
            path, deadline = settings(socket_path, timeout, posix.environ)
            _write(out_path, call(path, method, _read(in_path), deadline))
            return EXIT_OK
        except Failure as failure:
            if method == "cleanup" and failure.harmless_for_cleanup:
                # Reported on stderr (the agent's log) since the module ignores ERR on success.
                _log(f"gpu-isolator {method}: {failure.message}; reporting success")
                return EXIT_OK
            if method == "watch":
                return _quiet_watch(failure.message)
            _report(err_path, f"gpu-isolator {method}: {failure.message}")
            return failure.status
        except Exception as exc:  # a bug: still one line in ERR and a status below 128
            if method == "watch":
                return _quiet_watch(f"internal error in the bridge: {exc!r}")
            _report(err_path, f"gpu-isolator {method}: internal error in the bridge: {exc!r}")
            return EXIT_INTERNAL
    except Terminated as term:
        elapsed = time.monotonic() - started
        line = f"gpu-isolator {method}: interrupted by {term.name} after {elapsed:.1f} s"
        # When the module's own timeout sends SIGTERM it fails the call with "Command execution
        # error" and never reads ERR (criteo CommandRunner::run): stderr, the agent's log, is the
        # only place this line is seen then.
        _report(err_path, line)
        _log(line)
        return EXIT_SIGNAL


# ---- installing the launcher ----------------------------------------------------------------------

LAUNCHER_TEMPLATE = """\
#!{python} -IS
# The gpu-isolator bridge for criteo/mesos-command-modules, written by
# `python -m isolator.bridge install`. -I -S: no site-packages scan at start (one is forked per call).
import sys

sys.path.append({package_root!r})
from isolator.bridge.command import main

sys.exit(main(socket_path={socket!r}, timeout={timeout!r}))
"""


# The compiled bridge (isolator/bridge/bridge.c) reads its settings from this file beside it; the
# environment still wins over them, as over the Python launcher's.
CONF_NAME = "gpu-isolator-bridge.conf"
CONF_TEMPLATE = """\
# Settings of the compiled gpu-isolator bridge beside this file, written by
# `python -m isolator.bridge install --compiled`. GPU_ISOLATOR_BRIDGE_SOCKET and
# GPU_ISOLATOR_BRIDGE_TIMEOUT override them.
socket={socket}
timeout={timeout!r}
"""


def compiled_bridge() -> str | None:
    """The compiled bridge executable `make build` left in build/ beside the package, or None
    (a wheel, or a checkout where no compiler ran)."""
    import os

    import isolator

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(isolator.__file__)))
    path = os.path.join(package_root, "build", LAUNCHER)
    return path if os.access(path, os.X_OK) else None


def install(
    directory: str,
    socket_path: str = DEFAULT_SOCKET,
    timeout: float = DEFAULT_TIMEOUT,
    compiled: str | None = None,
) -> list[str]:
    """Write the launcher and one ``gpu-isolator-<method>`` symlink per method into ``directory``.

    The launcher is either a Python script that runs this interpreter with -I -S and finds this
    package by absolute path, or, with ``compiled`` (the path of a built bridge.c, e.g.
    ``compiled_bridge()``), a copy of that executable with ``gpu-isolator-bridge.conf`` beside it
    holding the socket and the timeout. Returns the paths an agent's modules.json names, launcher first.
    """
    import os
    import shutil

    import isolator

    if not 0 < timeout < 86400:
        raise ValueError(f"timeout {timeout} s must be above 0 and below a day")
    if "\n" in socket_path or "\0" in socket_path:
        raise ValueError(f"socket path {socket_path!r} holds a newline or a NUL")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(isolator.__file__)))
    os.makedirs(directory, exist_ok=True)
    launcher = os.path.join(os.path.abspath(directory), LAUNCHER)
    conf = os.path.join(os.path.dirname(launcher), CONF_NAME)
    pid = os.getpid()
    if compiled is not None:
        # The settings first: the binary without them would talk to the default socket.
        with open(f"{conf}.tmp{pid}", "w") as fh:
            fh.write(CONF_TEMPLATE.format(socket=socket_path, timeout=float(timeout)))
        os.chmod(f"{conf}.tmp{pid}", 0o644)
        os.replace(f"{conf}.tmp{pid}", conf)
        shutil.copyfile(compiled, f"{launcher}.tmp{pid}")
    else:
        with open(f"{launcher}.tmp{pid}", "w") as fh:
            fh.write(
                LAUNCHER_TEMPLATE.format(
                    python=sys.executable, package_root=package_root, socket=socket_path, timeout=float(timeout)
                )
            )
        if os.path.lexists(conf):
            os.unlink(conf)  # left by a compiled install; the Python launcher never reads it
    os.chmod(f"{launcher}.tmp{pid}", 0o755)
    os.replace(f"{launcher}.tmp{pid}", launcher)
    paths = [launcher]
    for method in METHODS:
        link = os.path.join(os.path.dirname(launcher), f"gpu-isolator-{method}")
        os.symlink(LAUNCHER, f"{link}.tmp{pid}")
        os.replace(f"{link}.tmp{pid}", link)
        paths.append(link)
    return paths


def _install_compiled(directory: str, socket_path: str, timeout: float) -> list[str]:
    """Build bridge.c into a scratch directory beside ``directory`` and install that; a build that
    cannot happen raises (never the Python launcher instead: the operator asked for this one)."""
    import os
    import tempfile

    from isolator.bridge.build import BuildError, build

    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gpu-isolator-build-", dir=directory) as scratch:
        binary = os.path.join(scratch, LAUNCHER)
        try:
            build(binary)
        except BuildError as exc:
            raise ValueError(
                f"--compiled: cannot build the compiled bridge: {exc}; nothing was installed"
                " (leave out --compiled for the Python launcher)"
            ) from exc
        return install(directory, socket_path, timeout, compiled=binary)


def _install_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m isolator.bridge install",
        description="Write the bridge launcher and its gpu-isolator-<method> symlinks into DIR.",
    )
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help=f"bridge socket (default {DEFAULT_SOCKET})")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds to wait for the sidecar; keep it below every isolator_<m>_timeout (default {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="install the compiled bridge instead of the Python launcher: bridge.c, shipped in the package,"
        " is built with $CC (default gcc); where it cannot be built the install fails and installs nothing",
    )
    args = parser.parse_args(argv)
    try:
        if args.compiled:
            paths = _install_compiled(args.directory, args.socket, args.timeout)
        else:
            paths = install(args.directory, args.socket, args.timeout)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"gpu-isolator bridge install: {exc}\n")
        return 1
    sys.stdout.write("".join(p + "\n" for p in paths))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["install"]:
        sys.exit(_install_main(sys.argv[2:]))
    sys.exit(main())
