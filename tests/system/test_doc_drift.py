"""The docs that list what the code defines are checked against the code (issue 33, item 13):
docs/configuration.md's table against ``serve``'s options (each with its true default and whether
SIGHUP takes it over), the README's shipped hosts against isolator/simhost/hosts/,
docs/metrics.md's metrics and labels against what the exporter registers, the health checks in
docs/cli.md and docs/metrics.md against what ``health`` runs, docs/cli.md's commands against the
CLI's parser, and the demo's first line against the CLI. Each list is read from the code, so a flag,
host, label, check or command added there fails here until the doc names it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex

import paths
import pytest

from isolator.cli import main as cli
from isolator.daemon import config as configmod
from isolator.simhost.host import shipped_hosts
from isolator.testing import fake_service

ROOT = paths.ROOT


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read()


def _section(text: str, heading: str) -> str:
    """The body of the markdown section whose heading line is ``heading``, up to the next heading of
    the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index("\n" + heading + "\n") + len(heading) + 2
    ends = [m.start() for m in re.finditer(rf"^#{{1,{level}}} ", text[start:], re.M)]
    return text[start : start + ends[0]] if ends else text[start:]


# ---- docs/configuration.md: serve's options ---------------------------------------------------------


def _option_rows() -> dict[str, list[str]]:
    """Flag -> the cells (flag, meaning, default, SIGHUP) of each row of docs/configuration.md's table."""
    rows = {}
    for line in _read("docs/configuration.md").splitlines():
        if line.startswith("| `--"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            flag = re.match(r"`(--[a-z][a-z0-9-]*)", cells[0])
            assert flag and len(cells) == 4, line
            assert flag.group(1) not in rows, f"{flag.group(1)} has two rows"
            rows[flag.group(1)] = cells
    return rows


def test_configuration_md_documents_every_option_and_no_other():
    documented = set(_option_rows())
    code = {o.flag for o in configmod.OPTIONS.values()} | {"--config"}
    assert sorted(code - documented) == [], "options missing from docs/configuration.md"
    assert sorted(documented - code) == [], "options in docs/configuration.md that serve does not have"


def test_configuration_md_gives_each_option_its_true_default_and_whether_sighup_takes_it():
    rows = _option_rows()
    wrong = {
        o.flag: (rows[o.flag][2:], [o.documented_default, "yes" if o.reloadable else "no"])
        for o in configmod.OPTIONS.values()
        if o.flag in rows and rows[o.flag][2:] != [o.documented_default, "yes" if o.reloadable else "no"]
    }
    assert wrong == {}, "(documented, true) default and SIGHUP cells"


def test_an_option_whose_default_is_unset_says_what_that_means():
    # An empty default is documented in words ("off", "none"...), never as an empty value.
    bare = [o.name for o in configmod.OPTIONS.values() if o.documented_default in ("", "``")]
    assert bare == []


def test_the_option_table_feeds_the_flags_and_the_reload():
    from isolator.daemon.reload import RELOADABLE

    parser = argparse.ArgumentParser()
    configmod.add_serve_arguments(parser)
    flags = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings and a.dest != "help"}
    assert flags == {"--config": "TOML config file"} | {o.flag: o.help for o in configmod.OPTIONS.values()}
    assert set(RELOADABLE) == {o.name for o in configmod.OPTIONS.values() if o.reloadable}
    assert "{default}" not in "".join(flags.values())


def test_the_readme_sends_the_reader_to_configuration_md_for_the_options():
    body = _section(_read("README.md"), "## Running the sidecar")
    assert "(docs/configuration.md)" in body
    assert not [line for line in body.splitlines() if line.startswith("| `--")], "the flags table moved"


# ---- README: shipped simulated hosts -----------------------------------------------------------------


def test_the_readme_names_every_shipped_host_and_no_other():
    body = _section(_read("README.md"), "## The simulated GPU host")
    sentence = body[body.index("Shipped hosts:") :].split(". ", 1)[0]
    named = set(re.findall(r"`([a-z0-9][a-z0-9-]*)`", sentence))
    assert sorted(set(shipped_hosts()) - named) == [], "shipped hosts missing from the README"
    assert sorted(named - set(shipped_hosts())) == [], "hosts in the README that are not shipped"


# ---- docs/metrics.md: every metric and label the exporter registers ----------------------------------


def _exported() -> dict[str, set[str]]:
    """Metric name (as scraped: counters with ``_total``) -> its label names, from a live registry
    over the shipped fakes: the families collected at scrape time and the instruments' declared
    labels (a counter's labels show in no sample before its first increment)."""
    from prometheus_client.metrics import MetricWrapperBase

    from isolator.exporters.metrics import PREFIX, Metrics

    rig = fake_service("dgx-a100")
    metrics = Metrics(rig.service)
    out: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = set(getattr(family, "_labelnames", ()))
        labels |= {k for s in family.samples for k in s.labels if k not in ("le", "quantile")}
        out.setdefault(name, set()).update(labels)
    for instrument in vars(metrics).values():
        if isinstance(instrument, MetricWrapperBase):
            name = instrument._name + ("_total" if instrument._type == "counter" else "")
            out.setdefault(name, set()).update(instrument._labelnames)
    return out


def _metrics_rows() -> dict[str, str]:
    body = _section(_read("docs/metrics.md"), "## Prometheus metrics (`--metrics-address`)")
    rows = {}
    for line in body.splitlines():
        cells = re.split(r"(?<!\\)\|", line)
        m = re.fullmatch(r" `(gpu_isolator_[a-z_]+)` ", cells[1]) if len(cells) > 4 else None
        if m:
            rows[m.group(1)] = cells[3]
    return rows


def test_metrics_md_lists_every_exported_metric_and_no_other():
    exported, rows = _exported(), _metrics_rows()
    assert sorted(set(exported) - set(rows)) == [], "metrics missing from docs/metrics.md"
    assert sorted(set(rows) - set(exported)) == [], "metrics in docs/metrics.md that are not exported"


def test_metrics_md_names_each_metrics_labels_as_exported():
    exported, rows = _exported(), _metrics_rows()
    missing = {
        name: sorted(label for label in labels if f"`{label}`" not in rows.get(name, ""))
        for name, labels in exported.items()
    }
    assert {k: v for k, v in missing.items() if v} == {}, "labels (case matters: dcgm joins on UUID)"


# ---- health checks: docs/cli.md and docs/metrics.md --------------------------------------------------


def _core_checks() -> list[str]:
    return [c.name for c in fake_service("dgx-1").service.health()]


def _cli_checks() -> list[str]:
    """The CLI's own checks added to the sidecar's (the socket, seen from the caller's side)."""
    return [c["name"] for c in cli._with_socket_check({"checks": []}, "/nonexistent")["checks"]]


def test_cli_md_explains_every_health_check_in_order():
    text = _read("docs/cli.md")
    paragraph = text[text.index("**`health`.**") :].split("\n\n", 1)[0]
    checks = [*_core_checks(), *_cli_checks()]
    explained = [name for name in re.findall(r"`([a-z_]+)`:", paragraph)]
    assert explained == checks
    example = _section(text, "### `health --json`")
    assert re.findall(r'"name": "([a-z_]+)"', example) == checks


def test_metrics_md_names_every_health_check_of_the_health_check_metric():
    row = _metrics_rows()["gpu_isolator_health_check"]
    assert [c for c in _core_checks() if f"`{c}`" not in row] == []


# ---- docs/cli.md: every command --------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_cli_md_names_every_command_of_the_parser():
    text = _read("docs/cli.md")
    commands = _subcommands(cli.build_parser())
    missing = [name for name in commands if not re.search(r"`(gpu-isolator )?" + re.escape(name) + r"\b", text)]
    assert missing == [], "commands missing from docs/cli.md"
    for name, parser in commands.items():  # and their subcommands (cdi generate, config check...)
        for sub in _subcommands(parser):
            assert re.search(rf"`(gpu-isolator )?{name} {sub}\b", text), f"{name} {sub} missing from docs/cli.md"


# ---- the demo's first line ---------------------------------------------------------------------------


def _demo():
    spec = importlib.util.spec_from_file_location("demo", os.path.join(ROOT, "scripts", "demo.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("host", ["dgx-1"])
def test_the_demo_shows_the_serve_command_as_an_operator_types_it(host, tmp_path):
    from isolator.testing.sidecar import Sidecar

    sidecar = Sidecar(work=str(tmp_path), host=host, cgroup_version="v1", cgroups_root="gpu-isolator-demo/x")
    line = _demo().serve_line(sidecar.argv())
    words = shlex.split(line)
    assert words[:3] == ["$", "gpu-isolator", "serve"], line
    args = cli.build_parser().parse_args(words[2:])  # it is a command line the CLI takes
    assert (args.simulate, args.mode) == (host, "standalone")
    readme = _read("README.md")
    claimed = re.search(r"`make demo` \([^)]*\) starts `(gpu-isolator serve[^`]*)`", readme)
    assert claimed, "the README says which command make demo starts"
    assert set(claimed.group(1).split()) <= set(words), "the README's demo command is not the demo's"
