"""Run a command inside the systemd unit's process sandbox, as far as it can be rebuilt without
systemd as PID 1: ``python -m isolator.testing.sandbox UNIT -- COMMAND...``.

Applied from the unit file's own lines: CapabilityBoundingSet= (PR_CAPBSET_DROP of every other
capability), NoNewPrivileges=, MemoryDenyWriteExecute= (PR_SET_MDWE, Linux 6.3+: refuses W+X
mappings and making memory executable, as systemd's seccomp rule does) and SystemCallFilter= with
SystemCallErrorNumber= (a seccomp allow-list through libseccomp, groups expanded by
``systemd-analyze syscall-filter``). Not rebuilt: the mount namespace (ProtectSystem=, PrivateTmp=,
...), RestrictNamespaces=, RestrictAddressFamilies= and the Protect* filters; tests/system/test_systemd.py
says so where it uses this.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import subprocess
import sys

PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
PR_SET_MDWE = 65
PR_MDWE_REFUSE_EXEC_GAIN = 1
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_KILL_PROCESS = 0x80000000

# linux/capability.h, 0 through CAP_LAST_CAP (40 on Linux 5.9+).
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
]


def unit_settings(text: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of a unit file, in order (comments skipped)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith(("#", ";", "[")):
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def syscall_groups() -> dict[str, list[str]]:
    """``@group`` -> its members (system calls and nested groups), from ``systemd-analyze syscall-filter``."""
    text = subprocess.run(
        ["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif current is not None and line.strip() and not line.strip().startswith("#"):
            current.append(line.strip())
    return groups


def expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for name in names:
        if name.startswith("@"):
            out |= expand(groups[name], groups)
        else:
            out.add(name)
    return out


def allowed_syscalls(settings: dict[str, list[str]], groups: dict[str, list[str]]) -> set[str]:
    """systemd's rule: the allow-lists add up, then ``~`` lines take away."""
    allowed: set[str] = set()
    for value in settings.get("SystemCallFilter", []):
        if not value.startswith("~"):
            allowed |= expand(value.split(), groups)
    for value in settings.get("SystemCallFilter", []):
        if value.startswith("~"):
            allowed -= expand(value[1:].split(), groups)
    return allowed


def enter(unit_text: str) -> list[str]:
    """Put this process in the unit's sandbox (irreversibly); returns what was applied."""
    settings = unit_settings(unit_text)
    libc = ctypes.CDLL(None, use_errno=True)
    applied = []

    def prctl(*args: int) -> None:
        if libc.prctl(*[ctypes.c_ulong(a) for a in args]) != 0:
            raise OSError(ctypes.get_errno(), f"prctl{args}: {os.strerror(ctypes.get_errno())}")

    keep = {c for v in settings.get("CapabilityBoundingSet", []) for c in v.split()}
    if keep:
        for number, name in enumerate(CAPABILITIES):
            if name not in keep:
                prctl(PR_CAPBSET_DROP, number, 0, 0, 0)
        applied.append(f"CapabilityBoundingSet={' '.join(sorted(keep))}")
    if settings.get("NoNewPrivileges", ["no"])[-1] == "yes":
        prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        applied.append("NoNewPrivileges=yes")
    if settings.get("MemoryDenyWriteExecute", ["no"])[-1] == "yes":
        prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0)
        applied.append("MemoryDenyWriteExecute=yes")
    if settings.get("SystemCallFilter"):
        names = allowed_syscalls(settings, syscall_groups())
        error = settings.get("SystemCallErrorNumber", [""])[-1]
        action = (0x00050000 | getattr(errno, error)) if error else SCMP_ACT_KILL_PROCESS  # SCMP_ACT_ERRNO(n)
        seccomp = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
        seccomp.seccomp_init.restype = ctypes.c_void_p
        seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        seccomp.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
        seccomp.seccomp_load.argtypes = [ctypes.c_void_p]
        ctx = seccomp.seccomp_init(ctypes.c_uint32(action))
        if not ctx:
            raise OSError("seccomp_init failed")
        for name in sorted(names):
            number = seccomp.seccomp_syscall_resolve_name(name.encode())
            # Names of other architectures resolve to __NR_SCMP_ERROR (-1).
            if number >= 0 and seccomp.seccomp_rule_add(ctx, SCMP_ACT_ALLOW, number, 0) != 0:
                raise OSError(f"seccomp_rule_add({name}) failed")
        rc = seccomp.seccomp_load(ctx)
        if rc != 0:
            raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")
        applied.append(f"SystemCallFilter ({len(names)} calls), errors {error or 'kill'}")
    return applied


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: python -m isolator.testing.sandbox UNIT -- COMMAND...\n")
        return 2
    with open(argv[0]) as fh:
        applied = enter(fh.read())
    sys.stderr.write(f"sandbox: {'; '.join(applied)}\n")
    sys.stderr.flush()
    os.execvp(argv[2], argv[2:])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
