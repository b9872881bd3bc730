"""One source for the public API's argument descriptions.

The collectives of every framework take the same arguments (``name``, ``op``,
``process_set``, ...); their descriptions live once, in :data:`ARGS`, and
:func:`documented` writes a function's ``Args:`` section from its signature at import
time.  ``help()`` and Sphinx's autodoc read ``__doc__`` at run time, so both show the
complete section, while the source keeps only what is the function's own: its summary,
``Returns:`` and ``Raises:``.  A framework adds its own wording (``torch.Tensor`` or
``tf.Tensor``) to a copy of the table; a function passes a description of its own for an
argument that means something else there.
"""

import inspect
import re
import textwrap
from typing import Callable, Dict, Mapping, Sequence, TypeVar

F = TypeVar("F", bound=Callable)

#: the reduction operations of allreduce
REDUCE_OPS = (
    "``hvd.Average`` (the default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max``, "
    "``hvd.Product`` or ``hvd.Adasum``."
)
#: the reduction operations of reducescatter
AVERAGE_OR_SUM = "``hvd.Average`` (the default) or ``hvd.Sum``."
#: the start of every collective's ``name``; each framework says how ``None`` is named
NAME = (
    "the operation's name, the same on every rank; it pairs the ranks' tensors and "
    "appears in errors and the timeline."
)
#: an argument kept so that Horovod's calls run unchanged
IGNORED = "accepted for Horovod compatibility and ignored."
_IGNORED_DEVICE = "accepted for Horovod compatibility and ignored (the collectives run on the CPU)."

#: argument name -> description, the same for every framework
ARGS: Dict[str, str] = {
    "average": (
        "deprecated: ``True`` means ``op=hvd.Average`` and ``False`` ``op=hvd.Sum``; "
        "give ``op`` or ``average``, not both."
    ),
    "op": REDUCE_OPS,
    "compression": (
        "``hvd.Compression.fp16`` sends floating-point tensors as float16 and "
        "restores their dtype in the result; ``None`` (the default) sends them as "
        "they are.  Any object with static ``compress``/``decompress`` works."
    ),
    "prescale_factor": "every rank's input is multiplied by this before the reduction.",
    "postscale_factor": "the reduced result is multiplied by this.",
    "process_set": (
        "the ranks that take part (default: all of them); each of its members "
        "must make the same call."
    ),
    "root_rank": (
        "the rank whose value everyone receives (a rank of the job, and a member "
        "of ``process_set``)."
    ),
    "splits": (
        "how many rows go to each rank, in rank order (a list or a 1-D tensor that "
        "sums to the first dimension); ``None`` splits the rows evenly."
    ),
    "device_dense": _IGNORED_DEVICE,
    "device_sparse": _IGNORED_DEVICE,
    "ignore_name_scope": IGNORED,
    "session": "Horovod's TensorFlow 1 argument, unused in TensorFlow 2.",
}

#: the headings that follow ``Args:`` in a Google-style docstring
_LATER_SECTIONS = re.compile(
    r"^(Returns|Yields|Raises|Examples?|Notes?|Warnings?|"
    r"See Also):\s*$",
    re.M,
)
_WIDTH = 88


def documented(
    table: Mapping[str, str], raises: Sequence[str] = (), **own: str
) -> Callable[[F], F]:
    """A decorator that writes the function's ``Args:`` section from ``table`` and ``own``,
    and adds the shared ``raises`` entries to its ``Raises:`` section.

    The arguments are listed in the signature's order (consecutive ones with the same
    description share one entry); ``own`` gives this function's wording for some of them.
    Each of ``raises`` is one entry (``"TypeError: when ..."``), written after the
    docstring's own entries.  The function object itself is returned, its ``__doc__``
    completed, so its signature, name and identity stay as they were.

    Raises:
        TypeError: (at import time) an argument has no description, ``own`` names one the
            function does not take, or the docstring is missing or writes ``Args:`` itself.
    """

    def decorate(fn: F) -> F:
        doc = with_args_section(fn, {**table, **own}, set(own))
        fn.__doc__ = with_raises(doc, raises)
        return fn

    return decorate


def with_raises(doc: str, raises: Sequence[str]) -> str:
    """``doc`` with ``raises`` appended to its ``Raises:`` section (made at the end when
    there is none)."""
    if not raises:
        return doc
    lines = "\n".join(_wrap(entry) for entry in raises)
    header = re.search(r"^Raises:\s*$", doc, re.M)
    if header is None:
        return f"{doc.rstrip()}\n\nRaises:\n{lines}\n"
    after = _LATER_SECTIONS.search(doc, header.end())
    end = len(doc) if after is None else after.start()
    rest = "\n" if after is None else f"\n\n{doc[end:]}"
    return f"{doc[:end].rstrip()}\n{lines}{rest}"


def _wrap(entry: str) -> str:
    """One section entry, indented and wrapped as the Args entries are."""
    return textwrap.fill(
        " ".join(entry.split()),
        _WIDTH,
        initial_indent="    ",
        subsequent_indent="        ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def with_args_section(fn: Callable, table: Mapping[str, str], must_use=frozenset()) -> str:
    """``fn``'s docstring (dedented) with an ``Args:`` section for its parameters, placed
    before its ``Returns:``/``Raises:`` (or at the end)."""
    where = getattr(fn, "__qualname__", repr(fn))
    doc = inspect.cleandoc(fn.__doc__ or "")
    if not doc:
        raise TypeError(f"{where}: no docstring to add the Args section to")
    if re.search(r"^Args:\s*$", doc, re.M):
        raise TypeError(
            f"{where}: the docstring writes its own Args section; leave it to "
            f"@documented (pass a description of its own as a keyword)"
        )
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params]
    unused = sorted(set(must_use) - set(names))
    if unused:
        raise TypeError(f"{where}: descriptions given for {unused}, which it does not take")
    missing = [n for n in names if n not in table]
    if missing:
        raise TypeError(
            f"{where}: no description for argument(s) {missing}; add them to the "
            f"table or pass them to @documented"
        )
    if not params:
        return doc
    section = "Args:\n" + "\n".join(_entries(params, table))
    later = _LATER_SECTIONS.search(doc)
    if later is None:
        return f"{doc}\n\n{section}\n"
    return f"{doc[: later.start()].rstrip()}\n\n{section}\n\n{doc[later.start() :]}"


def _entries(params, table: Mapping[str, str]):
    """One wrapped entry per run of consecutive parameters that share a description."""
    groups = []
    for p in params:
        label = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        text = " ".join(table[p.name].split())
        if groups and groups[-1][1] == text:
            groups[-1][0].append(label)
        else:
            groups.append(([label], text))
    for labels, text in groups:
        yield _wrap(f"{', '.join(labels)}: {text}")
