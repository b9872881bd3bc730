"""@documented writes a function's Args section from one table of argument descriptions,
so the collectives of every framework describe ``name``, ``op``, ... in one place."""

import inspect

import pytest

from hvdlite.common import api_docs

TABLE = {
    "tensor": "the input.",
    "name": "the op's name.",
    "first": "ignored.",
    "second": "ignored.",
}


def _args_lines(doc: str):
    lines = doc.splitlines()
    start = lines.index("Args:") + 1
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return lines[start:end]


def test_fills_args_in_signature_order_before_returns():
    def op(tensor, name=None, *, first=1, second=2):
        """Do the thing.

        More about it.

        Returns:
            The result.

        Raises:
            ValueError: never.
        """

    doc = api_docs.documented(TABLE, tensor="this op's own tensor.")(op).__doc__
    assert doc.startswith("Do the thing.\n\nMore about it.\n\nArgs:\n")
    assert _args_lines(doc) == [
        "    tensor: this op's own tensor.",
        "    name: the op's name.",
        "    first, second: ignored.",
    ]
    assert (
        doc.index("Args:")
        < doc.index("Returns:\n    The result.")
        < doc.index("Raises:\n    ValueError: never.")
    )


def test_appends_args_when_there_is_no_later_section_and_wraps_long_descriptions():
    def op(tensor, *rest):
        """Summary only."""

    doc = api_docs.documented({"tensor": "word " * 30, "rest": "more."})(op).__doc__
    lines = _args_lines(doc)
    assert doc.startswith("Summary only.\n\nArgs:\n")
    assert lines[0].startswith("    tensor: word") and lines[-1] == "    *rest: more."
    assert len(lines) > 2 and all(len(line) <= 88 for line in lines)
    assert all(line.startswith("        word") for line in lines[1:-1])


def test_shared_raises_entries_follow_the_own_ones_or_make_the_section():
    def op(tensor):
        """Do it.

        Raises:
            ValueError: a bad tensor.

        Notes:
            Stays last.
        """

    def bare(tensor):
        """Do it."""

    shared = ("TypeError: not a tensor.", "RuntimeError: the runtime stopped " + "long " * 20)
    doc = api_docs.documented(TABLE, raises=shared)(op).__doc__
    raises = doc.split("Raises:\n")[1].split("\n\n")[0].splitlines()
    assert raises[0] == "    ValueError: a bad tensor."
    assert raises[1] == "    TypeError: not a tensor."
    assert raises[2].startswith("    RuntimeError: the runtime stopped long")
    assert all(line.startswith("        ") for line in raises[3:]) and len(raises) > 3
    assert doc.rstrip().endswith("Notes:\n    Stays last.")
    doc = api_docs.documented(TABLE, raises=shared[:1])(bare).__doc__
    assert doc.endswith("Args:\n    tensor: the input.\n\nRaises:\n    TypeError: not a tensor.\n")


def test_keeps_the_function_object_and_its_signature():
    def op(tensor, name=None):
        """Summary."""

    before = inspect.signature(op)
    assert api_docs.documented(TABLE)(op) is op
    assert inspect.signature(op) == before and op.__name__ == "op"


def test_refuses_an_undocumented_argument():
    def op(tensor, colour=None):
        """Summary."""

    with pytest.raises(TypeError, match=r"op: no description for argument\(s\) \['colour'\]"):
        api_docs.documented(TABLE)(op)


def test_refuses_a_description_for_an_argument_it_does_not_take():
    def op(tensor):
        """Summary."""

    with pytest.raises(TypeError, match=r"\['name'\], which it does not take"):
        api_docs.documented(TABLE, name="stale.")(op)


def test_refuses_a_docstring_with_its_own_args_or_none():
    def written(tensor):
        """Summary.

        Args:
            tensor: by hand.
        """

    def bare(tensor):
        pass

    with pytest.raises(TypeError, match="writes its own Args section"):
        api_docs.documented(TABLE)(written)
    with pytest.raises(TypeError, match="no docstring"):
        api_docs.documented(TABLE)(bare)


def _public_functions(module):
    return [
        (n, f)
        for n, f in ((n, getattr(module, n)) for n in module.__all__)
        if inspect.isfunction(f)
        and f.__module__ == module.__name__
        and inspect.signature(f).parameters
    ]


def _check_every_argument_listed(module):
    functions = _public_functions(module)
    assert functions, module.__name__
    for n, f in functions:
        listed = " ".join(
            line.split(":")[0]
            for line in _args_lines(inspect.getdoc(f))
            if not line.startswith("        ")
        )
        names = [p.name for p in inspect.signature(f).parameters.values()]
        assert [p for p in names if p not in listed.replace(",", " ").split()] == [], n


def test_every_public_torch_function_lists_each_argument():
    pytest.importorskip("torch")
    from hvdlite.torch import functions, mpi_ops

    _check_every_argument_listed(mpi_ops)
    _check_every_argument_listed(functions)
    assert "its result is ``tensor`` itself" in inspect.getdoc(mpi_ops.allreduce_async_)


def test_every_public_tensorflow_function_lists_each_argument():
    pytest.importorskip("tensorflow")
    from hvdlite.tensorflow import functions, mpi_ops

    _check_every_argument_listed(mpi_ops)
    _check_every_argument_listed(functions)
