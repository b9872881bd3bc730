"""Horovod's ``rank_op``, ``size_op``, ``local_rank_op``, ``local_size_op`` and
``process_set_included_op``: the job's layout as int32 tensors.

A traced ``tf.function`` or a TF1 graph reads them each time it runs, not when it is built,
so the value follows an elastic job's resizes (what Horovod's ops are for); eagerly they are
constants.
"""

import functools

import tensorflow as tf

from hvdlite.common import api_docs, basics, ops
from hvdlite.common import process_sets as _sets

__all__ = ["rank_op", "size_op", "local_rank_op", "local_size_op", "process_set_included_op"]

_ARGS = {
    "process_set_id": (
        "the id of a registered process set (``ProcessSet.process_set_id``); "
        "0, the default, is every rank."
    ),
    "name": "the TensorFlow op's name (``None``: TensorFlow's default).",
}
_args = functools.partial(api_docs.documented, _ARGS)


def _process_set(process_set_id: int):
    """The registered set with this id.

    Raises:
        ValueError: no registered set has this id.
    """
    if process_set_id == 0:
        return _sets.global_process_set
    for ps in _sets.registered():
        if ps.process_set_id == process_set_id:
            return ps
    raise ValueError(
        f"process_set_id={process_set_id}: no registered process set has this "
        f"id (registered: 0 and "
        f"{sorted(p.process_set_id or 0 for p in _sets.registered())})"
    )


def _read(value_fn, name):
    """``value_fn()`` as an int32 scalar: a constant eagerly, read when run in a graph."""
    if tf.executing_eagerly():
        return tf.constant(value_fn(), tf.int32, name=name)
    out = tf.py_function(lambda: tf.constant(value_fn(), tf.int32), [], tf.int32, name=name)
    out.set_shape([])
    return out


@_args()
def rank_op(name=None):
    """This process's rank in the job, as a tensor.

    Returns:
        An int32 scalar tensor.
    """
    return _read(basics.rank, name)


@_args()
def local_rank_op(name=None):
    """This process's rank on its host, as a tensor.

    Returns:
        An int32 scalar tensor.
    """
    return _read(basics.local_rank, name)


@_args()
def local_size_op(name=None):
    """How many processes run on this host, as a tensor.

    Returns:
        An int32 scalar tensor.
    """
    return _read(basics.local_size, name)


@_args()
def size_op(process_set_id=0, name=None):
    """How many ranks the job (or the process set) has, as a tensor.

    Returns:
        An int32 scalar tensor.

    Raises:
        ValueError: ``process_set_id`` names no registered set (eagerly; in a graph when
            it runs, as ``tf.errors.InvalidArgumentError``).
    """

    def value():
        ps = _process_set(process_set_id)
        return ops.process_set_size(ps) if ps.included() else ps.size()

    return _read(value, name)


@_args()
def process_set_included_op(process_set_id=0, name=None):
    """Whether this process belongs to the process set, as a tensor.

    Returns:
        An int32 scalar tensor: 1 for a member, 0 otherwise.

    Raises:
        ValueError: ``process_set_id`` names no registered set.
    """
    return _read(lambda: int(bool(_process_set(process_set_id).included())), name)
