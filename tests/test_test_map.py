"""CONTRIBUTING.md's map from packages to their tests stays whole: every package of
``hvdlite`` has a row, every test file sits in some row, and every path in it exists."""

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
    packages = sorted(os.path.relpath(os.path.dirname(p), ROOT) for p in
                      glob.glob(os.path.join(ROOT, "hvdlite", "**", "__init__.py"),
                                recursive=True))
    assert packages and set(packages) == set(rows), (
        f"rows missing: {sorted(set(packages) - set(rows))}; "
        f"rows for no package: {sorted(set(rows) - set(packages))}")
    for package, tests in rows.items():
        assert tests, f"{package}: no test listed"
        missing = [t for t in tests if not os.path.isfile(os.path.join(ROOT, t))]
        assert not missing, f"{package}: no such test file {missing}"


def test_every_test_file_is_on_the_map():
    listed = {t for tests in _map().values() for t in tests}
    files = {os.path.relpath(p, ROOT) for p in
             glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)}
    assert files - listed == set(), (
        f"add these to CONTRIBUTING.md's test map: {sorted(files - listed)}")
