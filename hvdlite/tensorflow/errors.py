"""The TensorFlow exception types a Horovod user catches, for the runtime's errors.

Horovod's TensorFlow ops fail like any TensorFlow op, with a ``tf.errors.OpError``: ranks
that disagree on a tensor's shape, dtype, op or root raise ``FailedPreconditionError``, and
bad arguments (alltoall splits that do not fit, a root outside the set) raise
``InvalidArgumentError``.  The classes here are those TensorFlow errors *and* the runtime's
own types (``HvdliteMismatchError``, ``ValueError``), so code written for either keeps
working.

Inside a graph (``tf.function`` or a TF1 session) a collective is a ``py_function``, and a
``py_function`` keeps no error code but those of a few built-in exceptions (``ValueError``
becomes ``InvalidArgumentError``, anything else ``UnknownError``).  So in a graph a mismatch
is not raised from the ``py_function``: it returns the message as an extra output
(:func:`report_mismatch`, as a path that cannot be written), and a real TensorFlow op raises
``FailedPreconditionError`` with it (:func:`raise_reported`).
"""

import functools

import tensorflow as tf

from hvdlite.common.exceptions import HvdliteError, HvdliteMismatchError

__all__ = [
    "TensorMismatchError",
    "InvalidCollectiveArgument",
    "as_tf_errors",
    "report_mismatch",
    "raise_reported",
]


class TensorMismatchError(tf.errors.FailedPreconditionError, HvdliteMismatchError):
    """Ranks submitted the same collective with incompatible shapes, dtypes, ops or roots."""

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class InvalidCollectiveArgument(tf.errors.InvalidArgumentError, ValueError):
    """An argument of a collective that cannot work (splits, root rank, name...)."""

    def __init__(self, message: str):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def as_tf_errors(fn):
    """Run ``fn`` raising the runtime's mismatch and argument errors as the TensorFlow
    errors above (the original is the ``__cause__``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except tf.errors.OpError:
            raise
        except HvdliteMismatchError as exc:
            raise TensorMismatchError(str(exc)) from exc
        except ValueError as exc:
            if isinstance(exc, HvdliteError):  # configuration, not an argument
                raise
            raise InvalidCollectiveArgument(str(exc)) from exc

    return wrapper


#: a path under a file that is not a directory: writing there fails with ``ENOTDIR``, which
#: TensorFlow's file system reports as ``FailedPreconditionError`` with the path in the message
_NOT_A_DIRECTORY = "/dev/null/"
#: where the check writes when there is nothing to report: a write that always succeeds
_NOWHERE = "/dev/null"


def _report_path(message: str) -> str:
    """Where :func:`raise_reported` writes: nowhere for no message, else a path that fails
    and shows ``message`` (with ``/`` shown as ``|``)."""
    return _NOWHERE if not message else _NOT_A_DIRECTORY + message.replace("/", "|")


def report_mismatch(fn, touts):
    """``fn`` for a graph's ``py_function``, with one more output: the path
    :func:`raise_reported` writes to, which fails with the message of the
    ``FailedPreconditionError`` ``fn`` raised (its other outputs are then empty).  The path is
    made here, in Python, so that the check adds one node to the graph, not a string op
    each (every node of a TF1 graph slows each later ``session.run`` of a new fetch)."""

    def reporting(*xs):
        try:
            return list(fn(*xs)) + [tf.constant(_NOWHERE)]
        except tf.errors.FailedPreconditionError as exc:
            return [tf.zeros([0], d) for d in touts] + [tf.constant(_report_path(exc.message))]

    return reporting


def raise_reported(outs, path):
    """``outs`` when ``path`` (a :func:`report_mismatch` output) is nowhere; else fail with
    ``FailedPreconditionError`` carrying the message.  TensorFlow has no op that raises that
    code with a message taken from a tensor; a write under ``/dev/null`` does, the message
    being the file name.  The write always runs, to ``/dev/null`` itself when there is
    nothing to report: no ``tf.cond``, whose two branch functions would make the first run of
    every new fetch of a TF1 graph slower (tens of ms a collective, in that graph's function
    library).  It writes the path itself, so no constant is added for the contents."""
    with tf.control_dependencies([tf.raw_ops.WriteFile(filename=path, contents=path)]):
        if len(outs) > 1:  # one node for a grouped op's outputs: each node of a TF1
            return list(tf.raw_ops.IdentityN(input=list(outs)))  # graph slows new fetches
        return [tf.identity(o) for o in outs]
