"""The package's layering, read from the source with ``ast`` (nothing is imported).

Every ``import`` statement counts, at module level or inside a function: an
import moved into a function to dodge a cycle is still a cycle.
"""

import ast
import dataclasses
import os
import re
from typing import Dict, List, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "hvdlite")
#: the modules that spell variable names: the tunables' table, the launcher-set names, and
#: the config package itself (Horovod's variables that have no effect here)
NAME_MODULES = tuple(
    os.path.join("hvdlite", "common", "config", f)
    for f in ("tunables.py", "env_names.py", "__init__.py")
)
#: a full variable name, not the ``HVDLITE_*`` pattern of a help text
_VAR_NAME = re.compile(r"\bHVDLITE_[A-Z0-9][A-Z0-9_]*")
#: a full Horovod variable name (its tuning names too are spelled only in NAME_MODULES)
_HOROVOD_NAME = re.compile(r"\bHOROVOD_[A-Z0-9][A-Z0-9_]*")
#: the identity aliases the launcher exports (user scripts read them); these may appear
#: anywhere, e.g. in a message telling users which variables are set
_HOROVOD_IDENTITY = {
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE",
    "HOROVOD_HOSTNAME",
}
#: packages whose code runs in the launcher must not pull in a framework
_FRAMEWORKS = ("torch", "tensorflow", "hvdlite.torch", "hvdlite.tensorflow")


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement's target, as written in ``path`` at ``line``."""

    target: str
    path: str
    line: int
    in_function: bool

    def where(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


def _module_name(path: str) -> Tuple[str, bool]:
    """``(dotted name, is a package __init__)`` of a file under hvdlite/."""
    rel = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
    if rel[-1] == "__init__":
        return ".".join(rel[:-1]), True
    return ".".join(rel), False


def _sources() -> Dict[str, str]:
    """Every module under hvdlite/ -> its file."""
    found = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                found[_module_name(path)[0]] = path
    return found


def _function_lines(tree: ast.AST) -> Set[int]:
    """Line numbers of import statements inside a function body."""
    lines = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    lines.add(node.lineno)
    return lines


def _imports(path: str, modules: Set[str]) -> List[Import]:
    """Every import in ``path``, relative ones resolved; ``from pkg import mod`` names ``mod``."""
    name, is_package = _module_name(path)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    in_function = _function_lines(tree)
    found = set()
    for node in ast.walk(tree):
        nested = getattr(node, "lineno", None) in in_function
        if isinstance(node, ast.Import):
            found.update(Import(a.name, path, node.lineno, nested) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(Import(sub if sub in modules else base, path, node.lineno, nested))
    return sorted(found, key=lambda i: (i.line, i.target))


def _graph() -> Dict[str, List[Import]]:
    """hvdlite module -> its imports (of anything)."""
    sources = _sources()
    return {name: _imports(path, set(sources)) for name, path in sources.items()}


def _within(target: str, prefixes) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def _edges(violations: List[Tuple[str, Import]]) -> str:
    return "\n".join(f"{m} -> {i.target} ({i.where()})" for m, i in violations)


def _cycles(graph: Dict[str, List[Import]]) -> List[List[str]]:
    """One cycle (as a chain of modules) per back edge of a depth-first walk."""
    edges = {m: sorted({i.target for i in imps if i.target in graph}) for m, imps in graph.items()}
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []
    cycles = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in edges[m]:
            if state.get(n) == 1:
                cycles.append(path[path.index(n) :] + [n])
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return cycles


@pytest.fixture(scope="module")
def graph():
    return _graph()


def test_no_import_cycles(graph):
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_common_imports_no_launcher_or_framework_binding(graph):
    above = ("hvdlite.runner", "hvdlite.torch", "hvdlite.tensorflow", "hvdlite.ray")
    bad = [
        (m, i)
        for m, imps in graph.items()
        if _within(m, ["hvdlite.common"])
        for i in imps
        if _within(i.target, above)
    ]
    assert not bad, "hvdlite.common imports a layer above it:\n" + _edges(bad)


#: the layers inside hvdlite.common, lowest first, as docs/architecture.md draws them: a
#: module imports only modules of its own layer or of a lower one
_COMMON_LAYERS = (
    (
        "leaves",
        (
            "hvdlite.common.config",
            "hvdlite.common.exceptions",
            "hvdlite.common.api_docs",
            "hvdlite.common.fault_injection",
            "hvdlite.common.slurm.environment",
        ),
    ),
    ("net", ("hvdlite.common.net",)),
    ("buffers and messages", ("hvdlite.common.arrays", "hvdlite.common.engine.message")),
    ("backend", ("hvdlite.common.backend",)),
    ("engine and diagnostics", ("hvdlite.common.engine", "hvdlite.common.diagnostics")),
    ("set-up", ("hvdlite.common.basics", "hvdlite.common.process_sets", "hvdlite.common.slurm")),
    ("op layer", ("hvdlite.common.ops",)),
    (
        "over the op layer",
        (
            "hvdlite.common.rank_setup",
            "hvdlite.common.objects",
            "hvdlite.common.elastic_state",
            "hvdlite.common.compression",
            "hvdlite.common.powersgd_settings",
        ),
    ),
)


def _common_layer(module: str):
    """The index of ``module``'s layer in :data:`_COMMON_LAYERS`, or None."""
    for index, (_, prefixes) in enumerate(_COMMON_LAYERS):
        if _within(module, prefixes):
            return index
    return None


def _upward_imports(graph: Dict[str, List[Import]]) -> List[Tuple[str, Import]]:
    """Imports by a module of hvdlite.common of a module in a higher layer of it."""
    bad = []
    for m, imps in graph.items():
        mine = _common_layer(m)
        if mine is None:
            continue
        for i in imps:
            theirs = _common_layer(i.target)
            if theirs is not None and theirs > mine:
                bad.append((m, i))
    return bad


def test_every_common_module_has_a_layer(graph):
    loose = [
        m for m in graph if _within(m, ["hvdlite.common"]) and graph[m] and _common_layer(m) is None
    ]
    assert not loose, f"add these to _COMMON_LAYERS (and docs/architecture.md): {loose}"


def test_common_layers_import_only_downwards(graph):
    bad = _upward_imports(graph)
    assert not bad, "a layer of hvdlite.common imports a higher one:\n" + "\n".join(
        f"{m} ({_COMMON_LAYERS[_common_layer(m)][0]}) -> {i.target} "
        f"({_COMMON_LAYERS[_common_layer(i.target)][0]}) at {i.where()}"
        for m, i in bad
    )


def test_the_layer_check_sees_an_upward_import():
    """Not vacuous: the backend importing the runtime, even inside a function, is caught;
    the runtime importing the backend is not."""
    up = Import("hvdlite.common.engine.runtime", "x.py", 1, True)
    down = Import("hvdlite.common.backend.base", "y.py", 2, False)
    graph = {"hvdlite.common.backend.shm": [up], "hvdlite.common.engine.runtime": [down]}
    assert _upward_imports(graph) == [("hvdlite.common.backend.shm", up)]


#: the only modules of hvdlite.common that import torch when they are imported: Gloo is
#: torch.distributed's transport (basics refuses it first when torch is missing)
_TORCH_AT_IMPORT = ("hvdlite.common.backend.gloo",)


def test_common_and_tensorflow_run_without_torch(graph):
    """A TensorFlow job under MPI must not need torch: hvdlite.common imports torch only
    lazily (through common/arrays.py, which falls back to numpy) except in the Gloo
    backend, and hvdlite.tensorflow never imports it, nor does common import TensorFlow."""
    torch = ("torch",)
    bad = [
        (m, i)
        for m, imps in graph.items()
        for i in imps
        if _within(i.target, torch)
        and (
            (_within(m, ["hvdlite.common"]) and not i.in_function and m not in _TORCH_AT_IMPORT)
            or _within(m, ["hvdlite.tensorflow"])
        )
    ]
    bad += [
        (m, i)
        for m, imps in graph.items()
        if _within(m, ["hvdlite.common"])
        for i in imps
        if _within(i.target, ("tensorflow", "keras"))
    ]
    assert not bad, "an import that needs torch (or TensorFlow) where it must not:\n" + _edges(bad)


def test_launcher_imports_no_framework(graph):
    bad = [
        (m, i)
        for m, imps in graph.items()
        if _within(m, ["hvdlite.runner"])
        for i in imps
        if _within(i.target, _FRAMEWORKS)
    ]
    assert not bad, "hvdlite.runner imports a framework:\n" + _edges(bad)


def test_net_layer_imports_only_stdlib_and_exceptions(graph):
    allowed = ("hvdlite.common.net", "hvdlite.common.exceptions")
    bad = [
        (m, i)
        for m, imps in graph.items()
        if _within(m, ["hvdlite.common.net"])
        for i in imps
        if (i.target == "hvdlite" or i.target.startswith("hvdlite."))
        and not _within(i.target, allowed)
    ]
    assert not bad, "hvdlite.common.net imports more than the exceptions:\n" + _edges(bad)


def test_launcher_has_no_function_level_hvdlite_imports(graph):
    bad = [
        (m, i)
        for m, imps in graph.items()
        if _within(m, ["hvdlite.runner", "hvdlite.common.net"])
        for i in imps
        if i.in_function and _within(i.target, ["hvdlite"])
    ]
    assert not bad, "move these imports to module level:\n" + _edges(bad)


def _docstrings(tree: ast.AST) -> Set[int]:
    """ids of the string constants that are docstrings."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _names_outside_config(pattern, allowed=frozenset()) -> List[str]:
    """``NAME (file:line)`` for each match of ``pattern`` in a non-docstring string constant
    of a module other than the NAME_MODULES."""
    bad = []
    for path in _sources().values():
        if os.path.relpath(path, ROOT) in NAME_MODULES:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docs
            ):
                for name in pattern.findall(node.value):
                    if name not in allowed:
                        bad.append(f"{name} ({os.path.relpath(path, ROOT)}:{node.lineno})")
    return bad


def test_hvdlite_variable_names_are_spelled_only_in_config():
    bad = _names_outside_config(_VAR_NAME)
    assert not bad, "spell these with the constants of hvdlite/common/config:\n" + "\n".join(bad)


def test_horovod_variable_names_are_spelled_only_in_config():
    bad = _names_outside_config(_HOROVOD_NAME, _HOROVOD_IDENTITY)
    assert not bad, f"spell these Horovod names only in {NAME_MODULES}:\n" + "\n".join(bad)


def test_each_variable_name_is_spelled_once():
    """Within the NAME_MODULES too, a name is written once and referred to after."""
    seen: Dict[str, str] = {}
    twice = []
    for rel in NAME_MODULES:
        path = os.path.join(ROOT, rel)
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docs
                and (_VAR_NAME.fullmatch(node.value) or _HOROVOD_NAME.fullmatch(node.value))
            ):
                where = f"{rel}:{node.lineno}"
                if node.value in seen:
                    twice.append(f"{node.value} ({seen[node.value]} and {where})")
                seen.setdefault(node.value, where)
    assert not twice, "spelled more than once:\n" + "\n".join(twice)


def test_the_pattern_catches_a_horovod_name_in_code():
    """The check above is not vacuous: it sees names in f-strings and plain strings."""
    tree = ast.parse('x = f"{a} HOROVOD_CYCLE_TIME"\ny = "HOROVOD_RANK"\n')
    found = [
        n
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        for n in _HOROVOD_NAME.findall(node.value)
    ]
    assert sorted(found) == ["HOROVOD_CYCLE_TIME", "HOROVOD_RANK"]


#: the launcher's packages, lowest first: a module imports only its own package or a
#: lower one.  The entry points sit on top of them all: ``hvdlite.run`` (``api``),
#: ``python -m hvdlite.runner`` and a plain srun step's job (``step_job``, which runs a
#: job like the command line does)
_RUNNER_LAYERS = (
    "hvdlite.runner.processes",
    "hvdlite.runner.hosts",
    "hvdlite.runner.store",
    "hvdlite.runner.tasks",
    "hvdlite.runner.slurm",
    "hvdlite.runner.starters",
    "hvdlite.runner.agent",
    "hvdlite.runner.cli",
    ("hvdlite.runner.api", "hvdlite.runner.__main__", "hvdlite.runner.step_job"),
)


def _runner_layer(module: str):
    """The layer of the longest entry of :data:`_RUNNER_LAYERS` that holds ``module``."""
    best = None
    for index, entry in enumerate(_RUNNER_LAYERS):
        for prefix in entry if isinstance(entry, tuple) else (entry,):
            if _within(module, [prefix]) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def test_every_runner_module_has_a_layer(graph):
    loose = [
        m for m in graph if _within(m, ["hvdlite.runner"]) and graph[m] and _runner_layer(m) is None
    ]
    assert not loose, f"add these to _RUNNER_LAYERS (and docs/architecture.md): {loose}"


def test_runner_packages_import_only_downwards(graph):
    bad = [
        (m, i)
        for m, imps in graph.items()
        if _runner_layer(m) is not None
        for i in imps
        if _runner_layer(i.target) is not None and _runner_layer(i.target) > _runner_layer(m)
    ]
    assert not bad, "a package of hvdlite.runner imports a higher one:\n" + _edges(bad)


def test_platforms_sit_on_the_launcher_and_not_on_each_other(graph):
    """Ray and Spark use the launcher; neither imports the other, and nothing below them
    imports either."""
    platforms = ("hvdlite.ray", "hvdlite.spark")
    bad = [
        (m, i)
        for m, imps in graph.items()
        for i in imps
        if _within(i.target, platforms) and not _within(m, platforms)
    ]
    bad += [
        (m, i)
        for m, imps in graph.items()
        for i in imps
        for a, b in (platforms, platforms[::-1])
        if _within(m, [a]) and _within(i.target, [b])
    ]
    assert not bad, "an import of a platform from outside it:\n" + _edges(bad)


#: how many modules a package may hold beside its sub-packages
MAX_LOOSE_MODULES = 12


def test_no_package_is_a_flat_bag():
    crowded = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        loose = [f for f in files if f.endswith(".py") and f not in ("__init__.py", "__main__.py")]
        if len(loose) > MAX_LOOSE_MODULES:
            crowded[os.path.relpath(folder, ROOT)] = len(loose)
    assert not crowded, f"more than {MAX_LOOSE_MODULES} modules in one package: {crowded}"


def test_every_package_says_what_it_owns():
    """Each sub-package of common/ and runner/ has a docstring that says what it holds and
    what it may import."""
    bare = []
    for base in ("common", "runner"):
        for folder, dirs, _ in os.walk(os.path.join(PACKAGE, base)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if folder == os.path.join(PACKAGE, base):
                continue
            init = os.path.join(folder, "__init__.py")
            with open(init, encoding="utf-8") as f:
                doc = ast.get_docstring(ast.parse(f.read())) or ""
            if "import" not in doc.lower():
                bare.append(os.path.relpath(init, ROOT))
    assert not bare, "say what the package owns and may import in: " + ", ".join(bare)


def _agent_constructions(path: str) -> List[str]:
    """``file:line (function)`` of each call of ``Agent(...)`` in the module at ``path``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for fn in [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]:
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                callee = node.func
                name = (
                    callee.id
                    if isinstance(callee, ast.Name)
                    else callee.attr
                    if isinstance(callee, ast.Attribute)
                    else None
                )
                if name == "Agent":
                    found.append((node.lineno, getattr(fn, "name", "<module>")))
    # a call inside a function is also inside the module: keep the innermost owner
    owners = {}
    for line, owner in found:
        if owners.get(line) in (None, "<module>"):
            owners[line] = owner
    return [
        f"{os.path.relpath(path, ROOT)}:{line} ({owner})" for line, owner in sorted(owners.items())
    ]


def test_only_run_job_makes_the_agent():
    """Every job, wherever it starts (CLI, hvdlite.run, Ray, Spark, Slurm), goes through
    ``run_job``: nothing else in the package constructs the agent's loop."""
    made = [where for path in _sources().values() for where in _agent_constructions(path)]
    assert (
        len(made) == 1
        and made[0].startswith("hvdlite/runner/agent/job.py:")
        and made[0].endswith("(_run_agent)")
    ), "only run_job (agent/job.py) may construct the Agent:\n" + "\n".join(made)


def test_the_agent_check_sees_a_construction(tmp_path):
    """Not vacuous: a platform that builds its own agent is caught, with its function."""
    rogue = tmp_path / "rogue.py"
    rogue.write_text(
        "from x import state_machine\n\ndef go(a):\n"
        "    return state_machine.Agent(a, a, a, a).run()\n"
    )
    assert _agent_constructions(str(rogue))[0].endswith(":4 (go)")
