"""The device program generator (golden instruction bytes) and the evaluator that runs such programs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from isolator.cgroups.bpfprog import (
    EXIT,
    MOV32_K,
    Insn,
    Request,
    UnsupportedProgram,
    assemble,
    build,
    build_bytes,
    decode,
    denied,
    disassemble,
    evaluate,
)
from isolator.policy.devices import DeviceRule, parse_rules, permits

# Each line is one struct bpf_insn, written out by hand from bpf.h: code, src<<4|dst, off (le16),
# imm (le32). The comments are what `bpftool prog dump xlated` prints for them.
PROLOGUE_HEX = [
    "6112000000000000",  # r2 = *(u32 *)(r1 +0)
    "54020000ffff0000",  # w2 &= 65535
    "6113000000000000",  # r3 = *(u32 *)(r1 +0)
    "7403000010000000",  # w3 >>= 16
    "6114040000000000",  # r4 = *(u32 *)(r1 +4)
    "6115080000000000",  # r5 = *(u32 *)(r1 +8)
]
DENY_HEX = ["b400000000000000", "9500000000000000"]  # w0 = 0; exit
ALLOW_HEX = ["b400000001000000", "9500000000000000"]  # w0 = 1; exit


def hex_lines(code: bytes) -> list[str]:
    return [code[i : i + 8].hex() for i in range(0, len(code), 8)]


def test_empty_rule_set_is_a_program_that_denies_everything() -> None:
    assert hex_lines(build_bytes([])) == PROLOGUE_HEX + DENY_HEX


def test_allow_all_rule_is_an_unconditional_allow_block() -> None:
    assert hex_lines(build_bytes([DeviceRule.parse("a *:* rwm")])) == PROLOGUE_HEX + ALLOW_HEX + DENY_HEX


def test_golden_exact_device_with_access_subset_and_wildcard_minor() -> None:
    rules = parse_rules(["c 1:3 rw", "c 195:* rwm"])
    assert hex_lines(build_bytes(rules)) == [
        *PROLOGUE_HEX,
        # c 1:3 rw
        "5502070002000000",  # if r2 != 2 (char) goto +7
        "bc31000000000000",  # w1 = w3
        "5401000006000000",  # w1 &= 6 (read|write)
        "5d31040000000000",  # if r1 != r3 goto +4: asks for more than rw
        "5504030001000000",  # if r4 != 1 goto +3
        "5505020003000000",  # if r5 != 3 goto +2
        *ALLOW_HEX,
        # c 195:* rwm: no access check, no minor check
        "5502030002000000",  # if r2 != 2 goto +3
        "55040200c3000000",  # if r4 != 195 goto +2
        *ALLOW_HEX,
        *DENY_HEX,
    ]


def test_golden_block_device_mknod_only() -> None:
    assert hex_lines(build_bytes([DeviceRule.parse("b *:* m")]))[6:] == [
        "5502050001000000",  # if r2 != 1 (block) goto +5
        "bc31000000000000",  # w1 = w3
        "5401000001000000",  # w1 &= 1 (mknod)
        "5d31020000000000",  # if r1 != r3 goto +2
        *ALLOW_HEX,
        *DENY_HEX,
    ]


def test_encompassed_rules_are_not_emitted_twice() -> None:
    assert build(parse_rules(["c 195:* rwm", "c 195:0 rw", "c 195:* rwm"])) == build(parse_rules(["c 195:* rwm"]))


def test_decode_inverts_assemble() -> None:
    prog = build(parse_rules(["c 1:3 rw", "b 8:* m"]))
    assert tuple(decode(assemble(prog))) == prog
    assert disassemble(prog)[6] == "  6: if r2 != 2 goto +7"


rules_strategy = st.builds(
    DeviceRule,
    st.sampled_from("abc"),
    st.none(),
    st.none(),
    st.sampled_from(["r", "w", "m", "rw", "rm", "wm", "rwm"]),
) | st.builds(
    DeviceRule,
    st.sampled_from("bc"),
    st.one_of(st.none(), st.integers(0, 3)),
    st.one_of(st.none(), st.integers(0, 3)),
    st.sampled_from(["r", "w", "m", "rw", "rm", "wm", "rwm"]),
)
request_strategy = st.builds(
    Request,
    st.sampled_from("bc"),
    st.integers(0, 3),
    st.integers(0, 3),
    st.sampled_from(["r", "w", "m", "rw", "rm", "wm", "rwm"]),
)


@given(st.lists(rules_strategy, max_size=6), request_strategy)
def test_program_allows_exactly_what_the_rules_permit(rules: list[DeviceRule], req: Request) -> None:
    as_rule = DeviceRule(req.type, req.major, req.minor, req.access)
    assert evaluate(build_bytes(rules), req) == int(permits(rules, as_rule))


def test_denied_lists_each_refused_request_for_concrete_rules() -> None:
    prog = build_bytes(parse_rules(["c 195:0 r", "c *:* m"]))
    refused = denied(prog, parse_rules(["c 195:0 rwm", "c 195:1 rwm", "c 136:* rwm"]))
    assert [str(r) for r in refused] == [
        "c 195:0 w",
        "c 195:0 rw",
        "c 195:1 r",
        "c 195:1 w",
        "c 195:1 rw",
    ]


def test_evaluator_runs_a_systemd_style_epilogue_with_ja() -> None:
    # systemd's bpf-devices.c: matches jump to a shared "r0 = 1" through ja.
    prog = [
        Insn(0x61, 4, 1, 4),  # r4 = major
        Insn(0x55, 4, 0, 1, 1),  # if r4 != 1 goto +1
        Insn(0x05, off=2),  # ja +2 (to r0 = 1)
        Insn(0xB7, 0, imm=0),  # r0 = 0 (64-bit mov)
        Insn(0x05, off=1),  # ja +1
        Insn(MOV32_K, 0, imm=1),
        Insn(EXIT),
    ]
    assert evaluate(prog, Request("c", 1, 3, "r")) == 1
    assert evaluate(prog, Request("c", 5, 3, "r")) == 0


def test_evaluator_refuses_what_it_does_not_model() -> None:
    with pytest.raises(UnsupportedProgram, match="helper"):
        evaluate([Insn(0x85, imm=1), Insn(EXIT)], Request("c", 1, 3, "r"))
    with pytest.raises(UnsupportedProgram, match="outside"):
        evaluate([Insn(0x61, 2, 1, 12), Insn(EXIT)], Request("c", 1, 3, "r"))


# ---- The evaluator, one instruction at a time -------------------------------------------------
# Expected values are the kernel's eBPF semantics (Documentation/bpf/standardization/
# instruction-set.rst): ALU32 results are zero-extended to 64 bits, shift amounts are masked to the
# operand width, division by zero yields 0 and modulo by zero leaves the dividend, immediates are
# sign-extended to 64 bits. Each table row is one operator at one boundary, so that a changed operator,
# comparison or mask in the evaluator is noticed (make mutation, docs/mutation.md).

import struct  # noqa: E402

from isolator.cgroups import bpfprog  # noqa: E402

REQ = Request("c", 195, 7, "rw")
ALU32, ALU64, JMP, JMP32 = 0x04, 0x07, 0x05, 0x06
K, X = 0x00, 0x08
MOV64_K = 0xB7
RSH64_K = 0x77
M64 = (1 << 64) - 1


def _s32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def ld64(reg: int, value: int) -> list[Insn]:
    """LD_IMM64 in its two slots: the low word in the first imm, the high word in the second."""
    value &= M64
    return [Insn(0x18, reg, 0, 0, _s32(value)), Insn(0, 0, 0, 0, _s32(value >> 32))]


def r0_after(body: list[Insn]) -> int:
    """The full 64-bit r0 after ``body``: exit returns only w0, so the high word is read by a second
    run that shifts it down first."""
    lo = evaluate(assemble([*body, Insn(EXIT)]), REQ)
    hi = evaluate(assemble([*body, Insn(RSH64_K, 0, imm=32), Insn(EXIT)]), REQ)
    return (hi << 32) | lo


ALU_CASES = [
    # (op, class, a, b, expected r0)
    (0x00, ALU64, 5, 3, 8),
    (0x00, ALU64, M64, 2, 1),  # wraps at 64 bits
    (0x00, ALU32, 0x1_FFFF_FFFF, 2, 1),  # wraps at 32 bits, upper half cleared
    (0x10, ALU64, 3, 5, M64 - 1),
    (0x10, ALU32, 3, 5, 0xFFFF_FFFE),
    (0x10, ALU64, 9, 4, 5),
    (0x20, ALU64, 0x1_0000_0000, 3, 0x3_0000_0000),
    (0x20, ALU32, 0x1_0001, 0x1_0001, 0x2_0001),
    (0x30, ALU64, 7, 2, 3),
    (0x30, ALU64, M64 - 1, 2, 0x7FFF_FFFF_FFFF_FFFF),  # unsigned division
    (0x30, ALU32, 0x1_0000_0008, 2, 4),  # only the low word divides
    (0x30, ALU64, 7, 0, 0),  # division by zero gives 0
    (0x40, ALU64, 0b1010, 0b0110, 0b1110),
    (0x40, ALU32, 0x1_0000_0001, 0b10, 0b11),
    (0x50, ALU64, 0b1010, 0b0110, 0b0010),
    (0x50, ALU64, 0x3_0000_0000, 0x1_0000_0000, 0x1_0000_0000),
    (0x60, ALU64, 1, 33, 0x2_0000_0000),
    (0x60, ALU64, 1, 65, 2),  # shift amount masked to 6 bits
    (0x60, ALU32, 1, 33, 2),  # shift amount masked to 5 bits
    (0x60, ALU32, 0x8000_0001, 1, 2),  # bits shifted out of the word are gone
    (0x70, ALU64, 1 << 63, 63, 1),
    (0x70, ALU64, 8, 65, 4),
    (0x70, ALU32, 8, 33, 4),
    (0x70, ALU32, 0x1_0000_0000, 0, 0),
    (0x80, ALU64, 1, 0, M64),  # neg
    (0x80, ALU32, 1, 0, 0xFFFF_FFFF),
    (0x80, ALU64, 0, 0, 0),
    (0x90, ALU64, 7, 3, 1),
    (0x90, ALU64, 7, 0, 7),  # modulo by zero leaves the dividend
    (0x90, ALU32, 0x1_0000_0007, 0, 7),  # ... truncated to the word
    (0x90, ALU64, 0x1_0000_0007, 0x1_0000_0000, 7),
    (0xA0, ALU64, 0b1010, 0b0110, 0b1100),
    (0xA0, ALU64, M64, 1, M64 - 1),
    (0xB0, ALU64, 123, 0x1_0000_0002, 0x1_0000_0002),  # mov
    (0xB0, ALU32, 123, 0x1_0000_0002, 2),
    (0xC0, ALU64, 1 << 63, 63, M64),  # arsh keeps the sign
    (0xC0, ALU32, 0x8000_0000, 31, 0xFFFF_FFFF),
    (0xC0, ALU64, 0x4000_0000, 30, 1),
    (0xC0, ALU32, 0x1_4000_0000, 30, 1),
    (0xC0, ALU64, 1 << 63, 65, 0xC000_0000_0000_0000),  # shift amount masked
]


@pytest.mark.parametrize(("op", "cls", "a", "b", "expected"), ALU_CASES)
def test_alu_register_source_matches_the_kernel(op: int, cls: int, a: int, b: int, expected: int) -> None:
    body = [*ld64(0, a), *ld64(2, b), Insn(op | X | cls, 0, 2)]
    assert r0_after(body) == expected


@pytest.mark.parametrize(
    ("op", "cls", "a", "imm", "expected"),
    [
        (0x00, ALU64, 5, -1, 4),  # imm sign-extended: 5 + (-1)
        (0x00, ALU32, 5, -1, 4),
        (0xB0, ALU64, 0, -1, M64),  # mov64 of -1 is all ones
        (0xB0, ALU32, 0, -1, 0xFFFF_FFFF),  # mov32 of -1 zero-extends
        (0x50, ALU64, M64, 0xFFFF, 0xFFFF),
        (0x70, ALU32, 0x00FF_0000, 16, 0xFF),
        (0x30, ALU64, 10, 3, 3),
        (0x90, ALU64, 10, 3, 1),
    ],
)
def test_alu_immediate_source_is_sign_extended(op: int, cls: int, a: int, imm: int, expected: int) -> None:
    assert r0_after([*ld64(0, a), Insn(op | K | cls, 0, imm=imm)]) == expected


NEG1 = M64  # -1 as a 64-bit register
JUMP_CASES = [
    # (op, a, b, taken) at 64 bits
    (0x10, 5, 5, True),
    (0x10, 5, 6, False),
    (0x20, 6, 5, True),
    (0x20, 5, 5, False),
    (0x20, NEG1, 1, True),  # unsigned
    (0x30, 5, 5, True),
    (0x30, 4, 5, False),
    (0x30, 6, 5, True),
    (0x40, 6, 3, True),  # jset
    (0x40, 4, 3, False),
    (0x50, 5, 6, True),
    (0x50, 5, 5, False),
    (0x60, 1, NEG1, True),  # signed
    (0x60, NEG1, 1, False),
    (0x60, 5, 5, False),
    (0x70, 5, 5, True),
    (0x70, NEG1, 1, False),
    (0x70, 1, NEG1, True),
    (0xA0, 4, 5, True),
    (0xA0, 5, 5, False),
    (0xA0, NEG1, 1, False),
    (0xB0, 5, 5, True),
    (0xB0, 6, 5, False),
    (0xB0, 4, 5, True),
    (0xC0, NEG1, 1, True),
    (0xC0, 5, 5, False),
    (0xC0, 1, NEG1, False),
    (0xD0, 5, 5, True),
    (0xD0, 1, NEG1, False),
    (0xD0, NEG1, 1, True),
]


def _jump_program(code: int, a: int, b: int, imm: int = 0) -> list[Insn]:
    """r0 = 1 when the jump at the middle is taken, 0 when execution falls through."""
    return [
        *ld64(2, a),
        *ld64(3, b),
        Insn(MOV64_K, 0, imm=0),
        Insn(code, 2, 3, 1, imm),
        Insn(EXIT),
        Insn(MOV64_K, 0, imm=1),
        Insn(EXIT),
    ]


@pytest.mark.parametrize(("op", "a", "b", "taken"), JUMP_CASES)
def test_jump_with_register_source_matches_the_kernel(op: int, a: int, b: int, taken: bool) -> None:
    assert evaluate(_jump_program(op | X | JMP, a, b), REQ) == int(taken)


@pytest.mark.parametrize(("op", "a", "b", "taken"), JUMP_CASES)
def test_jump_with_immediate_source_matches_the_kernel(op: int, a: int, b: int, taken: bool) -> None:
    assert evaluate(_jump_program(op | K | JMP, a, 0, _s32(b)), REQ) == int(taken)


@pytest.mark.parametrize(
    ("op", "a", "b", "taken64", "taken32"),
    [
        (0x10, 0x1_0000_0005, 5, False, True),  # jeq: JMP32 compares the low words only
        (0x20, 0x1_0000_0000, 5, True, False),
        (0x60, 0x8000_0000, 1, True, False),  # jsgt: 0x80000000 is negative as a word
        (0xC0, 0xFFFF_FFFF, 0, False, True),  # jslt: 0xffffffff is -1 as a word
        (0xD0, 0x1_8000_0000, 0, False, True),
    ],
)
def test_jmp32_compares_the_low_words_signed_as_words(op: int, a: int, b: int, taken64: bool, taken32: bool) -> None:
    assert evaluate(_jump_program(op | X | JMP, a, b), REQ) == int(taken64)
    assert evaluate(_jump_program(op | X | JMP32, a, b), REQ) == int(taken32)


def test_backward_conditional_jump_loops_until_the_condition_fails() -> None:
    prog = [
        Insn(MOV64_K, 0, imm=0),
        Insn(0x07, 0, imm=1),  # r0 += 1
        Insn(0x55, 0, 0, -2, 3),  # if r0 != 3 goto -2
        Insn(EXIT),
    ]
    assert evaluate(prog, REQ) == 3


def test_exit_returns_the_low_word_of_r0() -> None:
    assert evaluate([*ld64(0, 0x7_0000_0001), Insn(EXIT)], REQ) == 1


def test_context_words_are_access_type_major_and_minor() -> None:
    req = Request("b", 8, 17, "m")
    assert req.ctx() == struct.pack("<III", (1 << 16) | 1, 8, 17)
    read = {off: evaluate([Insn(0x61, 0, 1, off), Insn(EXIT)], req) for off in (0, 4, 8)}
    assert read == {0: 0x1_0001, 4: 8, 8: 17}


@pytest.mark.parametrize(
    ("code", "off", "expected"),
    [
        (0x61, 0, 0x0006_0002),  # W: access_type of c ... rw
        (0x69, 0, 0x0002),  # H
        (0x69, 2, 0x0006),
        (0x71, 2, 0x06),  # B
        (0x79, 4, (7 << 32) | 195),  # DW: major and minor together
    ],
)
def test_context_loads_of_each_size(code: int, off: int, expected: int) -> None:
    assert r0_after([Insn(code, 0, 1, off)]) == expected


@pytest.mark.parametrize("off", [-1, 9, 12])
def test_context_loads_outside_the_context_are_refused(off: int) -> None:
    with pytest.raises(UnsupportedProgram, match=r"load of 4 bytes outside the context and stack"):
        evaluate([Insn(0x61, 0, 1, off), Insn(EXIT)], REQ)


def test_stack_store_then_load_of_each_size_is_little_endian() -> None:
    value = 0x0807_0605_0403_0201
    store = [*ld64(2, value), Insn(0x7B, 10, 2, -8)]  # *(u64 *)(r10 - 8) = r2
    assert r0_after([*store, Insn(0x79, 0, 10, -8)]) == value
    assert r0_after([*store, Insn(0x61, 0, 10, -8)]) == 0x0403_0201
    assert r0_after([*store, Insn(0x61, 0, 10, -4)]) == 0x0807_0605
    assert r0_after([*store, Insn(0x69, 0, 10, -6)]) == 0x0403
    assert r0_after([*store, Insn(0x71, 0, 10, -1)]) == 0x08


@pytest.mark.parametrize(
    ("code", "expected"),
    [(0x73, 0xFF), (0x6B, 0xFFFF), (0x63, 0xFFFF_FFFF), (0x7B, M64)],  # STX B, H, W, DW
)
def test_register_stores_write_only_their_size(code: int, expected: int) -> None:
    # The slot is zeroed first: a read of stack bytes never written is refused (the kernel lets
    # root read whatever was there, so no verdict can be given).
    prog = [Insn(0x7A, 10, 0, -16, 0), *ld64(2, M64), Insn(code, 10, 2, -16), Insn(0x79, 0, 10, -16)]
    assert r0_after(prog) == expected


@pytest.mark.parametrize(
    ("code", "expected"),
    [(0x72, 0xFF), (0x6A, 0xFFFF), (0x62, 0xFFFF_FFFF), (0x7A, M64)],  # ST B, H, W, DW of imm -1
)
def test_immediate_stores_write_their_size_of_the_sign_extended_imm(code: int, expected: int) -> None:
    assert r0_after([Insn(0x7A, 10, 0, -16, 0), Insn(code, 10, 0, -16, -1), Insn(0x79, 0, 10, -16)]) == expected


def test_the_stack_is_512_bytes_below_r10_and_unwritten_bytes_are_never_read() -> None:
    with pytest.raises(UnsupportedProgram, match=r"^read of stack never written"):
        evaluate([Insn(0x79, 0, 10, -512), Insn(EXIT)], REQ)
    assert r0_after([Insn(0x7A, 10, 0, -512, 5), Insn(0x79, 0, 10, -512)]) == 5
    for bad in (-513, -7, 0):
        with pytest.raises(UnsupportedProgram, match=r"^store outside the stack$"):
            evaluate([Insn(0x7A, 10, 0, bad, 5), Insn(EXIT)], REQ)
        with pytest.raises(UnsupportedProgram, match=r"^load of 8 bytes outside"):
            evaluate([Insn(0x79, 0, 10, bad), Insn(EXIT)], REQ)


def test_ld_imm64_refuses_map_references_and_a_missing_second_slot() -> None:
    with pytest.raises(UnsupportedProgram, match=r"^map or BTF references$"):
        evaluate([Insn(0x18, 0, 1, 0, 1), Insn(0), Insn(EXIT)], REQ)
    with pytest.raises(UnsupportedProgram, match=r"^map or BTF references$"):
        evaluate([Insn(0x18, 0, 0, 0, 1)], REQ)
    assert evaluate([Insn(0x18, 0, 0, 0, 1), Insn(0, imm=-1), Insn(EXIT)], REQ) == 1


@pytest.mark.parametrize(
    ("insn", "message"),
    [
        (Insn(0x3F, 0, 2, 1), r"^signed ALU variants$"),  # sdiv: off 1
        (Insn(0xD4, 0, imm=16), r"^byte swap$"),
        (Insn(0xE7, 0), r"^ALU op 0xe0$"),
        (Insn(0xF4, 0), r"^ALU op 0xf0$"),
        (Insn(0xE5, 0, 0, 1), r"^jump op 0xe0$"),
        (Insn(0x06, 0, 0, 1), r"^jump op 0x0$"),  # JMP32 | JA ("gotol") is not modeled
        (Insn(0x85, imm=1), r"^helper calls$"),
        (Insn(0x20, imm=0), r"^opcode 0x20$"),  # LD ABS
        (Insn(0x81, 0, 1), r"^opcode 0x81$"),  # LDX MEMSX
        (Insn(0xC3, 10, 0, -8), r"^opcode 0xc3$"),  # atomic
        (Insn(0x82, 10, 0, -8), r"^opcode 0x82$"),
    ],
)
def test_each_instruction_the_evaluator_does_not_model_is_named(insn: Insn, message: str) -> None:
    with pytest.raises(UnsupportedProgram, match=message):
        evaluate([Insn(MOV64_K, 0, imm=0), insn, Insn(EXIT)], REQ)


def test_running_off_either_end_of_the_program_is_refused() -> None:
    with pytest.raises(UnsupportedProgram, match=r"^jump out of the program to 1$"):
        evaluate([Insn(MOV64_K, 0, imm=1)], REQ)
    with pytest.raises(UnsupportedProgram, match=r"^jump out of the program to -1$"):
        evaluate([Insn(0x05, off=-2), Insn(EXIT)], REQ)
    with pytest.raises(UnsupportedProgram, match=r"^jump out of the program to 3$"):
        evaluate([Insn(0x05, off=2), Insn(EXIT)], REQ)


def test_a_program_that_never_exits_is_refused_after_the_step_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bpfprog, "_MAX_STEPS", 50)
    with pytest.raises(UnsupportedProgram, match=r"^no exit within 50 steps$"):
        evaluate([Insn(0x05, off=-1)], REQ)
    # 49 steps of a countdown and an exit fit in a budget of 50.
    countdown = [Insn(MOV64_K, 0, imm=24), Insn(0x17, 0, imm=1), Insn(0x55, 0, 0, -2, 0), Insn(EXIT)]
    assert evaluate(countdown, REQ) == 0


def test_evaluate_accepts_bytes_bytearray_and_instructions_alike() -> None:
    prog = build(parse_rules(["c 195:7 rw"]))
    code = assemble(prog)
    assert evaluate(prog, REQ) == evaluate(code, REQ) == evaluate(bytearray(code), REQ) == 1


def test_decode_refuses_a_partial_instruction() -> None:
    with pytest.raises(ValueError, match=r"^program length 12 is not a multiple of 8$"):
        decode(b"\x95" + bytes(11))


def test_decode_splits_registers_and_keeps_signed_fields() -> None:
    assert decode(bytes.fromhex("5d31feffffffffff")) == [Insn(0x5D, 1, 3, -2, -1)]


def test_disassembly_names_every_opcode_build_emits() -> None:
    prog = [
        Insn(0x61, 2, 1, 4),
        Insn(0x54, 2, imm=0xFFFF),
        Insn(0x74, 3, imm=16),
        Insn(0xB4, 0, imm=1),
        Insn(0xBC, 1, 3),
        Insn(0x55, 2, 0, 7, 2),
        Insn(0x5D, 1, 3, 4),
        Insn(0x95),
        Insn(0x07, 4, 2, -3, 9),
    ]
    assert disassemble(assemble(prog)) == [
        "  0: r2 = *(u32 *)(r1 + 4)",
        "  1: w2 &= 0xffff",
        "  2: w3 >>= 16",
        "  3: w0 = 1",
        "  4: w1 = w3",
        "  5: if r2 != 2 goto +7",
        "  6: if r1 != r3 goto +4",
        "  7: exit",
        "  8: code=0x07 dst=r4 src=r2 off=-3 imm=9",
    ]


def test_requests_for_a_concrete_rule_are_each_bit_and_read_write_together() -> None:
    assert [str(r) for r in bpfprog.requests_for(DeviceRule.parse("c 195:0 rwm"))] == [
        "c 195:0 r",
        "c 195:0 w",
        "c 195:0 m",
        "c 195:0 rw",
    ]
    assert [str(r) for r in bpfprog.requests_for(DeviceRule.parse("b 8:1 rm"))] == ["b 8:1 r", "b 8:1 m"]
    assert [str(r) for r in bpfprog.requests_for(DeviceRule.parse("c 1:3 w"))] == ["c 1:3 w"]
    with pytest.raises(ValueError, match=r"is not one device"):
        bpfprog.requests_for(DeviceRule.parse("c 195:* rwm"))


def test_denied_skips_wildcard_rules_and_accepts_instructions() -> None:
    prog = build(parse_rules(["c 195:0 rwm"]))
    assert denied(prog, parse_rules(["c *:* rwm", "c 195:0 rwm"])) == ()
    assert [str(r) for r in denied(prog, parse_rules(["c 195:1 m"]))] == ["c 195:1 m"]


def test_access_mask_sums_the_bits_of_each_letter() -> None:
    assert bpfprog.access_mask("") == 0
    assert bpfprog.access_mask("m") == 1
    assert bpfprog.access_mask("rwm") == 7
    assert bpfprog.access_mask("wr") == 6


@pytest.mark.parametrize(
    ("op", "a", "b", "taken"),
    [(0x60, 5, 4, True), (0x70, 4, 5, False), (0xC0, 4, 5, True), (0xD0, 5, 4, False)],
)
def test_signed_jumps_tell_neighbouring_values_apart(op: int, a: int, b: int, taken: bool) -> None:
    assert evaluate(_jump_program(op | X | JMP, a, b), REQ) == int(taken)
    assert evaluate(_jump_program(op | X | JMP32, a, b), REQ) == int(taken)


def test_stores_to_neighbouring_stack_slots_keep_each_other() -> None:
    prog = [
        *ld64(2, 0x1111),
        Insn(0x7B, 10, 2, -8),
        *ld64(2, 0x2222),
        Insn(0x7B, 10, 2, -16),
    ]
    assert r0_after([*prog, Insn(0x79, 0, 10, -8)]) == 0x1111
    assert r0_after([*prog, Insn(0x79, 0, 10, -16)]) == 0x2222


def test_a_program_that_exits_without_setting_r0_denies() -> None:
    # Registers start at zero (the kernel's verifier would refuse the read; we fail closed).
    assert evaluate([Insn(EXIT)], REQ) == 0
    assert r0_after([Insn(0xBF, 0, 7)]) == 0  # r0 = r7, never written


def test_denied_goes_on_after_a_wildcard_rule() -> None:
    prog = build(parse_rules(["c 195:0 rwm"]))
    assert [str(r) for r in denied(prog, parse_rules(["c *:* rwm", "c 195:1 m"]))] == ["c 195:1 m"]


def test_mesos_mode_decides_only_character_devices_of_the_given_majors() -> None:
    rules = parse_rules(["c 195:0 rw"])
    prog = build(rules, decide_majors=[195, 10, 195])
    lines = disassemble(prog)
    # After the prologue: not a character device -> allow; major 10 or 195 -> the rules; else allow.
    assert lines[6:11] == [
        "  6: if r2 != 2 goto +2",
        "  7: if r4 == 10 goto +3",
        "  8: if r4 == 195 goto +2",
        "  9: w0 = 1",
        " 10: exit",
    ]
    assert build_bytes(rules, decide_majors=[10, 195]) == assemble(prog)
    assert hex_lines(assemble(prog))[6:11] == [
        "5502020002000000",  # if r2 != 2 goto +2
        "150403000a000000",  # if r4 == 10 goto +3
        "15040200c3000000",  # if r4 == 195 goto +2
        *ALLOW_HEX,
    ]
    assert evaluate(prog, Request("c", 195, 0, "rw")) == 1  # the rule
    assert evaluate(prog, Request("c", 195, 1, "r")) == 0  # a decided major, no rule
    assert evaluate(prog, Request("c", 10, 200, "r")) == 0  # the other decided major
    assert evaluate(prog, Request("c", 1, 3, "rwm")) == 1  # another major: left to the agent's program
    assert evaluate(prog, Request("b", 195, 0, "rwm")) == 1  # a block device: likewise
    # Without majors the same rules decide everything.
    assert evaluate(build(rules), Request("c", 1, 3, "r")) == 0


def test_disassembly_names_equal_jumps_and_unconditional_jumps() -> None:
    assert disassemble([Insn(0x15, 4, 0, 3, 195), Insn(0x05, 0, 0, 2)]) == ["  0: if r4 == 195 goto +3", "  1: goto +2"]


def test_a_one_byte_store_marks_only_that_byte_written() -> None:
    store = Insn(0x72, 10, 0, -16, 7)  # *(u8 *)(r10 - 16) = 7
    assert r0_after([store, Insn(0x71, 0, 10, -16)]) == 7
    with pytest.raises(UnsupportedProgram, match=r"^read of stack never written"):
        evaluate([store, Insn(0x61, 0, 10, -16), Insn(EXIT)], REQ)
    with pytest.raises(UnsupportedProgram, match=r"^read of stack never written"):
        evaluate([store, Insn(0x71, 0, 10, -15), Insn(EXIT)], REQ)
