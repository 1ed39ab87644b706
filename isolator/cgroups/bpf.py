"""The only bpf(2) caller: load, attach, replace, query, detach and inspect cgroup device programs.

Raw syscalls through ctypes with zeroed ``union bpf_attr`` buffers (no libbpf, no compiler). Layouts
and constants: include/uapi/linux/bpf.h, checked on this kind of machine (bridge-and-cgroup2.md B.2).
It decides nothing about rules; callers pass instructions and file descriptors.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import resource
import struct
from dataclasses import dataclass

from isolator.errors import BpfError

LOG = logging.getLogger(__name__)

# __NR_bpf per architecture (golang.org/x/sys zsysnum_linux_*.go).
_NR_BPF = {"x86_64": 321, "aarch64": 280, "arm64": 280, "armv7l": 386, "ppc64le": 361, "s390x": 351}

BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 2
BPF_F_REPLACE = 4
BPF_OBJ_NAME_LEN = 16

# sizeof(union bpf_attr) in the 6.x header is 168; the kernel zero-fills what we do not pass and
# accepts a larger, zero-tailed buffer. Kernels from 6.17 write query.revision (@56) whatever size
# is passed, so every attr is at least this big (opencontainers/cgroups f017afb).
_ATTR_SIZE = 168
_INFO_SIZE = 232  # sizeof(struct bpf_prog_info) in the same header
_LOG_SIZES = (64 * 1024, 1024 * 1024, 16 * 1024 * 1024)
_EAGAIN_RETRIES = 10
LICENSE = b"Apache-2.0"

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _nr() -> int:
    machine = platform.machine()
    if machine not in _NR_BPF:
        raise BpfError(op="find bpf(2) for", path=machine, cause="unknown architecture")
    return _NR_BPF[machine]


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    while True:
        ret = _syscall(ctypes.c_long(_nr()), ctypes.c_long(cmd), attr, ctypes.c_ulong(len(attr)))
        if ret >= 0:
            return int(ret)
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))


def _attr() -> ctypes.Array[ctypes.c_char]:
    return ctypes.create_string_buffer(_ATTR_SIZE)


def _addr(buf: ctypes.Array[ctypes.c_char]) -> int:
    return ctypes.addressof(buf)


def _keep_fd(fd: int) -> int:
    # bpf(2) reads fd 0 as "unset" in several attrs; never hand out fd 0 (runc's bpfFD does the same).
    if fd != 0:
        return fd
    dup = os.dup(fd)
    os.close(fd)
    return dup


def raise_memlock() -> None:
    """Lift RLIMIT_MEMLOCK as far as allowed: kernels before 5.11 charge bpf memory to it (runc #2167).

    Without CAP_SYS_RESOURCE only the soft limit can rise (to the hard one); kernels from 5.11
    account bpf memory to the memory cgroup instead, so a failure here is logged once, not raised.
    """
    global _memlock_done
    if _memlock_done:
        return
    _memlock_done = True
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return
    failure: Exception | None = None
    for target in ((resource.RLIM_INFINITY, resource.RLIM_INFINITY), (hard, hard)):
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, target)
            return
        except (ValueError, OSError) as exc:
            failure = exc
    LOG.info("RLIMIT_MEMLOCK stays at %s/%s (%s); old kernels may refuse bpf loads with EPERM", soft, hard, failure)


_memlock_done = False


def prog_load(insns: bytes, name: str = "") -> int:
    """Load a cgroup device program; returns its fd. A refusal carries the verifier log."""
    raise_memlock()
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(LICENSE)
    encoded = name.encode()[: BPF_OBJ_NAME_LEN - 1]

    def attempt(log: ctypes.Array[ctypes.c_char] | None) -> int:
        attr = _attr()
        struct.pack_into("<IIQQ", attr, 0, BPF_PROG_TYPE_CGROUP_DEVICE, len(insns) // 8, _addr(code), _addr(lic))
        if log is not None:
            struct.pack_into("<IIQ", attr, 24, 1, len(log), _addr(log))
        struct.pack_into(f"<{len(encoded)}s", attr, 48, encoded)
        for _ in range(_EAGAIN_RETRIES):
            try:
                return _keep_fd(_bpf(BPF_PROG_LOAD, attr))
            except OSError as exc:
                # EAGAIN: the verifier was interrupted by a signal (runc, Mesos retry too).
                if exc.errno != errno.EAGAIN:
                    raise
        return _keep_fd(_bpf(BPF_PROG_LOAD, attr))

    try:
        return attempt(None)
    except OSError as first:
        failure: OSError = first
    text = ""
    for size in _LOG_SIZES:
        log = ctypes.create_string_buffer(size)
        try:
            fd = attempt(log)
        except OSError as exc:
            failure = exc
            text = log.value.decode(errors="replace").strip()
            if exc.errno == errno.ENOSPC:
                continue
            break
        # Loaded with a log but not without: close it and report the first failure.
        os.close(fd)
        break
    cause = failure.strerror or str(failure)
    if failure.errno == errno.EPERM:
        cause += " (needs CAP_BPF and CAP_SYS_ADMIN, or a higher RLIMIT_MEMLOCK on old kernels)"
    if text:
        cause += "; verifier log:\n" + text[-4000:]
    raise BpfError(op="load device program", path=name or "<unnamed>", cause=cause, verifier_log=text) from failure


def prog_attach(cgroup_fd: int, prog_fd: int, replace_fd: int | None = None, path: str = "") -> None:
    """Attach with BPF_F_ALLOW_MULTI; with ``replace_fd``, atomically swap that program out."""
    attr = _attr()
    flags = BPF_F_ALLOW_MULTI | (BPF_F_REPLACE if replace_fd is not None else 0)
    struct.pack_into("<IIIII", attr, 0, cgroup_fd, prog_fd, BPF_CGROUP_DEVICE, flags, replace_fd or 0)
    try:
        _bpf(BPF_PROG_ATTACH, attr)
    except OSError as exc:
        cause = exc.strerror or str(exc)
        if exc.errno == errno.E2BIG:
            cause += " (64 programs are attached already: something leaks programs)"
        raise BpfError(op="attach device program to", path=path, cause=cause) from exc


def prog_detach(cgroup_fd: int, prog_fd: int, path: str = "") -> None:
    attr = _attr()
    struct.pack_into("<III", attr, 0, cgroup_fd, prog_fd, BPF_CGROUP_DEVICE)
    try:
        _bpf(BPF_PROG_DETACH, attr)
    except OSError as exc:
        raise BpfError(op="detach device program from", path=path, cause=exc.strerror or str(exc)) from exc


def prog_query(cgroup_fd: int, path: str = "") -> tuple[int, ...]:
    """The ids of device programs attached directly to the cgroup (not inherited ones)."""
    capacity = 64
    while True:
        ids = (ctypes.c_uint32 * capacity)()
        attr = _attr()
        struct.pack_into("<III", attr, 0, cgroup_fd, BPF_CGROUP_DEVICE, 0)
        struct.pack_into("<QI", attr, 16, ctypes.addressof(ids), capacity)
        try:
            _bpf(BPF_PROG_QUERY, attr)
        except OSError as exc:
            if exc.errno == errno.ENOSPC and capacity < 65536:
                capacity *= 4
                continue
            raise BpfError(op="query device programs of", path=path, cause=exc.strerror or str(exc)) from exc
        (count,) = struct.unpack_from("<I", attr, 24)
        return tuple(ids[i] for i in range(min(count, capacity)))


def prog_fd_by_id(prog_id: int) -> int:
    attr = _attr()
    struct.pack_into("<I", attr, 0, prog_id)
    try:
        return _keep_fd(_bpf(BPF_PROG_GET_FD_BY_ID, attr))
    except OSError as exc:
        raise BpfError(op="open device program", path=f"id {prog_id}", cause=exc.strerror or str(exc)) from exc


@dataclass(frozen=True)
class ProgInfo:
    """What ``bpftool prog show id N`` prints: type, id, name, tag, and the translated instructions."""

    type: int
    id: int
    name: str
    tag: str
    insns: bytes


def prog_info(prog_fd: int) -> ProgInfo:
    """BPF_OBJ_GET_INFO_BY_FD, twice: once for the sizes, once with a buffer for the instructions."""

    def get(xlated: ctypes.Array[ctypes.c_char] | None) -> ctypes.Array[ctypes.c_char]:
        info = ctypes.create_string_buffer(_INFO_SIZE)
        if xlated is not None:
            struct.pack_into("<I", info, 20, len(xlated))
            struct.pack_into("<Q", info, 32, ctypes.addressof(xlated))
        attr = _attr()
        struct.pack_into("<IIQ", attr, 0, prog_fd, _INFO_SIZE, ctypes.addressof(info))
        try:
            _bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
        except OSError as exc:
            raise BpfError(op="inspect device program", path=f"fd {prog_fd}", cause=exc.strerror or str(exc)) from exc
        return info

    first = get(None)
    (xlated_len,) = struct.unpack_from("<I", first, 20)
    buf = ctypes.create_string_buffer(max(xlated_len, 8))
    info = get(buf) if xlated_len else first
    ptype, pid = struct.unpack_from("<II", info, 0)
    (got_len,) = struct.unpack_from("<I", info, 20)
    (got_ptr,) = struct.unpack_from("<Q", info, 32)
    raw = info.raw
    name = raw[64 : 64 + BPF_OBJ_NAME_LEN].split(b"\0", 1)[0].decode(errors="replace")
    tag = raw[8:16].hex()
    # A zeroed pointer back means the kernel withheld the instructions (no CAP_SYS_ADMIN, or
    # constant blinding with kptr_restrict); callers then treat the program as opaque.
    insns = bytes(buf.raw[: min(got_len, len(buf))]) if xlated_len and got_ptr else b""
    return ProgInfo(type=ptype, id=pid, name=name, tag=tag, insns=insns)
