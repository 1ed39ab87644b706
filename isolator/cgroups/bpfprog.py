"""Device rules to a BPF_PROG_TYPE_CGROUP_DEVICE program, and an evaluator for such programs; pure.

``build`` emits a default-deny allow-list program; ``evaluate`` runs any cgroup device program's
instructions (ours or another's, e.g. read back from the kernel) against one access request, so a
foreign program that would deny our GPUs can be named before we rely on it. No syscalls here.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from isolator.policy.devices import DeviceRule, normalize

# include/uapi/linux/bpf.h (values checked against the header on this kind of machine,
# bridge-and-cgroup2.md B.2): bpf_cgroup_dev_ctx.access_type = (ACC_* << 16) | DEV_*.
DEV_BLOCK = 1
DEV_CHAR = 2
ACC_MKNOD = 1
ACC_READ = 2
ACC_WRITE = 4
TYPE_BITS = {"b": DEV_BLOCK, "c": DEV_CHAR}
ACCESS_BITS = {"m": ACC_MKNOD, "r": ACC_READ, "w": ACC_WRITE}
ALL_ACCESS = ACC_MKNOD | ACC_READ | ACC_WRITE

# Opcode bytes: class | size/op | mode/source (include/uapi/linux/bpf_common.h, bpf.h).
LDX_W = 0x61  # BPF_LDX | BPF_W | BPF_MEM
AND32_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
RSH32_K = 0x74  # BPF_ALU | BPF_RSH | BPF_K
MOV32_X = 0xBC  # BPF_ALU | BPF_MOV | BPF_X
MOV32_K = 0xB4  # BPF_ALU | BPF_MOV | BPF_K
JNE_K = 0x55  # BPF_JMP | BPF_JNE | BPF_K
JNE_X = 0x5D  # BPF_JMP | BPF_JNE | BPF_X
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JA = 0x05  # BPF_JMP | BPF_JA
EXIT = 0x95  # BPF_JMP | BPF_EXIT

# Registers after the prologue: r2 device type, r3 requested access, r4 major, r5 minor.
R0, R1, R2, R3, R4, R5 = range(6)


@dataclass(frozen=True)
class Insn:
    """One ``struct bpf_insn``: code, dst_reg (low nibble), src_reg (high nibble), off, imm."""

    code: int
    dst: int = 0
    src: int = 0
    off: int = 0
    imm: int = 0

    def encode(self) -> bytes:
        return struct.pack("<BBhi", self.code, (self.src << 4) | self.dst, self.off, self.imm)


def assemble(insns: Iterable[Insn]) -> bytes:
    return b"".join(i.encode() for i in insns)


def decode(code: bytes) -> list[Insn]:
    if len(code) % 8:
        raise ValueError(f"program length {len(code)} is not a multiple of 8")
    out = []
    for pos in range(0, len(code), 8):
        op, regs, off, imm = struct.unpack_from("<BBhi", code, pos)
        out.append(Insn(op, regs & 0xF, regs >> 4, off, imm))
    return out


PROLOGUE = (
    Insn(LDX_W, R2, R1, 0, 0),  # r2 = ctx->access_type
    Insn(AND32_K, R2, imm=0xFFFF),  # w2 &= 0xffff: device type
    Insn(LDX_W, R3, R1, 0, 0),  # r3 = ctx->access_type
    Insn(RSH32_K, R3, imm=16),  # w3 >>= 16: requested access bits
    Insn(LDX_W, R4, R1, 4, 0),  # r4 = ctx->major
    Insn(LDX_W, R5, R1, 8, 0),  # r5 = ctx->minor
)
EPILOGUE = (Insn(MOV32_K, R0, imm=0), Insn(EXIT))  # nothing matched: deny


def access_mask(access: str) -> int:
    mask = 0
    for c in access:
        mask |= ACCESS_BITS[c]
    return mask


def _rule_block(rule: DeviceRule) -> list[Insn]:
    # Each check is "if this does not match, skip the rest of the block"; the block ends with
    # r0 = 1; exit. Jump offsets are counted from the next instruction, so they are filled in
    # once the block's length is known.
    checks: list[tuple[int, int, int, int]] = []  # (code, dst, src, imm) of a conditional jump
    pre: dict[int, list[Insn]] = {}
    if rule.type != "a":
        checks.append((JNE_K, R2, 0, TYPE_BITS[rule.type]))
    mask = access_mask(rule.access)
    if mask != ALL_ACCESS:
        # The request must be a subset of the rule's access: (w3 & mask) == w3.
        pre[len(checks)] = [Insn(MOV32_X, R1, R3), Insn(AND32_K, R1, imm=mask)]
        checks.append((JNE_X, R1, R3, 0))
    if rule.major is not None:
        checks.append((JNE_K, R4, 0, rule.major))
    if rule.minor is not None:
        checks.append((JNE_K, R5, 0, rule.minor))
    tail = [Insn(MOV32_K, R0, imm=1), Insn(EXIT)]
    length = sum(1 + len(pre.get(i, [])) for i in range(len(checks))) + len(tail)
    out: list[Insn] = []
    for i, (code, dst, src, imm) in enumerate(checks):
        out.extend(pre.get(i, []))
        out.append(Insn(code, dst, src, 0, imm))
    # Second pass: each jump skips to the end of the block.
    fixed: list[Insn] = []
    for pos, insn in enumerate(out):
        if insn.code in (JNE_K, JNE_X):
            insn = Insn(insn.code, insn.dst, insn.src, length - pos - 1, insn.imm)
        fixed.append(insn)
    return fixed + tail


def build(rules: Iterable[DeviceRule], decide_majors: Iterable[int] | None = None) -> tuple[Insn, ...]:
    """A default-deny program allowing exactly ``rules`` (normalized; first match allows).

    With ``decide_majors`` (mesos mode) the program decides only for character devices of those
    majors, with the same allow-list, and allows everything else: device programs on a cgroup and
    its ancestors must all allow (BPF_F_ALLOW_MULTI is an AND), so every other device is left to
    the agent's program, exactly as the agent's ``--allowed_devices`` set it.
    """
    insns: list[Insn] = list(PROLOGUE)
    blocks: list[Insn] = []
    for rule in normalize(rules):
        blocks.extend(_rule_block(rule))
    if decide_majors is not None:
        majors = sorted(set(decide_majors))
        # 0: if type != c goto allow; 1..k: if major == M_i goto rules; k+1, k+2: allow (w0 = 1;
        # exit); k+3: the rule blocks. Offsets count from the next instruction.
        k = len(majors)
        insns.append(Insn(JNE_K, R2, 0, k, DEV_CHAR))
        insns.extend(Insn(JEQ_K, R4, 0, k - i + 1, major) for i, major in enumerate(majors))
        insns.extend((Insn(MOV32_K, R0, imm=1), Insn(EXIT)))
    insns.extend(blocks)
    insns.extend(EPILOGUE)
    return tuple(insns)


def build_bytes(rules: Iterable[DeviceRule], decide_majors: Iterable[int] | None = None) -> bytes:
    return assemble(build(rules, decide_majors))


# ---- Evaluation -------------------------------------------------------------------------------


class UnsupportedProgram(Exception):
    """The program uses an instruction the evaluator does not model (helpers, atomics, ...)."""


@dataclass(frozen=True)
class Request:
    """One access the kernel would check: what ``open()``/``mknod()`` on a node passes."""

    type: str
    major: int
    minor: int
    access: str

    def ctx(self) -> bytes:
        return struct.pack("<III", (access_mask(self.access) << 16) | TYPE_BITS[self.type], self.major, self.minor)

    def __str__(self) -> str:
        return f"{self.type} {self.major}:{self.minor} {self.access}"


MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1
_CTX_BASE = 0x10_0000_0000
_STACK_TOP = 0x20_0000_0000
_STACK_SIZE = 512
_MAX_STEPS = 1_000_000  # the verifier's own instruction budget


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _alu(op: int, dst: int, src: int, bits: int) -> int:
    mask = (1 << bits) - 1
    a, b = dst & mask, src & mask
    if op == 0x00:
        r = a + b
    elif op == 0x10:
        r = a - b
    elif op == 0x20:
        r = a * b
    elif op == 0x30:
        r = a // b if b else 0
    elif op == 0x40:
        r = a | b
    elif op == 0x50:
        r = a & b
    elif op == 0x60:
        r = a << (b & (bits - 1))
    elif op == 0x70:
        r = a >> (b & (bits - 1))
    elif op == 0x80:
        r = -a
    elif op == 0x90:
        r = a % b if b else a
    elif op == 0xA0:
        r = a ^ b
    elif op == 0xB0:
        r = b
    elif op == 0xC0:
        r = _signed(a, bits) >> (b & (bits - 1))
    else:
        raise UnsupportedProgram(f"ALU op {op:#x}")
    return r & mask


def _jump_taken(op: int, a: int, b: int, bits: int) -> bool:
    mask = (1 << bits) - 1
    a, b = a & mask, b & mask
    sa, sb = _signed(a, bits), _signed(b, bits)
    table = {
        0x10: a == b,
        0x20: a > b,
        0x30: a >= b,
        0x40: bool(a & b),
        0x50: a != b,
        0x60: sa > sb,
        0x70: sa >= sb,
        0xA0: a < b,
        0xB0: a <= b,
        0xC0: sa < sb,
        0xD0: sa <= sb,
    }
    if op not in table:
        raise UnsupportedProgram(f"jump op {op:#x}")
    return table[op]


def evaluate(program: bytes | Sequence[Insn], request: Request) -> int:
    """Run a cgroup device program on one request; returns r0 (1 allow, 0 deny)."""
    insns = decode(program) if isinstance(program, bytes | bytearray) else list(program)
    regs = [0] * 11
    regs[1] = _CTX_BASE
    regs[10] = _STACK_TOP
    ctx = request.ctx()
    stack = bytearray(_STACK_SIZE)
    written = bytearray(_STACK_SIZE)  # privileged programs may read stack they never wrote: garbage
    sizes = {0x00: 4, 0x08: 2, 0x10: 1, 0x18: 8}

    def load(addr: int, size: int) -> int:
        if addr >= _CTX_BASE and addr + size <= _CTX_BASE + len(ctx):
            return int.from_bytes(ctx[addr - _CTX_BASE : addr - _CTX_BASE + size], "little")
        base = _STACK_TOP - _STACK_SIZE
        if base <= addr and addr + size <= _STACK_TOP:
            if not all(written[addr - base : addr - base + size]):
                raise UnsupportedProgram("read of stack never written (its value is whatever was there)")
            return int.from_bytes(stack[addr - base : addr - base + size], "little")
        raise UnsupportedProgram(f"load of {size} bytes outside the context and stack")

    def store(addr: int, size: int, value: int) -> None:
        base = _STACK_TOP - _STACK_SIZE
        if not (base <= addr and addr + size <= _STACK_TOP):
            raise UnsupportedProgram("store outside the stack")
        stack[addr - base : addr - base + size] = (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little")
        written[addr - base : addr - base + size] = b"\x01" * size

    pc = 0
    for _ in range(_MAX_STEPS):
        if not 0 <= pc < len(insns):
            raise UnsupportedProgram(f"jump out of the program to {pc}")
        insn = insns[pc]
        cls, op = insn.code & 0x07, insn.code & 0xF0
        use_reg = bool(insn.code & 0x08)
        pc += 1
        if cls in (0x04, 0x07):  # ALU, ALU64
            if insn.off != 0:
                raise UnsupportedProgram("signed ALU variants")
            bits = 64 if cls == 0x07 else 32
            src = regs[insn.src] if use_reg else insn.imm & MASK64
            if op == 0xD0:
                raise UnsupportedProgram("byte swap")
            regs[insn.dst] = _alu(op, regs[insn.dst], src, bits)
        elif cls in (0x05, 0x06):  # JMP, JMP32
            if op == 0x90:
                return regs[0] & MASK32
            if op == 0x00 and cls == 0x05:
                pc += insn.off
                continue
            if op == 0x80:
                raise UnsupportedProgram("helper calls")
            src = regs[insn.src] if use_reg else insn.imm & MASK64
            if _jump_taken(op, regs[insn.dst], src, 32 if cls == 0x06 else 64):
                pc += insn.off
        elif cls == 0x01 and insn.code & 0xE0 == 0x60:  # LDX MEM
            regs[insn.dst] = load(regs[insn.src] + insn.off, sizes[insn.code & 0x18])
        elif cls == 0x03 and insn.code & 0xE0 == 0x60:  # STX MEM
            store(regs[insn.dst] + insn.off, sizes[insn.code & 0x18], regs[insn.src])
        elif cls == 0x02 and insn.code & 0xE0 == 0x60:  # ST MEM
            store(regs[insn.dst] + insn.off, sizes[insn.code & 0x18], insn.imm & MASK64)
        elif insn.code == 0x18:  # LD_IMM64: two slots
            if insn.src != 0 or pc >= len(insns):
                raise UnsupportedProgram("map or BTF references")
            regs[insn.dst] = ((insns[pc].imm & MASK32) << 32) | (insn.imm & MASK32)
            pc += 1
        else:
            raise UnsupportedProgram(f"opcode {insn.code:#04x}")
    raise UnsupportedProgram(f"no exit within {_MAX_STEPS} steps")


def requests_for(rule: DeviceRule) -> tuple[Request, ...]:
    """The requests a process makes on a concrete device the rule grants: each bit, and rw together."""
    if rule.is_wildcard:
        raise ValueError(f"{rule} is not one device")
    assert rule.major is not None and rule.minor is not None
    accesses = list(rule.access)
    if "r" in rule.access and "w" in rule.access:
        accesses.append("rw")  # open(O_RDWR) asks for both at once
    return tuple(Request(rule.type, rule.major, rule.minor, a) for a in accesses)


def denied(program: bytes | Sequence[Insn], rules: Iterable[DeviceRule]) -> tuple[Request, ...]:
    """The requests for concrete ``rules`` that the program denies (empty when it allows them all)."""
    insns = decode(program) if isinstance(program, bytes | bytearray) else list(program)
    out: list[Request] = []
    for rule in rules:
        if rule.is_wildcard:
            continue
        out.extend(req for req in requests_for(rule) if evaluate(insns, req) == 0)
    return tuple(out)


def disassemble(program: bytes | Sequence[Insn]) -> list[str]:
    """Readable lines for logs and test failures (only the opcodes ``build`` emits are named)."""
    insns = decode(program) if isinstance(program, bytes | bytearray) else list(program)
    lines = []
    for i, n in enumerate(insns):
        if n.code == LDX_W:
            text = f"r{n.dst} = *(u32 *)(r{n.src} + {n.off})"
        elif n.code in (AND32_K, RSH32_K, MOV32_K):
            op = {AND32_K: "&=", RSH32_K: ">>=", MOV32_K: "="}[n.code]
            text = f"w{n.dst} {op} {n.imm:#x}" if n.code == AND32_K else f"w{n.dst} {op} {n.imm}"
        elif n.code == MOV32_X:
            text = f"w{n.dst} = w{n.src}"
        elif n.code == JNE_K:
            text = f"if r{n.dst} != {n.imm} goto +{n.off}"
        elif n.code == JNE_X:
            text = f"if r{n.dst} != r{n.src} goto +{n.off}"
        elif n.code == JEQ_K:
            text = f"if r{n.dst} == {n.imm} goto +{n.off}"
        elif n.code == JA:
            text = f"goto +{n.off}"
        elif n.code == EXIT:
            text = "exit"
        else:
            text = f"code={n.code:#04x} dst=r{n.dst} src=r{n.src} off={n.off} imm={n.imm}"
        lines.append(f"{i:3d}: {text}")
    return lines
