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
import json
import threading
from typing import Callable, Dict, List, Optional, Sequence

from hvdlite.common import arrays, basics
from hvdlite.common import process_sets as _sets
from hvdlite.common import config as cfg
from hvdlite.common.config import Config
from hvdlite.common.backend import shared_buckets
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.process_sets import ProcessSet, global_process_set  # noqa: F401
from hvdlite.common.diagnostics.raised import noted
from hvdlite.common.diagnostics.recorder import NULL, Recorder
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


def op_names(op: OpType, name: Optional[str], count: int, grouped: bool,
             set_id: int = 0) -> List[str]:
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
        fast = PLAIN_OPS.get(op) if not isinstance(op, bool) else None
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
    if not isinstance(root_rank, int) or isinstance(root_rank, bool) or \
            not 0 <= root_rank < n:
        raise ValueError(f"broadcast of tensor {name!r}: root_rank={root_rank!r} is not a rank "
                         f"of this job (0..{n - 1})")
    if len(ranks) == n:
        return root_rank
    if root_rank not in ranks:
        raise ValueError(f"broadcast of tensor {name!r}: root_rank={root_rank} is not a member "
                         f"of the process set (ranks {ranks})")
    return ranks.index(root_rank)


def _check_has_rows(buf, name: str, op: OpType) -> None:
    if len(buf.shape) == 0:
        raise ValueError(f"{op.name.lower()} of tensor {name!r}: a scalar has no first "
                         f"dimension to split or concatenate; reshape it to [1]")


# -- submission --------------------------------------------------------------------------------
def _submit(op: OpType, buffers: Sequence, names: Sequence[str], outputs: Sequence,
            finish: Optional[Callable[[list], object]] = None, runtime=None,
            **fields) -> Handle:
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
        raise ValueError(f"tensor name {name[:60]!r}... is {len(name)} characters long; names "
                         f"are limited to {MAX_NAME_CHARS} characters (they are sent to every "
                         f"rank in each negotiation)")


@noted
def _check_reducible(dt: str, op: ReduceOp, name: str) -> None:
    if dt == "bool" and op not in _BOOL_OPS:
        raise TypeError(f"allreduce of bool tensor {name!r}: only op=hvd.Min or hvd.Max "
                        f"(logical and / or) are defined for bool")


def shared_bucket(numel: int, dtype, process_set=None):
    """A zeroed flat buffer of ``numel`` elements of ``dtype`` that this host's other ranks
    can read, for a gradient bucket reduced in place with the global set: its shared-memory
    allreduce then copies nothing in or out (:mod:`hvdlite.common.backend.shared_buckets`).
    None when that cannot be (``--no-zero-copy``, no shared memory, another set, not
    initialized): the caller allocates the buffer itself."""
    runtime = basics.current_runtime()
    if runtime is None or not runtime.config.zero_copy or \
            (process_set is not None and process_set.process_set_id != 0):
        return None
    return shared_buckets.allocate(numel, dtype)


def allreduce_one(buffer, output, name: Optional[str], op: ReduceOp, prescale: float = 1.0,
                  postscale: float = 1.0, finish=None) -> Handle:
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
        basics.runtime()                    # raises the not-initialized error
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
        req = Request(name, OpType.ALLREDUCE, dt, tuple(buffer.shape), -1, op,
                      prescale if type(prescale) is float else float(prescale),
                      postscale if type(postscale) is float else float(postscale))
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
def allreduce_packed(flat, count: int, digest: int, name: Optional[str], op: ReduceOp,
                     prescale: float = 1.0, postscale: float = 1.0, process_set=None,
                     finish=None) -> Handle:
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
    req = Request(base, OpType.ALLREDUCE, dt, tuple(flat.shape), -1, int(op), float(prescale),
                  float(postscale), parts=(count, digest))
    runtime.enqueue([Entry(req, flat, flat, handle, 0)])
    return handle


@noted
def allreduce_async(buffers: Sequence, outputs: Sequence, name: Optional[str], grouped: bool,
                    op: ReduceOp, prescale: float = 1.0, postscale: float = 1.0,
                    process_set=None, finish=None) -> Handle:
    """Reduce each buffer over the set's ranks into its output (which may be the buffer
    itself)."""
    if not grouped and (process_set is None or process_set is global_process_set):
        return allreduce_one(buffers[0], outputs[0], name, op, prescale, postscale, finish)
    runtime, set_id = _runtime(process_set)
    names = op_names(OpType.ALLREDUCE, name, len(buffers), grouped, set_id)
    for buf, nm in zip(buffers, names):
        _check_reducible(buffer_dtype(buf, nm, OpType.ALLREDUCE), op, nm)
    return _submit(OpType.ALLREDUCE, buffers, names, outputs, finish, runtime,
                   reduce_op=int(op), prescale=float(prescale), postscale=float(postscale))


@noted
def allgather_async(buffers: Sequence, name: Optional[str], grouped: bool,
                    process_set=None, finish=None) -> Handle:
    """Concatenate every rank's buffers along dim 0 (first dimensions may differ)."""
    runtime, set_id = _runtime(process_set)
    names = op_names(OpType.ALLGATHER, name, len(buffers), grouped, set_id)
    for buf, nm in zip(buffers, names):
        _check_has_rows(buf, nm, OpType.ALLGATHER)
    return _submit(OpType.ALLGATHER, buffers, names, [None] * len(buffers), finish, runtime)


@noted
def broadcast_async(buffer, output, root_rank, name: Optional[str], process_set=None,
                    finish=None) -> Handle:
    """The root's buffer in ``output`` on every rank (``output`` may be ``buffer``)."""
    runtime, set_id = _runtime(process_set)
    [nm] = op_names(OpType.BROADCAST, name, 1, False, set_id)
    root = check_root(root_rank, nm, runtime)
    return _submit(OpType.BROADCAST, [buffer], [nm], [output], finish, runtime, root=root)


@noted
def alltoall_async(buffer, splits: Optional[Sequence[int]], name: Optional[str],
                   process_set=None, finish=None) -> Handle:
    """Send ``splits[r]`` rows to rank r; the result is ``(rows received, received splits)``
    (or ``finish`` of the list holding that pair)."""
    runtime, set_id = _runtime(process_set)
    [nm] = op_names(OpType.ALLTOALL, name, 1, False, set_id)
    _check_has_rows(buffer, nm, OpType.ALLTOALL)
    n = runtime.size
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
    return _submit(OpType.ALLTOALL, [buffer], [nm], [None], finish, runtime,
                   splits=tuple(split_list))


@noted
def reducescatter_async(buffers: Sequence, op: ReduceOp, name: Optional[str], grouped: bool,
                        prescale: float = 1.0, postscale: float = 1.0, process_set=None,
                        finish=None) -> Handle:
    """Reduce each buffer; each rank gets its slice of dim 0 (earlier ranks get extra rows)."""
    runtime, set_id = _runtime(process_set)
    names = op_names(OpType.REDUCESCATTER, name, len(buffers), grouped, set_id)
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter of {names[0]!r}: only hvd.Average and hvd.Sum are "
                         f"supported")
    for buf, nm in zip(buffers, names):
        _check_has_rows(buf, nm, OpType.REDUCESCATTER)
    return _submit(OpType.REDUCESCATTER, buffers, names, [None] * len(buffers), finish,
                   runtime, reduce_op=int(op), prescale=float(prescale),
                   postscale=float(postscale))


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
    if type(handle) is Handle and handle.done():     # the common case after the first wait
        return handle.value()
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


# -- process sets ------------------------------------------------------------------------------
#: names of the job-wide exchanges that agree on a change of process sets
_AGREE_NAME = "hvdlite.process_sets"


def _set_ranks_seen_here(ps: ProcessSet) -> Optional[List[int]]:
    """The ranks this process says ``ps`` has; None when it cannot know (a communicator
    this process is not in)."""
    if ps.mpi_comm is None:
        return list(ps.ranks)
    backend = basics.runtime().backend
    if not hasattr(backend, "job_ranks_of"):
        raise ValueError(f"a ProcessSet made from an MPI communicator needs the MPI backend; "
                         f"this job runs {backend.name!r} (give the ranks as a list)")
    return sorted(backend.job_ranks_of(ps.mpi_comm)) or None


def _agree(kind: str, sets: Sequence[ProcessSet]) -> List[List[int]]:
    """Check that every rank asks for the same change; returns each set's ranks.

    A collective over the whole job (two allgathers), so every rank reaches the same
    verdict and raises the same error.

    Raises:
        ValueError: the ranks asked for different changes, or a set's ranks are not valid.
    """
    k = arrays.kind()
    me, n = basics.rank(), basics.size()
    mine = {"kind": kind, "sets": [_set_ranks_seen_here(ps) for ps in sets]}
    blob = json.dumps(mine).encode()
    lens = synchronize(allgather_async([k.tensor([len(blob)], "int64")],
                                       _AGREE_NAME + ".len", False)).tolist()
    width = max(lens)
    row = k.zeros((1, width), "uint8")
    row[0, :len(blob)] = k.from_bytes(blob)
    rows = synchronize(allgather_async([row], _AGREE_NAME + ".data", False))
    asked = [json.loads(k.to_numpy(rows[r, :lens[r]]).tobytes()) for r in range(n)]
    shapes = {(a["kind"], len(a["sets"])) for a in asked}
    if len(shapes) > 1:
        said = "; ".join(f"rank {r}: {a['kind']} {len(a['sets'])} set(s)"
                         for r, a in enumerate(asked))
        raise ValueError(f"rank {me}: the ranks disagree on the process-set change ({said}); "
                         f"every rank must add and remove the same sets in the same order")
    agreed = []
    for i in range(len(sets)):
        views = {}
        for r, a in enumerate(asked):
            if a["sets"][i] is not None:
                views.setdefault(tuple(a["sets"][i]), []).append(r)
        if len(views) != 1:
            said = "; ".join(f"ranks {rs} asked for {list(v)}" for v, rs in views.items()) \
                or "no rank is a member"
            raise ValueError(f"rank {me}: {kind} process set: the ranks disagree on its "
                             f"members ({said})")
        ranks = list(next(iter(views)))
        if not ranks or ranks[0] < 0 or ranks[-1] >= n:
            raise ValueError(f"rank {me}: {kind} process set {ranks}: ranks must be a "
                             f"non-empty subset of 0..{n - 1}")
        agreed.append(ranks)
    return agreed


def _dynamic_required(what: str) -> None:
    if not _sets.dynamic_enabled():
        twins = " or ".join(f"{t}=1" for t in cfg.horovod_twins(cfg.DYNAMIC_PROCESS_SETS))
        raise ValueError(f"{what}: dynamic process sets are off; start with "
                         f"hvd.init(process_sets='dynamic') or set "
                         f"{cfg.DYNAMIC_PROCESS_SETS}=1 ({twins})")


@noted
def add_process_set(process_set) -> ProcessSet:
    """Register a process set while the job runs; returns it (with its id).

    A collective: every rank of the job calls it, with the same ranks, in the same order
    as its other process-set changes.  Needs dynamic process sets.

    Args:
        process_set: a :class:`ProcessSet`, or a list of ranks to make one of.

    Returns:
        The registered :class:`ProcessSet`.

    Raises:
        ValueError: dynamic process sets are off, the ranks disagree or are out of range,
            the set is already registered, or a set with the same ranks exists.
    """
    basics.runtime()
    _dynamic_required("add_process_set")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"add_process_set: {ps!r} is already registered")
    [ranks] = _agree("add", [ps])
    if ranks == list(range(basics.size())):
        raise ValueError(f"add_process_set: ranks {ranks} are the whole job, which is "
                         f"hvd.global_process_set")
    existing = _sets.find(ranks)
    if existing is not None:
        raise ValueError(f"add_process_set: a process set with ranks {ranks} already exists "
                         f"({existing!r})")
    return _sets.register(ps, ranks)


@noted
def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set added with :func:`add_process_set`; its members' pending operations
    on it fail.  A collective over the job, like adding.

    Args:
        process_set: the registered :class:`ProcessSet`.

    Returns:
        True once removed.

    Raises:
        ValueError: dynamic process sets are off, the set is the global one or not
            registered, or the ranks disagree.
    """
    basics.runtime()
    _dynamic_required("remove_process_set")
    if _sets.is_global(process_set):
        raise ValueError("remove_process_set: the global process set cannot be removed")
    if not isinstance(process_set, ProcessSet) or \
            process_set not in _sets.registered():
        raise ValueError(f"remove_process_set: {process_set!r} is not a registered process set")
    _agree("remove", [process_set])
    _sets.unregister(process_set)
    return True


def init(comm=None, process_sets=None, *, dynamic_process_sets: Optional[bool] = None,
         config: Optional[Config] = None, recorder: Recorder = NULL) -> None:
    """Start hvdlite on this rank, as ``horovod.torch.init``.

    Idempotent while the runtime runs.  Every rank of the job must call it; it returns
    once this rank has joined the job's rendezvous.

    Args:
        comm: under MPI, the job's processes: an mpi4py communicator, or a list of
            ``MPI_COMM_WORLD`` ranks (``None``: all of them).
        process_sets: :class:`ProcessSet` objects to register now (every rank passes the
            same), or ``"dynamic"`` to allow :func:`add_process_set` later.
        dynamic_process_sets: allow :func:`add_process_set` / :func:`remove_process_set`
            (``None``: from the environment, ``HVDLITE_DYNAMIC_PROCESS_SETS`` or
            Horovod's name for it).
        config: a ready configuration (tests); ``None`` reads the environment.
        recorder: receives the background thread's phase boundaries (default: none).

    Raises:
        ValueError: ``comm`` does not fit the backend, or the sets are not valid.
    """
    static = []
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(f"hvd.init(process_sets={process_sets!r}): expected a list of "
                             f"ProcessSet objects or 'dynamic'")
        dynamic_process_sets = True
    elif process_sets is not None:
        static = [ps if isinstance(ps, ProcessSet) else ProcessSet(ps) for ps in process_sets]
    if basics.is_initialized() and basics.current_runtime().running():
        return
    basics.start_runtime(config, recorder, comm)
    if dynamic_process_sets is None:
        dynamic_process_sets = basics.config().dynamic_process_sets
    _sets.set_dynamic(dynamic_process_sets)
    if static:
        agreed = _agree("add", static)
        if len({tuple(r) for r in agreed}) != len(agreed):
            raise ValueError(f"hvd.init(process_sets=...): two sets have the same ranks "
                             f"({agreed})")
        for ps, ranks in zip(static, agreed):
            if ranks != list(range(basics.size())):
                _sets.register(ps, ranks)
            else:
                ps.process_set_id = 0
                ps.ranks = ranks
