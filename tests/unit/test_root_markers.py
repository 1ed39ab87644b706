"""`make test-unit` runs as any user (the Makefile says so): every test there that does what only root
may (a new namespace, a mount, a device node, a chown) carries the ``root`` marker, so that an
unprivileged run skips it with the reason instead of failing (issue 44, item 7: the pid namespace
contract test failed as nobody). Read from the source, so that this holds on a run as root too."""

from __future__ import annotations

import ast
import os

import paths

ROOT = paths.ROOT
UNIT_TESTS = ("tests/unit", "tests/contract")  # the Makefile's UNIT_TESTS
# Commands and calls that need root (CAP_SYS_ADMIN, CAP_MKNOD, CAP_CHOWN) whatever their arguments.
ROOT_COMMANDS = frozenset({"unshare", "nsenter", "mount", "umount", "mknod", "chown", "setpriv"})
ROOT_CALLS = frozenset({"os.mknod", "os.chown", "os.setns", "os.unshare", "os.chroot"})


def _marked_root(decorators: list[ast.expr]) -> bool:
    return any(ast.unparse(d).endswith("mark.root") for d in decorators)


def _module_marked_root(tree: ast.Module) -> bool:
    for node in tree.body:
        is_mark = isinstance(node, ast.Assign) and any(ast.unparse(t) == "pytestmark" for t in node.targets)
        if is_mark and "mark.root" in ast.unparse(node.value):
            return True
    return False


def _needs_root(func: ast.FunctionDef) -> str | None:
    """What in ``func`` needs root: a call in ROOT_CALLS, or a command list whose program is one of
    ROOT_COMMANDS (``["unshare", ...]``); None when nothing does."""
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ROOT_CALLS:
            return ast.unparse(node.func)
        if isinstance(node, ast.List) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and first.value in ROOT_COMMANDS:
                return str(first.value)
    return None


def unmarked_root_tests(source: str) -> list[tuple[str, str]]:
    """``(test, what needs root)`` for each test function in ``source`` that needs root and is not
    marked ``root`` (on itself or through the module's ``pytestmark``)."""
    tree = ast.parse(source)
    if _module_marked_root(tree):
        return []
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.FunctionDef)
            and node.name.startswith("test_")
            and not _marked_root(node.decorator_list)
        ):
            why = _needs_root(node)
            if why is not None:
                out.append((node.name, why))
    return out


def test_the_check_finds_a_test_that_unshares_without_the_marker_and_passes_it_with_the_marker():
    bare = 'def test_x():\n    subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "1"])\n'
    assert unmarked_root_tests(bare) == [("test_x", "unshare")]
    assert unmarked_root_tests("@pytest.mark.root\n" + bare) == []
    assert unmarked_root_tests("pytestmark = [pytest.mark.root]\n" + bare) == []
    assert unmarked_root_tests("def test_y():\n    os.mknod(path)\n") == [("test_y", "os.mknod")]
    assert unmarked_root_tests('def test_z():\n    run(["ls", "unshare"])\n') == []


def test_every_unit_and_contract_test_that_needs_root_is_marked_root():
    found = []
    for top in UNIT_TESTS:
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if name.startswith("test_") and name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    with open(path) as fh:
                        found += [(os.path.relpath(path, ROOT), *hit) for hit in unmarked_root_tests(fh.read())]
    assert found == [], f"needs root but has no @pytest.mark.root (skips loudly without root): {found}"
