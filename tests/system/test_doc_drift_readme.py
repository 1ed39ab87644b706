"""The README and the docs index held to what a newcomer needs and to what exists (issue 44, item 8):
a README read in minutes (what it is, the two commands with their measured times, the route by link
to docs/deploy.md, the last measured figures, where to go next), a docs index naming every page once,
no reference to a README section that is gone, and docs/operations.md free of what drifted there (a
commit and "this branch" cited as releases, a sample ``health`` output missing checks)."""

from __future__ import annotations

import os
import re

import paths

from isolator.cli import main as cli
from isolator.testing import fake_service

ROOT = paths.ROOT
README_MAX_LINES = 120  # about five minutes' reading


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read()


def _headings(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)]


def _section(text: str, heading: str) -> str:
    start = text.index("\n" + heading + "\n") + len(heading) + 2
    end = re.search(r"^## ", text[start:], re.M)
    return text[start : start + end.start()] if end else text[start:]


def test_the_readme_is_short_and_keeps_the_two_commands_with_their_measured_times():
    text = _read("README.md")
    assert len(text.splitlines()) <= README_MAX_LINES, "the README grew past a five-minute read: move detail to docs/"
    body = _section(text, "## The two commands")
    assert "make demo" in body and "make test" in body
    assert re.search(r"`tests \d+ s`", body) and re.search(r"\b20\d\d-\d\d-\d\d\b", body), "times, and when"


def test_the_readme_sends_the_agent_set_up_to_deploy_md_and_the_flags_to_configuration_md():
    text = _read("README.md")
    assert "(docs/deploy.md)" in _section(text, "## The route: our module in the agent")
    running = _section(text, "## Running the sidecar")
    assert "(docs/configuration.md)" in running
    assert not re.search(r"^\| `--", text, re.M), "the flags table lives in docs/configuration.md only"
    assert "(docs/index.md)" in text


def test_the_readmes_figures_are_a_short_table_each_dated_and_the_history_is_in_bench_md():
    body = _section(_read("README.md"), "## Performance, as last measured")
    rows = [line for line in body.splitlines() if line.startswith("| ") and not line.startswith(("| figure", "| ---"))]
    assert 0 < len(rows) <= 10
    assert all(re.search(r"\(20\d\d-\d\d-\d\d\)", row) for row in rows), "each figure says when it was measured"
    assert "history" in _read("docs/bench.md").lower() and "(docs/bench.md)" in body


def test_the_docs_index_lists_every_page_once_and_only_pages_that_exist():
    listed = re.findall(r"^- \[([a-z0-9-]+\.md)\]\(\1\)", _read("docs/index.md"), re.M)
    pages = sorted(n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md") and n != "index.md")
    assert len(listed) == len(set(listed)), "a page listed twice"
    assert sorted(set(pages) - set(listed)) == [], "pages missing from docs/index.md"
    assert sorted(set(listed) - set(pages)) == [], "docs/index.md lists pages that do not exist"


def test_every_reference_to_a_readme_section_names_one_that_exists():
    """``README "X"`` and ``README, "X"`` in the docs, the code and the build files."""
    headings = {re.sub(r"^#+ ", "", h) for h in _headings(_read("README.md"))}
    cited = []
    for top in ("docs", "isolator", "volumes", "scripts", "mesos", "tests"):
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "rpc")]
            for name in files:
                if name.endswith((".md", ".py", ".c", ".cpp", ".hpp", ".mk", ".service", ".sh")):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8", errors="replace") as fh:
                        for section in re.findall(r'README,? \\?"([^"\\]+)\\?"', fh.read()):
                            cited.append((os.path.relpath(path, ROOT), section))
    this_file = os.path.relpath(__file__, ROOT)
    gone = [(path, s) for path, s in cited if s not in headings and path != this_file]
    assert gone == [], f"README sections cited but not in the README: {gone}"


def test_operations_md_cites_releases_not_commits_or_branches():
    text = _read("docs/operations.md")
    assert "this branch" not in text
    assert not re.search(r"`[^`]*\bat `?[0-9a-f]{7,40}\b", text) and not re.search(r"/work/main", text)


def test_operations_md_shows_every_health_check_in_its_sample_output():
    text = _read("docs/operations.md")
    sample = text[text.index("# gpu-isolator health;") :].split("```", 1)[0]
    shown = re.findall(r"^([a-z_]+) +(?:ok|FAIL|warn)\b", sample, re.M)
    checks = [c.name for c in fake_service("dgx-1").service.health()]
    checks += [c["name"] for c in cli._with_socket_check({"checks": []}, "/nonexistent")["checks"]]
    assert shown == checks
