"""A documentation page run as written (docs/deploy.md by tests/mesos/test_deploy_page.py, the node
walkthrough of docs/operations.md by tests/node/): its ``sh`` blocks, and the first block's
``NAME=value`` lines given this test's values."""

from __future__ import annotations

import re
import shlex

# A value the reader sets: NAME=value, maybe with a comment after it.
VALUE = re.compile(r"^([A-Z_]+)=(\S.*?)(?:\s+#.*)?$")


def sh_blocks(text: str) -> list[str]:
    """The ``sh`` blocks of ``text``, in order (``text`` blocks are not run)."""
    return re.findall(r"^```sh\n(.*?)^```$", text, re.M | re.S)


def with_values(first: str, values: dict[str, str]) -> str:
    """The first block with each ``NAME=value`` line replaced by ``values[NAME]``; every name the
    page asks for must be given, and no other."""
    names = [m.group(1) for m in map(VALUE.match, first.splitlines()) if m]
    assert sorted(names) == sorted(values), f"the page's values {names} are not this test's {sorted(values)}"
    out = []
    for line in first.splitlines():
        m = VALUE.match(line)
        out.append(f"{m.group(1)}={shlex.quote(values[m.group(1)])}" if m else line)
    return "\n".join(out) + "\n"
