"""The horovod.torch collective API: torch's adapter over :mod:`hvdlite.common.ops`.

Every function has the name and semantics of its ``horovod.torch``
counterpart.  This module only does what is torch's own: it checks that a
tensor is a dense CPU ``torch.Tensor``, makes it contiguous (copying back for
in-place ops), allocates outputs, applies compression, and wraps the ops in
autograd functions.  Names, requests, validation, handles and waiting are the
op layer's.
"""

import functools
from typing import Optional

import torch

from hvdlite.common import api_docs, ops
from hvdlite.torch import grouped_packing
from hvdlite.common.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from hvdlite.common.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ProcessSet,  # noqa: F401
    Sum,
    global_process_set,
    poll,
    synchronize,
)
from hvdlite.common.rank_setup import add_process_set, init, remove_process_set  # noqa: F401
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.engine.tensor_queue import Handle

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "gloo_enabled",
    "mpi_enabled",
    "gloo_built",
    "mpi_built",
    "mpi_threads_supported",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
    "poll",
    "join",
    "barrier",
    "global_process_set",
    "ProcessSet",
    "add_process_set",
    "remove_process_set",
]

#: the ops' argument descriptions: the shared ones and torch's wording
_ARGS = {
    **api_docs.ARGS,
    "tensor": "a dense CPU ``torch.Tensor`` (a non-contiguous one is copied first).",
    "tensors": (
        "a list of dense CPU ``torch.Tensor`` objects, which may differ in shape and dtype."
    ),
    "name": api_docs.NAME
    + (
        "  ``None`` generates one, which requires every rank to issue "
        "its unnamed operations in the same order."
    ),
}
_ONE_DIM = "a dense CPU ``torch.Tensor`` with at least one dimension."
_ROWS = (
    "a dense CPU ``torch.Tensor`` with at least one dimension; ranks may differ in the "
    "first dimension only."
)
_SPARSE = "a sparse COO ``torch.Tensor`` on the CPU."
_SPARSE_NAME = (
    "the operation's name, the same on every rank (its two allgathers are named "
    "``<name>.indices`` and ``<name>.values``)."
)
#: ``@_args(**own)``: the function's Args section, from :data:`_ARGS` and its ``own`` wording
_args = functools.partial(api_docs.documented, _ARGS)

# Raises entries most ops share (``@_args(raises=...)`` appends them to a docstring)
_RAISES_DTYPE = "TypeError: an input is not a ``torch.Tensor`` or has an unsupported dtype."
_RAISES_MISMATCH = (
    "HvdliteMismatchError: ranks submitted ``name`` with different shapes, dtypes or operations."
)
_RAISES_STOPPED = "HvdliteInternalError: the runtime stopped (a peer died or shut down) first."
#: an op that starts a collective / one that also waits for its result
_RAISES_START = (_RAISES_DTYPE,)
_RAISES_WAIT = (_RAISES_DTYPE, _RAISES_MISMATCH, _RAISES_STOPPED)


def _checked(tensor, name: Optional[str], what: str):
    """``tensor`` if it can be a buffer (dense, CPU); the op layer checks its dtype."""
    label = f"tensor {name!r}" if name is not None else "an unnamed tensor"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} of {label}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{what} of {label}: tensor is on {tensor.device}, but hvdlite runs "
            f"on CPU tensors only (no CUDA or NCCL path yet); move it with .cpu() "
            f"(for DistributedOptimizer's gradients: the model, model.cpu())"
        )
    if tensor.is_sparse:
        raise ValueError(
            f"{what} of {label}: sparse tensors are not supported; densify it with .to_dense()"
        )
    return tensor


def _dense(t):
    """``t`` with the standard strides the runtime views as bytes (``contiguous()`` keeps a
    broadcast stride 0 on size-1 dimensions, e.g. the gradient of ``y.sum()``)."""
    t = t.contiguous()
    if t.dim() and t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _buffers(tensors, name, what: str):
    return [_dense(_checked(t, name, what)) for t in tensors]


def _contiguous_inplace(tensors, name, what: str):
    """Contiguous stand-ins for in-place ops on non-contiguous tensors, copied back at the end."""
    work, back = [], []
    for t in tensors:
        _checked(t, name, what)
        if t.is_contiguous():
            work.append(t)
        else:
            c = t.contiguous()
            work.append(c)
            back.append((t, c))
    return work, back


def _copy_back_finish(back, single: bool):
    def finish(results):
        for dst, src in back:
            dst.copy_(src)
        mapping = {id(src): dst for dst, src in back}
        targets = [mapping.get(id(r), r) for r in results]
        return targets[0] if single else targets

    return finish


#: dtypes torch has but the runtime does not carry, and what they travel as: a wider dtype
#: for arithmetic (reductions), a same-size one for moves (gather, broadcast, alltoall);
#: torch's uint16 has almost no arithmetic, so it is reduced as int32 (wrapping on the way
#: back, as uint16 arithmetic would) and moved as its int16 bits
_CARRIED = {torch.uint16: (torch.int32, torch.int16)} if hasattr(torch, "uint16") else {}


def _carry(tensors, arithmetic: bool, inplace: bool = False):
    """``tensors`` in dtypes the runtime carries, and a ``finish`` step turning the op's
    results back into the original dtypes (for in-place ops: into the original tensors),
    or ``None`` when nothing needed carrying."""
    dtypes = [t.dtype for t in tensors]
    if not any(d in _CARRIED for d in dtypes):
        return tensors, None
    work = [
        t if d not in _CARRIED else t.to(_CARRIED[d][0]) if arithmetic else t.view(_CARRIED[d][1])
        for t, d in zip(tensors, dtypes)
    ]

    def back(results):
        outs = []
        for r, t, d in zip(results, tensors, dtypes):
            if d in _CARRIED:
                r = r.to(d) if arithmetic else r.view(d)
                if inplace:
                    r = t.copy_(r)
            outs.append(r)
        return outs

    return work, back


def _then(back, finish, grouped: bool):
    """``finish`` for an op's handle that first applies ``back`` (from :func:`_carry`) to the
    results, then ``finish`` (``None``: the single result, or the list when grouped)."""
    if back is None:
        return finish
    if finish is not None:
        return lambda results: finish(back(results))
    return (lambda results: back(results)) if grouped else (lambda results: back(results)[0])


def _compressed(compression, tensors, run):
    """``run`` (a list of tensors to a list of results) on the compressed ``tensors``, each
    result decompressed with its own tensor's context; ``run(tensors)`` without a compressor.

    The one place where compression wraps a collective, so the sync ops cannot differ in it.
    """
    if compression is None:
        return run(tensors)
    pairs = [compression.compress(t) for t in tensors]
    outs = run([t for t, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# -- allreduce -------------------------------------------------------------------------------
def _allreduce_one(
    t, inplace: bool, average, name, op, prescale_factor, postscale_factor, process_set
) -> Handle:
    """One tensor: the case an optimizer issues thousands of times per step."""
    if (
        type(t) is torch.Tensor
        and process_set is global_process_set
        and t.is_cpu
        and not t.is_sparse
        and t.is_contiguous()
        and t.dtype not in _CARRIED
    ):
        rop = ops.PLAIN_OPS.get(op) if average is None else None
        if rop is None:
            rop = ops.reduce_op(average, op, name or "allreduce")
        return ops.allreduce_one(
            t, t if inplace else torch.empty_like(t), name, rop, prescale_factor, postscale_factor
        )
    return _allreduce_async(
        [t], inplace, False, average, name, op, prescale_factor, postscale_factor, process_set
    )


def _grouped_packed(
    tensors, inplace: bool, name, rop, prescale_factor, postscale_factor, process_set
) -> Optional[Handle]:
    """A grouped allreduce of plain CPU tensors of one carried dtype as one submission: the
    tensors are packed here (one C++ call), reduced as one flat buffer, and unpacked when
    the handle is synchronized (:mod:`hvdlite.torch.grouped_packing`).  None when the group
    does not qualify (the per-tensor path then checks and names each tensor)."""
    dtype = tensors[0].dtype
    if dtype in _CARRIED:
        return None
    for t in tensors:
        if type(t) not in _PLAIN or t.dtype is not dtype or not t.is_cpu or t.is_sparse:
            return None
    with torch.no_grad():  # as the per-tensor path: results carry no graph
        flat, digest, packing, one_d = grouped_packing.pack(tensors, dtype, name, inplace)
    return ops.allreduce_packed(
        flat,
        len(tensors),
        digest,
        name,
        rop,
        prescale_factor,
        postscale_factor,
        process_set,
        grouped_packing.finisher(tensors, inplace, packing, one_d),
    )


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _allreduce_async(
    tensors,
    inplace: bool,
    grouped: bool,
    average,
    name,
    op,
    prescale_factor,
    postscale_factor,
    process_set,
) -> Handle:
    rop = ops.reduce_op(average, op, name or "allreduce")
    if grouped and len(tensors) > 1 and rop != Adasum:
        handle = _grouped_packed(
            tensors, inplace, name, rop, prescale_factor, postscale_factor, process_set
        )
        if handle is not None:
            return handle
    finish = None
    if inplace:
        work, back = _contiguous_inplace(tensors, name, "allreduce")
        if back or grouped:
            finish = _copy_back_finish(back, single=not grouped)
        work, carried = _carry(work, arithmetic=True, inplace=True)
        outputs = work
    else:
        work, carried = _carry(_buffers(tensors, name, "allreduce"), arithmetic=True)
        outputs = [torch.empty_like(t) for t in work]
        if grouped:
            finish = list
    return ops.allreduce_async(
        work,
        outputs,
        name,
        grouped,
        rop,
        prescale_factor,
        postscale_factor,
        process_set,
        _then(carried, finish, grouped),
    )


@_args(raises=_RAISES_START)
def allreduce_async(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
) -> Handle:
    """Start reducing ``tensor`` over the ranks (by default: averaging it) without waiting.

    Returns:
        A handle for :func:`synchronize` (or :func:`poll`);
        its result is a new tensor of ``tensor``'s shape and dtype.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``op`` is unknown or given
            with ``average``, or ``name`` is too long.
    """
    return _allreduce_one(
        tensor, False, average, name, op, prescale_factor, postscale_factor, process_set
    )


@_args(raises=_RAISES_START)
def allreduce_async_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
) -> Handle:
    """In-place :func:`allreduce_async`: the result is written into ``tensor``.

    Returns:
        A handle for :func:`synchronize` (or :func:`poll`);
        its result is ``tensor`` itself, holding the reduction.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``op`` is unknown or given
            with ``average``, or ``name`` is too long.
    """
    # what an optimizer without buckets calls for every gradient: the plain case goes
    # straight to the runtime (the checks of _allreduce_one, inline)
    t = tensor
    if (
        type(t) is torch.Tensor
        and process_set is global_process_set
        and average is None
        and t.is_cpu
        and not t.is_sparse
        and t.is_contiguous()
        and t.dtype not in _CARRIED
    ):
        rop = ops.PLAIN_OPS.get(op)
        if rop is not None:
            return ops.allreduce_one(t, t, name, rop, prescale_factor, postscale_factor)
    return _allreduce_one(
        tensor, True, average, name, op, prescale_factor, postscale_factor, process_set
    )


@_args(raises=_RAISES_WAIT)
def allreduce(
    tensor,
    average=None,
    name=None,
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """Reduce ``tensor`` over the ranks (by default: average it) into a new tensor.

    Differentiable for ``hvd.Average`` and ``hvd.Sum``: the gradient is the same
    reduction of the output's gradient.

    Returns:
        A new tensor of ``tensor``'s shape and dtype, the same on every rank.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``op`` is unknown or given
            with ``average``, or ``name`` is too long.
    """

    def run(ts):
        [t] = ts
        if _tracks_grad(t):
            return [
                _AllreduceGrad.apply(
                    t, average, name, op, prescale_factor, postscale_factor, process_set
                )
            ]
        return [
            synchronize(
                allreduce_async(
                    t, average, name, op, prescale_factor, postscale_factor, process_set
                )
            )
        ]

    [out] = _compressed(compression, [tensor], run)
    return out


@_args(raises=_RAISES_WAIT)
def allreduce_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """In-place :func:`allreduce`: ``tensor`` is overwritten with the reduction.

    Returns:
        ``tensor``.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``op`` is unknown or given
            with ``average``, or ``name`` is too long.
    """
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


@_args(raises=_RAISES_START)
def grouped_allreduce_async(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
) -> Handle:
    """Start reducing several tensors as one operation, fused into one transfer.

    Returns:
        A handle for :func:`synchronize` (or :func:`poll`);
        its result is a list of new tensors, in the order of ``tensors``.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``op`` is unknown or given
            with ``average``, or ``name`` is too long.
    """
    return _allreduce_async(
        list(tensors),
        False,
        True,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
    )


@_args(raises=_RAISES_START)
def grouped_allreduce_async_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
) -> Handle:
    """In-place :func:`grouped_allreduce_async`: each result is written into its input.

    Returns:
        A handle for :func:`synchronize` (or :func:`poll`);
        its result is the list of the input tensors, holding the reductions.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``op`` is unknown or given
            with ``average``, or ``name`` is too long.
    """
    return _allreduce_async(
        list(tensors), True, True, average, name, op, prescale_factor, postscale_factor, process_set
    )


@_args(raises=_RAISES_WAIT)
def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """Reduce several tensors as one operation (fused into one transfer); new tensors.

    All ranks must pass the same number of tensors with the same shapes.  Differentiable
    for ``hvd.Average`` and ``hvd.Sum``.

    Returns:
        A list of new tensors, in the order of ``tensors``.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``op`` is unknown or given
            with ``average``, or ``name`` is too long.
    """

    def run(ts):
        if any(_tracks_grad(t) for t in ts):
            return list(
                _GroupedAllreduceGrad.apply(
                    average, name, op, prescale_factor, postscale_factor, process_set, *ts
                )
            )
        return synchronize(
            grouped_allreduce_async(
                ts, average, name, op, prescale_factor, postscale_factor, process_set
            )
        )

    return _compressed(compression, list(tensors), run)


@_args(raises=_RAISES_WAIT)
def grouped_allreduce_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """In-place :func:`grouped_allreduce`: each tensor is overwritten with its reduction.

    Returns:
        The list of the input tensors.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``op`` is unknown or given
            with ``average``, or ``name`` is too long.
    """
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


# -- allgather -------------------------------------------------------------------------------
def _allgather_async(tensors, grouped: bool, name, process_set) -> Handle:
    work, carried = _carry(_buffers(tensors, name, "allgather"), arithmetic=False)
    return ops.allgather_async(
        work, name, grouped, process_set, _then(carried, list if grouped else None, grouped)
    )


@_args(tensor=_ROWS, raises=_RAISES_START)
def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along the first dimension.

    Returns:
        A handle for :func:`synchronize` (or :func:`poll`);
        its result is a new tensor whose rows are rank 0's, then rank 1's, and so on.

    Raises:
        ValueError: an input is not a dense CPU tensor or is a scalar, or ``name`` is too
            long.
    """
    return _allgather_async([tensor], False, name, process_set)


@_args(tensor=_ROWS, raises=_RAISES_WAIT)
def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    Differentiable: this rank's gradient is its own rows of the averaged output
    gradient.

    Returns:
        A new tensor whose rows are rank 0's, then rank 1's, and so on.

    Raises:
        ValueError: an input is not a dense CPU tensor or is a scalar, or ``name`` is too
            long.
    """
    if _tracks_grad(tensor):
        return _AllgatherGrad.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


@_args(raises=_RAISES_START)
def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    """Start :func:`allgather_async` of several tensors as one operation.

    Returns:
        A handle for :func:`synchronize` (or :func:`poll`);
        its result is a list of the gathered tensors, in the order of ``tensors``.

    Raises:
        ValueError: an input is not a dense CPU tensor or is a scalar, or ``name`` is too
            long.
    """
    return _allgather_async(list(tensors), True, name, process_set)


@_args(raises=_RAISES_WAIT)
def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather several tensors as one operation (differentiable, as :func:`allgather`).

    Returns:
        A list of the gathered tensors, in the order of ``tensors``.

    Raises:
        ValueError: an input is not a dense CPU tensor or is a scalar, or ``name`` is too
            long.
    """
    if any(_tracks_grad(t) for t in tensors):
        return list(_GroupedAllgatherGrad.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# -- broadcast -------------------------------------------------------------------------------
def _broadcast_async(tensor, root_rank, name, inplace: bool, process_set) -> Handle:
    if inplace:
        [work], back = _contiguous_inplace([tensor], name, "broadcast")
        finish = _copy_back_finish(back, True) if back else None
        [work], carried = _carry([work], arithmetic=False, inplace=True)
        out = work
    else:
        [work], carried = _carry(_buffers([tensor], name, "broadcast"), arithmetic=False)
        out = work.clone() if rank() == root_rank else torch.empty_like(work)
        finish = None
    return ops.broadcast_async(
        work, out, root_rank, name, process_set, _then(carried, finish, False)
    )


@_args(raises=_RAISES_START)
def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start copying the root's ``tensor`` to every rank, into a new tensor.

    Returns:
        A handle for :func:`synchronize` (or :func:`poll`);
        its result is a new tensor holding the root's value.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``root_rank`` is not a member of
            ``process_set``, or ``name`` is too long.
    """
    return _broadcast_async(tensor, root_rank, name, False, process_set)


@_args(raises=_RAISES_START)
def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """In-place :func:`broadcast_async`: the root's value is written into ``tensor``.

    Returns:
        A handle for :func:`synchronize` (or :func:`poll`);
        its result is ``tensor``.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``root_rank`` is not a member of
            ``process_set``, or ``name`` is too long.
    """
    return _broadcast_async(tensor, root_rank, name, True, process_set)


@_args(raises=_RAISES_WAIT)
def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """The root's ``tensor`` on every rank, in a new tensor.

    Differentiable: the output gradients are averaged over the ranks and flow to
    the root's input only (the others get zeros).

    Returns:
        A new tensor holding ``root_rank``'s value.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``root_rank`` is not a member of
            ``process_set``, or ``name`` is too long.
    """
    if _tracks_grad(tensor):
        return _BroadcastGrad.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


@_args(raises=_RAISES_WAIT)
def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place :func:`broadcast`: ``tensor`` is overwritten with the root's value.

    Returns:
        ``tensor``.

    Raises:
        ValueError: an input is not a dense CPU tensor, ``root_rank`` is not a member of
            ``process_set``, or ``name`` is too long.
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall / reducescatter ----------------------------------------------------------------
@_args(tensor=_ONE_DIM, raises=_RAISES_START)
def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    """Start sending a slice of ``tensor``'s rows to every rank.

    Returns:
        A handle for :func:`synchronize` (or :func:`poll`);
        its result is ``(output, received_splits)``: the rows received, in rank order, and
        how many came from each rank.

    Raises:
        ValueError: an input is not a dense CPU tensor or is a scalar, ``splits`` does not fit
            the first dimension (``None``: the set's size must divide it), or ``name``
            is too long.
    """
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    [work], carried = _carry(_buffers([tensor], name, "alltoall"), arithmetic=False)
    finish = (
        None if carried is None else (lambda results: (carried([results[0][0]])[0], results[0][1]))
    )
    return ops.alltoall_async(work, splits, name, process_set, finish)


@_args(tensor=_ONE_DIM, raises=_RAISES_WAIT)
def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[r]`` rows of ``tensor`` to rank ``r``; receive every rank's rows for
    this one.

    Differentiable: the gradient of each received row is sent back to its sender.

    Returns:
        The received rows in rank order; with ``splits`` given, the pair ``(rows,
        received_splits)`` (as Horovod).

    Raises:
        ValueError: an input is not a dense CPU tensor or is a scalar, ``splits`` does not fit
            the first dimension (``None``: the set's size must divide it), or ``name``
            is too long.
    """
    if _tracks_grad(tensor):
        out, received = _AlltoallGrad.apply(tensor, splits, name, process_set)
    else:
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, received)


def _reducescatter_async(
    tensors, grouped, name, op, process_set, prescale_factor, postscale_factor
) -> Handle:
    rop = ops.reduce_op(None, op, name or "reducescatter")
    if rop == Adasum:
        # Horovod's runtime refuses it and its torch adapter raises HorovodInternalError
        raise HvdliteInternalError(
            f"reducescatter of {'an unnamed tensor' if name is None else repr(name)}: "
            "Reducescatter currently only supports SUM (op=hvd.Adasum is not supported; use "
            "hvd.Sum or hvd.Average)"
        )
    work, carried = _carry(_buffers(tensors, name, "reducescatter"), arithmetic=True)
    return ops.reducescatter_async(
        work,
        rop,
        name,
        grouped,
        prescale_factor,
        postscale_factor,
        process_set,
        _then(carried, list if grouped else None, grouped),
    )


@_args(tensor=_ONE_DIM, op=api_docs.AVERAGE_OR_SUM, raises=_RAISES_START)
def reducescatter_async(
    tensor,
    name=None,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
) -> Handle:
    """Start reducing ``tensor`` over the ranks, each keeping one slice of the result.

    Returns:
        A handle for :func:`synchronize` (or :func:`poll`);
        its result is this rank's slice of the first dimension (the first ranks get one
        extra row when the size does not divide it).

    Raises:
        ValueError: an input is not a dense CPU tensor or is a scalar, ``op`` is neither
            Average nor Sum, or ``name`` is too long.
        HvdliteInternalError: ``op`` is ``hvd.Adasum`` (as Horovod's ``HorovodInternalError``).
    """
    return _reducescatter_async(
        [tensor], False, name, op, process_set, prescale_factor, postscale_factor
    )


@_args(tensor=_ONE_DIM, op=api_docs.AVERAGE_OR_SUM, raises=_RAISES_WAIT)
def reducescatter(
    tensor,
    name=None,
    compression=None,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """This rank's slice (along the first dimension) of the reduction of ``tensor``.

    Differentiable: the gradient is the allgather of the output gradients (times the
    set's size for ``hvd.Sum``, and times the scale factors).

    Returns:
        A new tensor: rows ``[start, end)`` of the reduction for this rank; the rows are
        split as evenly as possible, the first ranks getting one extra.

    Raises:
        ValueError: an input is not a dense CPU tensor or is a scalar, ``op`` is neither
            Average nor Sum, or ``name`` is too long.
        HvdliteInternalError: ``op`` is ``hvd.Adasum`` (as Horovod's ``HorovodInternalError``).
    """

    def run(ts):
        [t] = ts
        if _tracks_grad(t):
            return list(
                _ReducescatterGrad.apply(
                    name, op, process_set, prescale_factor, postscale_factor, t
                )
            )
        return [
            synchronize(
                reducescatter_async(t, name, op, process_set, prescale_factor, postscale_factor)
            )
        ]

    [out] = _compressed(compression, [tensor], run)
    return out


@_args(op=api_docs.AVERAGE_OR_SUM, raises=_RAISES_START)
def grouped_reducescatter_async(
    tensors,
    name=None,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
) -> Handle:
    """Start :func:`reducescatter_async` of several tensors as one operation.

    Returns:
        A handle for :func:`synchronize` (or :func:`poll`);
        its result is a list of this rank's slices, in the order of ``tensors``.

    Raises:
        ValueError: an input is not a dense CPU tensor or is a scalar, ``op`` is neither
            Average nor Sum, or ``name`` is too long.
        HvdliteInternalError: ``op`` is ``hvd.Adasum`` (as Horovod's ``HorovodInternalError``).
    """
    return _reducescatter_async(
        list(tensors), True, name, op, process_set, prescale_factor, postscale_factor
    )


@_args(op=api_docs.AVERAGE_OR_SUM, raises=_RAISES_WAIT)
def grouped_reducescatter(
    tensors,
    name=None,
    compression=None,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """:func:`reducescatter` of several tensors as one operation (differentiable).

    Returns:
        A list of this rank's slices, in the order of ``tensors``.

    Raises:
        ValueError: an input is not a dense CPU tensor or is a scalar, ``op`` is neither
            Average nor Sum, or ``name`` is too long.
        HvdliteInternalError: ``op`` is ``hvd.Adasum`` (as Horovod's ``HorovodInternalError``).
    """

    def run(ts):
        if any(_tracks_grad(t) for t in ts):
            return list(
                _ReducescatterGrad.apply(
                    name, op, process_set, prescale_factor, postscale_factor, *ts
                )
            )
        return synchronize(
            grouped_reducescatter_async(
                ts, name, op, process_set, prescale_factor, postscale_factor
            )
        )

    return _compressed(compression, list(tensors), run)


@_args(tensor=_SPARSE, name=_SPARSE_NAME, op="``hvd.Average`` or ``hvd.Sum``.")
def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing a sparse COO tensor by allgathering its indices and values.

    Duplicate indices from different ranks are summed when the result is coalesced, so
    the reduction is a sum (divided by the set's size for ``hvd.Average``), as in Horovod.

    Returns:
        A handle for :func:`synchronize`, whose result is the reduced sparse tensor.
    """
    t = tensor.coalesce()
    hi = allgather_async(
        t.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set
    )
    hv = allgather_async(t.values().contiguous(), name=f"{name}.values", process_set=process_set)

    def finish():
        values = synchronize(hv)
        indices = synchronize(hi)
        if ops.reduce_op(None, op, name) == Average:
            values = values / ops.process_set_size(process_set)
        return torch.sparse_coo_tensor(indices.t(), values, t.shape, check_invariants=True)

    return finish


# -- autograd ---------------------------------------------------------------------------------
def _tracks_grad(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def _grad_name(name, what: str):
    return None if name is None else f"{name}.{what}"


class _AllreduceGrad(torch.autograd.Function):
    """allreduce whose gradient is the allreduce (same op and scaling) of the output gradient."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale, postscale, process_set):
        ctx.args = (average, name, op, prescale, postscale, process_set)
        if ops.reduce_op(average, op, name or "allreduce") not in (Average, Sum):
            ctx.args = None
        return synchronize(
            allreduce_async(tensor.detach(), average, name, op, prescale, postscale, process_set)
        )

    @staticmethod
    def backward(ctx, grad):
        if ctx.args is None:
            raise NotImplementedError(
                "the gradient of allreduce is defined for hvd.Average and hvd.Sum only"
            )
        average, name, op, pre, post, ps = ctx.args
        out = synchronize(
            allreduce_async(grad.contiguous(), average, _grad_name(name, "grad"), op, pre, post, ps)
        )
        return out, None, None, None, None, None, None


class _AllgatherGrad(torch.autograd.Function):
    """allgather whose gradient is this rank's slice of the averaged output gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.name, ctx.process_set = tensor.shape[0], name, process_set
        return synchronize(allgather_async(tensor.detach(), name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(
            allreduce_async(
                grad.contiguous(),
                name=_grad_name(ctx.name, "grad"),
                op=Average,
                process_set=ctx.process_set,
            )
        )
        rows = synchronize(
            allgather_async(
                torch.tensor([ctx.rows]),
                name=_grad_name(ctx.name, "grad.rows"),
                process_set=ctx.process_set,
            )
        )
        offset = int(rows[: ops.process_set_rank(ctx.process_set)].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


class _BroadcastGrad(torch.autograd.Function):
    """broadcast whose gradient flows (averaged over ranks) to the root only."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.name, ctx.process_set = root_rank, name, process_set
        return synchronize(broadcast_async(tensor.detach(), root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(
            allreduce_async(
                grad.contiguous(),
                name=_grad_name(ctx.name, "grad"),
                op=Average,
                process_set=ctx.process_set,
            )
        )
        if rank() != ctx.root:
            reduced.zero_()
        return reduced, None, None, None


class _GroupedAllreduceGrad(torch.autograd.Function):
    """grouped allreduce; each gradient is reduced like :class:`_AllreduceGrad`'s."""

    @staticmethod
    def forward(ctx, average, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (average, name, op, prescale, postscale, process_set)
        outs = synchronize(
            grouped_allreduce_async(
                [t.detach() for t in tensors], average, name, op, prescale, postscale, process_set
            )
        )
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        average, name, op, pre, post, ps = ctx.args
        if ops.reduce_op(average, op, name or "grouped_allreduce") not in (Average, Sum):
            raise NotImplementedError(
                "the gradient of allreduce is defined for hvd.Average and hvd.Sum only"
            )
        outs = synchronize(
            grouped_allreduce_async(
                [g.contiguous() for g in grads],
                average,
                _grad_name(name, "grad"),
                op,
                pre,
                post,
                ps,
            )
        )
        return (None,) * 6 + tuple(outs)


class _GroupedAllgatherGrad(torch.autograd.Function):
    """grouped allgather; each gradient is this rank's rows of the averaged output gradient."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.name, ctx.process_set = [t.shape[0] for t in tensors], name, process_set
        return tuple(
            synchronize(grouped_allgather_async([t.detach() for t in tensors], name, process_set))
        )

    @staticmethod
    def backward(ctx, *grads):
        reduced = synchronize(
            grouped_allreduce_async(
                [g.contiguous() for g in grads],
                name=_grad_name(ctx.name, "grad"),
                op=Average,
                process_set=ctx.process_set,
            )
        )
        rows = synchronize(
            allgather_async(
                torch.tensor([ctx.rows]),
                name=_grad_name(ctx.name, "grad.rows"),
                process_set=ctx.process_set,
            )
        )
        offsets = rows[: ops.process_set_rank(ctx.process_set)].sum(0).tolist()
        return (None, None) + tuple(
            r.narrow(0, int(o), n) for r, o, n in zip(reduced, offsets, ctx.rows)
        )


class _AlltoallGrad(torch.autograd.Function):
    """alltoall whose gradient sends each received row's gradient back to its sender."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = synchronize(alltoall_async(tensor.detach(), splits, name, process_set))
        ctx.received, ctx.name, ctx.process_set = received, name, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _unused):
        back, _ = synchronize(
            alltoall_async(
                grad.contiguous(), ctx.received, _grad_name(ctx.name, "grad"), ctx.process_set
            )
        )
        return back, None, None, None


class _ReducescatterGrad(torch.autograd.Function):
    """(grouped) reducescatter whose gradient is the allgather of the output gradients,
    scaled as Horovod's (by the size for hvd.Sum, and by the pre/post factors)."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, *tensors):
        ctx.args = (
            name,
            ops.reduce_op(None, op, name or "reducescatter"),
            process_set,
            prescale * postscale,
        )
        h = _reducescatter_async(
            [t.detach() for t in tensors],
            len(tensors) > 1,
            name,
            op,
            process_set,
            prescale,
            postscale,
        )
        out = synchronize(h)
        return tuple(out) if isinstance(out, list) else (out,)

    @staticmethod
    def backward(ctx, *grads):
        name, rop, process_set, factor = ctx.args
        if rop == Sum:
            factor *= ops.process_set_size(process_set)
        scaled = [g.contiguous() * factor if factor != 1.0 else g.contiguous() for g in grads]
        gathered = synchronize(
            grouped_allgather_async(scaled, _grad_name(name, "grad"), process_set)
        )
        return (None,) * 5 + tuple(gathered)


# -- join, barrier ---------------------------------------------------------------------------
@_args(device="accepted for Horovod compatibility and ignored (tensors are on the CPU).")
def join(device=-1) -> int:
    """Block until every rank has joined; returns the rank that joined last.

    While this rank waits here it keeps taking part in the other ranks'
    allreduces (contributing neutral values), reducescatters (zeros) and
    alltoalls (no rows), so ranks with fewer batches do not stall the rest.
    As in Horovod, the others' allgathers and broadcasts fail at once with a
    ``RuntimeError`` meanwhile (the job goes on).

    Returns:
        The rank that joined last.

    Raises:
        HvdliteInternalError: the runtime stopped before every rank joined.
    """
    return ops.join()


@_args()
def barrier(process_set=global_process_set) -> None:
    """Block until every rank of the process set has reached the barrier.

    Raises:
        HvdliteInternalError: the runtime stopped before every member arrived.
    """
    ops.barrier(process_set)
