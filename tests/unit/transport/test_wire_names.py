"""The routes' conventions outside the messages are named once, in proto/gpuisolator/v1/wire.proto:
the gRPC metadata keys (``gpu-isolator-deadline-ms``, ``grpc-retry-pushback-ms``) and the bridge
socket's framing (its protocol versions and the OK/ERROR/RETRY reply words). Every client and the
server use exactly those names: the Python ones read them from the contract (isolator/transport/
wire.py), the C++ module from its generated wire.pb.h, and the two stdlib-only bridge executables
(command.py, bridge.c) spell them, checked here. No other such literal lives in the sources."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from isolator.bridge import command
from isolator.rpc import wire_pb2
from isolator.testing import grpcproxy
from isolator.transport import bridge, client, serving, status, wire

ROOT = pathlib.Path(__file__).resolve().parents[3]


def contract_names() -> dict[str, str]:
    """Each named value of wire.proto's enums and its ``(wire)`` string."""
    names = {}
    for enum in wire_pb2.DESCRIPTOR.enum_types_by_name.values():
        for value in enum.values:
            if value.number == 0:
                assert not value.GetOptions().HasExtension(wire_pb2.wire), value.name
                continue
            assert value.GetOptions().HasExtension(wire_pb2.wire), f"{value.name} has no (wire) name"
            names[value.name] = value.GetOptions().Extensions[wire_pb2.wire]
    return names


NAMES = contract_names()

# What a convention of this kind looks like, so that one spelled differently (a new key, a typo, a
# version 3) is caught as well as a copy of a named one.
LOOKALIKES = re.compile(r"gpu-isolator-[a-z-]*-ms|grpc-[a-z-]*-ms|gpu-isolator-bridge/\d")
# The bridge reply words as Python writes them on the wire: bytes beginning a reply line.
REPLY_BYTES = re.compile(rb"^(OK\n|OK$|ERROR |RETRY )")

# The stdlib-only executables spell the names; each spelling is checked against the contract below.
SPELLERS = {"isolator/bridge/command.py", "isolator/bridge/bridge.c"}


def python_literals(source: str) -> list[str | bytes]:
    """The str and bytes constants of a module, docstrings left out (prose may name a convention)."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes) and id(node) not in docstrings
    ]


def c_literals(source: str) -> list[str]:
    """The string literals of a C or C++ source, comments left out."""
    source = re.sub(r"/\*.*?\*/", " ", source, flags=re.S)
    source = re.sub(r"//[^\n]*", " ", source)
    return [m.group(1) for m in re.finditer(r'"((?:[^"\\\n]|\\.)*)"', source)]


def offending(literals: list[str | bytes]) -> list[str | bytes]:
    """The literals that spell a convention: a contract name inside a string, a look-alike, or a
    bytes reply word."""
    found: list[str | bytes] = []
    for literal in literals:
        text = literal.decode("latin-1") if isinstance(literal, bytes) else literal
        if (
            any(name in text for name in NAMES.values() if len(name) > 5)
            or LOOKALIKES.search(text)
            or (isinstance(literal, bytes) and REPLY_BYTES.match(literal))
        ):
            found.append(literal)
    return found


def sources() -> list[pathlib.Path]:
    paths = [*(ROOT / "isolator").rglob("*.py"), *(ROOT / "isolator").rglob("*.c"), *(ROOT / "mesos").glob("*.?pp")]
    return sorted(p for p in paths if "rpc" not in p.relative_to(ROOT).parts)


def test_the_contract_names_each_convention_once():
    assert NAMES == {
        "METADATA_KEY_DEADLINE": "gpu-isolator-deadline-ms",
        "METADATA_KEY_RETRY_PUSHBACK": "grpc-retry-pushback-ms",
        "BRIDGE_PROTOCOL_1": "gpu-isolator-bridge/1",
        "BRIDGE_PROTOCOL_2": "gpu-isolator-bridge/2",
        "BRIDGE_REPLY_OK": "OK",
        "BRIDGE_REPLY_ERROR": "ERROR",
        "BRIDGE_REPLY_RETRY": "RETRY",
    }
    assert len(set(NAMES.values())) == len(NAMES)


def test_the_python_server_and_clients_use_the_contracts_names():
    assert client.DEADLINE_METADATA == serving.DEADLINE_METADATA == NAMES["METADATA_KEY_DEADLINE"]
    assert status.RETRY_PUSHBACK == grpcproxy.RETRY_PUSHBACK == NAMES["METADATA_KEY_RETRY_PUSHBACK"]
    assert NAMES["BRIDGE_PROTOCOL_1"].encode() == bridge.PROTOCOL
    assert NAMES["BRIDGE_PROTOCOL_2"].encode() == bridge.PROTOCOL_2
    assert (wire.BRIDGE_OK, wire.BRIDGE_ERROR, wire.BRIDGE_RETRY) == (b"OK", b"ERROR", b"RETRY")
    assert client.deadline_metadata(1.0)[0][0] == NAMES["METADATA_KEY_DEADLINE"]


def test_the_python_bridge_executable_spells_the_contracts_names():
    assert NAMES["BRIDGE_PROTOCOL_2"].encode() == command.PROTOCOL
    assert NAMES["BRIDGE_REPLY_OK"].encode() == command.REPLY_OK
    assert NAMES["BRIDGE_REPLY_ERROR"].encode() == command.REPLY_ERROR
    assert NAMES["BRIDGE_REPLY_RETRY"].encode() == command.REPLY_RETRY


def test_the_c_bridge_executable_spells_the_contracts_names():
    text = (ROOT / "isolator/bridge/bridge.c").read_text()
    defines = dict(re.findall(r'^#define (PROTOCOL|REPLY_\w+) "([^"]*)"$', text, flags=re.M))
    assert defines == {
        "PROTOCOL": NAMES["BRIDGE_PROTOCOL_2"],
        "REPLY_OK": NAMES["BRIDGE_REPLY_OK"],
        "REPLY_ERROR": NAMES["BRIDGE_REPLY_ERROR"],
        "REPLY_RETRY": NAMES["BRIDGE_REPLY_RETRY"],
    }
    code = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    # The reply words are compared through the defines only.
    assert not re.search(r'(memcmp|strcmp)\([^;]*"(OK|ERROR|RETRY)', code)


def test_the_mesos_module_reads_the_metadata_keys_from_the_contract():
    code = "".join(" ".join(c_literals(p.read_text())) for p in (ROOT / "mesos").glob("*.?pp"))
    body = "".join(p.read_text() for p in (ROOT / "mesos").glob("*.?pp"))
    assert "METADATA_KEY_DEADLINE" in body and "METADATA_KEY_RETRY_PUSHBACK" in body
    assert "wire.pb.h" in body
    assert not offending([code])


def test_no_source_spells_a_convention_but_through_the_contract():
    found = {}
    for path in sources():
        rel = str(path.relative_to(ROOT))
        if rel in SPELLERS:
            continue
        text = path.read_text()
        literals = python_literals(text) if path.suffix == ".py" else c_literals(text)
        bad = offending(literals)
        if bad:
            found[rel] = bad
    assert found == {}


def test_the_spellers_spell_nothing_beyond_the_named_conventions():
    """command.py and bridge.c may write the names, and only in the definitions checked above."""
    text = (ROOT / "isolator/bridge/command.py").read_text()
    defined = [command.PROTOCOL, command.REPLY_OK, command.REPLY_ERROR, command.REPLY_RETRY]
    literals = python_literals(text)
    assert [literals.count(name) for name in defined] == [1, 1, 1, 1]  # each spelled once, where defined
    assert offending([lit for lit in literals if lit not in defined]) == []
    c_text = (ROOT / "isolator/bridge/bridge.c").read_text()
    c_found = [lit for lit in offending(c_literals(c_text)) if lit != NAMES["BRIDGE_PROTOCOL_2"]]
    assert c_found == []


@pytest.mark.parametrize(
    "source",
    [
        'KEY = "gpu-isolator-deadline-ms"\n',
        'KEY = "grpc-retry-pushback-ms"\n',
        'KEY = "gpu-isolator-budget-ms"\n',
        'HEAD = b"gpu-isolator-bridge/3 %s"\n',
        'def f(x):\n    return x.startswith(b"ERROR ")\n',
        'REPLY = b"OK\\n" + b"out"\n',
        'def f():\n    """Docstrings are prose."""\n    return ("x", "grpc-retry-pushback-ms")\n',
    ],
)
def test_the_scan_finds_a_convention_spelled_in_python(source):
    assert offending(python_literals(source))


@pytest.mark.parametrize(
    "source",
    [
        'def f():\n    """Sends grpc-retry-pushback-ms; answers b"ERROR ..."."""\n',
        'CODE = "OK"\nNAME = "ERROR"\n',
        "# gpu-isolator-deadline-ms in a comment\nX = 1\n",
    ],
)
def test_the_scan_leaves_prose_and_code_names_alone(source):
    assert offending(python_literals(source)) == []


def test_the_scan_finds_a_convention_spelled_in_cpp_but_not_in_comments():
    assert offending(c_literals('ctx.AddMetadata("gpu-isolator-deadline-ms", v); // ok\n'))
    assert offending(c_literals('// "grpc-retry-pushback-ms"\n/* "gpu-isolator-bridge/2" */ f("x");\n')) == []
