"""The op layer every framework adapts: names, requests, validation, handles, synchronize, join.

A framework adapter (``hvdlite.torch``, later ``hvdlite.tensorflow``) turns its
tensors into *buffers* at the edge and calls the functions here.  A buffer is a
contiguous CPU ``torch.Tensor`` (torch serves as the runtime's array type; a
TensorFlow adapter wraps its numpy views with ``torch.from_numpy``): the op layer
reads its ``dtype``, ``shape`` and data, and the background thread writes results
into the output buffers the adapter allocated (allreduce, broadcast) or returns
new buffers (allgather, alltoall, reducescatter).  Each ``*_async`` function is
the one place its requests are built and checked; fast paths live inside them.

Unnamed operations are numbered per kind (``allreduce.noname.3``), so every
rank must issue them in the same order; the numbering restarts at every
``init()``.
"""

import itertools
import threading
from typing import Callable, Dict, List, Optional, Sequence

from hvdlite.common import basics
from hvdlite.common.basics import _STATE       # read on the hot path without a call
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.fusion import DTYPE_NAMES, dtype_name
from hvdlite.common.message import BARRIER_NAME, JOIN_NAME, OpType, ReduceOp, Request
from hvdlite.common.tensor_queue import Entry, Handle

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

#: how often a waiting synchronize() checks that the background thread still runs
_SYNC_POLL_S = 0.5
_BOOL_OPS = (Min, Max)
_OPS_WITHOUT_AVERAGE = {None: Average, Average: Average, Sum: Sum, Min: Min, Max: Max,
                        Product: Product}


class _GlobalProcessSet:
    """All ranks; the only process set so far."""

    process_set_id = 0

    def size(self) -> int:
        return basics.size()

    def rank(self) -> int:
        return basics.rank()

    def included(self) -> bool:
        return True

    def __repr__(self):
        return "global_process_set"


global_process_set = _GlobalProcessSet()


# -- names -------------------------------------------------------------------------------------
_counters: Dict[OpType, "itertools.count"] = {}
_counter_lock = threading.Lock()


def _reset_names() -> None:
    with _counter_lock:
        _counters.clear()
        _counters.update({op: itertools.count() for op in OpType})


_reset_names()
basics.register_reset_hook(_reset_names)


def auto_name(op: OpType) -> str:
    with _counter_lock:
        return f"{op.name.lower()}.noname.{next(_counters[op])}"


def op_names(op: OpType, name: Optional[str], count: int, grouped: bool) -> List[str]:
    """The request names of one call: ``name`` (or an automatic one), ``.i``-suffixed
    per tensor when the call is grouped."""
    base = name if name is not None else auto_name(op)
    if not grouped:
        return [base]
    return [f"{base}.{i}" for i in range(count)]


# -- checks ------------------------------------------------------------------------------------
_NAME_OF: Dict[object, str] = {}


def buffer_dtype(buf, name: str, op: OpType) -> str:
    """The wire name of ``buf``'s dtype.

    Raises:
        TypeError: the dtype is not one hvdlite transports (names the tensor).
    """
    dt = _NAME_OF.get(buf.dtype)
    if dt is None:
        dt = dtype_name(buf.dtype)
        if dt not in DTYPE_NAMES:
            raise TypeError(f"{op.name.lower()} of tensor {name!r}: dtype {buf.dtype} is not "
                            f"supported (supported: {', '.join(DTYPE_NAMES)})")
        _NAME_OF[buf.dtype] = dt
    return dt


def reduce_op(average, op, name: str) -> ReduceOp:
    """Horovod's ``op=`` / deprecated ``average=`` arguments as one ReduceOp.

    Raises:
        ValueError: both given, or an unknown op.
    """
    if average is None:
        fast = _OPS_WITHOUT_AVERAGE.get(op) if not isinstance(op, bool) else None
        if fast is not None:
            return fast
    elif op is not None:
        raise ValueError(f"allreduce of {name!r}: pass either op= or the deprecated average=, "
                         f"not both")
    if op is None:
        op = Sum if average is False else Average
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"allreduce of {name!r}: unknown reduce op {op!r}; use hvd.Average, "
                         f"hvd.Sum, hvd.Min, hvd.Max or hvd.Product") from None
    return op


def check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("hvdlite supports only the global process set so far")


def check_root(root_rank, name: str) -> int:
    n = basics.size()
    if not isinstance(root_rank, int) or isinstance(root_rank, bool) or \
            not 0 <= root_rank < n:
        raise ValueError(f"broadcast of tensor {name!r}: root_rank={root_rank!r} is not a rank "
                         f"of this job (0..{n - 1})")
    return root_rank


def _check_has_rows(buf, name: str, op: OpType) -> None:
    if buf.dim() == 0:
        raise ValueError(f"{op.name.lower()} of tensor {name!r}: a scalar has no first "
                         f"dimension to split or concatenate; reshape it to [1]")


# -- submission --------------------------------------------------------------------------------
def _submit(op: OpType, buffers: Sequence, names: Sequence[str], outputs: Sequence,
            finish: Optional[Callable[[list], object]] = None, **fields) -> Handle:
    runtime = basics.runtime()
    handle = Handle(len(buffers), finish)
    handle.names = list(names)
    entries = []
    for i, (buf, nm, out) in enumerate(zip(buffers, names, outputs)):
        if len(nm) > MAX_NAME_CHARS:
            check_name_length(nm)
        req = Request(nm, op, buffer_dtype(buf, nm, op), tuple(buf.shape), **fields)
        entries.append(Entry(req, buf, out, handle, i))
    runtime.enqueue(entries)
    return handle


#: the longest tensor name accepted: every name travels to every rank in each negotiation
#: and its size into the int32 control vector, so it is bounded at submission
MAX_NAME_CHARS = 4096


def check_name_length(name: str) -> None:
    """Refuse an over-long name here, in the caller's thread, with a clear error (rather
    than overflowing the control vector and failing every later operation).

    Raises:
        ValueError: ``name`` is longer than :data:`MAX_NAME_CHARS`.
    """
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"tensor name {name[:60]!r}... is {len(name)} characters long; names "
                         f"are limited to {MAX_NAME_CHARS} characters (they are sent to every "
                         f"rank in each negotiation)")


def _check_reducible(dt: str, op: ReduceOp, name: str) -> None:
    if dt == "bool" and op not in _BOOL_OPS:
        raise TypeError(f"allreduce of bool tensor {name!r}: only op=hvd.Min or hvd.Max "
                        f"(logical and / or) are defined for bool")


def allreduce_one(buffer, output, name: Optional[str], op: ReduceOp, prescale: float = 1.0,
                  postscale: float = 1.0, finish=None) -> Handle:
    """Reduce one buffer over all ranks into ``output`` (which may be the buffer itself).

    The common case, issued thousands of times per step by an optimizer, so it does the
    least work that is still every check :func:`allreduce_async` makes.
    """
    runtime = _STATE.runtime
    if runtime is None:
        basics.runtime()                    # raises the not-initialized error
    dt = _NAME_OF.get(buffer.dtype)
    if dt is None or dt == "bool":
        dt = buffer_dtype(buffer, name, OpType.ALLREDUCE)
        _check_reducible(dt, op, name)
    if name is None:
        name = auto_name(OpType.ALLREDUCE)
    elif len(name) > MAX_NAME_CHARS:
        check_name_length(name)
    handle = Handle(1, finish)
    handle.names = [name]
    req = Request(name, OpType.ALLREDUCE, dt, tuple(buffer.shape), -1, op,
                  prescale if type(prescale) is float else float(prescale),
                  postscale if type(postscale) is float else float(postscale))
    runtime.enqueue([Entry(req, buffer, output, handle, 0)])
    return handle


def allreduce_async(buffers: Sequence, outputs: Sequence, name: Optional[str], grouped: bool,
                    op: ReduceOp, prescale: float = 1.0, postscale: float = 1.0,
                    process_set=None, finish=None) -> Handle:
    """Reduce each buffer over all ranks into its output (which may be the buffer itself)."""
    check_process_set(process_set)
    if not grouped:
        return allreduce_one(buffers[0], outputs[0], name, op, prescale, postscale, finish)
    names = op_names(OpType.ALLREDUCE, name, len(buffers), grouped)
    for buf, nm in zip(buffers, names):
        _check_reducible(buffer_dtype(buf, nm, OpType.ALLREDUCE), op, nm)
    return _submit(OpType.ALLREDUCE, buffers, names, outputs, finish, reduce_op=int(op),
                   prescale=float(prescale), postscale=float(postscale))


def allgather_async(buffers: Sequence, name: Optional[str], grouped: bool,
                    process_set=None, finish=None) -> Handle:
    """Concatenate every rank's buffers along dim 0 (first dimensions may differ)."""
    check_process_set(process_set)
    names = op_names(OpType.ALLGATHER, name, len(buffers), grouped)
    for buf, nm in zip(buffers, names):
        _check_has_rows(buf, nm, OpType.ALLGATHER)
    return _submit(OpType.ALLGATHER, buffers, names, [None] * len(buffers), finish)


def broadcast_async(buffer, output, root_rank, name: Optional[str], process_set=None,
                    finish=None) -> Handle:
    """The root's buffer in ``output`` on every rank (``output`` may be ``buffer``)."""
    check_process_set(process_set)
    [nm] = op_names(OpType.BROADCAST, name, 1, False)
    root = check_root(root_rank, nm)
    return _submit(OpType.BROADCAST, [buffer], [nm], [output], finish, root=root)


def alltoall_async(buffer, splits: Optional[Sequence[int]], name: Optional[str],
                   process_set=None) -> Handle:
    """Send ``splits[r]`` rows to rank r; the result is ``(rows received, received splits)``."""
    check_process_set(process_set)
    [nm] = op_names(OpType.ALLTOALL, name, 1, False)
    _check_has_rows(buffer, nm, OpType.ALLTOALL)
    n = basics.size()
    rows = buffer.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall of tensor {nm!r}: first dimension {rows} does not divide "
                             f"evenly over {n} ranks; pass splits=")
        split_list = [rows // n] * n
    else:
        split_list = [int(s) for s in splits]
        if len(split_list) != n or any(s < 0 for s in split_list) or sum(split_list) != rows:
            raise ValueError(f"alltoall of tensor {nm!r}: splits {split_list} must have {n} "
                             f"non-negative entries summing to the first dimension {rows}")
    return _submit(OpType.ALLTOALL, [buffer], [nm], [None], splits=tuple(split_list))


def reducescatter_async(buffers: Sequence, op: ReduceOp, name: Optional[str], grouped: bool,
                        prescale: float = 1.0, postscale: float = 1.0, process_set=None,
                        finish=None) -> Handle:
    """Reduce each buffer; each rank gets its slice of dim 0 (earlier ranks get extra rows)."""
    check_process_set(process_set)
    names = op_names(OpType.REDUCESCATTER, name, len(buffers), grouped)
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter of {names[0]!r}: only hvd.Average and hvd.Sum are "
                         f"supported")
    for buf, nm in zip(buffers, names):
        _check_has_rows(buf, nm, OpType.REDUCESCATTER)
    return _submit(OpType.REDUCESCATTER, buffers, names, [None] * len(buffers), finish,
                   reduce_op=int(op), prescale=float(prescale), postscale=float(postscale))


# -- waiting -----------------------------------------------------------------------------------
def poll(handle: Handle) -> bool:
    """True once the operation finished (successfully or not); never blocks."""
    return handle.done()


def synchronize(handle: Handle):
    """Wait for the operation and return its result (raises its error).

    The wait ends with HvdliteInternalError if the runtime stops (a peer died
    or shut down) before the operation completes.  A composite operation's handle (a
    callable, e.g. a sparse allreduce) is called to wait for its parts.
    """
    if callable(handle) and not isinstance(handle, Handle):
        return handle()
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize expects a handle returned by an *_async call, got "
                        f"{type(handle).__name__}")
    while not handle.wait(_SYNC_POLL_S):
        runtime = basics.current_runtime()
        if runtime is None or not runtime.running():
            if handle.wait(0.1):
                break
            raise HvdliteInternalError(
                f"operation on {handle.names} cannot complete: hvdlite's background thread has "
                f"stopped ({runtime.error() if runtime is not None else 'shut down'})")
    return handle.value()


def _control(op: OpType, name: str) -> Handle:
    handle = Handle(1)
    handle.names = [name]
    basics.runtime().enqueue([Entry(Request(name, op), None, None, handle, 0)])
    return handle


def join() -> int:
    """Block until every rank has joined; returns the rank that joined last.

    While this rank waits here it keeps taking part in the other ranks'
    allreduces (contributing neutral values) and allgathers (contributing no
    rows), so ranks with fewer batches do not stall the rest.
    """
    return synchronize(_control(OpType.JOIN, JOIN_NAME))


def barrier(process_set=None) -> None:
    """Block until every rank reached the barrier."""
    check_process_set(process_set)
    synchronize(_control(OpType.BARRIER, BARRIER_NAME))
