"""Helpers that make every rank start from the same state: variables and Python objects.

The object functions are :mod:`hvdlite.common.objects`' (signed with the job's key, refused
in a multi-rank job without one), with Horovod's TensorFlow signatures.
"""

import functools
from typing import Any, List, Optional

import tensorflow as tf

from hvdlite.common import api_docs, arrays, basics, objects, ops
from hvdlite.common.process_sets import global_process_set
from hvdlite.tensorflow import mpi_ops

__all__ = [
    "broadcast_variables",
    "broadcast_",
    "broadcast_object",
    "broadcast_object_fn",
    "allgather_object",
]

#: the helpers' argument descriptions: the shared ones, and ``name`` as the objects use it
_ARGS = {
    **api_docs.ARGS,
    "name": "the operation's name, the same on every rank (``None``: generated).",
}
_VARIABLES = "``tf.Variable`` objects, the same list in the same order on every rank."
_INPLACE = "accepted for Horovod compatibility and ignored (variables are always assigned)."
#: ``@_args(**own)``: the function's Args section, from :data:`_ARGS` and its ``own`` wording
_args = functools.partial(api_docs.documented, _ARGS)


@_args(variables=_VARIABLES, inplace=_INPLACE)
def broadcast_variables(variables, root_rank: int, process_set=global_process_set, inplace=None):
    """Assign ``root_rank``'s value to each of ``variables`` on every rank of the set.

    Eager: the broadcasts are issued together (fused by the runtime) and assigned when
    all arrived.  Inside ``tf.function`` each variable gets an assign op.

    Returns:
        None eagerly; inside ``tf.function`` the grouped assign op.

    Raises:
        TypeError: ``root_rank`` is not an int, or a variable's dtype is unsupported.
        ValueError: ``root_rank`` is not a rank of ``process_set``.
    """
    objects.check_root(root_rank, "broadcast_variables", process_set)
    variables = list(variables)
    if not tf.executing_eagerly():
        return tf.group(
            *[
                v.assign(
                    mpi_ops.broadcast(
                        v, root_rank, name=f"broadcast_variables.{i}", process_set=process_set
                    )
                )
                for i, v in enumerate(variables)
            ]
        )
    me = basics.rank()
    pending = []
    for i, v in enumerate(variables):
        value = mpi_ops.supported_tensor(
            v.read_value() if hasattr(v, "read_value") else v,
            f"broadcast_variables.{i}",
            "broadcast_variables",
        )
        [value], back = mpi_ops.carried([value], False)
        buf = mpi_ops.to_buffer(value)
        out = arrays.kind().clone(buf) if me == root_rank else mpi_ops.empty_buffer_like(buf)
        # ``value`` stays in ``pending``: the runtime reads its memory until the handle is done
        pending.append(
            (
                v,
                value,
                back,
                ops.broadcast_async(buf, out, root_rank, f"broadcast_variables.{i}", process_set),
            )
        )
    for v, _value, back, h in pending:
        v.assign(back([mpi_ops.from_buffer(ops.synchronize(h))])[0])
    return None


@_args(variables=_VARIABLES)
def broadcast_(
    variables, root_rank: int, name: Optional[str] = None, process_set=global_process_set
):
    """Horovod's in-place broadcast: assign ``root_rank``'s value to each of ``variables``.

    Returns:
        The variables eagerly; in a graph the list of their assign ops' values.

    Raises:
        TypeError: ``root_rank`` is not an int, or a variable's dtype is unsupported.
        ValueError: ``root_rank`` is not a rank of ``process_set``.
    """
    variables = list(variables)
    objects.check_root(root_rank, "broadcast_", process_set)
    if tf.executing_eagerly():
        broadcast_variables(variables, root_rank, process_set)
        return variables
    prefix = name or "broadcast_"
    return [
        v.assign(mpi_ops.broadcast(v, root_rank, name=f"{prefix}.{i}", process_set=process_set))
        for i, v in enumerate(variables)
    ]


# --- objects ------------------------------------------------------------------------------
@_args(obj="the object to send (only the root's matters).")
def broadcast_object(
    obj: Any = None,
    root_rank: int = 0,
    session=None,
    name: Optional[str] = None,
    process_set=global_process_set,
) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (cloudpickled and signed with the job's
    key, as :func:`hvdlite.torch.broadcast_object`).

    Returns:
        The root's object.

    Raises:
        TypeError: ``root_rank`` is not an int.
        ValueError: ``root_rank`` is not a rank of ``process_set``.
        HvdliteSerializationError: the root's object could not be pickled (on every
            rank).
        HvdliteAuthError: the payload failed verification, or the job has no key.
    """
    return objects.broadcast_object(obj, root_rank, name, process_set)


@_args()
def broadcast_object_fn(
    root_rank: int = 0, session=None, name: Optional[str] = None, process_set=global_process_set
):
    """A function ``fn(obj)`` that returns ``root_rank``'s ``obj`` on every rank, as
    Horovod's (which builds its graph once for repeated TF1 broadcasts): each call is a
    :func:`broadcast_object`.

    Returns:
        The function; every rank of the set must call it, as often as the others.
    """

    def broadcast(obj=None):
        return objects.broadcast_object(obj, root_rank, name, process_set)

    return broadcast


@_args(obj="this rank's object.")
def allgather_object(
    obj: Any, session=None, name: Optional[str] = None, process_set=global_process_set
) -> List[Any]:
    """Return every rank's ``obj``, in rank order (cloudpickled and signed with the job's key).

    Returns:
        A list with one object per rank of the set.

    Raises:
        HvdliteSerializationError: some rank's object could not be pickled (on every
            rank).
        HvdliteAuthError: a payload failed verification, or the job has no key.
    """
    return objects.allgather_object(obj, name, process_set)
