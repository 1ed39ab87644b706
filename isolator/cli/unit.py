"""``install-unit``: the shipped systemd unit filled in for this installation (its executable, its
config file, what its sandbox would hide), and a default config file when there is none."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from isolator.cli.exits import EXIT_ERROR, EXIT_OK
from isolator.cli.parser import docs_dir
from isolator.cli.render import fail
from isolator.model import Mode

DEFAULT_CONFIG_TEXT = f"""\
# gpu-isolator serve settings; keys are the flags without their dashes (docs/configuration.md).
mode = "{Mode.MESOS}"
socket = "/run/gpu-isolator/isolator.sock"
work_dir = "/var/lib/gpu-isolator"
"""


# What the unit's sandbox hides from the service: PrivateTmp=yes gives it empty /tmp and /var/tmp,
# ProtectHome=yes empty /home, /root and /run/user. An installation or config file there is bound
# read-only into the sandbox (BindReadOnlyPaths=; with ProtectHome=tmpfs, as systemd.exec(5)
# recommends for exposing parts of a home), or the service could not even start.
PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp")
HOME_DIRS = ("/home", "/root", "/run/user")


def _under(path: str, roots: Sequence[str]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)


def hidden_by_sandbox(paths: Sequence[str]) -> list[str]:
    """The outermost of ``paths`` that the unit's sandbox would hide (see PRIVATE_TMP_DIRS)."""
    hidden = sorted({os.path.normpath(os.path.abspath(p)) for p in paths if p})
    hidden = [p for p in hidden if _under(p, PRIVATE_TMP_DIRS + HOME_DIRS)]
    return [p for p in hidden if not any(p != q and _under(p, (q,)) for q in hidden)]


def _unit_word(word: str, command: bool = False) -> str:
    """``word`` as one word of a unit file line: ``%`` specifiers and (in a command) ``$`` variables
    escaped, quoted when it holds whitespace, quotes or backslashes."""
    word = word.replace("%", "%%")
    if command:
        word = word.replace("$", "$$")
    if not word or any(c.isspace() or c in "\"'\\;" for c in word):
        word = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def docs_url() -> str:
    """This installation's README as a ``file:`` URL, for the unit's Documentation= (``docs_dir``)."""
    from urllib.parse import quote

    return "file://" + quote(os.path.join(docs_dir(), "README.md"))


def unit_text(executable: str, config_path: str, read_only: Sequence[str] = (), docs: str | None = None) -> str:
    """The shipped unit with its placeholders filled in; ``read_only``: directories the service
    must read that its sandbox hides (``hidden_by_sandbox``); ``docs``: the Documentation= URL
    (default ``docs_url()``). Only the settings are filled in: comments stay as shipped."""
    from importlib.resources import files

    template = files("isolator").joinpath("data/gpu-isolator.service").read_text()
    exec_words = executable.split(" ") if executable.startswith(sys.executable + " ") else [executable]
    fills = {
        "@EXEC@": " ".join(_unit_word(w, command=True) for w in exec_words),
        "@CONFIG@": _unit_word(config_path, command=True),
        "@DOCS@": _unit_word(docs if docs is not None else docs_url()),
    }
    lines = template.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.startswith(("#", ";")):
            for placeholder, value in fills.items():
                line = line.replace(placeholder, value)
            lines[i] = line
    text = "".join(lines)
    if read_only:
        lines = text.splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if line.startswith("ProtectHome="))
        if any(_under(p, HOME_DIRS) for p in read_only):
            lines[at] = "ProtectHome=tmpfs\n"
        lines.insert(at + 1, "BindReadOnlyPaths=" + " ".join(_unit_word(p) for p in read_only) + "\n")
        text = "".join(lines)
    return text


def run(args: argparse.Namespace) -> int:
    import shutil

    executable = shutil.which("gpu-isolator") or ""
    here = os.path.join(os.path.dirname(sys.executable), "gpu-isolator")
    if os.access(here, os.X_OK):
        executable = here  # the one of this installation (a venv), not the first on PATH
    if not executable:
        executable = f"{sys.executable} -m isolator"
    unit_path = os.path.join(args.dir, "gpu-isolator.service")
    try:
        os.makedirs(args.dir, exist_ok=True)
        if not os.path.exists(args.unit_config):
            os.makedirs(os.path.dirname(os.path.abspath(args.unit_config)), exist_ok=True)
            with open(args.unit_config, "w") as fh:
                fh.write(DEFAULT_CONFIG_TEXT)
            print(f"wrote {args.unit_config}")
        config_path = os.path.abspath(args.unit_config)
        import isolator

        package_root = os.path.dirname(os.path.dirname(os.path.abspath(isolator.__file__)))
        exe_dir = os.path.dirname(executable.split(" ")[0])
        read_only = hidden_by_sandbox([sys.prefix, package_root, exe_dir, os.path.dirname(config_path)])
        tmp = unit_path + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(unit_text(executable, config_path, read_only))
        os.chmod(tmp, 0o644)
        os.replace(tmp, unit_path)
    except OSError as exc:
        fail(f"install-unit: failed to write '{exc.filename}': {exc.strerror}")
        return EXIT_ERROR
    print(f"wrote {unit_path}")
    if read_only:
        print(f"bound read-only into the unit's sandbox, which would hide them: {' '.join(read_only)}")
    print("now: systemctl daemon-reload && systemctl enable --now gpu-isolator")
    return EXIT_OK
