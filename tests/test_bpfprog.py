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
from isolator.devices import DeviceRule, parse_rules, permits

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
