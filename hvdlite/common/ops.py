"""The op layer every framework adapts: names, requests, validation, handles, synchronize, join.

A framework adapter (``hvdlite.torch``, ``hvdlite.tensorflow``) turns its
tensors into *buffers* at the edge and calls the functions here.  A buffer is a
contiguous CPU array of the process's array kind (:mod:`hvdlite.common.arrays`: a
``torch.Tensor`` whenever torch is installed, else a numpy array): the op layer
reads its ``dtype``, ``shape`` and data, and the background thread writes results
into the output buffers the adapter allocated (allreduce, broadcast) or returns
new buffers (allgather, alltoall, reducescatter).  Each ``*_async`` function is
the one place its requests are built and checked; fast paths live inside them.

Unnamed operations are numbered per kind and per process set
(``allreduce.noname.3``), so every rank must issue them in the same order; the
numbering restarts at every ``init()``.  ``process_set=`` selects that set's
own runtime, and a broadcast's ``root_rank`` (a job rank) becomes a set rank
(:func:`check_root`).
"""

import itertools
import threading
from typing import Callable, Dict, List, Optional, Sequence

from hvdlite.common import basics
from hvdlite.common import process_sets as _sets
from hvdlite.common.backend import shared_buckets
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.process_sets import ProcessSet, global_process_set  # noqa: F401
from hvdlite.common.diagnostics.raised import noted
from hvdlite.common.arrays import DTYPE_NAMES, dtype_name
from hvdlite.common.engine.message import BARRIER_NAME, JOIN_NAME, OpType, ReduceOp, Request
from hvdlite.common.engine.tensor_queue import Entry, Handle

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

#: how often a waiting synchronize() checks that the background thread still runs
_SYNC_POLL_S = 0.5
_BOOL_OPS = (Min, Max)
#: the ``op=`` values (``average=`` not given) that are a ReduceOp as they are, no Adasum
PLAIN_OPS = {None: Average, Average: Average, Sum: Sum, Min: Min, Max: Max, Product: Product}


# -- names -------------------------------------------------------------------------------------
_counters: Dict[tuple, "itertools.count"] = {}
_counter_lock = threading.Lock()


def _reset_names() -> None:
    with _counter_lock:
        _counters.clear()


basics.register_reset_hook(_reset_names)


def auto_name(op: OpType, set_id: int = 0) -> str:
    """The next automatic name of ``op`` in a process set (numbered per set: a rank outside
    a set does not advance that set's numbering)."""
    with _counter_lock:
        counter = _counters.get((set_id, op))
        if counter is None:
            counter = _counters[(set_id, op)] = itertools.count()
        return f"{op.name.lower()}.noname.{next(counter)}"


def op_names(
    op: OpType, name: Optional[str], count: int, grouped: bool, set_id: int = 0
) -> List[str]:
    """The request names of one call: ``name`` (or an automatic one), ``.i``-suffixed
    per tensor when the call is grouped."""
    base = name if name is not None else auto_name(op, set_id)
    if not grouped:
        return [base]
    return [f"{base}.{i}" for i in range(count)]


# -- checks ------------------------------------------------------------------------------------
_NAME_OF: Dict[object, str] = {}


@noted
def buffer_dtype(buf, name: str, op: OpType) -> str:
    """The wire name of ``buf``'s dtype.

    Raises:
        TypeError: the dtype is not one hvdlite transports (names the tensor).
    """
    dt = _NAME_OF.get(buf.dtype)
    if dt is None:
        dt = dtype_name(buf.dtype)
        if dt not in DTYPE_NAMES:
            raise TypeError(
                f"{op.name.lower()} of tensor {name!r}: dtype {buf.dtype} is not "
                f"supported (supported: {', '.join(DTYPE_NAMES)})"
            )
        _NAME_OF[buf.dtype] = dt
    return dt


def reduce_op(average, op, name: str) -> ReduceOp:
    """Horovod's ``op=`` / deprecated ``average=`` arguments as one ReduceOp.

    Raises:
        ValueError: both given, or an unknown op.
    """
    if average is None:
        fast = PLAIN_OPS.get(op) if not isinstance(op, bool) else None
        if fast is not None:
            return fast
    elif op is not None:
        raise ValueError(
            f"allreduce of {name!r}: pass either op= or the deprecated average=, not both"
        )
    if op is None:
        op = Sum if average is False else Average
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(
            f"allreduce of {name!r}: unknown reduce op {op!r}; use hvd.Average, "
            f"hvd.Sum, hvd.Min, hvd.Max or hvd.Product"
        ) from None
    return op


def _runtime(process_set):
    """(runtime, set id) of the set ``process_set`` names (None: the global set)."""
    if process_set is None or process_set is global_process_set:
        return basics.runtime(), 0
    return _sets.runtime_of(process_set), process_set.process_set_id


@noted
def process_set_rank(process_set=None) -> int:
    """This rank's position in ``process_set`` (its rank in the job for the global set).

    Raises:
        ValueError: not registered, or this rank is not a member.
    """
    return _runtime(process_set)[0].rank


def is_member(process_set=None) -> bool:
    """Whether this rank is in ``process_set`` (None or the global set: always), for the
    optimizers that, as Horovod's, do nothing on a non-member.  A set that is not registered,
    or not a set, counts as one: its first use then raises the clear error."""
    included = getattr(process_set, "included", None)
    if process_set is None or process_set is global_process_set or included is None:
        return True
    return included() is not False


@noted
def process_set_size(process_set=None) -> int:
    """How many ranks ``process_set`` has (the job's size for the global set)."""
    return _runtime(process_set)[0].size


@noted
def check_root(root_rank, name: str, runtime=None) -> int:
    """``root_rank`` (a rank of the job) as a rank of the set ``runtime`` serves.

    Raises:
        ValueError: not a rank of the job, or not a member of the set.
    """
    runtime = runtime or basics.runtime()
    ranks = runtime.ranks
    n = basics.size()
    if not isinstance(root_rank, int) or isinstance(root_rank, bool) or not 0 <= root_rank < n:
        raise ValueError(
            f"broadcast of tensor {name!r}: root_rank={root_rank!r} is not a rank "
            f"of this job (0..{n - 1})"
        )
    if len(ranks) == n:
        return root_rank
    if root_rank not in ranks:
        raise ValueError(
            f"broadcast of tensor {name!r}: root_rank={root_rank} is not a member "
            f"of the process set (ranks {ranks})"
        )
    return ranks.index(root_rank)


def _check_has_rows(buf, name: str, op: OpType) -> None:
    if len(buf.shape) == 0:
        raise ValueError(
            f"{op.name.lower()} of tensor {name!r}: a scalar has no first "
            f"dimension to split or concatenate; reshape it to [1]"
        )


# -- submission --------------------------------------------------------------------------------
def _submit(
    op: OpType,
    buffers: Sequence,
    names: Sequence[str],
    outputs: Sequence,
    finish: Optional[Callable[[list], object]] = None,
    runtime=None,
    **fields,
) -> Handle:
    runtime = runtime or basics.runtime()
    handle = Handle(len(buffers), finish, runtime.hurry)
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


@noted
def check_name_length(name: str) -> None:
    """Refuse an over-long name here, in the caller's thread, with a clear error (rather
    than overflowing the control vector and failing every later operation).

    Raises:
        ValueError: ``name`` is longer than :data:`MAX_NAME_CHARS`.
    """
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(
            f"tensor name {name[:60]!r}... is {len(name)} characters long; names "
            f"are limited to {MAX_NAME_CHARS} characters (they are sent to every "
            f"rank in each negotiation)"
        )


@noted
def _check_reducible(dt: str, op: ReduceOp, name: str) -> None:
    if dt == "bool" and op not in _BOOL_OPS:
        raise TypeError(
            f"allreduce of bool tensor {name!r}: only op=hvd.Min or hvd.Max "
            f"(logical and / or) are defined for bool"
        )


def shared_bucket(numel: int, dtype, process_set=None):
    """A zeroed flat buffer of ``numel`` elements of ``dtype`` that this host's other ranks
    can read, for a gradient bucket reduced in place with the global set: its shared-memory
    allreduce then copies nothing in or out (:mod:`hvdlite.common.backend.shared_buckets`).
    None when that cannot be (``--no-zero-copy``, no shared memory, another set, not
    initialized): the caller allocates the buffer itself."""
    runtime = basics.current_runtime()
    if (
        runtime is None
        or not runtime.config.zero_copy
        or (process_set is not None and process_set.process_set_id != 0)
    ):
        return None
    return shared_buckets.allocate(numel, dtype)


def allreduce_one(
    buffer,
    output,
    name: Optional[str],
    op: ReduceOp,
    prescale: float = 1.0,
    postscale: float = 1.0,
    finish=None,
) -> Handle:
    """Reduce one buffer over all ranks into ``output`` (which may be the buffer itself).

    The common case, issued thousands of times per step by an optimizer, so it does the
    least work that is still every check :func:`allreduce_async` makes (the checks that
    raise note their error for stall reports, not this function: see
    :mod:`hvdlite.common.diagnostics.raised`).  A named tensor's
    :class:`Request` is built once and reused on later steps (keyed by name, dtype, shape,
    op and scale factors; the table is cleared at every ``init()``).
    """
    runtime = basics.current_runtime()
    if runtime is None:
        basics.runtime()  # raises the not-initialized error
    dt = _NAME_OF.get(buffer.dtype)
    if dt is None or dt == "bool":
        dt = buffer_dtype(buffer, name, OpType.ALLREDUCE)
        _check_reducible(dt, op, name)
    if name is None:
        name = auto_name(OpType.ALLREDUCE)
        req = key = None
    else:
        # a named request repeats every step: reuse it (requests are never changed)
        key = (name, dt, buffer.shape, op, prescale, postscale)
        req = _REQUESTS.get(key)
    if req is None:
        if len(name) > MAX_NAME_CHARS:
            check_name_length(name)
        req = Request(
            name,
            OpType.ALLREDUCE,
            dt,
            tuple(buffer.shape),
            -1,
            op,
            prescale if type(prescale) is float else float(prescale),
            postscale if type(postscale) is float else float(postscale),
        )
        if key is not None:
            if len(_REQUESTS) >= _MAX_REUSED_REQUESTS:
                _REQUESTS.clear()
            _REQUESTS[key] = req
    handle = Handle(1, finish, runtime.hurry)
    handle.names = [name]
    runtime.enqueue_one(Entry(req, buffer, output, handle, 0))
    return handle


#: named single-allreduce requests by (name, dtype, shape, op, prescale, postscale)
_REQUESTS: Dict[tuple, Request] = {}
_MAX_REUSED_REQUESTS = 1 << 16
basics.register_reset_hook(_REQUESTS.clear)


@noted
def allreduce_packed(
    flat,
    count: int,
    digest: int,
    name: Optional[str],
    op: ReduceOp,
    prescale: float = 1.0,
    postscale: float = 1.0,
    process_set=None,
    finish=None,
) -> Handle:
    """A grouped allreduce of ``count`` same-dtype tensors that the caller packed into the
    one flat buffer ``flat`` (reduced in place): one request, one queue entry and one cache
    slot instead of ``count``.  ``digest`` stands for the tensors' shapes, which every rank
    must agree on as on the total size; ``finish`` unpacks the result.

    Raises:
        TypeError: the dtype is not carried, or bool with an op other than Min/Max.
        ValueError: ``name`` is too long.
    """
    runtime, set_id = _runtime(process_set)
    base = name if name is not None else auto_name(OpType.ALLREDUCE, set_id)
    if len(base) > MAX_NAME_CHARS:
        check_name_length(base)
    dt = buffer_dtype(flat, base, OpType.ALLREDUCE)
    _check_reducible(dt, op, base)
    handle = Handle(1, finish, runtime.hurry)
    handle.names = [base]
    req = Request(
        base,
        OpType.ALLREDUCE,
        dt,
        tuple(flat.shape),
        -1,
        int(op),
        float(prescale),
        float(postscale),
        parts=(count, digest),
    )
    runtime.enqueue([Entry(req, flat, flat, handle, 0)])
    return handle


@noted
def allreduce_async(
    buffers: Sequence,
    outputs: Sequence,
    name: Optional[str],
    grouped: bool,
    op: ReduceOp,
    prescale: float = 1.0,
    postscale: float = 1.0,
    process_set=None,
    finish=None,
) -> Handle:
    """Reduce each buffer over the set's ranks into its output (which may be the buffer
    itself)."""
    if not grouped and (process_set is None or process_set is global_process_set):
        return allreduce_one(buffers[0], outputs[0], name, op, prescale, postscale, finish)
    runtime, set_id = _runtime(process_set)
    names = op_names(OpType.ALLREDUCE, name, len(buffers), grouped, set_id)
    for buf, nm in zip(buffers, names):
        _check_reducible(buffer_dtype(buf, nm, OpType.ALLREDUCE), op, nm)
    return _submit(
        OpType.ALLREDUCE,
        buffers,
        names,
        outputs,
        finish,
        runtime,
        reduce_op=int(op),
        prescale=float(prescale),
        postscale=float(postscale),
    )


@noted
def allgather_async(
    buffers: Sequence, name: Optional[str], grouped: bool, process_set=None, finish=None
) -> Handle:
    """Concatenate every rank's buffers along dim 0 (first dimensions may differ)."""
    runtime, set_id = _runtime(process_set)
    names = op_names(OpType.ALLGATHER, name, len(buffers), grouped, set_id)
    for buf, nm in zip(buffers, names):
        _check_has_rows(buf, nm, OpType.ALLGATHER)
    return _submit(OpType.ALLGATHER, buffers, names, [None] * len(buffers), finish, runtime)


@noted
def broadcast_async(
    buffer, output, root_rank, name: Optional[str], process_set=None, finish=None
) -> Handle:
    """The root's buffer in ``output`` on every rank (``output`` may be ``buffer``)."""
    runtime, set_id = _runtime(process_set)
    [nm] = op_names(OpType.BROADCAST, name, 1, False, set_id)
    root = check_root(root_rank, nm, runtime)
    return _submit(OpType.BROADCAST, [buffer], [nm], [output], finish, runtime, root=root)


@noted
def alltoall_async(
    buffer, splits: Optional[Sequence[int]], name: Optional[str], process_set=None, finish=None
) -> Handle:
    """Send ``splits[r]`` rows to rank r; the result is ``(rows received, received splits)``
    (or ``finish`` of the list holding that pair)."""
    runtime, set_id = _runtime(process_set)
    [nm] = op_names(OpType.ALLTOALL, name, 1, False, set_id)
    _check_has_rows(buffer, nm, OpType.ALLTOALL)
    n = runtime.size
    rows = buffer.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(
                f"alltoall of tensor {nm!r}: first dimension {rows} does not divide "
                f"evenly over {n} ranks; pass splits="
            )
        split_list = [rows // n] * n
    else:
        split_list = [int(s) for s in splits]
        if len(split_list) != n or any(s < 0 for s in split_list) or sum(split_list) != rows:
            raise ValueError(
                f"alltoall of tensor {nm!r}: splits {split_list} must have {n} "
                f"non-negative entries summing to the first dimension {rows}"
            )
    return _submit(
        OpType.ALLTOALL, [buffer], [nm], [None], finish, runtime, splits=tuple(split_list)
    )


@noted
def reducescatter_async(
    buffers: Sequence,
    op: ReduceOp,
    name: Optional[str],
    grouped: bool,
    prescale: float = 1.0,
    postscale: float = 1.0,
    process_set=None,
    finish=None,
) -> Handle:
    """Reduce each buffer; each rank gets its slice of dim 0 (earlier ranks get extra rows)."""
    runtime, set_id = _runtime(process_set)
    names = op_names(OpType.REDUCESCATTER, name, len(buffers), grouped, set_id)
    if op not in (Average, Sum):
        raise ValueError(
            f"reducescatter of {names[0]!r}: only hvd.Average and hvd.Sum are supported"
        )
    for buf, nm in zip(buffers, names):
        _check_has_rows(buf, nm, OpType.REDUCESCATTER)
    return _submit(
        OpType.REDUCESCATTER,
        buffers,
        names,
        [None] * len(buffers),
        finish,
        runtime,
        reduce_op=int(op),
        prescale=float(prescale),
        postscale=float(postscale),
    )


# -- waiting -----------------------------------------------------------------------------------
def poll(handle: Handle) -> bool:
    """Whether the operation of ``handle`` has finished (successfully or not); never blocks.

    Args:
        handle: a handle returned by an ``*_async`` function.

    Returns:
        True once :func:`synchronize` would return (or raise) at once.
    """
    return handle.done()


def synchronize(handle: Handle):
    """Wait for the operation of ``handle`` and return its result (or raise its error).

    The wait ends with HvdliteInternalError if the runtime stops (a peer died
    or shut down) before the operation completes.  A composite operation's handle (a
    callable, e.g. a sparse allreduce) is called to wait for its parts.

    Args:
        handle: a handle returned by an ``*_async`` function.

    Returns:
        The operation's result (see the ``*_async`` function that made the handle).

    Raises:
        TypeError: ``handle`` is not a handle.
        HvdliteInternalError: the runtime stopped before the operation completed.
        HvdliteMismatchError: the ranks submitted the operation with incompatible
            parameters.
    """
    if type(handle) is Handle and handle.done():  # the common case after the first wait
        return handle.value()
    if callable(handle) and not isinstance(handle, Handle):
        return handle()
    if not isinstance(handle, Handle):
        raise TypeError(
            f"synchronize expects a handle returned by an *_async call, got {type(handle).__name__}"
        )
    while not handle.wait(_SYNC_POLL_S):
        runtime = basics.current_runtime()
        if runtime is None or not runtime.running():
            if handle.wait(0.1):
                break
            raise HvdliteInternalError(
                f"operation on {handle.names} cannot complete: hvdlite's background thread has "
                f"stopped ({runtime.error() if runtime is not None else 'shut down'})"
            )
    return handle.value()


def _control(op: OpType, name: str, runtime=None) -> Handle:
    runtime = runtime or basics.runtime()
    handle = Handle(1, None, runtime.hurry)
    handle.names = [name]
    runtime.enqueue([Entry(Request(name, op), None, None, handle, 0)])
    return handle


@noted
def join() -> int:
    """Block until every rank has joined; returns the rank that joined last.

    While this rank waits here it keeps taking part in the other ranks'
    allreduces (contributing neutral values), reducescatters (zeros) and
    alltoalls (no rows), so ranks with fewer batches do not stall the rest.
    As in Horovod, the others' allgathers and broadcasts fail at once with a
    ``RuntimeError`` meanwhile (the job goes on).
    """
    return synchronize(_control(OpType.JOIN, JOIN_NAME))


@noted
def barrier(process_set=None) -> None:
    """Block until every rank of the set (default: the job) reached the barrier."""
    synchronize(_control(OpType.BARRIER, BARRIER_NAME, _runtime(process_set)[0]))
