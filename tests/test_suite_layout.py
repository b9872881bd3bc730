"""How the suite is laid out stays as CONTRIBUTING.md says: its map from packages to their
tests is whole (every package of ``hvdlite`` has a row, every test file sits in some row,
every path in it exists), and every job a test starts goes through ``tests/launching.py``."""

import ast
import glob
import os
import re
from typing import Dict, List

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROW = re.compile(r"^\| `(hvdlite[\w/]*)`[^|]*\| (.*) \|$")
_TEST = re.compile(r"`(tests/[\w/]+\.py)`")


def _map() -> Dict[str, List[str]]:
    with open(os.path.join(ROOT, "CONTRIBUTING.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Where the tests of a package are", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = _ROW.match(line)
        if match:
            assert match.group(1) not in rows, f"{match.group(1)} has two rows"
            rows[match.group(1)] = _TEST.findall(match.group(2))
    return rows


def test_every_package_has_a_row_with_tests_that_exist():
    rows = _map()
    packages = sorted(
        os.path.relpath(os.path.dirname(p), ROOT)
        for p in glob.glob(os.path.join(ROOT, "hvdlite", "**", "__init__.py"), recursive=True)
    )
    assert packages and set(packages) == set(rows), (
        f"rows missing: {sorted(set(packages) - set(rows))}; "
        f"rows for no package: {sorted(set(rows) - set(packages))}"
    )
    for package, tests in rows.items():
        assert tests, f"{package}: no test listed"
        missing = [t for t in tests if not os.path.isfile(os.path.join(ROOT, t))]
        assert not missing, f"{package}: no such test file {missing}"


def test_every_test_file_is_on_the_map():
    listed = {t for tests in _map().values() for t in tests}
    files = {
        os.path.relpath(p, ROOT)
        for p in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
    }
    assert files - listed == set(), (
        f"add these to CONTRIBUTING.md's test map: {sorted(files - listed)}"
    )


#: the launcher's modules a test could run with ``python -m``
_LAUNCHER_MODULES = {"hvdlite.runner", "hvdlite.runner.cli.launch"}
#: tests of the entry point itself (``python -m hvdlite.runner --version``), which is not a job
_ENTRY_POINT_TESTS = {("tests/runner/test_horovod_flags.py", "test_python_m_hvdlite_runner")}


def _own_launches(path: str) -> list:
    """``(function, line)`` of each ``[..., "-m", "<launcher module>", ...]`` in ``path``
    and each other use of the launcher module's name as a string (docstrings aside)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = []

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            if any(a == "-m" and b in _LAUNCHER_MODULES for a, b in zip(items, items[1:])):
                found.append((function, node.lineno))
        elif isinstance(node, ast.Constant) and node.value == "hvdlite.runner.cli.launch":
            found.append((function, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return sorted(set(found), key=lambda f: f[1])


def test_every_job_is_started_through_tests_launching():
    """No test file builds the launcher's command itself: ``tests.launching`` makes the
    command, the environment and the bounded run (or the started job) for all of them."""
    offenders = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        if rel in ("tests/launching.py", "tests/test_suite_layout.py") or "/workers/" in rel:
            continue
        for function, line in _own_launches(path):
            if (rel, function) not in _ENTRY_POINT_TESTS:
                offenders.append(f"{rel}:{line} ({function})")
    assert not offenders, f"start these jobs with tests.launching.run/start: {offenders}"


def test_the_launch_check_finds_a_hand_built_command(tmp_path):
    """The check above is not blind: a hand-built launcher command is found."""
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import sys\ndef test_x():\n"
        "    cmd = [sys.executable, '-m', 'hvdlite.runner', '-np', '2']\n"
    )
    assert [f for f, _ in _own_launches(str(sample))] == ["test_x"]
