"""Each package's docstring names each of its modules (docs/architecture.md, "Habits that keep it so").

The tree is the map only while each package says what is in it: a module added without a line in
its package's docstring is a module a newcomer cannot find from the package. Generated code
(``isolator/rpc``) is exempt: ``make proto`` writes it.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from tests.paths import ROOT as _ROOT

ROOT = pathlib.Path(_ROOT)

EXEMPT = {"isolator/rpc"}


def _unnamed(doc: str, members: list[str]) -> list[str]:
    """The members the docstring does not name, by file name (``state.py``) or as a word (``state``)."""
    return [m for m in members if not re.search(rf"(?<!\w){re.escape(m)}(\.py)?\b", doc)]


def _packages() -> list[pathlib.Path]:
    found = []
    for top in ("isolator", "volumes"):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            pkg = init.parent
            if "__pycache__" in pkg.parts or str(pkg.relative_to(ROOT)) in EXEMPT:
                continue
            found.append(pkg)
    return found


def _members(pkg: pathlib.Path) -> list[str]:
    modules = [p.stem for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__")]
    subpackages = [p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()]
    return sorted(modules + subpackages)


@pytest.mark.parametrize("pkg", _packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_package_docstring_names_each_of_its_modules(pkg: pathlib.Path) -> None:
    doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
    missing = _unnamed(doc, _members(pkg))
    assert not missing, f"{pkg.relative_to(ROOT)}/__init__.py's docstring names none of: {', '.join(missing)}"


def test_the_check_sees_a_missing_module(tmp_path: pathlib.Path) -> None:
    """The rule itself: a package whose docstring leaves a module out fails."""
    (tmp_path / "__init__.py").write_text('"""Has alpha.py and beta."""\n')
    for name in ("alpha", "beta", "gamma"):
        (tmp_path / f"{name}.py").write_text("")
    doc = ast.get_docstring(ast.parse((tmp_path / "__init__.py").read_text())) or ""
    assert _unnamed(doc, _members(tmp_path)) == ["gamma"]
