"""`make mutation`: mutation testing of the pure modules, each against its own unit tests only.

For every module in MODULES this runs mutmut (one worker) in a scratch copy of the tree under
build/mutation/<name>/, so that the run sees only that module mutated and only the listed test files,
and nothing in the work tree is rewritten. It then reads the verdicts, drops the mutants that
mutation/equivalent.toml lists as equivalent (matched by function and by the changed lines, so the
list survives edits elsewhere in the file), and prints killed/total per module. It exits non-zero when
a module scores below its threshold (0.9 unless MODULES says otherwise) or when an entry of the
equivalent list no longer matches any surviving mutant (a stale exclusion hides nothing and is removed).

    python scripts/mutation.py                 # every module
    python scripts/mutation.py bpfprog gpuflags  # some, by name
    python scripts/mutation.py --survivors     # also print each surviving mutant's diff
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutation"
EQUIVALENT = ROOT / "mutation" / "equivalent.toml"
THRESHOLD = 0.9


@dataclass(frozen=True)
class Module:
    name: str
    path: str
    tests: tuple[str, ...]
    threshold: float = THRESHOLD


MODULES = (
    Module("bpfprog", "isolator/cgroups/bpfprog.py", ("tests/unit/cgroups/test_bpfprog.py",)),
    Module("inject", "volumes/inject.py", ("tests/unit/volumes/test_inject.py",)),
    Module("plan", "volumes/plan.py", ("tests/unit/volumes/test_plan.py",)),
    Module("gpuflags", "isolator/policy/gpuflags.py", ("tests/unit/policy/test_gpuflags.py",)),
    Module("devices", "isolator/policy/devices.py", ("tests/unit/policy/test_devices.py",)),
    Module("devicerule", "isolator/devicerule.py", ("tests/unit/policy/test_devices.py",)),
    Module("allocator", "isolator/policy/allocator.py", ("tests/unit/policy/test_allocator.py",)),
    Module("fabric", "isolator/policy/fabric.py", ("tests/unit/policy/test_allocator.py",)),
    Module("search", "isolator/policy/search.py", ("tests/unit/policy/test_allocator.py",)),
    Module("handover", "isolator/policy/handover.py", ("tests/unit/policy/test_handover.py",)),
    Module("affinity", "isolator/policy/affinity.py", ("tests/unit/policy/test_affinity.py",)),
    Module(
        "drift",
        "isolator/policy/drift.py",
        ("tests/unit/policy/test_drift.py", "tests/unit/policy/test_shared_gpus.py"),
    ),
    Module(
        "adopt",
        "isolator/policy/adopt.py",
        ("tests/unit/policy/test_adopt.py", "tests/unit/policy/test_shared_gpus.py"),
    ),
    Module("placement", "isolator/policy/placement.py", ("tests/unit/policy/test_placement.py",)),
    Module("launch", "isolator/policy/launch.py", ("tests/unit/policy/test_launch.py",)),
    Module("shares", "isolator/policy/shares.py", ("tests/unit/policy/test_shares.py",)),
)

# Verdicts that count as "the tests noticed": a failing test, or a hang the timeout caught (a mutant
# that turns a loop infinite was noticed, just slowly).
DETECTED = {"killed", "timeout", "segfault", "caught by type check"}

# Runs inside the scratch copy after `mutmut run`: every mutant's verdict and, for the ones not
# detected, its diff (mutmut's own rendering of the mutated function against the original).
_COLLECT = r"""
import json, sys
from mutmut.__main__ import walk_mutatable_files
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
detected = set(sys.argv[1].split(","))
out = {}
for path in walk_mutatable_files():
    m = SourceFileMutationData(path=path)
    m.load()
    for key, code in m.exit_code_by_key.items():
        status = status_by_exit_code[code]
        diff = "" if status in detected else get_diff_for_mutant(key, path=path)
        out[key] = {"status": status, "diff": diff}
json.dump(out, sys.stdout)
"""


@dataclass
class Equivalent:
    module: str
    function: str
    removed: tuple[str, ...]
    added: tuple[str, ...]
    why: str
    used: int = 0


@dataclass
class Result:
    module: Module
    statuses: dict[str, str] = field(default_factory=dict)
    survivors: dict[str, str] = field(default_factory=dict)
    excluded: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.statuses) - len(self.excluded)

    @property
    def killed(self) -> int:
        return sum(1 for k, s in self.statuses.items() if s in DETECTED and k not in self.excluded)

    @property
    def score(self) -> float:
        return self.killed / self.total if self.total else 1.0


def load_equivalents() -> list[Equivalent]:
    if not EQUIVALENT.exists():
        return []
    data = tomllib.loads(EQUIVALENT.read_text())
    return [
        Equivalent(
            module=e["module"],
            function=e["function"],
            removed=tuple(_norm(x) for x in e.get("removed", [])),
            added=tuple(_norm(x) for x in e.get("added", [])),
            why=e["why"],
        )
        for e in data.get("equivalent", [])
    ]


def _norm(line: str) -> str:
    return " ".join(line.split())


def changed_lines(diff: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    removed, added = [], []
    for line in diff.splitlines():
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("-"):
            removed.append(_norm(line[1:]))
        elif line.startswith("+"):
            added.append(_norm(line[1:]))
    return tuple(removed), tuple(added)


def function_of(mutant: str) -> str:
    """`policy.gpuflags.x_parse__mutmut_3` -> `parse`; methods: `xǁClassǁmethod__mutmut_3` -> `Class.method`."""
    mangled = mutant.rsplit("__mutmut_", 1)[0].rsplit(".", 1)[1]
    if mangled.startswith("xǁ"):
        return ".".join(mangled[2:].split("ǁ"))
    return mangled[2:] if mangled.startswith("x_") else mangled


def prepare(module: Module) -> Path:
    work = WORK / module.name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    package = module.path.split("/", 1)[0]
    for top in ("isolator", "volumes", "tests"):
        shutil.copytree(ROOT / top, work / top, ignore=ignore)
    # The repo's pytest section (markers, --strict-markers) plus this module's mutmut section.
    cfg = (ROOT / "setup.cfg").read_text()
    tests = "\n    ".join(module.tests)
    cfg += (
        "\n[mutmut]\n"
        f"source_paths = {package}\n"
        f"only_mutate = {module.path}\n"
        f"pytest_add_cli_args_test_selection =\n    {tests}\n"
        "pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -q\n"
        "use_git_change_detection = false\n"
        "use_setproctitle = false\n"
    )
    (work / "setup.cfg").write_text(cfg)
    return work


def run_module(module: Module, equivalents: list[Equivalent]) -> Result:
    work = prepare(module)
    log = work / "mutmut.log"
    with open(log, "w") as fh:
        proc = subprocess.run(
            [sys.executable, "-m", "mutmut", "run", "--max-children", "1"],
            cwd=work,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0:
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"mutmut failed on {module.path} (exit {proc.returncode}); log: {log}")
    out = subprocess.run(
        [sys.executable, "-c", _COLLECT, ",".join(sorted(DETECTED))],
        cwd=work,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result = Result(module)
    for key, v in json.loads(out).items():
        result.statuses[key] = v["status"]
        if v["status"] in DETECTED:
            continue
        removed, added = changed_lines(v["diff"])
        for eq in equivalents:
            if (
                eq.module == module.path
                and eq.function == function_of(key)
                and eq.removed == removed
                and eq.added == added
            ):
                eq.used += 1
                result.excluded.append(key)
                break
        else:
            result.survivors[key] = v["diff"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="module names (default: all): " + ", ".join(m.name for m in MODULES))
    parser.add_argument("--survivors", action="store_true", help="print the diff of every surviving mutant")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MODULES}
    unknown = [n for n in args.modules if n not in by_name]
    if unknown:
        parser.error(f"unknown module(s) {unknown}; known: {sorted(by_name)}")
    chosen = [by_name[n] for n in args.modules] if args.modules else list(MODULES)
    equivalents = load_equivalents()

    results = []
    for module in chosen:
        print(f"mutation: {module.path} against {' '.join(module.tests)} ...", flush=True)
        result = run_module(module, equivalents)
        results.append(result)
        if args.survivors:
            for key, diff in sorted(result.survivors.items()):
                print(f"\n## {key}: {result.statuses[key]}\n{diff}")
        print(_line(result), flush=True)

    print("\nmodule                          killed/total   score  (equivalent excluded)")
    failed = False
    for r in results:
        mark = "ok" if r.score >= r.module.threshold else f"BELOW {r.module.threshold}"
        failed |= r.score < r.module.threshold
        print(f"{r.module.path:<32}{r.killed:>6}/{r.total:<6}  {r.score:6.3f}  ({len(r.excluded)})  {mark}")
    chosen_paths = {m.path for m in chosen}
    stale = [e for e in equivalents if e.module in chosen_paths and e.used == 0]
    for e in stale:
        failed = True
        print(f"stale entry in {EQUIVALENT.relative_to(ROOT)}: {e.module} {e.function} {e.added} matches no survivor")
    return 1 if failed else 0


def _line(r: Result) -> str:
    return (
        f"  {r.module.path}: {r.killed}/{r.total} killed = {r.score:.3f}"
        f" ({len(r.excluded)} equivalent excluded, {len(r.survivors)} surviving)"
    )


if __name__ == "__main__":
    sys.exit(main())
