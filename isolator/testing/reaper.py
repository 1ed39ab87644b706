"""Run a command under a process that reaps every orphan below it at once, as systemd (PID 1) does.

``python -m isolator.testing.reaper -- COMMAND [ARG...]``: runs COMMAND as its only child, is a child
subreaper (prctl PR_SET_CHILD_SUBREAPER), so every process orphaned below COMMAND is re-parented to it
instead of to PID 1, and reaps each one the moment it exits. It passes SIGTERM, SIGINT, SIGHUP and
SIGQUIT on to COMMAND, gives COMMAND a parent-death signal of SIGKILL (a SIGKILLed reaper leaves no
agent behind), and exits as COMMAND does (128 + N for a signal N, as a shell reports it) as soon as
COMMAND itself ends: orphans still running then move on to the next subreaper up, or to PID 1.

Why the real-agent harness starts the Mesos agent this way: when Mesos destroys a container it kills
every process in the container's cgroup and waits until each is gone (libprocess's reaper polls
``kill(pid, 0)`` every 100 ms). A task's own processes are children of its executor; killed together
with it, they are orphans, and only their new parent can remove them. On a host PID 1 is an init that
reaps at once (systemd), but on this project's build machine PID 1 is a microVM's init that reaps
orphans about every 2 s (measured: a SIGKILLed orphan stayed a zombie 1.55-1.95 s), and that wait
was most of an XID's 1.5-2.2 s to TASK_FAILED. Under this reaper the agent's destroys take what they
take on a host, for every configuration alike (our module, criteo's, no module, Mesos's gpu/nvidia).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
USAGE = "usage: python -m isolator.testing.reaper -- COMMAND [ARG...]"


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {value}): {os.strerror(err)}")


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def run(argv: list[str]) -> int:
    """Run ``argv`` as described above; its exit code."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    me = os.getpid()
    # Block the forwarded signals until their handlers are set, so that none is lost in between.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    child = os.fork()
    if child == 0:
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != me:  # the reaper died before the signal was set
                os._exit(137)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
            os.execvp(argv[0], argv)
        except OSError as exc:
            print(f"reaper: cannot run {argv[0]!r}: {exc}", file=sys.stderr)
            os._exit(127)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    while True:
        try:
            pid, status = os.wait()  # any child: the command, or an orphan re-parented here
        except ChildProcessError:
            return 1  # not reached: the command is a child until it has been reaped here
        if pid == child:
            return _exit_code(status)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
