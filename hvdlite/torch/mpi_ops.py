"""The horovod.torch collective API on hvdlite's runtime.

Every function has the name and semantics of its ``horovod.torch``
counterpart.  Async variants return a handle for :func:`synchronize` /
:func:`poll`; names must be unique among operations in flight, and ranks must
use the same name for the same tensor (unnamed operations are numbered per
kind, so all ranks must issue them in the same order).
"""

import itertools
import threading
from typing import List, Optional, Sequence

import torch

from hvdlite.common import basics
from hvdlite.common.basics import (cross_rank, cross_size, gloo_built, gloo_enabled, init,
                                   is_homogeneous, is_initialized, local_rank, local_size,
                                   mpi_built, mpi_enabled, rank, shutdown, size)
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.message import BARRIER_NAME, JOIN_NAME, OpType, ReduceOp, Request
from hvdlite.common.tensor_queue import Entry, Handle

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "gloo_enabled", "mpi_enabled", "gloo_built",
    "mpi_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "synchronize", "poll", "join",
    "barrier", "global_process_set",
]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
           torch.float64: "float64", torch.int8: "int8", torch.int16: "int16",
           torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8",
           torch.bool: "bool"}
_REDUCIBLE_BOOL_OPS = (Min, Max)


class _GlobalProcessSet:
    """All ranks; the only process set until process sets are implemented."""

    process_set_id = 0

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True

    def __repr__(self):
        return "global_process_set"


global_process_set = _GlobalProcessSet()

_counters = {op: itertools.count() for op in OpType}
_counter_lock = threading.Lock()
_SYNC_POLL_S = 0.5


def nccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def _auto_name(op: OpType) -> str:
    with _counter_lock:
        return f"{op.name.lower()}.noname.{next(_counters[op])}"


def _check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("hvdlite supports only the global process set so far")


def _dtype(tensor, name: str, op: OpType) -> str:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op.name.lower()} of {name!r}: expected a torch.Tensor, got "
                        f"{type(tensor).__name__}")
    dt = _DTYPES.get(tensor.dtype)
    if dt is None:
        raise TypeError(f"{op.name.lower()} of tensor {name!r}: dtype {tensor.dtype} is not "
                        f"supported (supported: {', '.join(_DTYPES.values())})")
    if tensor.device.type != "cpu":
        raise ValueError(f"{op.name.lower()} of tensor {name!r}: tensor is on {tensor.device}, "
                         f"but hvdlite's Gloo/MPI transports work on CPU tensors; move it with "
                         f".cpu() first")
    if tensor.is_sparse:
        raise ValueError(f"{op.name.lower()} of tensor {name!r}: sparse tensors are not "
                         f"supported; densify it with .to_dense()")
    return dt


def _reduce_op(average, op, name: str) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError(f"allreduce of {name!r}: pass either op= or the deprecated average=, "
                         f"not both")
    if op is None:
        op = Sum if average is False else Average
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"allreduce of {name!r}: unknown reduce op {op!r}; use hvd.Average, "
                         f"hvd.Sum, hvd.Min, hvd.Max or hvd.Product") from None
    if op == Adasum:
        raise NotImplementedError("op=hvd.Adasum is not implemented in hvdlite yet; use "
                                  "hvd.Average or hvd.Sum")
    return op


def _submit(entries: List[Entry]) -> None:
    basics.runtime().enqueue(entries)


def _make(op: OpType, tensors: Sequence, names: Sequence[str], outputs: Sequence,
          finish=None, **fields) -> Handle:
    handle = Handle(len(tensors), finish)
    entries = []
    for i, (t, nm, out) in enumerate(zip(tensors, names, outputs)):
        req = Request(nm, op, _dtype(t, nm, op), tuple(t.shape), **fields)
        entries.append(Entry(req, t, out, handle, i))
    handle.names = list(names)
    _submit(entries)
    return handle


def _names(op: OpType, name: Optional[str], count: int, grouped: bool) -> List[str]:
    if not grouped:
        return [name if name is not None else _auto_name(op)]
    base = name if name is not None else _auto_name(op)
    return [f"{base}.{i}" for i in range(count)]


def _contiguous_inplace(tensors):
    """Contiguous stand-ins for in-place ops on non-contiguous tensors, copied back at the end."""
    work, back = [], []
    for t in tensors:
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
        targets = results
        mapping = {id(src): dst for dst, src in back}
        targets = [mapping.get(id(r), r) for r in results]
        return targets[0] if single else targets
    return finish


# -- allreduce -------------------------------------------------------------------------------
def _allreduce_async(tensors, inplace: bool, grouped: bool, average, name, op, prescale_factor,
                     postscale_factor, process_set) -> Handle:
    _check_process_set(process_set)
    names = _names(OpType.ALLREDUCE, name, len(tensors), grouped)
    rop = _reduce_op(average, op, names[0])
    for t, nm in zip(tensors, names):
        if isinstance(t, torch.Tensor) and t.dtype == torch.bool and rop not in \
                _REDUCIBLE_BOOL_OPS:
            raise TypeError(f"allreduce of bool tensor {nm!r}: only op=hvd.Min or hvd.Max "
                            f"(logical and / or) are defined for bool")
    fields = dict(reduce_op=int(rop), prescale=float(prescale_factor),
                  postscale=float(postscale_factor))
    finish = None
    if inplace:
        work, back = _contiguous_inplace(tensors)
        outputs = work
        if back or grouped:
            finish = _copy_back_finish(back, single=not grouped)
        elif not grouped:
            finish = None
    else:
        work = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in tensors]
        outputs = [torch.empty_like(t) if isinstance(t, torch.Tensor) else None for t in work]
        if grouped:
            finish = list
    return _make(OpType.ALLREDUCE, work, names, outputs, finish, **fields)


_FAST_OPS = {None: Average, Average: Average, Sum: Sum, Min: Min, Max: Max, Product: Product}


def _allreduce_one(tensor, inplace: bool, average, name, op, prescale_factor, postscale_factor,
                   process_set) -> Handle:
    """The common case (one plain CPU tensor) without the general path's bookkeeping:
    an optimizer issues thousands of these per step."""
    rop = _FAST_OPS.get(op) if average is None and process_set is None else None
    dt = _DTYPES.get(tensor.dtype) if type(tensor) is torch.Tensor else None
    if rop is None or dt is None or dt == "bool" or not tensor.is_cpu or tensor.is_sparse or \
            not tensor.is_contiguous():
        return _allreduce_async([tensor], inplace, False, average, name, op, prescale_factor,
                                postscale_factor, process_set)
    rt = basics._STATE.runtime
    if rt is None:
        basics.runtime()                  # raises the not-initialized error
    if name is None:
        name = _auto_name(OpType.ALLREDUCE)
    handle = Handle(1)
    handle.names = [name]
    req = Request(name, OpType.ALLREDUCE, dt, tuple(tensor.shape), -1, rop,
                  prescale_factor if type(prescale_factor) is float else float(prescale_factor),
                  postscale_factor if type(postscale_factor) is float else float(postscale_factor))
    rt.enqueue([Entry(req, tensor, tensor if inplace else torch.empty_like(tensor), handle, 0)])
    return handle


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None) -> Handle:
    """Start averaging (or summing, ...) ``tensor`` over all ranks; returns a handle."""
    return _allreduce_one(tensor, False, average, name, op, prescale_factor, postscale_factor,
                          process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None) -> Handle:
    """In-place :func:`allreduce_async`: the result lands in ``tensor``."""
    return _allreduce_one(tensor, True, average, name, op, prescale_factor, postscale_factor,
                          process_set)


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None):
    """Reduce ``tensor`` over all ranks and return the result in a new tensor.

    ``compression`` (e.g. ``hvd.Compression.fp16``) compresses before sending
    and restores the original dtype after.
    """
    ctx = None
    if compression is not None:
        tensor, ctx = compression.compress(tensor)
    if _tracks_grad(tensor):
        out = _AllreduceGrad.apply(tensor, average, name, op, prescale_factor, postscale_factor,
                                   process_set)
    else:
        out = synchronize(allreduce_async(tensor, average, name, op, prescale_factor,
                                          postscale_factor, process_set))
    if compression is not None:
        out = compression.decompress(out, ctx)
    return out


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """In-place :func:`allreduce`."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None) -> Handle:
    """Reduce a list of tensors as one unit (fused together); one handle for all."""
    return _allreduce_async(list(tensors), False, True, average, name, op, prescale_factor,
                            postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None) -> Handle:
    return _allreduce_async(list(tensors), True, True, average, name, op, prescale_factor,
                            postscale_factor, process_set)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    ctxs = None
    if compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        tensors, ctxs = [p[0] for p in pairs], [p[1] for p in pairs]
    outs = synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                               postscale_factor, process_set))
    if compression is not None:
        outs = [compression.decompress(o, c) for o, c in zip(outs, ctxs)]
    return outs


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather -------------------------------------------------------------------------------
def _allgather_async(tensors, grouped: bool, name, process_set) -> Handle:
    _check_process_set(process_set)
    names = _names(OpType.ALLGATHER, name, len(tensors), grouped)
    work = []
    for t, nm in zip(tensors, names):
        _dtype(t, nm, OpType.ALLGATHER)
        if t.dim() == 0:
            raise ValueError(f"allgather of tensor {nm!r}: a scalar has no first dimension to "
                             f"concatenate; reshape it to [1]")
        work.append(t.contiguous())
    return _make(OpType.ALLGATHER, work, names, [None] * len(work),
                 list if grouped else None)


def allgather_async(tensor, name=None, process_set=None) -> Handle:
    """Start concatenating every rank's ``tensor`` along dim 0 (sizes may differ)."""
    return _allgather_async([tensor], False, name, process_set)


def allgather(tensor, name=None, process_set=None):
    """Concatenate every rank's ``tensor`` along dim 0 (differentiable)."""
    if _tracks_grad(tensor):
        return _AllgatherGrad.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=None) -> Handle:
    return _allgather_async(list(tensors), True, name, process_set)


def grouped_allgather(tensors, name=None, process_set=None):
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# -- broadcast -------------------------------------------------------------------------------
def _check_root(root_rank, name: str) -> int:
    n = size()
    if not isinstance(root_rank, int) or isinstance(root_rank, bool) or \
            not 0 <= root_rank < n:
        raise ValueError(f"broadcast of tensor {name!r}: root_rank={root_rank!r} is not a rank "
                         f"of this job (0..{n - 1})")
    return root_rank


def _broadcast_async(tensor, root_rank, name, inplace: bool, process_set) -> Handle:
    _check_process_set(process_set)
    [nm] = _names(OpType.BROADCAST, name, 1, False)
    _dtype(tensor, nm, OpType.BROADCAST)
    root = _check_root(root_rank, nm)
    if inplace:
        [work], back = _contiguous_inplace([tensor])
        out = work
        finish = _copy_back_finish(back, True) if back else None
    else:
        work = tensor.contiguous()
        out = work.clone() if rank() == root else torch.empty_like(work)
        finish = None
    return _make(OpType.BROADCAST, [work], [nm], [out], finish, root=root)


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> Handle:
    """Start copying the root's ``tensor`` to every rank (into a new tensor)."""
    return _broadcast_async(tensor, root_rank, name, False, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> Handle:
    return _broadcast_async(tensor, root_rank, name, True, process_set)


def broadcast(tensor, root_rank, name=None, process_set=None):
    """The root's ``tensor`` on every rank, in a new tensor (differentiable)."""
    if _tracks_grad(tensor):
        return _BroadcastGrad.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=None):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall / reducescatter ----------------------------------------------------------------
def alltoall_async(tensor, splits=None, name=None, process_set=None) -> Handle:
    """Send ``splits[r]`` rows of ``tensor`` to rank r; returns (output, received_splits)."""
    _check_process_set(process_set)
    [nm] = _names(OpType.ALLTOALL, name, 1, False)
    _dtype(tensor, nm, OpType.ALLTOALL)
    if tensor.dim() == 0:
        raise ValueError(f"alltoall of tensor {nm!r}: a scalar cannot be split; reshape it")
    n = size()
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall of tensor {nm!r}: first dimension {rows} does not divide "
                             f"evenly over {n} ranks; pass splits=")
        split_list = [rows // n] * n
    else:
        if isinstance(splits, torch.Tensor):
            split_list = [int(s) for s in splits.tolist()]
        else:
            split_list = [int(s) for s in splits]
        if len(split_list) != n or any(s < 0 for s in split_list) or sum(split_list) != rows:
            raise ValueError(f"alltoall of tensor {nm!r}: splits {split_list} must have {n} "
                             f"non-negative entries summing to the first dimension {rows}")
    return _make(OpType.ALLTOALL, [tensor.contiguous()], [nm], [None], None,
                 splits=tuple(split_list))


def alltoall(tensor, splits=None, name=None, process_set=None):
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def _reducescatter_async(tensors, grouped, op, name, prescale_factor, postscale_factor,
                         process_set) -> Handle:
    _check_process_set(process_set)
    names = _names(OpType.REDUCESCATTER, name, len(tensors), grouped)
    rop = _reduce_op(None, op, names[0])
    if rop not in (Average, Sum):
        raise ValueError(f"reducescatter of {names[0]!r}: only hvd.Average and hvd.Sum are "
                         f"supported")
    work = []
    for t, nm in zip(tensors, names):
        _dtype(t, nm, OpType.REDUCESCATTER)
        if t.dim() == 0:
            raise ValueError(f"reducescatter of tensor {nm!r}: a scalar cannot be scattered")
        work.append(t.contiguous())
    return _make(OpType.REDUCESCATTER, work, names, [None] * len(work),
                 list if grouped else None, reduce_op=int(rop),
                 prescale=float(prescale_factor), postscale=float(postscale_factor))


def reducescatter_async(tensor, op=Average, name=None, prescale_factor=1.0,
                        postscale_factor=1.0, process_set=None) -> Handle:
    """Reduce ``tensor`` and give each rank its slice of dim 0 (earlier ranks get the extra rows)."""
    return _reducescatter_async([tensor], False, op, name, prescale_factor, postscale_factor,
                                process_set)


def reducescatter(tensor, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=None):
    return synchronize(reducescatter_async(tensor, op, name, prescale_factor, postscale_factor,
                                           process_set))


def grouped_reducescatter_async(tensors, op=Average, name=None, prescale_factor=1.0,
                                postscale_factor=1.0, process_set=None) -> Handle:
    return _reducescatter_async(list(tensors), True, op, name, prescale_factor, postscale_factor,
                                process_set)


def grouped_reducescatter(tensors, op=Average, name=None, prescale_factor=1.0,
                          postscale_factor=1.0, process_set=None):
    return synchronize(grouped_reducescatter_async(tensors, op, name, prescale_factor,
                                                   postscale_factor, process_set))


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
        if _reduce_op(average, op, name or "allreduce") not in (Average, Sum):
            ctx.args = None
        return synchronize(allreduce_async(tensor.detach(), average, name, op, prescale,
                                           postscale, process_set))

    @staticmethod
    def backward(ctx, grad):
        if ctx.args is None:
            raise NotImplementedError("the gradient of allreduce is defined for hvd.Average "
                                      "and hvd.Sum only")
        average, name, op, pre, post, ps = ctx.args
        out = synchronize(allreduce_async(grad.contiguous(), average, _grad_name(name, "grad"),
                                          op, pre, post, ps))
        return out, None, None, None, None, None, None


class _AllgatherGrad(torch.autograd.Function):
    """allgather whose gradient is this rank's slice of the averaged output gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.name, ctx.process_set = tensor.shape[0], name, process_set
        return synchronize(allgather_async(tensor.detach(), name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(allreduce_async(grad.contiguous(), name=_grad_name(ctx.name, "grad"),
                                              op=Average, process_set=ctx.process_set))
        rows = synchronize(allgather_async(torch.tensor([ctx.rows]),
                                           name=_grad_name(ctx.name, "grad.rows"),
                                           process_set=ctx.process_set))
        offset = int(rows[:rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


class _BroadcastGrad(torch.autograd.Function):
    """broadcast whose gradient flows (averaged over ranks) to the root only."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.name, ctx.process_set = root_rank, name, process_set
        return synchronize(broadcast_async(tensor.detach(), root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(allreduce_async(grad.contiguous(), name=_grad_name(ctx.name, "grad"),
                                              op=Average, process_set=ctx.process_set))
        if rank() != ctx.root:
            reduced.zero_()
        return reduced, None, None, None


# -- handles, join, barrier ------------------------------------------------------------------
def poll(handle: Handle) -> bool:
    """True once the operation finished (successfully or not); never blocks."""
    return handle.done()


def synchronize(handle: Handle):
    """Wait for the operation and return its result (raises its error).

    The wait ends with HvdliteInternalError if the runtime stops (a peer died
    or shut down) before the operation completes.
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize expects a handle returned by an *_async call, got "
                        f"{type(handle).__name__}")
    while not handle.wait(_SYNC_POLL_S):
        rt = basics._STATE.runtime
        if rt is None or not rt.running():
            if handle.wait(0.1):
                break
            raise HvdliteInternalError(
                f"operation on {handle.names} cannot complete: hvdlite's background thread has "
                f"stopped ({rt.error() if rt is not None else 'shut down'})")
    return handle.value()


def join(device=-1) -> int:
    """Block until every rank has joined; returns the rank that joined last.

    While this rank waits here it keeps taking part in the other ranks'
    allreduces (contributing neutral values) and allgathers (contributing no
    rows), so ranks with fewer batches do not stall the rest.
    """
    handle = Handle(1)
    _submit([Entry(Request(JOIN_NAME, OpType.JOIN), None, None, handle, 0)])
    return synchronize(handle)


def barrier(process_set=None) -> None:
    """Block until every rank reached the barrier."""
    _check_process_set(process_set)
    handle = Handle(1)
    _submit([Entry(Request(BARRIER_NAME, OpType.BARRIER), None, None, handle, 0)])
    synchronize(handle)
