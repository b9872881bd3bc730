"""The collectives of ``horovod.tensorflow.keras``: Horovod's Keras signatures, which take
any tensor-compatible value and the name second, over the TensorFlow functions."""

import functools

import tensorflow as tf

from hvdlite.common import api_docs
from hvdlite.common.ops import Average
from hvdlite.tensorflow import mpi_ops

__all__ = ["allreduce", "allgather", "broadcast", "reducescatter"]

_ARGS = {
    **api_docs.ARGS,
    "value": "a tensor, or a value convertible to one (a number, a list, a numpy array).",
    "name": api_docs.NAME + "  ``None`` generates one.",
}
_args = functools.partial(api_docs.documented, _ARGS)


@_args()
def allreduce(
    value,
    name=None,
    average=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    op=None,
    compression=None,
):
    """Reduce ``value`` over the ranks (by default: average it), as
    :func:`hvdlite.tensorflow.allreduce`.

    Returns:
        A tensor of ``value``'s shape and dtype.

    Raises:
        ValueError: ``op`` is unknown or given with ``average``.
    """
    return mpi_ops.allreduce(
        tf.convert_to_tensor(value),
        average=average,
        compression=compression,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        name=name,
    )


@_args()
def allgather(value, name=None):
    """Concatenate every rank's ``value`` along the first dimension, in rank order.

    Returns:
        The gathered tensor.
    """
    return mpi_ops.allgather(tf.convert_to_tensor(value), name=name)


@_args()
def broadcast(value, root_rank, name=None):
    """The root's ``value`` on every rank.

    Returns:
        A tensor holding ``root_rank``'s value.
    """
    return mpi_ops.broadcast(tf.convert_to_tensor(value), root_rank, name=name)


@_args(op=api_docs.AVERAGE_OR_SUM)
def reducescatter(value, name=None, op=Average):
    """This rank's slice (along the first dimension) of the reduction of ``value``.

    Returns:
        This rank's rows of the reduction.
    """
    return mpi_ops.reducescatter(tf.convert_to_tensor(value), op=op, name=name)
