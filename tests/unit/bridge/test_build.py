"""isolator/bridge/build.py: which compiler ``install --compiled`` runs, and with what.

The compiler here is a small script on a PATH of the test's own that records its arguments and
writes the output file, so the command line is what is checked (the real gcc build is
tests/system/test_wheel_install.py's).
"""

from __future__ import annotations

import os
import stat

import pytest

from isolator.bridge import build


@pytest.fixture
def recorder(tmp_path):
    """A fake ``cc`` on a PATH of its own: records argv, then writes the file after ``-o``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "argv"
    script = bin_dir / "fakecc"
    script.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > {log}\n'
        'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then : > "$2"; fi; shift; done\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return {"PATH": str(bin_dir), "log": log, "path": str(script)}


def test_cc_with_arguments_keeps_them_before_the_flags(recorder, tmp_path):
    env = {"PATH": recorder["PATH"], "CC": "fakecc -m64 '-DNAME=two words'"}
    output = str(tmp_path / "bridge")
    used = build.build(output, env)
    argv = recorder["log"].read_text().splitlines()
    assert argv[:2] == ["-m64", "-DNAME=two words"]
    assert argv[2 : 2 + len(build.CFLAGS)] == build.CFLAGS
    assert used == f"{recorder['path']} -m64 -DNAME=two words"
    assert os.path.exists(output)


def test_a_bare_cc_is_found_on_path_and_gcc_is_the_default(recorder):
    assert build.compiler({"PATH": recorder["PATH"], "CC": "fakecc"}) == [recorder["path"]]
    with pytest.raises(build.BuildError, match="the C compiler 'gcc' was not found on PATH"):
        build.compiler({"PATH": recorder["PATH"], "CC": "  "})


@pytest.mark.parametrize(
    ("cc", "message"),
    [("nosuchcc -O2", "the C compiler 'nosuchcc' was not found"), ("fakecc '-Dunclosed", "cannot be split")],
)
def test_a_cc_that_cannot_run_is_a_build_error_naming_it(recorder, cc, message):
    with pytest.raises(build.BuildError, match=message):
        build.compiler({"PATH": recorder["PATH"], "CC": cc})
