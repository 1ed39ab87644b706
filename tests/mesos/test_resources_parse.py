"""Mesos's own resource parser on the ``--resources`` gpu-isolator prints (issue 42 item 1): the share
units ``gpu-share-<N>`` beside ``gpus`` and ``mig-<profile>``.

``resources_parse.cpp`` beside this file is compiled at test time against ``MESOS_HOME/include`` and
linked with libmesos: it runs ``mesos::Resources::parse`` (the agent's parse of its flag, then
``Resources::validate``) and prints each resource as stout writes it. Every shipped host, with its
GPUs whole, cut in one size and cut in several, must come back with the names and counts
``gpu-isolator resources --json`` meant, each a scalar. Needs no agent; the binary is cached in build/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import libmesos_helper, line_parser

from isolator.policy import shares
from isolator.simhost.host import shipped_hosts

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "resources_parse.cpp")


@pytest.fixture(scope="module")
def parse(mesos_home: str) -> Any:
    return line_parser(libmesos_helper(SOURCE, mesos_home))


def _cuts(host: str) -> list[str]:
    """Per host: nothing shared, every GPU not in MIG mode cut four ways, and each cut another way
    (GPU 0 stays whole where another can be shared)."""
    from isolator.simhost.host import load_host

    free = [g.index for g in load_host(host).gpus if not g.mig]
    if not free:
        return [""]
    some = free[1:] or free
    one = ",".join(f"{i}:4:mps" for i in some)
    mixed = ",".join(f"{i}:{(2, 3, 4, 8, 64)[n % 5]}" for n, i in enumerate(some))
    return ["", one, mixed]


@pytest.mark.parametrize("host", shipped_hosts())
def test_mesos_reads_every_share_unit_with_the_name_and_count_we_meant(parse, host, short_tmp):
    for cut in _cuts(host):
        argv = [sys.executable, "-m", "isolator", "resources", "--simulate", host, "--json"]
        argv += ["--work-dir", short_tmp] + (["--shared-gpus", cut] if cut else [])
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
        ours = json.loads(out.stdout)
        parsed = parse(ours["resources"])
        assert parsed is not None, f"Mesos refused {ours['resources']!r}"
        assert all(r["type"] == "SCALAR" and r.get("role", "*") == "*" for r in parsed)
        # Mesos keeps no order, and drops a scalar of 0 (``gpus:0`` when every GPU is shared).
        meant = {name: n for name, n in ours["entries"].items() if n}
        assert {r["name"]: r["scalar"]["value"] for r in parsed} == meant, cut
        units = [n for n in ours["entries"] if n.startswith(shares.UNIT_PREFIX)]
        assert bool(units) == bool(cut), (cut, ours["resources"])


def test_every_unit_name_and_a_role_survive_mesos_parse(parse):
    names = [shares.unit_name(n) for n in range(2, shares.MAX_REQUEST + 1)]
    parsed = parse(";".join(f"{n}:{i + 1}" for i, n in enumerate(names)))
    assert parsed is not None and [(r["name"], r["scalar"]["value"]) for r in parsed] == [
        (n, i + 1) for i, n in enumerate(names)
    ]
    [reserved] = parse("gpu-share-4(gpu-jobs):8") or [{}]
    assert (reserved["name"], reserved["scalar"]["value"]) == ("gpu-share-4", 8)
    assert parse("gpu-share-4:8:2") is None, "the checker refuses what Mesos refuses"
