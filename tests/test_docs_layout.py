"""The docs name only what exists: ``hvdlite/...`` paths, short paths such as
``agent/job.py`` and dotted names such as ``hvdlite.runner.api`` in README.md,
CONTRIBUTING.md and docs/*.md are in the tree, links between the pages resolve (headings
included), and the architecture page stays short enough to read in one sitting.

Nothing is imported: modules are found on disk, and an attribute after a module must
be a name that module's source defines.
"""

import ast
import glob
import os
import re
from typing import Dict, List, Optional, Set, Tuple

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHITECTURE = os.path.join("docs", "architecture.md")
MAX_ARCHITECTURE_LINES = 300

#: ``hvdlite/...`` paths (a module, a package folder, or a file in one); not inside a
#: longer path such as ``tests/hvdlite/...``
_PATH = re.compile(r"(?<![\w./-])hvdlite/[\w/]*[\w](?:\.py)?")
#: ``hvdlite.x.y`` dotted names (the first part is ``hvdlite`` itself)
_DOTTED = re.compile(r"(?<![\w./-])hvdlite(?:\.[A-Za-z_]\w*)+")
#: markdown links ``[text](target)``
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*```")


def _pages() -> List[str]:
    pages = ["README.md", "CONTRIBUTING.md"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
    )
    assert len(pages) > 3, pages
    return pages


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _lines_outside_code_blocks(text: str) -> List[Tuple[int, str]]:
    """``(line number, line)`` of the prose: fenced code blocks left out."""
    out, fenced = [], False
    for number, line in enumerate(text.split("\n"), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def _prose(text: str) -> str:
    """``text`` with its fenced code blocks blanked (line numbers kept)."""
    lines = text.split("\n")
    kept = dict(_lines_outside_code_blocks(text))
    return "\n".join(kept.get(n, "") for n in range(1, len(lines) + 1))


def _module_file(parts: List[str]) -> Optional[str]:
    """The source file of the module or package ``parts`` names, or None."""
    base = os.path.join(ROOT, *parts)
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def path_problem(path: str) -> Optional[str]:
    """Why ``hvdlite/...`` does not name something in the tree (None when it does)."""
    full = os.path.join(ROOT, path.rstrip("/"))
    if os.path.exists(full) or os.path.isfile(full + ".py"):
        return None
    return "no such file or folder"


def module_names(source_file: str) -> Set[str]:
    """The names a module defines at its top level: functions, classes, assignments,
    imports, ``__all__``, and what a module ``__getattr__`` answers to (lazy names)."""
    with open(source_file, encoding="utf-8") as f:
        tree = ast.parse(f.read(), source_file)
    names: Set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if node.name == "__getattr__":
                    names.update(
                        c.value
                        for c in ast.walk(node)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    )
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                if (
                    any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)
                    and node.value is not None
                ):
                    names.update(
                        c.value
                        for c in ast.walk(node.value)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    )
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING, optional imports
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return names


def dotted_problem(name: str) -> Optional[str]:
    """Why ``hvdlite.x.y...`` does not name a module, or an attribute of one.

    The longest prefix that is a module or package is found on disk; the part right
    after it, if any, must be a name that module defines (:func:`module_names`).  Parts
    after that are attributes of attributes and are not checked.
    """
    parts = name.split(".")
    for length in range(len(parts), 0, -1):
        source = _module_file(parts[:length])
        if source is None:
            continue
        if length == len(parts):
            return None
        attribute = parts[length]
        if attribute in module_names(source):
            return None
        return f"{'.'.join(parts[:length])} has no {attribute!r}"
    return "no such module"


def _named(pattern: re.Pattern) -> Dict[str, List[str]]:
    """Every match of ``pattern`` in the pages -> where (``page:line``)."""
    found: Dict[str, List[str]] = {}
    for page in _pages():
        for number, line in enumerate(_read(page).split("\n"), 1):
            for match in pattern.findall(line):
                found.setdefault(match, []).append(f"{page}:{number}")
    return found


def test_every_module_path_in_the_docs_exists():
    paths = _named(_PATH)
    assert paths, "the docs name no hvdlite/ path: is the pattern right?"
    bad = [
        f"{p} ({', '.join(where)}): {path_problem(p)}"
        for p, where in sorted(paths.items())
        if path_problem(p)
    ]
    assert not bad, "the docs name paths that do not exist:\n" + "\n".join(bad)


def test_every_dotted_module_name_in_the_docs_exists():
    names = _named(_DOTTED)
    assert names, "the docs name no hvdlite.x module: is the pattern right?"
    bad = [
        f"{n} ({', '.join(where)}): {dotted_problem(n)}"
        for n, where in sorted(names.items())
        if dotted_problem(n)
    ]
    assert not bad, "the docs name modules that do not exist:\n" + "\n".join(bad)


#: a file or folder written in backticks without the ``hvdlite/`` prefix: ``agent/job.py``,
#: ``runner/store/``, ``tests/test_layers.py`` (a module's dotted attribute such as
#: ``job.run_job`` is not a path: a path ends in ``.py`` or ``/``)
_SHORT_PATH = re.compile(r"`((?:[\w.-]+/)*[\w.-]+(?:\.py|/))`")


def _tree() -> Tuple[Set[str], Set[str]]:
    """Every file and folder of the repository (relative, ``/``-separated), .git and the
    virtualenv left out."""
    files, folders = set(), set()
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".") and d != "__pycache__" and not d.endswith(".egg-info")
        ]
        rel = os.path.relpath(folder, ROOT).replace(os.sep, "/")
        if rel != ".":
            folders.add(rel)
        files.update(f"{rel}/{n}" if rel != "." else n for n in names)
    return files, folders


def short_path_problem(path: str, tree: Tuple[Set[str], Set[str]]) -> Optional[str]:
    """Why a short path names nothing: no file (or, ending in ``/``, no folder) of the
    repository ends with it at a folder boundary."""
    files, folders = tree
    want = path.rstrip("/")
    pool = folders if path.endswith("/") else files
    if any(p == want or p.endswith("/" + want) for p in pool):
        return None
    return "no file or folder of the repository ends with it"


def test_every_short_path_in_the_docs_exists():
    """``agent/job.py`` or ``store/`` must be a real file or folder (of hvdlite/, tests/,
    benchmarks/, ...): old names such as ``procs.py`` or ``runner/services/`` are caught."""
    tree = _tree()
    found = _named(_SHORT_PATH)
    assert found, "the docs name no short path: is the pattern right?"
    bad = [
        f"{p} ({', '.join(where)})"
        for p, where in sorted(found.items())
        if short_path_problem(p, tree)
    ]
    assert not bad, "the docs name files or folders that do not exist:\n" + "\n".join(bad)


def test_the_checks_see_old_names():
    """Not vacuous: names from before the packages moved are caught, current ones pass."""
    assert path_problem("hvdlite/common/runtime.py")
    assert path_problem("hvdlite/runner/services/")
    assert path_problem("hvdlite/ray/executor.py")
    assert path_problem("hvdlite/common/engine/runtime.py") is None
    assert path_problem("hvdlite/runner/agent/") is None
    assert dotted_problem("hvdlite.runner.launch")
    assert dotted_problem("hvdlite.runner.procs")
    assert dotted_problem("hvdlite.common.elastic")
    assert dotted_problem("hvdlite.nothing")
    assert dotted_problem("hvdlite.common.diagnostics.timeline_writer.load_events") is None
    assert dotted_problem("hvdlite.torch") is None
    assert dotted_problem("hvdlite.run") is None  # an attribute of the package
    assert _PATH.findall("see tests/hvdlite/x.py and `hvdlite/torch/`.") == ["hvdlite/torch"]
    tree = _tree()
    for old in (
        "procs.py",
        "runner/services/",
        "common/runtime.py",
        "stack_reports.py",
        "ray/elastic.py",
    ):
        assert short_path_problem(old, tree), old
    for new in ("agent/job.py", "store/", "engine/runtime.py", "tests/test_layers.py"):
        assert short_path_problem(new, tree) is None, new
    assert _SHORT_PATH.findall("`agent/job.py`, `store/`, `job.run_job`") == [
        "agent/job.py",
        "store/",
    ]
    assert _DOTTED.findall("`hvdlite.run`, hvdlite.torch.") == ["hvdlite.run", "hvdlite.torch"]


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: str) -> Set[str]:
    anchors: Set[str] = set()
    counts: Dict[str, int] = {}
    for _, line in _lines_outside_code_blocks(_read(page)):
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            slug = _slug(match.group(1))
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_links_between_the_pages_resolve():
    """A link to a file in the repository finds it, and a link to a heading of a markdown
    page finds the heading (sections moved between pages leave no dead links)."""
    bad = []
    for page in _pages():
        prose = _prose(_read(page))
        for match in _LINK.finditer(prose):  # link text may span lines
            target = match.group(1)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            rel = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
            where = f"{page}:{prose.count(chr(10), 0, match.start()) + 1}: {target}"
            if not os.path.exists(os.path.join(ROOT, rel)):
                bad.append(f"{where} (no such file)")
            elif anchor and rel.endswith(".md") and anchor not in _anchors(rel):
                bad.append(f"{where} (no such heading in {rel})")
    assert not bad, "dead links:\n" + "\n".join(bad)


def test_slugs_and_links_are_read_as_github_does():
    assert _slug("horovodrun's flags") == "horovodruns-flags"
    assert _LINK.findall("see [One\ncycle](architecture.md#one-cycle) and [x](y.md)") == [
        "architecture.md#one-cycle",
        "y.md",
    ]
    assert _slug("Running a function: `hvdlite.run`") == "running-a-function-hvdliterun"
    assert (
        _slug("Monitoring: stragglers and live metrics") == "monitoring-stragglers-and-live-metrics"
    )
    assert (
        _slug("Stateful compression (`hvdlite/torch/grad_compression.py`)")
        == "stateful-compression-hvdlitetorchgrad_compressionpy"
    )


def test_architecture_is_read_in_one_sitting():
    lines = _read(ARCHITECTURE).count("\n")
    assert lines <= MAX_ARCHITECTURE_LINES, (
        f"{ARCHITECTURE} has {lines} lines (at most {MAX_ARCHITECTURE_LINES}): move details "
        "into the docstrings of the modules they describe"
    )


def test_architecture_stands_alone():
    """It describes what is built, from inside the repository: no link leaves it."""
    text = _read(ARCHITECTURE)
    for target in _LINK.findall(_prose(text)):
        if re.match(r"[a-z]+:", target):
            continue
        rel = os.path.normpath(os.path.join("docs", target.partition("#")[0]))
        assert not rel.startswith(".."), target
    assert "../shared" not in text and "shared/" not in text


def test_readme_keeps_the_test_command_and_points_at_the_docs():
    readme = _read("README.md")
    assert "make test" in readme
    for page in ("docs/reference.md", "docs/architecture.md"):
        assert f"({page}" in readme, page
