"""Helpers that make every rank start from the same state: variables and Python objects.

The object functions are :mod:`hvdlite.common.objects`' (signed with the job's key, refused
in a multi-rank job without one), with Horovod's TensorFlow signatures.
"""

from typing import Any, List, Optional

import tensorflow as tf

from hvdlite.common import arrays, basics, objects, ops
from hvdlite.common.process_sets import global_process_set
from hvdlite.tensorflow import mpi_ops

__all__ = ["broadcast_variables", "broadcast_object", "allgather_object"]


def broadcast_variables(variables, root_rank: int, process_set=global_process_set,
                        inplace=None):
    """Assign ``root_rank``'s value to each of ``variables`` on every rank of the set.

    Eager: the broadcasts are issued together (fused by the runtime) and assigned when all
    arrived; returns None.  Inside ``tf.function``: returns the grouped assign op.
    ``variables`` must be the same list, in the same order, on every rank.
    """
    objects.check_root(root_rank, "broadcast_variables", process_set)
    variables = list(variables)
    if not tf.executing_eagerly():
        return tf.group(*[v.assign(mpi_ops.broadcast(v, root_rank,
                                                     name=f"broadcast_variables.{i}",
                                                     process_set=process_set))
                          for i, v in enumerate(variables)])
    me = basics.rank()
    pending = []
    for i, v in enumerate(variables):
        value = mpi_ops._check(v.read_value() if hasattr(v, "read_value") else v,
                               f"broadcast_variables.{i}", "broadcast_variables")
        buf = mpi_ops.to_buffer(value)
        out = arrays.kind().clone(buf) if me == root_rank else mpi_ops._empty_like(buf)
        # ``value`` stays in ``pending``: the runtime reads its memory until the handle is done
        pending.append((v, value, ops.broadcast_async(
            buf, out, root_rank, f"broadcast_variables.{i}", process_set)))
    for v, _value, h in pending:
        v.assign(mpi_ops.from_buffer(ops.synchronize(h)))
    return None


# --- objects ------------------------------------------------------------------------------
def broadcast_object(obj: Any = None, root_rank: int = 0, session=None,
                     name: Optional[str] = None, process_set=global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (cloudpickled, signed with the job key;
    :func:`hvdlite.common.objects.broadcast_object`).  ``session`` is Horovod's TF1
    argument, unused in eager TensorFlow 2."""
    return objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, session=None, name: Optional[str] = None,
                     process_set=global_process_set) -> List[Any]:
    """Return the list of every set rank's ``obj``, in rank order (cloudpickled, signed;
    :func:`hvdlite.common.objects.allgather_object`)."""
    return objects.allgather_object(obj, name, process_set)
