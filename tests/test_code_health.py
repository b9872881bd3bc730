"""Code-health limits the project holds itself to, checked on the source with ``ast``.

* No function in ``hvdlite/`` is over 90 lines, and at most 4 are over 60.
* No test hides an assertion behind a broad ``except`` (``except:``, ``Exception``,
  ``BaseException``, ``AssertionError``) that does not raise again: such a test cannot fail.
* No module in ``hvdlite/`` reaches into another's private names (``from hvdlite.x import
  _name``, or ``mod._name`` where ``mod`` came from an hvdlite import): what a module shares
  is public, with a docstring that says why.
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
    return sorted(
        (
            (node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.name}")
            for path in (ROOT / "hvdlite").rglob("*.py")
            for node in _functions(path)
        ),
        reverse=True,
    )


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
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in (ROOT / "tests").rglob("*.py")
        for line in _swallowing_tries(ast.parse(path.read_text()))
    ]
    assert not found, found


def test_the_checks_catch_what_they_look_for():
    bad = ast.parse("try:\n    assert x\nexcept Exception:\n    pass\n")
    fine = ast.parse("try:\n    assert x\nexcept OSError:\n    pass\n")
    again = ast.parse("try:\n    assert x\nexcept Exception:\n    raise\n")
    assert list(_swallowing_tries(bad)) == [1]
    assert list(_swallowing_tries(fine)) == [] and list(_swallowing_tries(again)) == []


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _in_hvdlite(module: str) -> bool:
    return module.split(".")[0] == "hvdlite"


def _from_hvdlite(node: ast.AST) -> bool:
    """Whether ``node`` is a ``from ... import`` out of hvdlite (a relative one is: every
    module checked is in hvdlite/)."""
    return isinstance(node, ast.ImportFrom) and (node.level > 0 or _in_hvdlite(node.module))


def _hvdlite_names(tree: ast.AST) -> set:
    """The names the file's imports of hvdlite bind (``import hvdlite.x`` binds ``hvdlite``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or "hvdlite" for a in node.names if _in_hvdlite(a.name))
        elif _from_hvdlite(node):
            names.update(a.asname or a.name for a in node.names)
    return names


def _root_name(node: ast.AST):
    """The name ``a`` of a chain ``a.b.c`` (None when the chain starts with a call, ...)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_reaches(tree: ast.AST):
    """``(line, what)`` for each private name the file takes from another hvdlite module."""
    imported = _hvdlite_names(tree)
    for node in ast.walk(tree):
        if _from_hvdlite(node):
            yield from ((node.lineno, a.name) for a in node.names if _is_private(a.name))
        elif (
            isinstance(node, ast.Attribute)
            and _is_private(node.attr)
            and _root_name(node.value) in imported
        ):
            yield node.lineno, ast.unparse(node)


def test_no_private_reach_into_another_module():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in sorted((ROOT / "hvdlite").rglob("*.py"))
        for line, what in _private_reaches(ast.parse(path.read_text()))
    ]
    assert not found, found


def test_the_reach_check_finds_what_it_looks_for():
    bad = ast.parse(
        "from hvdlite.common.basics import _STATE, runtime\n"
        "from hvdlite.tensorflow import mpi_ops\n"
        "import hvdlite.common.ops\n"
        "mpi_ops._check(x)\n"
        "hvdlite.common.ops._REQUESTS.clear()\n"
        "from .objects import _verify\n"
    )
    fine = ast.parse(
        "import os\nfrom hvdlite.tensorflow import mpi_ops\n"
        "os._exit(0)\nmpi_ops.__name__\nself._own()\n_local._x\n"
    )
    assert sorted(_private_reaches(bad)) == [
        (1, "_STATE"),
        (4, "mpi_ops._check"),
        (5, "hvdlite.common.ops._REQUESTS"),
        (6, "_verify"),
    ]
    assert list(_private_reaches(fine)) == []
