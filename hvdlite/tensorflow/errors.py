"""The TensorFlow exception types a Horovod user catches, for the runtime's errors.

Horovod's TensorFlow ops fail like any TensorFlow op, with a ``tf.errors.OpError``: ranks
that disagree on a tensor's shape, dtype, op or root raise ``FailedPreconditionError``, and
bad arguments (alltoall splits that do not fit, a root outside the set) raise
``InvalidArgumentError``.  The classes here are those TensorFlow errors *and* the runtime's
own types (``HvdliteMismatchError``, ``ValueError``), so code written for either keeps
working.  Inside a graph a ``py_function`` passes an ``OpError``'s code on, and turns a
``ValueError`` into ``InvalidArgumentError`` itself.
"""

import functools

import tensorflow as tf

from hvdlite.common.exceptions import HvdliteError, HvdliteMismatchError

__all__ = ["TensorMismatchError", "InvalidCollectiveArgument", "as_tf_errors"]


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
            if isinstance(exc, HvdliteError):      # configuration, not an argument
                raise
            raise InvalidCollectiveArgument(str(exc)) from exc
    return wrapper
