"""The MPS control daemons' edge: one ``nvidia-cuda-mps-control -d`` per shared GPU in mps mode, its
pipe and log directories under a root of ours, control commands, liveness and stop (docs/sharing.md).

Decides nothing (which GPU needs a daemon is the core's, core/mps.py). The executable and the root
come from the constructor: the driver's ``nvidia-cuda-mps-control`` on a real host, the simulated
host's stand-in (isolator/simhost/mpscontrol.py) under ``--simulate``.

Who a daemon is comes from what this edge started, never from the pid file the daemon keeps in its
pipe directory: the real one makes it 0666, so any user may rewrite it (docs/gpu-host-results.md).
At start the edge finds the process it launched in /proc and checks it (uid 0, its executable, our
pipe directory in its environment, started after the launch), then records its pid and start time
in memory and in ``<root>/<GPU UUID>/daemon.json`` (0600, in a 0755 directory of root's), so that a
restarted sidecar recognises it; a pid whose start time differs is another process by now.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from isolator.crashpoints import crashpoint
from isolator.errors import FailedPrecondition

LOG = logging.getLogger(__name__)

# Where the control daemon keeps its pid, inside its pipe directory: never read (any user may write it).
PID_FILE = "nvidia-cuda-mps-control.pid"
# What this edge knows of the daemon it started, beside (not inside) the pipe directory.
RECORD = "daemon.json"
COMMAND_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
SETTLE_TIMEOUT_S = 10.0
DAEMON_FLAGS = ("-d", "--daemon")


class MpsError(FailedPrecondition):
    msg_fmt = "failed to {op} the MPS control daemon of GPU {gpu} ('{path}'): {cause}"


@dataclass(frozen=True)
class Daemon:
    """A control daemon this edge started: its pid and its start time (clock ticks after boot,
    field 22 of /proc/<pid>/stat) in the boot that started it. Together they name one process."""

    pid: int
    start: int
    boot: str


@dataclass(frozen=True)
class _Record:
    """``daemon.json``: the boot and tick at which a launch began; the daemon, once it was found."""

    boot: str
    since: int
    pid: int | None = None
    start: int | None = None


class MpsControl:
    """``root``/<GPU UUID>/pipe and /log, made 0755 by us; ``executable`` is nvidia-cuda-mps-control.
    ``daemon_exe`` is the file the daemon process runs: by default the executable itself (the
    driver's), or for a script (the simulated host's stand-in) the interpreter its ``#!`` line names."""

    def __init__(self, executable: str, root: str, proc_root: str = "/proc", daemon_exe: str | None = None) -> None:
        self.executable = executable
        self._daemon_exe = daemon_exe
        self.root = root
        self.proc_root = proc_root
        self._lock = threading.Lock()
        self._known: dict[str, Daemon] = {}
        self._scanned: dict[str, int] = {}  # uuid -> the launch tick whose orphan was looked for already

    @property
    def daemon_exe(self) -> str:
        if self._daemon_exe:
            return self._daemon_exe
        try:
            with open(self.executable, "rb") as fh:
                first = fh.readline(512)
        except OSError:
            return self.executable
        words = first[2:].split() if first.startswith(b"#!") else []
        return words[0].decode(errors="replace") if words else self.executable

    def pipe_dir(self, uuid: str) -> str:
        return os.path.join(self.root, uuid, "pipe")

    def log_dir(self, uuid: str) -> str:
        return os.path.join(self.root, uuid, "log")

    def _record_path(self, uuid: str) -> str:
        return os.path.join(self.root, uuid, RECORD)

    def _env(self, uuid: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
        env.update(
            CUDA_VISIBLE_DEVICES=uuid,  # the daemon and its servers see this GPU only
            CUDA_MPS_PIPE_DIRECTORY=self.pipe_dir(uuid),
            CUDA_MPS_LOG_DIRECTORY=self.log_dir(uuid),
        )
        return env

    # ---- start, command, liveness, stop ------------------------------------------------------------

    def start(self, uuid: str, multiuser: bool = False) -> int:
        """Start the control daemon of GPU ``uuid``; its pid. The directories are made (or checked)
        first; the launch is recorded before it happens and the daemon once it is found, so that a
        sidecar killed in between recognises it after a restart. ``multiuser``: ``-multiuser-server``,
        one server for every uid (no isolation between users)."""
        self._own_dirs(uuid)
        boot = self._boot_id()
        since = self._ticks_now()
        self._write_record(uuid, _Record(boot, since))
        crashpoint("mps.launching")
        try:
            result = subprocess.run(
                [self.executable, "-d", *(["-multiuser-server"] if multiuser else [])],
                env=self._env(uuid),
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(op="start", gpu=uuid, path=self.executable, cause=str(exc)) from exc
        if result.returncode != 0:
            cause = (result.stderr or result.stdout).strip() or f"exit {result.returncode}"
            raise MpsError(op="start", gpu=uuid, path=self.executable, cause=cause)
        crashpoint("mps.spawned")
        daemon = self._settle(uuid, boot, since)
        self._write_record(uuid, _Record(boot, since, daemon.pid, daemon.start))
        with self._lock:
            self._known[uuid] = daemon
        return daemon.pid

    def command(self, uuid: str, text: str) -> str:
        """Send one control command (``echo text | nvidia-cuda-mps-control``); its answer."""
        try:
            result = subprocess.run(
                [self.executable],
                env=self._env(uuid),
                input=text + "\n",
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(op=f"send '{text}' to", gpu=uuid, path=self.executable, cause=str(exc)) from exc
        if result.returncode != 0:
            cause = (result.stderr or result.stdout).strip() or f"exit {result.returncode}"
            raise MpsError(op=f"send '{text}' to", gpu=uuid, path=self.executable, cause=cause)
        return result.stdout.strip()

    def pid(self, uuid: str) -> int | None:
        """The pid of the control daemon this edge (or the sidecar before a restart) started for
        ``uuid``, while it runs; None otherwise, whatever the pipe directory says."""
        daemon = self.identify(uuid)
        return daemon.pid if daemon is not None else None

    def multiuser(self, uuid: str) -> bool | None:
        """Whether the running daemon was started with -multiuser-server (its command line, as
        ``ps -o args`` shows it); None when none runs."""
        pid = self.pid(uuid)
        if pid is None:
            return None
        try:
            with open(os.path.join(self.proc_root, str(pid), "cmdline"), "rb") as fh:
                args = fh.read().split(b"\0")
        except OSError:
            return None
        return any(a in (b"-multiuser-server", b"-M", b"--multiuser-server") for a in args)

    def alive(self, uuid: str) -> bool:
        """Our daemon's process lives and it answers a control command."""
        if self.identify(uuid) is None:
            return False
        try:
            self.command(uuid, "get_server_list")
        except MpsError as exc:
            LOG.warning("MPS control daemon of GPU %s does not answer: %s", uuid, exc.message)
            return False
        return True

    def stop(self, uuid: str) -> None:
        """``quit``, then SIGKILL if it is still there after STOP_TIMEOUT_S. Only a daemon this edge
        started is ever signalled; nothing of ours runs: no-op."""
        daemon = self.identify(uuid)
        if daemon is None:
            return
        with contextlib.suppress(MpsError):
            self.command(uuid, "quit")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self._is_ours(uuid, daemon) and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._is_ours(uuid, daemon):
            LOG.error("MPS control daemon %d of GPU %s did not quit; killing it", daemon.pid, uuid)
            self._kill(uuid, daemon)
        with self._lock:
            self._known.pop(uuid, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._record_path(uuid))

    # ---- identity ----------------------------------------------------------------------------------

    def identify(self, uuid: str) -> Daemon | None:
        """Our daemon of ``uuid`` if it still runs: the one remembered, else the one recorded (a
        restarted sidecar), else, when a launch was recorded but not its daemon (the sidecar died in
        between), the one process that launch can have made. None for anything else."""
        with self._lock:
            known = self._known.get(uuid)
        if known is not None and self._is_ours(uuid, known):
            return known
        record = self._read_record(uuid)
        if record is None or record.boot != self._boot_id():
            return None  # nothing launched, or launched before a reboot: nothing of it runs
        daemon: Daemon | None = None
        if record.pid is not None and record.start is not None:
            candidate = Daemon(record.pid, record.start, record.boot)
            daemon = candidate if self._is_ours(uuid, candidate) else None
        else:
            with self._lock:
                looked = self._scanned.get(uuid) == record.since
                self._scanned[uuid] = record.since
            found = [] if looked else self._candidates(uuid, record.since)
            if len(found) == 1:
                daemon = Daemon(found[0][0], found[0][1], record.boot)
                self._write_record(uuid, _Record(record.boot, record.since, daemon.pid, daemon.start))
                LOG.warning("GPU %s: recognised MPS control daemon %d, launched before a restart", uuid, daemon.pid)
            elif found:
                LOG.error("GPU %s: %d processes could be the MPS control daemon launched: none taken", uuid, len(found))
        with self._lock:
            if daemon is None:
                self._known.pop(uuid, None)
            else:
                self._known[uuid] = daemon
        return daemon

    def _settle(self, uuid: str, boot: str, since: int) -> Daemon:
        """The daemon the launch made: the one candidate, the same before and after it answers
        (``-d`` may return while an intermediate fork still lives)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        seen: list[tuple[int, int]] = []
        while time.monotonic() < deadline:
            seen = self._candidates(uuid, since)
            if len(seen) == 1:
                with contextlib.suppress(MpsError):
                    self.command(uuid, "get_server_list")
                    if self._candidates(uuid, since) == seen:
                        return Daemon(seen[0][0], seen[0][1], boot)
            time.sleep(0.02)
        cause = f"{len(seen)} processes could be it" if seen else "no daemon process of ours runs after it returned"
        raise MpsError(op="start", gpu=uuid, path=self.executable, cause=cause)

    def _candidates(self, uuid: str, since: int) -> list[tuple[int, int]]:
        """(pid, start tick) of each process that can be our daemon of ``uuid`` started at or after
        tick ``since``, by /proc."""
        out = []
        try:
            names = os.listdir(self.proc_root)
        except OSError as exc:
            raise MpsError(op="find", gpu=uuid, path=self.proc_root, cause=exc.strerror) from exc
        for name in names:
            if not name.isdigit():
                continue
            start = self._start_tick(int(name))
            if start is None or start < since:
                continue
            if self._could_be(uuid, int(name)) and self._start_tick(int(name)) == start:
                out.append((int(name), start))
        return sorted(out)

    def _is_ours(self, uuid: str, daemon: Daemon) -> bool:
        """Process ``daemon.pid`` is still the one recorded: the same start tick (a pid reused since
        starts later), not a zombie. (What it is was checked when it was found: ``_could_be``.)"""
        return daemon.start == self._start_tick(daemon.pid)

    def _could_be(self, uuid: str, pid: int) -> bool:
        """Process ``pid`` runs as root, runs the daemon's executable as a daemon (``-d`` among its
        arguments, ``-multiuser-server`` or not) and serves our pipe directory of ``uuid``. A daemon
        that is not dumpable hides its executable and environment from a sidecar without
        CAP_SYS_PTRACE (the shipped unit has none): then its command's name decides instead of its
        executable, and the launch's time and uid remain."""
        proc = os.path.join(self.proc_root, str(pid))
        try:
            with open(os.path.join(proc, "status")) as fh:
                uids = next((line.split()[1:] for line in fh if line.startswith("Uid:")), None)
            if uids is None or any(u != "0" for u in uids):
                return False
            with open(os.path.join(proc, "cmdline"), "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().rstrip(b"\0").split(b"\0")]
            if not set(argv[1:]) & set(DAEMON_FLAGS):
                return False
            try:
                exe, want = os.stat(os.path.join(proc, "exe")), os.stat(self.daemon_exe)
                if (exe.st_dev, exe.st_ino) != (want.st_dev, want.st_ino):
                    return False
                with open(os.path.join(proc, "environ"), "rb") as fh:
                    env = fh.read().split(b"\0")
            except PermissionError:
                return os.path.basename(argv[0]) == os.path.basename(self.executable)
        except (OSError, ValueError, StopIteration):
            return False  # gone, a zombie (no exe), or unreadable: not a daemon we can vouch for
        return f"CUDA_MPS_PIPE_DIRECTORY={self.pipe_dir(uuid)}".encode() in env

    def _start_tick(self, pid: int) -> int | None:
        """Field 22 of /proc/<pid>/stat (after the parenthesised command, which may hold spaces);
        None for a zombie or a process gone."""
        try:
            with open(os.path.join(self.proc_root, str(pid), "stat"), "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            return None
        if not fields or fields[0] == b"Z":
            return None
        try:
            return int(fields[19])
        except (IndexError, ValueError):
            return None

    def _ticks_now(self) -> int:
        """Now in the clock ticks of /proc/<pid>/stat's start time, one tick early (uptime is rounded)."""
        path = os.path.join(self.proc_root, "uptime")
        try:
            with open(path) as fh:
                seconds = float(fh.read().split()[0])
        except (OSError, ValueError, IndexError) as exc:
            raise MpsError(op="start", gpu="?", path=path, cause=f"cannot read the uptime: {exc}") from exc
        return max(0, int(seconds * os.sysconf("SC_CLK_TCK")) - 1)

    def _boot_id(self) -> str:
        try:
            with open(os.path.join(self.proc_root, "sys/kernel/random/boot_id")) as fh:
                return fh.read().strip()
        except OSError:
            return ""

    def _kill(self, uuid: str, daemon: Daemon) -> None:
        """SIGKILL through a pidfd, checked to be ours once it is held: never another process."""
        try:
            fd = os.pidfd_open(daemon.pid)
        except OSError:
            return  # gone meanwhile
        try:
            if self._is_ours(uuid, daemon):
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)

    # ---- the files of ours -------------------------------------------------------------------------

    def open_root(self) -> None:
        """Let sharers of any uid reach their pipe directory: the directory ``root`` is in (the work
        directory, 0700 as the sidecar and its unit's StateDirectoryMode make it) gets the search bit
        for group and others (0711: they may pass, not list; the state under it stays 0700). Without it
        a sharer that is not root cannot reach ``<root>/<GPU>/pipe``, and its CUDA runs without MPS
        (seen under the real agent: a task run as nobody got Permission denied). Called at every start
        of the sidecar (systemd resets the mode) and before each daemon starts. Directories above the
        work directory are the operator's (docs/sharing.md)."""
        parent = os.path.dirname(os.path.abspath(self.root))
        try:
            st = os.stat(parent)
            if st.st_uid == os.geteuid() and st.st_mode & 0o011 != 0o011:
                os.chmod(parent, (st.st_mode & 0o7777) | 0o011)
                LOG.info(
                    "MPS: '%s' made searchable by every user (mode %o), for sharers' pipe directories",
                    parent,
                    (st.st_mode & 0o7777) | 0o011,
                )
        except OSError as exc:
            raise MpsError(op="open the directory of", gpu="any", path=parent, cause=exc.strerror) from exc

    def _own_dirs(self, uuid: str) -> None:
        """``root``, its GPU directory, pipe and log: real directories of our uid, 0755 (sharers reach
        the control socket; only we write). A link or someone else's directory is refused."""
        self.open_root()
        for path in (self.root, os.path.join(self.root, uuid), self.pipe_dir(uuid), self.log_dir(uuid)):
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o755)
                st = os.lstat(path)
            except OSError as exc:
                raise MpsError(op="make the directories of", gpu=uuid, path=path, cause=exc.strerror) from exc
            if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.geteuid():
                raise MpsError(
                    op="make the directories of",
                    gpu=uuid,
                    path=path,
                    cause=f"not a directory of ours (a link, or owned by uid {st.st_uid}): refused",
                )
            if st.st_mode & 0o7777 != 0o755:
                os.chmod(path, 0o755)

    def _write_record(self, uuid: str, record: _Record) -> None:
        path = self._record_path(uuid)
        tmp = f"{path}.tmp"
        data = {"boot": record.boot, "since": record.since, "pid": record.pid, "start": record.start}
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            dfd = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            raise MpsError(op="record", gpu=uuid, path=path, cause=exc.strerror) from exc

    def _read_record(self, uuid: str) -> _Record | None:
        """The record, when it is a regular file of ours that parses; None otherwise (fail closed:
        nothing is recognised from it)."""
        path = self._record_path(uuid)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                LOG.error(
                    "GPU %s: ignoring '%s': not a file of ours (uid %d, mode %o)", uuid, path, st.st_uid, st.st_mode
                )
                return None
            with os.fdopen(fd, closefd=False) as fh:
                data = json.load(fh)
            pid, start = data.get("pid"), data.get("start")
            return _Record(
                str(data["boot"]),
                int(data["since"]),
                int(pid) if pid is not None else None,
                int(start) if start is not None else None,
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            LOG.error("GPU %s: ignoring '%s': %s", uuid, path, exc)
            return None
        finally:
            os.close(fd)
