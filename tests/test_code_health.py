"""Code-health limits the project holds itself to, checked on the source with ``ast``.

* No function in ``hvdlite/`` is over 90 lines, and at most 4 are over 60.
* No test hides an assertion behind a broad ``except`` (``except:``, ``Exception``,
  ``BaseException``, ``AssertionError``) that does not raise again: such a test cannot fail.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
BROAD = {"Exception", "BaseException", "AssertionError"}


def _functions(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _lengths():
    return sorted(((node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.name}")
                   for path in (ROOT / "hvdlite").rglob("*.py") for node in _functions(path)),
                  reverse=True)


def test_function_lengths():
    lengths = _lengths()
    assert not [f for n, f in lengths if n > 90], lengths[:5]
    over_60 = [(n, f) for n, f in lengths if n > 60]
    assert len(over_60) <= 4, over_60


def _is_broad(handler: ast.ExceptHandler) -> bool:
    types = handler.type
    if types is None:
        return True
    names = types.elts if isinstance(types, ast.Tuple) else [types]
    return any(isinstance(n, ast.Name) and n.id in BROAD for n in names)


def _swallowing_tries(tree: ast.AST):
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        asserts = any(isinstance(n, ast.Assert) for stmt in node.body for n in ast.walk(stmt))
        for handler in node.handlers:
            reraises = any(isinstance(n, ast.Raise) for n in ast.walk(handler))
            if asserts and _is_broad(handler) and not reraises:
                yield node.lineno


def test_no_assertion_swallowed_by_a_broad_except():
    found = [f"{path.relative_to(ROOT)}:{line}"
             for path in (ROOT / "tests").rglob("*.py")
             for line in _swallowing_tries(ast.parse(path.read_text()))]
    assert not found, found


def test_the_checks_catch_what_they_look_for():
    bad = ast.parse("try:\n    assert x\nexcept Exception:\n    pass\n")
    fine = ast.parse("try:\n    assert x\nexcept OSError:\n    pass\n")
    again = ast.parse("try:\n    assert x\nexcept Exception:\n    raise\n")
    assert list(_swallowing_tries(bad)) == [1]
    assert list(_swallowing_tries(fine)) == [] and list(_swallowing_tries(again)) == []
