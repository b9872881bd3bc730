"""The one table of tunables: Config, the launcher's flags, the YAML reader and the
table in docs/reference.md all follow it."""

import argparse
import ast
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

from hvdlite.common import config as cfg
from hvdlite.common.config import tunables
from hvdlite.runner.cli import config_file
from hvdlite.runner.cli import flags

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN, END = "<!-- tunables:begin -->\n", "<!-- tunables:end -->"
#: where the generated table lives, and the page that must point users at it
REFERENCE, README = os.path.join("docs", "reference.md"), "README.md"
#: flags that run an action instead of setting something: no default to show
ACTIONS = {"-h", "--help", "-v", "--version", "-cb", "--check-build", "--check-hosts"}


def table_block(text: str) -> str:
    """The text between the tunables markers."""
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "one pair of markers"
    return text.split(BEGIN)[1].split(END)[0]


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def test_reference_table_is_the_generated_one():
    block = table_block(_read(REFERENCE))
    assert block == tunables.markdown(), (
        f"{REFERENCE}'s tunables table differs from hvdlite/common/config/tunables.py; paste "
        "the output of 'python -m hvdlite.common.config.tunables --markdown' between the markers"
    )


def test_the_table_is_in_one_place_and_the_readme_points_at_it():
    """The README carries no copy of the table (a second copy could drift) and links to
    the page that has it."""
    readme = _read(README)
    assert "<!-- tunables:" not in readme, "the tunables table lives in " + REFERENCE
    assert "(docs/reference.md)" in readme or "(docs/reference.md#tunables)" in readme
    assert "## Tunables\n" in _read(REFERENCE)


def test_table_check_sees_an_edit():
    """The comparison above fails when a row is changed on one side only."""
    generated = tunables.markdown()
    edited = generated.replace("| 128 MiB |", "| 64 MiB |")
    assert edited != generated
    assert table_block(f"x\n{BEGIN}{edited}{END}\ny") != generated


def test_markdown_from_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "hvdlite.common.config.tunables", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": ROOT},
    ).stdout
    assert out == tunables.markdown()
    assert out.count("\n") == len(tunables.TUNABLES) + 2


def test_config_fields_and_defaults_are_the_table():
    fields = {f.name: f for f in dataclasses.fields(cfg.Config)}
    for t in tunables.TUNABLES:
        assert fields[t.field].default == t.default and fields[t.field].type is t.type
        assert isinstance(t.default, t.type), t.field
        assert getattr(cfg.Config(), t.field) == (
            "WARNING" if t.field == "log_level" else t.default
        )
    job = {f.name for f in dataclasses.fields(cfg._JobFacts)}
    assert set(fields) == job | set(tunables.BY_FIELD)


def _config_field_defaults(source: str):
    """``(field, default expression)`` of every annotated field of ``class Config``."""
    tree = ast.parse(source)
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    return [(n.target.id, n.value) for n in config.body if isinstance(n, ast.AnnAssign)]


def _takes_its_row(field, value) -> bool:
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "_default"
        and len(value.args) == 1
        and isinstance(value.args[0], ast.Constant)
        and value.args[0].value == field
    )


def test_config_spells_no_default_itself():
    """``Config``'s tunable fields take their defaults from the table, by their own name,
    in the table's order: a default written there would be a second spelling."""
    source = (pathlib.Path(ROOT) / "hvdlite" / "common" / "config" / "__init__.py").read_text()
    got = _config_field_defaults(source)
    assert [f for f, _ in got] == [t.field for t in tunables.TUNABLES]
    assert not [f for f, v in got if not _takes_its_row(f, v)]
    bad = _config_field_defaults("class Config:\n    a: int = 3\n    b: int = _default('a')\n")
    assert [f for f, v in bad if not _takes_its_row(f, v)] == ["a", "b"]


def _tunable_named(name: str):
    """The tunable a ``DEFAULT_X`` constant or an ``x`` / ``x_s`` parameter stands for."""
    stem = name.lower()[len("default_") :] if name.startswith("DEFAULT_") else name
    return next((tunables.BY_FIELD[c] for c in (stem, stem + "_s") if c in tunables.BY_FIELD), None)


def _second_spellings(source: str, where: str):
    """Module constants ``DEFAULT_X = <number>`` and parameter defaults ``x=<number>`` that
    repeat the table's default of the tunable they are named after."""
    found = []

    def check(name, value, line):
        row = _tunable_named(name)
        if (
            row is not None
            and isinstance(value, ast.Constant)
            and type(value.value) in (int, float)
            and value.value == row.default
        ):
            found.append(f"{where}:{line} {name}={value.value!r} (the table's {row.field})")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.startswith("DEFAULT_"):
                    check(target.id, node.value, node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults) :], a.defaults))
            pairs += [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for arg, default in pairs:
                check(arg.arg, default, node.lineno)
    return found


def test_no_tunable_default_is_spelled_outside_the_table():
    package = pathlib.Path(ROOT) / "hvdlite"
    found = [
        hit
        for path in package.rglob("*.py")
        if "config" not in path.parts
        for hit in _second_spellings(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not found, found
    example = "DEFAULT_ELASTIC_TIMEOUT_S = 600.0\ndef f(op_timeout=1, elastic_timeout=600): pass\n"
    assert len(_second_spellings(example, "x.py")) == 2


def test_names_fields_and_dests_are_unique():
    rows = tunables.TUNABLES
    assert len({t.field for t in rows}) == len(rows)
    assert len({t.env for t in rows}) == len(rows)
    assert not {t.env for t in rows} & cfg.LAUNCHER_SET
    twins = [h for t in rows for h in t.horovod]
    assert len(set(twins)) == len(twins)
    dests = [f.dest for t in rows for f in t.flags]
    assert len(set(dests)) == len(dests)


def test_every_range_refuses_its_edges(monkeypatch):
    for t in tunables.TUNABLES:
        if t.range is None:
            continue
        below = t.range.low if t.range.low_open else t.range.low - 1
        with pytest.raises(cfg.HvdliteSettingError, match=re.escape(t.env)):
            cfg.Config(**{t.field: t.type(below)})
        if t.range.high is not None:
            with pytest.raises(cfg.HvdliteSettingError, match=re.escape(t.range.words)):
                cfg.Config(**{t.field: t.type(t.range.high * 2 + 1)})


def test_every_flag_and_yaml_key_of_the_table_is_in_the_parser():
    parser = flags.build_parser()
    options = parser._option_string_actions
    for t in tunables.TUNABLES:
        for f in t.flags:
            names = f.on + f.off if isinstance(f, tunables.Switch) else f.names
            assert all(options[n].dest == f.dest for n in names), names
            assert flags.TUNABLE_FLAGS[f.dest][0] == t.env
        for y in t.yaml:
            assert config_file.HOROVOD_SECTIONS[y.section][y.key][0] == y.dest
            assert any(a.dest == y.dest for a in parser._actions), y


def test_every_flag_shows_help_and_its_default():
    """Every flag --help lists shows its default; the horovodrun flags kept only for
    compatibility are named together in one section instead of one by one."""
    parser = flags.build_parser()
    compat = next(g for g in parser._action_groups if g.title == flags.COMPAT_TITLE)
    hidden = []
    for action in parser._actions:
        if not action.option_strings or set(action.option_strings) & ACTIONS:
            continue
        if action.help == argparse.SUPPRESS:
            hidden += action.option_strings
            continue
        assert action.help, action.option_strings
        assert re.search(r"\((default: .+|the default)\)$", action.help), action.help
    assert "--tcp" in hidden and "--jsrun" in hidden
    named = set(re.findall(r"-[-\w]+", compat.description))
    assert set(hidden) <= named, set(hidden) - named


@pytest.mark.parametrize(
    "flag, shown",
    [
        ("--fusion-threshold-mb", "(default: 128)"),
        ("--cycle-time-ms", "(default: 1)"),
        ("--op-timeout-seconds", "(default: 60)"),
        ("--stall-check-warning-time-seconds", "(default: 60)"),
        ("--stall-check-shutdown-time-seconds", "(default: 0)"),
        ("--stall-check", "(the default)"),
        ("--no-stall-check", "(default: --stall-check)"),
        ("--log-level", "(default: WARNING)"),
        ("--hierarchical-allreduce", "(default: --no-hierarchical-allreduce)"),
    ],
)
def test_defaults_in_help_follow_config(flag, shown):
    action = flags.build_parser()._option_string_actions[flag]
    assert action.help.endswith(shown), action.help


def test_flag_values_become_the_variables_in_their_units():
    conv = flags.TUNABLE_FLAGS
    assert conv["fusion_threshold_mb"][1](1.5) == str(3 * 512 * 1024)
    assert conv["fusion_chunk_mb"][1](0) == "1"  # at least one byte
    assert conv["no_stall_check"] == (cfg.STALL_CHECK_DISABLE, conv["no_stall_check"][1])
    assert conv["no_stall_check"][1](False) == "0"
    assert conv["hierarchical_allreduce"][1](False) is None  # Horovod's default: nothing
    c = cfg.Config.from_env({cfg.STALL_CHECK_DISABLE: "1", cfg.FUSION_THRESHOLD: "1024"})
    assert c.stall_check is False and c.fusion_threshold_bytes == 1024
