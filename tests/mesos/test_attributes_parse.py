"""Mesos's own attribute parser on the ``--attributes`` gpu-isolator prints (issue 33, item 8).

``attributes_parse.cpp`` beside this file is compiled at test time against ``MESOS_HOME/include`` and
linked with libmesos: it runs ``mesos::Attributes::parse``, the agent's parse of its flag, and prints
each attribute as stout writes it. Every shipped host's attributes must come back with the names,
types and values we meant (no space dropped, no text read as a number), and our model of the parse
(isolator/policy/attributes.py ``mesos_type``) must agree with Mesos's on the cases its unit tests
pin. Needs no agent; the binary is cached in build/ by source and Mesos version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import libmesos_helper, line_parser

from isolator.policy import attributes as attrs
from isolator.simhost.host import shipped_hosts

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "attributes_parse.cpp")


@pytest.fixture(scope="module")
def parse(mesos_home: str) -> Any:
    return line_parser(libmesos_helper(SOURCE, mesos_home))


def _value(attribute: dict[str, Any]) -> Any:
    kind = attribute["type"].lower()
    return attribute[kind]["value"] if kind in ("scalar", "text") else attribute[kind]


@pytest.mark.parametrize("host", shipped_hosts())
def test_mesos_reads_every_attribute_with_the_name_type_and_value_we_meant(parse, host, short_tmp):
    argv = [sys.executable, "-m", "isolator", "attributes", "--simulate", host, "--json"]
    out = subprocess.run([*argv, "--work-dir", short_tmp], capture_output=True, text=True, timeout=120, check=True)
    ours = json.loads(out.stdout)
    parsed = parse(ours["attributes"])
    assert parsed is not None, "Mesos refused the attributes"
    pairs = [tuple(p.split(":", 1)) for p in ours["attributes"].split(";")]
    assert [a["name"] for a in parsed] == [name for name, _ in pairs]
    assert [a["type"].lower() for a in parsed] == [attrs.mesos_type(value) for _, value in pairs]
    assert {a["name"]: _value(a) for a in parsed} == ours["values"]


@pytest.mark.parametrize(
    "value",
    [
        *("12.2", "16160", "1e5", "inf", "nan", "-1", "+1", ".5", "0x10"),
        *("535.104.05", "Tesla-V100-SXM2-16GB", "[1000-1500]", "{a,b}", "a[1]"),
    ],
)
def test_our_model_of_the_parse_agrees_with_mesos(parse, value):
    parsed = parse(f"x:{value}")
    kind = attrs.mesos_type(value)
    if kind == "invalid":
        # Refused (the agent would abort); or, for the doubles 1.11 refuses, read as text by 1.12.
        assert parsed is None or (value in ("inf", "nan", "-1") and parsed[0]["type"] == "TEXT"), parsed
    else:
        assert parsed is not None and parsed[0]["type"].lower() == kind


def test_mesos_drops_the_spaces_of_a_raw_model_name_which_is_why_we_replace_them(parse):
    [raw] = parse("gpu_model:Tesla V100-SXM2-16GB")
    assert raw["text"]["value"] == "TeslaV100-SXM2-16GB"
    [ours] = parse("gpu_model:" + attrs.text_value("Tesla V100-SXM2-16GB"))
    assert ours["text"]["value"] == "Tesla-V100-SXM2-16GB"


@pytest.mark.parametrize("cut", ["4:4:mps,5-7:2", "1-7:48:mps", "1:2,2:3:mps,3:64"])
def test_mesos_reads_the_shared_gpus_attributes_with_the_types_we_meant(parse, cut, short_tmp):
    argv = [sys.executable, "-m", "isolator", "attributes", "--simulate", "dgx-1", "--json", "--shared-gpus", cut]
    out = subprocess.run([*argv, "--work-dir", short_tmp], capture_output=True, text=True, timeout=120, check=True)
    ours = json.loads(out.stdout)
    parsed = parse(ours["attributes"])
    assert parsed is not None, "Mesos refused the attributes"
    shared = [a for a in parsed if a["name"].startswith("gpu_share_")]
    assert shared and {a["name"]: _value(a) for a in shared} == {
        k: v for k, v in ours["values"].items() if k.startswith("gpu_share_")
    }
    kinds = {a["name"].rsplit("_", 1)[-1] if not a["name"].endswith("memory_mib") else "mib": a["type"] for a in shared}
    assert kinds == {"gpus": "SCALAR", "mode": "TEXT", "mib": "SCALAR"}
