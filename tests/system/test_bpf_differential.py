"""The eBPF evaluator (isolator/cgroups/bpfprog.evaluate) checked against the kernel as the oracle.

Before granting on v2 the sidecar runs the device programs already attached above a container (the
agent's, systemd's, runc's) in ``bpfprog.evaluate`` to refuse when they would deny our GPUs. Here
every program of a corpus is loaded into the kernel, attached alone (BPF_F_ALLOW_MULTI) to a test
cgroup under gpu-isolator-test/ holding a forked prober, and the kernel's verdict for each request
(open O_RDONLY / O_WRONLY / O_RDWR and mknod of mknod'ed char and block nodes of many numbers) is
compared with the evaluator's. The corpus:

* programs in the exact instruction forms runc, systemd and Mesos emit, written from the facts of how
  each builds its program (reference bridge-and-cgroup2.md §B.1, §B.4; mesos-gpu-isolator.md §5.4);
* generated programs (seeded, bounded) using every opcode the evaluator claims to support: ALU and
  ALU64 (K and X; add sub mul div or and lsh rsh neg mod xor mov arsh), JMP and JMP32 (K and X; ja
  jeq jgt jge jset jne jsgt jsge jlt jle jslt jsle), LDX of 1/2/4 bytes from the context, ST/STX/LDX
  on the stack, LD_IMM64.

A second set of tests proves the corpus can catch a wrong evaluator: with JEQ, JGT, JSGT or ADD
changed, at least one kernel verdict disagrees. Programs the kernel accepts but the evaluator does
not model (helper calls, byte swaps, signed division) must raise UnsupportedProgram, never a guess.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from cgroup_helpers import hierarchy_mounts, scratch_cgroups_root

from isolator.cgroups import bpf, bpfprog
from isolator.cgroups.bpfprog import (
    AND32_K,
    EXIT,
    JA,
    JEQ_K,
    JNE_K,
    JNE_X,
    LDX_W,
    MOV32_K,
    MOV32_X,
    RSH32_K,
    Insn,
    Request,
    UnsupportedProgram,
)
from isolator.errors import BpfError
from isolator.policy.devices import DeviceRule

pytestmark = [pytest.mark.root, pytest.mark.cgroup_v2]

MOV64_K = 0xB7
R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10 = range(11)

# Device numbers without a driver or a module alias (majors far above any registered or aliased
# one, and 0), so an open that passes the cgroup ends in ENXIO and never reaches real hardware.
CHAR_MAJORS = (0, 4000, 4001, 4093, 4095)
BLOCK_MAJORS = (4000, 4094)
MINORS = (0, 1, 5, 255, 256, 65535, 65536, (1 << 20) - 1)
ACCESSES = ("r", "w", "rw", "m")
OPEN_FLAGS = {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}


def requests() -> list[Request]:
    out = []
    for major in CHAR_MAJORS:
        for minor in MINORS[:: 1 if major in (0, 4000) else 3]:
            if (major, minor) == (0, 0):
                continue  # no device: the kernel skips the device cgroup check for i_rdev 0
            out.extend(Request("c", major, minor, a) for a in ACCESSES)
    for major in BLOCK_MAJORS:
        for minor in (0, 7, (1 << 20) - 1):
            out.extend(Request("b", major, minor, a) for a in ACCESSES)
    return out


REQUESTS = requests()
INTERESTING = sorted({*CHAR_MAJORS, *BLOCK_MAJORS, *MINORS, 1, 2, 3, 4, 6, 7})


# ---- the prober: a forked child in the test cgroup that opens and mknods on request ------------


class Prober:
    def __init__(self, nodes_dir: str, scratch_dir: str) -> None:
        cmd_r, self._cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(self._cmd_w)
                os.close(reply_r)
                _serve(cmd_r, reply_w, nodes_dir, scratch_dir)
            finally:
                os._exit(0)
        os.close(cmd_r)
        os.close(reply_w)
        self.pid = pid
        self._reader = os.fdopen(reply_r, "r")

    def verdicts(self, reqs: list[Request]) -> list[int]:
        """1 where the kernel let the request through (any result but EPERM), else 0."""
        body = [[r.type, r.major, r.minor, r.access] for r in reqs]
        os.write(self._cmd_w, (json.dumps(body) + "\n").encode())
        line = self._reader.readline()
        if not line:
            raise RuntimeError("the prober died")
        return [0 if e == "EPERM" else 1 for e in json.loads(line)]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._cmd_w)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self._reader.close()


def node_name(kind: str, major: int, minor: int) -> str:
    return f"{kind}-{major}-{minor}"


def _serve(cmd_r: int, reply_w: int, nodes_dir: str, scratch_dir: str) -> None:
    with os.fdopen(cmd_r, "r") as commands:
        for line in commands:
            out = []
            for kind, major, minor, access in json.loads(line):
                try:
                    if access == "m":
                        target = os.path.join(scratch_dir, "n")
                        mode = 0o600 | (0o020000 if kind == "c" else 0o060000)
                        os.mknod(target, mode, os.makedev(major, minor))
                        os.unlink(target)
                    else:
                        fd = os.open(os.path.join(nodes_dir, node_name(kind, major, minor)), OPEN_FLAGS[access])
                        os.close(fd)
                    out.append("OK")
                except OSError as exc:
                    out.append(errno.errorcode.get(exc.errno or 0, str(exc.errno)))
            os.write(reply_w, (json.dumps(out) + "\n").encode())


@dataclass
class Oracle:
    """The kernel: attach a program to the prober's cgroup alone and read its verdicts."""

    cgroup: str
    prober: Prober

    def verdicts(self, code: bytes) -> list[int]:
        prog_fd = bpf.prog_load(code, "differential")
        cg = os.open(self.cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            bpf.prog_attach(cg, prog_fd, None, self.cgroup)
            try:
                return self.prober.verdicts(REQUESTS)
            finally:
                bpf.prog_detach(cg, prog_fd, self.cgroup)
        finally:
            os.close(cg)
            os.close(prog_fd)


# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("oracle", "corpus")


@pytest.fixture(scope="module")
def oracle() -> Iterator[Oracle]:
    _, mount = hierarchy_mounts()
    if mount is None:
        pytest.skip("no cgroup2 hierarchy mounted")
    work = tempfile.mkdtemp(prefix="gi-bpfdiff-", dir="/tmp")
    nodes, scratch = os.path.join(work, "nodes"), os.path.join(work, "scratch")
    os.makedirs(nodes)
    os.makedirs(scratch)
    for r in REQUESTS:
        path = os.path.join(nodes, node_name(r.type, r.major, r.minor))
        if not os.path.exists(path):
            os.mknod(path, 0o666 | (0o020000 if r.type == "c" else 0o060000), os.makedev(r.major, r.minor))
    prober = Prober(nodes, scratch)
    try:
        with scratch_cgroups_root(mount, "v2") as relative:
            cgroup = os.path.join(mount, relative)
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as fh:
                fh.write(str(prober.pid))
            baseline = prober.verdicts(REQUESTS)
            if 0 in baseline:
                pytest.skip("device programs above the test cgroup already deny some test devices")
            yield Oracle(cgroup, prober)
            prober.close()
    finally:
        prober.close()
        shutil.rmtree(work, ignore_errors=True)


# ---- programs in the forms runc, systemd and Mesos emit -------------------------------------------

TYPE = {"c": 2, "b": 1}
ACC = {"r": 2, "w": 4, "m": 1}


def _acc(access: str) -> int:
    return sum(ACC[c] for c in access)


PROLOGUE = [
    Insn(LDX_W, R2, R1, 0),
    Insn(AND32_K, R2, imm=0xFFFF),
    Insn(LDX_W, R3, R1, 0),
    Insn(RSH32_K, R3, imm=16),
    Insn(LDX_W, R4, R1, 4),
    Insn(LDX_W, R5, R1, 8),
]


def _fix(block: list[Insn]) -> list[Insn]:
    """Resolve "next" placeholders (offset to the end of the block) in a block's jumps."""
    out = []
    for pos, insn in enumerate(block):
        if insn.off == -32768:  # placeholder
            insn = Insn(insn.code, insn.dst, insn.src, len(block) - pos - 1, insn.imm)
        out.append(insn)
    return out


NEXT = -32768


def runc_program(rules: list[tuple[DeviceRule, bool]], default_allow: bool) -> list[Insn]:
    """opencontainers/cgroups devices/devicefilter.go: per rule `if r2 != type goto next`; access
    subset `w1 = w3; w1 &= acc; if r1 != r3 goto next` (only when not rwm); `if r4 != major`, `if r5 !=
    minor` unless wildcards; `w0 = allow; exit`. Epilogue `w0 = default; exit`."""
    insns = list(PROLOGUE)
    for rule, allow in rules:
        block: list[Insn] = []
        if rule.type != "a":
            block.append(Insn(JNE_K, R2, 0, NEXT, TYPE[rule.type]))
        if rule.access != "rwm":
            block += [Insn(MOV32_X, R1, R3), Insn(AND32_K, R1, imm=_acc(rule.access)), Insn(JNE_X, R1, R3, NEXT)]
        if rule.major is not None:
            block.append(Insn(JNE_K, R4, 0, NEXT, rule.major))
        if rule.minor is not None:
            block.append(Insn(JNE_K, R5, 0, NEXT, rule.minor))
        block += [Insn(MOV32_K, R0, imm=int(allow)), Insn(EXIT)]
        insns += _fix(block)
    return [*insns, Insn(MOV32_K, R0, imm=int(default_allow)), Insn(EXIT)]


def systemd_program(entries: list[DeviceRule]) -> list[Insn]:
    """systemd src/core/bpf-devices.c: per DeviceAllow= entry an optional access-subset check, then
    type, major, minor; a full match `ja PASS`. Epilogue `r0 = 0; ja +1; r0 = 1 (PASS); exit`."""
    insns = list(PROLOGUE)
    jumps = []
    for rule in entries:
        block: list[Insn] = []
        if rule.access != "rwm":
            block += [Insn(MOV32_X, R1, R3), Insn(AND32_K, R1, imm=_acc(rule.access)), Insn(JNE_X, R1, R3, NEXT)]
        block.append(Insn(JNE_K, R2, 0, NEXT, TYPE[rule.type]))
        if rule.major is not None:
            block.append(Insn(JNE_K, R4, 0, NEXT, rule.major))
        if rule.minor is not None:
            block.append(Insn(JNE_K, R5, 0, NEXT, rule.minor))
        block.append(Insn(JA, off=0))  # to PASS, fixed below
        fixed = _fix(block)
        jumps.append(len(insns) + len(fixed) - 1)
        insns += fixed
    if not entries:  # DevicePolicy=strict with nothing allowed: just deny
        return [*insns, Insn(MOV64_K, R0, imm=0), Insn(EXIT)]
    insns += [Insn(MOV64_K, R0, imm=0), Insn(JA, off=1), Insn(MOV64_K, R0, imm=1), Insn(EXIT)]
    passed = len(insns) - 2
    for j in jumps:
        insns[j] = Insn(JA, off=passed - j - 1)
    return insns


def mesos_program(allow: list[DeviceRule], deny: list[DeviceRule]) -> list[Insn]:
    """Mesos src/linux/cgroups2.cpp DeviceProgram::build (mesos-gpu-isolator.md §5.4): prologue,
    `r0 = 0`; an allow section whose blocks check major, minor, type (wildcards skip), then
    `(r3 & acc) == r3`, and on a match jump past the section's `exit` to the deny section; deny
    blocks with "any overlap" `(r3 & acc) != 0` exit with r0 = 0; finally `r0 = 1; exit`. A catch-all
    allow skips the allow section; an empty allow list exits at once."""
    insns = [*PROLOGUE, Insn(MOV64_K, R0, imm=0)]
    if not allow:
        return [*insns, Insn(EXIT)]
    catch_all = any(r.type == "a" and r.access == "rwm" for r in allow)
    if not catch_all:
        to_deny = []
        for rule in allow:
            block: list[Insn] = []
            if rule.major is not None:
                block.append(Insn(JNE_K, R4, 0, NEXT, rule.major))
            if rule.minor is not None:
                block.append(Insn(JNE_K, R5, 0, NEXT, rule.minor))
            if rule.type != "a":
                block.append(Insn(JNE_K, R2, 0, NEXT, TYPE[rule.type]))
            block += [Insn(MOV32_X, R1, R3), Insn(AND32_K, R1, imm=_acc(rule.access)), Insn(JNE_X, R1, R3, NEXT)]
            block.append(Insn(JA, off=0))  # to the deny section
            fixed = _fix(block)
            to_deny.append(len(insns) + len(fixed) - 1)
            insns += fixed
        insns.append(Insn(EXIT))  # nothing allowed it: r0 = 0
        for j in to_deny:
            insns[j] = Insn(JA, off=len(insns) - j - 1)
    for rule in deny:
        block = []
        if rule.major is not None:
            block.append(Insn(JNE_K, R4, 0, NEXT, rule.major))
        if rule.minor is not None:
            block.append(Insn(JNE_K, R5, 0, NEXT, rule.minor))
        if rule.type != "a":
            block.append(Insn(JNE_K, R2, 0, NEXT, TYPE[rule.type]))
        block += [Insn(MOV32_X, R1, R3), Insn(AND32_K, R1, imm=_acc(rule.access)), Insn(JEQ_K, R1, 0, NEXT, 0)]
        block.append(Insn(EXIT))  # r0 is still 0
        insns += _fix(block)
    return [*insns, Insn(MOV64_K, R0, imm=1), Insn(EXIT)]


def R(text: str) -> DeviceRule:
    return DeviceRule.parse(text)


SHAPED: list[tuple[str, list[Insn]]] = [
    (
        "runc-allowlist",
        runc_program(
            [
                (R("c *:* m"), True),
                (R("b *:* m"), True),
                (R("c 4000:0 rwm"), True),
                (R("c 4001:* rw"), True),
                (R("c 4093:255 r"), True),
                (R("b 4000:7 w"), True),
                (R("c 0:65536 rwm"), True),
            ],
            default_allow=False,
        ),
    ),
    (
        "runc-blacklist",
        runc_program([(R("c 4000:* rw"), False), (R("b *:* m"), False), (R("c 0:1 w"), False)], default_allow=True),
    ),
    (
        "systemd-device-allow",
        systemd_program([R("c 4000:1 rw"), R("c 4001:* r"), R("b 4094:* rwm"), R("c 4095:1048575 rwm"), R("c 0:5 m")]),
    ),
    ("systemd-strict-empty", systemd_program([])),
    (
        "mesos-allow-deny",
        mesos_program(
            [R("c *:* m"), R("b *:* m"), R("c 4000:* rwm"), R("c 4093:256 rw"), R("b 4000:0 r")],
            [R("c 4000:5 w"), R("c 4000:65535 rwm")],
        ),
    ),
    ("mesos-catch-all-allow-with-deny", mesos_program([R("a *:* rwm")], [R("c 4001:* rw"), R("b 4094:7 m")])),
    ("mesos-empty-allow", mesos_program([], [])),
    (
        # 64-bit arithmetic deciding the verdict: major + -4000 == 0, then minor + 2^32 (three adds)
        # must carry past 32 bits and differ from the minor in a 64-bit compare.
        "arith-add-jeq-64",
        [
            *PROLOGUE,
            Insn(0xBF, R6, R4),
            Insn(0x07, R6, imm=-4000),
            Insn(JEQ_K, R6, off=2, imm=0),
            Insn(MOV32_K, R0, imm=0),
            Insn(EXIT),
            Insn(0xBF, R7, R5),
            Insn(0x07, R7, imm=0x7FFFFFFF),
            Insn(0x07, R7, imm=0x7FFFFFFF),
            Insn(0x07, R7, imm=2),
            Insn(0x1D, R7, R5, 5),  # if r7 == r5 goto deny
            Insn(0xBF, R8, R7),
            Insn(0x77, R8, imm=32),
            Insn(JNE_K, R8, off=2, imm=1),
            Insn(MOV32_K, R0, imm=1),
            Insn(EXIT),
            Insn(MOV32_K, R0, imm=0),
            Insn(EXIT),
        ],
    ),
    ("ours-standalone", list(bpfprog.build([R("c *:* m"), R("c 4000:1 rwm"), R("c 0:255 rw")]))),
    ("ours-mesos-mode", list(bpfprog.build([R("c *:* m"), R("c 4000:1 rwm")], decide_majors={4000, 0}))),
]


# ---- generated programs ---------------------------------------------------------------------------

ALU_OPS = (0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0)
JMP_OPS = (0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0xA0, 0xB0, 0xC0, 0xD0)
SCALARS = (R0, R2, R3, R4, R5, R6, R7, R8, R9)


def _imm(rng: random.Random) -> int:
    choice = rng.random()
    if choice < 0.5:
        value = rng.choice(INTERESTING) + rng.choice((-1, 0, 0, 0, 1))
    elif choice < 0.7:
        value = -rng.choice(INTERESTING) - rng.choice((0, 1))
    elif choice < 0.85:
        value = rng.choice((0x7FFFFFFF, -0x80000000, 0xFFFF, 0x10000, -1, 16, 20, 31, 32))
    else:
        value = rng.randint(-(1 << 31), (1 << 31) - 1)
    return max(-(1 << 31), min((1 << 31) - 1, value))


def generate(rng: random.Random, length: int = 30) -> list[Insn]:
    """A verifier-friendly program: scalars only (r1 and r10 are used as pointers and never
    changed), forward jumps only, every exit preceded by r0 limited to 0 or 1."""
    insns: list[Insn] = []
    # Context loads, sometimes narrow (the verifier allows 1/2-byte loads of access_type only).
    insns.append(Insn(LDX_W, R2, R1, 0))
    insns.append(Insn(0x69, R3, R1, rng.choice((0, 2))) if rng.random() < 0.3 else Insn(LDX_W, R3, R1, 0))
    insns.append(Insn(0x71, R6, R1, rng.choice((0, 1, 2, 3))))  # one byte of access_type
    insns.append(Insn(LDX_W, R4, R1, 4))
    insns.append(Insn(LDX_W, R5, R1, 8))
    insns += [Insn(MOV64_K, R0, imm=0), Insn(MOV64_K, R7, imm=_imm(rng)), Insn(0xBF, R8, R4), Insn(0xBF, R9, R5)]
    # Stack slots written before any read (a read of unwritten stack is garbage, and unsupported).
    insns += [Insn(0x7A, R10, off=-8, imm=_imm(rng)), Insn(0x7A, R10, off=-16, imm=_imm(rng))]
    if rng.random() < 0.4:
        insns += [Insn(0x18, R7, imm=_imm(rng)), Insn(0, imm=_imm(rng))]  # LD_IMM64
    stack_ready = False
    body: list[tuple[str, Insn]] = []
    for _ in range(length):
        kind = rng.random()
        dst = rng.choice(SCALARS)
        if kind < 0.45:
            cls = rng.choice((0x04, 0x07))
            bits = 32 if cls == 0x04 else 64
            op = rng.choice(ALU_OPS)
            if op == 0x80:  # neg
                body.append(("alu", Insn(cls | op, dst)))
            elif op in (0x60, 0x70, 0xC0):  # shifts: immediate in range only
                body.append(("alu", Insn(cls | op, dst, imm=rng.randrange(bits))))
            elif rng.random() < 0.5 and op not in (0x30, 0x90):
                body.append(("alu", Insn(cls | op | 0x08, dst, rng.choice(SCALARS))))
            elif op in (0x30, 0x90):
                if rng.random() < 0.5:
                    body.append(("alu", Insn(cls | op | 0x08, dst, rng.choice(SCALARS))))  # may divide by 0
                else:
                    body.append(("alu", Insn(cls | op, dst, imm=_imm(rng) or 3)))
            else:
                body.append(("alu", Insn(cls | op, dst, imm=_imm(rng))))
        elif kind < 0.8:
            cls = rng.choice((0x05, 0x06))
            op = rng.choice(JMP_OPS)
            if rng.random() < 0.6:
                body.append(("jmp", Insn(cls | op, rng.choice((R2, R3, R4, R5, R6, R8, R9)), imm=_imm(rng))))
            else:
                body.append(("jmp", Insn(cls | op | 0x08, rng.choice(SCALARS), rng.choice(SCALARS))))
        elif kind < 0.87:
            # check_cfg refuses unreachable instructions: what a `ja` skips must stay reachable, so it
            # comes behind a conditional jump over it.
            body.append(("fixed", _cond(rng, 1)))
            body.append(("ja", Insn(JA)))
        elif kind < 0.94:
            size = rng.choice((0x18, 0x00, 0x08, 0x10))  # DW, W, H, B
            body.append(("stx", Insn(0x63 | size, R10, rng.choice(SCALARS), -8)))
            body.append(("ldx", Insn(0x61 | size, dst, R10, -8)))
            stack_ready = True
        elif kind < 0.97 and stack_ready:
            body.append(("st", Insn(0x62, R10, off=-16, imm=_imm(rng))))
            body.append(("ldx", Insn(0x61, dst, R10, -16)))
        else:
            body.append(("fixed", _cond(rng, 2)))  # an early exit the next instruction is reachable past
            body.append(("exit", Insn(MOV32_K, R0, imm=rng.randint(0, 1))))
            body.append(("exit-insn", Insn(EXIT)))
    tail = [Insn(0xBF, R0, rng.choice(SCALARS)), Insn(0x57, R0, imm=1), Insn(EXIT)]  # r0 = rX & 1
    start = len(insns)
    total = start + len(body) + len(tail)
    for i, (kind, insn) in enumerate(body):
        pos = start + i
        if kind in ("jmp", "ja"):
            # A forward target that is not an exit (r0 there may be unbounded) and not the second
            # slot of an LD_IMM64 (there are none in the body).
            targets = [t for t in range(pos + 1, total) if not _is_exit(body, tail, start, t)]
            target = rng.choice(targets[:12]) if rng.random() < 0.8 else rng.choice(targets)
            insn = Insn(insn.code, insn.dst, insn.src, target - pos - 1, insn.imm)
        insns.append(insn)
    return insns + tail


def _cond(rng: random.Random, skip: int) -> Insn:
    cls = rng.choice((0x05, 0x06))
    return Insn(cls | rng.choice(JMP_OPS), rng.choice((R2, R3, R4, R5, R6)), off=skip, imm=_imm(rng))


def _is_exit(body: list[tuple[str, Insn]], tail: list[Insn], start: int, t: int) -> bool:
    i = t - start
    if i < len(body):
        return body[i][0] == "exit-insn"
    return tail[i - len(body)].code == EXIT


GENERATED_COUNT = int(os.environ.get("GPU_ISOLATOR_BPF_PROGRAMS", "160"))


def generated() -> list[tuple[str, list[Insn]]]:
    rng = random.Random(16)
    return [(f"gen-{i}", generate(rng, rng.randint(8, 40))) for i in range(GENERATED_COUNT)]


@dataclass
class Case:
    name: str
    insns: list[Insn]
    kernel: list[int]


@pytest.fixture(scope="module")
def corpus(oracle: Oracle) -> list[Case]:
    cases = []
    refused = []
    for name, insns in SHAPED + generated():
        code = bpfprog.assemble(insns)
        try:
            kernel = oracle.verdicts(code)
        except BpfError as exc:
            if name.startswith("gen-"):
                refused.append((name, str(exc)[:200]))
                continue
            raise
        cases.append(Case(name, insns, kernel))
    # The generator is meant to write programs the verifier accepts; a few refusals are tolerated.
    assert len(refused) <= GENERATED_COUNT // 10, refused[:3]
    return cases


def _evaluate_all(insns: list[Insn]) -> list[int]:
    return [bpfprog.evaluate(insns, r) for r in REQUESTS]


def test_the_evaluator_agrees_with_the_kernel_on_every_request_of_every_program(corpus: list[Case]) -> None:
    disagreements = []
    for case in corpus:
        ours = _evaluate_all(case.insns)
        for req, k, o in zip(REQUESTS, case.kernel, ours, strict=True):
            if k != o:
                disagreements.append(f"{case.name}: {req}: kernel {k}, evaluator {o}")
                break
    assert not disagreements, "\n".join(disagreements[:10]) + "\n" + "\n".join(bpfprog.disassemble(corpus[0].insns))


def test_the_corpus_uses_every_opcode_the_evaluator_supports_and_both_verdicts(corpus: list[Case]) -> None:
    used = {i.code for c in corpus for i in c.insns}
    alu = {cls | op | src for cls in (0x04, 0x07) for op in ALU_OPS for src in (0x00, 0x08) if not (op == 0x80 and src)}
    alu -= {cls | op | 0x08 for cls in (0x04, 0x07) for op in (0x60, 0x70, 0xC0)}  # register shifts: not generated
    jumps = {cls | op | src for cls in (0x05, 0x06) for op in JMP_OPS for src in (0x00, 0x08)}
    memory = {0x61, 0x69, 0x71, 0x79, 0x62, 0x7A, 0x63, 0x6B, 0x73, 0x7B, 0x18, JA, EXIT}
    missing = sorted((alu | jumps | memory) - used)
    assert not missing, [hex(c) for c in missing]
    verdicts = {v for c in corpus for v in c.kernel}
    assert verdicts == {0, 1}
    for name, _ in SHAPED:
        assert name in {c.name for c in corpus}


# ---- a wrong evaluator is caught ------------------------------------------------------------------


def _mutated_jump(op: int, wrong: Callable[[int, int, int], bool]) -> Callable[[int, int, int, int], bool]:
    original = bpfprog._jump_taken

    def jump(o: int, a: int, b: int, bits: int) -> bool:
        return wrong(a, b, bits) if o == op else original(o, a, b, bits)

    return jump


def _unsigned(a: int, b: int, bits: int) -> tuple[int, int]:
    mask = (1 << bits) - 1
    return a & mask, b & mask


MUTANTS: dict[str, tuple[str, Callable]] = {
    "JEQ as JNE": ("_jump_taken", _mutated_jump(0x10, lambda a, b, n: _unsigned(a, b, n)[0] != _unsigned(a, b, n)[1])),
    "JEQ on 32 bits always": (
        "_jump_taken",
        _mutated_jump(0x10, lambda a, b, n: (a & 0xFFFFFFFF) == (b & 0xFFFFFFFF)),
    ),
    "JGT as JGE": ("_jump_taken", _mutated_jump(0x20, lambda a, b, n: _unsigned(a, b, n)[0] >= _unsigned(a, b, n)[1])),
    "JGT signed": (
        "_jump_taken",
        _mutated_jump(0x20, lambda a, b, n: bpfprog._signed(a, n) > bpfprog._signed(b, n)),
    ),
    "JSGT unsigned": (
        "_jump_taken",
        _mutated_jump(0x60, lambda a, b, n: _unsigned(a, b, n)[0] > _unsigned(a, b, n)[1]),
    ),
    "JSGT as JSGE": (
        "_jump_taken",
        _mutated_jump(0x60, lambda a, b, n: bpfprog._signed(a, n) >= bpfprog._signed(b, n)),
    ),
}


def _mutated_alu(op: int, wrong: Callable[[int, int, int], int]) -> Callable[[int, int, int, int], int]:
    original = bpfprog._alu

    def alu(o: int, dst: int, src: int, bits: int) -> int:
        return wrong(dst, src, bits) & ((1 << bits) - 1) if o == op else original(o, dst, src, bits)

    return alu


MUTANTS.update(
    {
        "ADD as SUB": ("_alu", _mutated_alu(0x00, lambda a, b, n: a - b)),
        "ADD without carry past 32 bits": ("_alu", _mutated_alu(0x00, lambda a, b, n: (a + b) & 0xFFFFFFFF)),
        "ADD off by one": ("_alu", _mutated_alu(0x00, lambda a, b, n: a + b + 1)),
    }
)


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_wrong_evaluator_disagrees_with_the_kernel_somewhere(
    corpus: list[Case], mutant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, replacement = MUTANTS[mutant]
    monkeypatch.setattr(bpfprog, name, replacement)
    for case in corpus:
        try:
            if _evaluate_all(case.insns) != case.kernel:
                return
        except UnsupportedProgram:
            continue
    pytest.fail(f"no program in the corpus tells the mutant '{mutant}' from the kernel")


# ---- programs the evaluator does not model --------------------------------------------------------


UNSUPPORTED = {
    # Reads 8 bytes of stack nothing wrote (root may; the value is whatever the stack held).
    "uninitialized stack": [*PROLOGUE, Insn(0x79, R6, R10, -8), Insn(0xBF, R0, R6), Insn(0x57, R0, imm=1), Insn(EXIT)],
    # bpf_get_current_uid_gid (helper 15) is allowed in cgroup device programs.
    "helper call": [*PROLOGUE, Insn(0x85, imm=15), Insn(0x57, R0, imm=1), Insn(EXIT)],
    # Signed division (BPF_SDIV: ALU64 DIV with off 1; cpu v4, Linux 6.6) of the major by 3.
    "signed division": [*PROLOGUE, Insn(0x37, R4, off=1, imm=3), Insn(MOV32_K, R0, imm=1), Insn(EXIT)],
    # BPF_END (byte swap to big endian, 32 bits) of the major.
    "byte swap": [*PROLOGUE, Insn(0xDC, R4, imm=32), Insn(MOV32_K, R0, imm=1), Insn(EXIT)],
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_programs_the_kernel_runs_but_the_evaluator_does_not_model_are_reported_unsupported(
    oracle: Oracle, name: str
) -> None:
    insns = UNSUPPORTED[name]
    try:
        oracle.verdicts(bpfprog.assemble(insns))  # a real program: the kernel loads and runs it
    except BpfError as exc:
        pytest.skip(f"this kernel does not load the {name} program: {str(exc)[:120]}")
    with pytest.raises(UnsupportedProgram):
        bpfprog.evaluate(insns, REQUESTS[0])
    with pytest.raises(UnsupportedProgram):
        bpfprog.denied(insns, [R("c 4000:1 rw")])


def test_struct_layout_of_the_context_is_the_kernels() -> None:
    # bpf_cgroup_dev_ctx: access_type = (ACC << 16) | TYPE, then major, then minor (u32 each).
    ctx = Request("b", 7, 9, "rw").ctx()
    assert struct.unpack("<III", ctx) == (((2 | 4) << 16) | 1, 7, 9)
