"""The horovod.tensorflow collective API: TensorFlow's adapter over :mod:`hvdlite.common.ops`.

Every function has the name and semantics of its ``horovod.tensorflow`` counterpart.  This
module only does what is TensorFlow's own:

* **The crossing.**  An eager CPU tensor becomes a *buffer* of the runtime's array kind
  (:mod:`hvdlite.common.arrays`) through ``np.asarray`` (TensorFlow's own read-only view of
  the tensor's memory, no copy): with torch installed ``torch.from_numpy`` wraps it (no
  copy; bfloat16 travels as its int16 bit pattern viewed back as torch's bfloat16), without
  torch the numpy array is the buffer.  A result buffer comes back through DLPack (no copy)
  when it is 64-byte aligned, as TensorFlow requires, else (or for numpy's bfloat16, which
  numpy cannot export) through ``tf.convert_to_tensor`` of a numpy view (one copy).  torch
  is never imported here: a TensorFlow job under MPI runs without it.
* **Graph mode.**  Inside ``tf.function`` each collective is one ``tf.py_function`` node that
  runs the eager code, between two writes of one order token, so ``tf.function``'s automatic
  control dependencies run every collective, and every ``tf.cond`` / ``tf.while_loop`` holding
  one, in program order on every rank (:mod:`hvdlite.tensorflow.graph.nodes`).  An unnamed
  op gets its name when it is traced, from the graph's name and the input tensor's name, made unique by the graph's
  numbering (the same on every rank that traces the same program), as Horovod names its
  graph ops.  In a TF1 graph (``tf.compat.v1`` sessions) each collective is one node of
  hvdlite's asynchronous kernel, which holds no thread of the session's inter-op pool while
  it waits (a ``tf.data`` iterator's thread where the kernel cannot be built), so the
  collectives of a run need no order among them and are submitted together
  (:mod:`hvdlite.tensorflow.graph.nodes`).
* **Gradients** (``tf.custom_gradient``) are Horovod's registered TensorFlow gradients (and
  ``hvdlite.torch``'s): allreduce's is an allreduce with the same op and scaling, allgather's
  this rank's rows of an Average-allreduce, broadcast's an Average-allreduce kept on the root
  (zeros elsewhere), alltoall's the reverse alltoall, reducescatter's an allgather (times the
  set's size for Sum, and the pre/post factors).  A gradient takes the dtype of the output
  gradient it is computed from, as Horovod's and TensorFlow's own: ``tf.gradients`` and
  ``GradientTape.gradient`` accept output gradients of another floating dtype than the
  output (a float32 ``grad_ys`` for a float64 output), so the backward node cannot assume
  the input's dtype.
"""

import functools
import re
import warnings
from typing import List

import numpy as np
import tensorflow as tf

from hvdlite.common import api_docs, arrays, ops
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
    start_timeline,
    stop_timeline,
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
)
from hvdlite.common.rank_setup import add_process_set, init, remove_process_set  # noqa: F401
from hvdlite.tensorflow.graph import nodes as graph_nodes
from hvdlite.tensorflow.errors import as_tf_errors, raise_reported, report_mismatch

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
    "start_timeline",
    "stop_timeline",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
    "join",
    "barrier",
    "global_process_set",
    "ProcessSet",
    "add_process_set",
    "remove_process_set",
]

#: the ops' argument descriptions: the shared ones and TensorFlow's wording
_ARGS = {
    **api_docs.ARGS,
    "tensor": "a ``tf.Tensor`` with at least one dimension.",
    "tensors": "a list of ``tf.Tensor`` objects, which may differ in shape and dtype.",
    "name": api_docs.NAME
    + ("  ``None`` generates one (inside ``tf.function`` from the graph and the input's name)."),
}
_ALLREDUCE_TENSOR = (
    "a ``tf.Tensor`` (or a value convertible to one).  A ``tf.IndexedSlices`` "
    "is allgathered instead (for ``hvd.Average`` its values divided by the "
    "size with true division: integer values come back as float32 or "
    "float64), as Horovod does."
)
_ALLREDUCE_TENSORS = (
    _ARGS["tensors"][:-1] + "; ``IndexedSlices`` among them are reduced as in :func:`allreduce`."
)
_ALLGATHER_TENSOR = (
    "a ``tf.Tensor`` with at least one dimension; ranks may differ in the "
    "first dimension only.  ``IndexedSlices`` are gathered as "
    "``IndexedSlices``."
)
_BROADCAST_TENSOR = "a ``tf.Tensor`` (or a value convertible to one) on the CPU."
#: ``@_args(**own)``: the function's Args section, from :data:`_ARGS` and its ``own`` wording
_args = functools.partial(api_docs.documented, _ARGS)

# Raises entries most ops share (``@_args(raises=...)`` appends them to a docstring)
_RAISES_DTYPE = (
    "TypeError: an input has an unsupported dtype (or is an ``IndexedSlices`` "
    "where only allreduce takes one)."
)
_RAISES_MISMATCH = (
    "tf.errors.FailedPreconditionError: ranks submitted ``name`` with different shapes, "
    "dtypes, operations or roots (eagerly also an ``HvdliteMismatchError``)."
)
_RAISES_REFUSED = (
    "tf.errors.InvalidArgumentError: an argument the runtime refused when the "
    "op ran (eagerly also a ``ValueError``)."
)
_RAISES_STOPPED = (
    "HvdliteInternalError: the runtime stopped (a peer died or shut down) "
    "first; inside ``tf.function`` it reaches Python wrapped in a TensorFlow "
    "error."
)
#: an op that starts a collective / one that also waits for its result
_RAISES_START = (_RAISES_DTYPE,)
_RAISES_WAIT = (_RAISES_DTYPE, _RAISES_MISMATCH, _RAISES_REFUSED, _RAISES_STOPPED)

# np.asarray of an eager tensor is read-only; the runtime never writes into an input buffer
# (torch warns when it wraps one).
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning
)

_from_dlpack = tf.experimental.dlpack.from_dlpack


# -- the crossing ----------------------------------------------------------------------------
_SUPPORTED = (
    tf.float16,
    tf.bfloat16,
    tf.float32,
    tf.float64,
    tf.int8,
    tf.int16,
    tf.int32,
    tf.int64,
    tf.uint8,
    tf.uint16,
    tf.bool,
)
#: dtypes the runtime has no buffers for (Gloo and torch have no uint16 arithmetic), and what
#: carries them: (for reductions, a wider integer that holds every value and wraps back the
#: same; for data movement, a dtype of the same bits)
_CARRIED = {tf.uint16: (tf.int32, tf.int16)}


def _label(name) -> str:
    return f"tensor {name!r}" if name is not None else "an unnamed tensor"


def supported_tensor(t, name, what: str):
    """``t`` as a tensor the runtime can carry (dense, a supported dtype); every op checks
    its inputs with it, and so does ``broadcast_variables``, which starts its broadcasts
    itself.

    Raises:
        TypeError: an unsupported dtype or not a tensor.
    """
    if isinstance(t, tf.IndexedSlices):
        raise TypeError(
            f"{what} of {_label(name)}: IndexedSlices are handled by allreduce "
            f"only; densify with tf.convert_to_tensor"
        )
    t = tf.convert_to_tensor(t)
    if t.dtype not in _SUPPORTED:
        raise TypeError(
            f"{what} of {_label(name)}: dtype {t.dtype.name} is not supported "
            f"(supported: {', '.join(d.name for d in _SUPPORTED)})"
        )
    return t


def carried(tensors, arithmetic: bool):
    """``tensors`` in dtypes the runtime carries (see :data:`_CARRIED`), and the function
    that turns a list of results back into the original dtypes: the last step before a
    tensor crosses to the runtime, here and in ``broadcast_variables``."""
    dtypes = [t.dtype for t in tensors]
    if not any(d in _CARRIED for d in dtypes):
        return list(tensors), list

    def there(t):
        if t.dtype not in _CARRIED:
            return t
        wide, bits = _CARRIED[t.dtype]
        return tf.cast(t, wide) if arithmetic else tf.bitcast(t, bits)

    def back(outs):
        return [
            o if d not in _CARRIED else tf.cast(o, d) if arithmetic else tf.bitcast(o, d)
            for o, d in zip(outs, dtypes)
        ]

    return [there(t) for t in tensors], back


def to_buffer(t):
    """The runtime's buffer over an eager tensor's memory (no copy where TF allows it)."""
    a = np.asarray(t)
    if not a.flags.c_contiguous:  # never for a TF tensor; numpy scalars are fine
        a = np.ascontiguousarray(a)
    return arrays.kind().from_numpy(a)


#: TensorFlow's kernels assume this alignment (an unaligned tensor aborts the process)
_TF_ALIGN = 64


def from_buffer(b) -> tf.Tensor:
    """A TensorFlow tensor over a result buffer: the buffer's own memory through DLPack
    when it is aligned as TensorFlow needs (the runtime hands each result buffer over for
    good; the capsule keeps it alive), else a copy."""
    k = arrays.kind()
    if k.is_contiguous(b) and k.data_ptr(b) % _TF_ALIGN == 0:
        capsule = k.dlpack(b)
        if capsule is not None:
            return _from_dlpack(capsule)
    return tf.convert_to_tensor(k.to_numpy(b))


def empty_buffer_like(b):
    """A new uninitialised buffer of ``b``'s shape and dtype, for a result the runtime
    writes (an allreduce's output, a broadcast's on the ranks that receive)."""
    k = arrays.kind()
    return k.empty(tuple(b.shape), k.dtype_name(b))


# -- eager or graph --------------------------------------------------------------------------
def _run(fn, inputs, touts, collective=None):
    """``fn(*inputs)`` now (eager), or as one py_function node (inside a graph); a list.
    ``collective``: the name of the collective ``fn`` runs (None: ``fn`` waits for no other
    rank), whose node then runs where waiting cannot deadlock
    (:mod:`hvdlite.tensorflow.graph.nodes`)."""
    if tf.executing_eagerly():
        return list(fn(*inputs))
    outs = None if collective is None else graph_nodes.kernel_call(fn, inputs, touts)
    if outs is not None:
        return outs
    fn, touts = report_mismatch(fn, touts), list(touts) + [tf.string]
    if collective is None:
        outs = tf.py_function(fn, list(inputs), touts)
    else:
        outs = graph_nodes.collective_node(fn, inputs, touts)
    return raise_reported(outs[:-1], outs[-1])


#: the process-wide counter TensorFlow appends to a control-flow branch's graph name
#: (``cond_true_5120``, ``while_body_77``): it differs between ranks whose earlier code
#: differed, so it is left out of op names
_BRANCH_UID = re.compile(r"_(true|false|body|cond)_\d+$")
#: the name of the placeholder standing for a captured eager tensor: its id, under the name
#: scope of the branch that captured it again (``748:0``, ``cond/748:0``)
_CAPTURE_ID = re.compile(r"(^|/)\d+:\d+$")


def _graph_name(kind: str, t) -> str:
    """``<kind>.<graph>/<input tensor>``, made unique in the graph (several collectives may
    read one tensor) by the graph's own deterministic numbering.  A ``tf.cond`` /
    ``tf.while_loop`` branch is named without TensorFlow's process-wide counter; the name
    scope of the branch (``cond/``, ``cond_1/``) keeps two branches apart.  An eager tensor
    a ``tf.function`` captured is named by its process-wide id, which differs between ranks
    (inside a branch too, as ``cond/748:0``): the id is called ``captured`` instead (the
    graph's numbering tells captures apart)."""
    graph = tf.compat.v1.get_default_graph()
    label = _BRANCH_UID.sub(r"_\1", getattr(graph, "name", "graph"))
    tensor = _CAPTURE_ID.sub(r"\1captured", t.name)
    return graph.unique_name(f"{kind}.{label}/{tensor}")


def _name(kind: str, name, t):
    """The op's name: the given one; None (numbered by the op layer) when eager; else a
    name fixed at trace time that every rank tracing the same program agrees on."""
    if name is not None or tf.executing_eagerly():
        return name
    return _graph_name(kind, t)


def _sub(name, what: str):
    return None if name is None else f"{name}.{what}"


def _grad_name(name):
    """The name of a gradient's collective, fixed when the gradient is traced.  In a graph
    every tracing gets its own, by the graph's numbering (the same on every rank): one
    ``tf.gradients`` call per output of a grouped op, or two over one output, put several
    gradient nodes of one op in one run, which must not share a name."""
    if name is None or tf.executing_eagerly():
        return _sub(name, "grad")
    return tf.compat.v1.get_default_graph().unique_name(f"{name}.grad")


try:  # TensorFlow's own test, private: fall back to "yes"
    from tensorflow.python.eager.record import could_possibly_record as _could_record
except ImportError:  # pragma: no cover

    def _could_record():
        return True


def _size_now(process_set) -> tf.Tensor:
    """The set's size as an int32 scalar: a constant eagerly, read when the graph runs
    otherwise (an elastic job's size changes under a traced ``tf.function``)."""

    def size():
        return tf.constant(ops.process_set_size(process_set), tf.int32)

    if tf.executing_eagerly():
        return size()
    out = tf.py_function(size, [], tf.int32)
    out.set_shape([])
    return out


def scaled_by_size(t, process_set, power: int):
    """``t * size**power`` with the set's size read when the op runs (:func:`_size_now`).
    Integers are scaled in float64 and truncated toward zero, as the runtime scales them,
    keeping the dtype.  ``DistributedGradientTape`` divides a local source's gradient with
    it too (``power=-1``), so that division also follows an elastic job's size."""
    factor = tf.cast(_size_now(process_set), tf.float64) ** power
    if t.dtype.is_floating:
        return t * tf.cast(factor, t.dtype)
    return tf.cast(tf.cast(t, tf.float64) * factor, t.dtype)


def _differentiable(tensors) -> bool:
    """Whether to wrap the op in ``tf.custom_gradient``: floating inputs, and (eager) some
    gradient tape recording, since the wrapper costs about as much as the crossing."""
    if tf.executing_eagerly() and not _could_record():
        return False
    return any(t.dtype.is_floating for t in tensors)


def _collective(tensors, name, forward, shape_of, backward):
    """``forward(*xs)`` (eager, on the runtime) as one node whose outputs get
    ``shape_of(x)``; differentiable through ``backward(xs, outs, dys)`` (missing output
    gradients are zeros) when :func:`_differentiable` says so."""

    def compute(*xs):
        outs = _run(forward, xs, [x.dtype for x in xs], name)
        for o, x in zip(outs, xs):
            o.set_shape(shape_of(x))
        return outs

    if not _differentiable(tensors):
        return compute(*tensors)

    @tf.custom_gradient
    def op(*xs):
        outs = compute(*xs)

        def grad(*dys):
            dys = [
                tf.zeros_like(o) if d is None else tf.convert_to_tensor(d)
                for d, o in zip(dys, outs)
            ]
            return backward(xs, outs, dys)

        return outs, grad

    return list(op(*tensors))


def _rows_shape(x):
    return tf.TensorShape([None]).concatenate(x.shape[1:])


# -- allreduce -------------------------------------------------------------------------------
@as_tf_errors
def _allreduce_eager(tensors, name, grouped, rop, pre, post, process_set) -> List[tf.Tensor]:
    bufs = [to_buffer(t) for t in tensors]
    outs = [empty_buffer_like(b) for b in bufs]
    h = ops.allreduce_async(
        bufs, outs, name, grouped, rop, pre, post, process_set, list if grouped else None
    )
    res = ops.synchronize(h)
    return [from_buffer(r) for r in (res if grouped else [res])]


def _allreduce_dense(tensors, name, grouped, rop, pre, post, process_set):
    """Reduce dense tensors (one op, or one grouped op); differentiable."""

    def forward(*xs):
        return _allreduce_eager(xs, name, grouped, rop, pre, post, process_set)

    def backward(xs, outs, dys):
        if rop not in (Average, Sum):
            raise NotImplementedError(
                "the gradient of allreduce is defined for hvd.Average and hvd.Sum only"
            )
        return _allreduce_dense(dys, _grad_name(name), grouped, rop, pre, post, process_set)

    return _collective(tensors, name, forward, lambda x: x.shape, backward)


def _check_sparse(rop, pre, post, name):
    """What Horovod refuses for ``tf.IndexedSlices``, refused with its exception type.

    Raises:
        NotImplementedError: an op other than Sum or Average, or a scale factor.
    """
    if rop not in (Average, Sum):
        raise NotImplementedError(
            f"allreduce of IndexedSlices {_label(name)}: only hvd.Sum and hvd.Average are "
            f"supported with tf.IndexedSlices (or densify with sparse_as_dense=True)"
        )
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError(
            f"allreduce of IndexedSlices {_label(name)}: prescale_factor and "
            f"postscale_factor are not supported with tf.IndexedSlices"
        )


def _divided_by_size(values, process_set, name):
    """Gathered ``IndexedSlices`` values averaged as Horovod averages them: ``values / size``
    with TensorFlow's true division, so integers come back as floats (int8, uint8, int16
    and uint16 as float32, int32 and int64 as float64) instead of being truncated.

    Raises:
        TypeError: boolean values, which have no average.
    """
    if values.dtype == tf.bool:
        raise TypeError(
            f"allreduce of IndexedSlices {_label(name)}: hvd.Average of bool "
            f"values is undefined; use hvd.Sum or cast the values"
        )
    return tf.math.truediv(values, tf.cast(_size_now(process_set), values.dtype))


def _allreduce_sparse(slices: tf.IndexedSlices, name, rop, process_set):
    """Horovod's sparse allreduce: allgather the values and indices (Average divides the
    values by the size, see :func:`_divided_by_size`)."""
    values = allgather(slices.values, name=_sub(name, "values"), process_set=process_set)
    indices = allgather(slices.indices, name=_sub(name, "indices"), process_set=process_set)
    if rop == Average:
        values = _divided_by_size(values, process_set, name)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _compressed(compression, tensors, run):
    """``run`` (a list of tensors to a list of results) on the compressed ``tensors``, each
    result decompressed with its tensor's context; without a compressor, ``run(tensors)``."""
    if compression is None:
        return run(tensors)
    pairs = [compression.compress(t) for t in tensors]
    outs = run([t for t, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


@_args(tensor=_ALLREDUCE_TENSOR, raises=_RAISES_WAIT)
def allreduce(
    tensor,
    average=None,
    device_dense="",
    device_sparse="",
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
):
    """Reduce ``tensor`` over the ranks (by default: average it) into a new tensor.

    Differentiable for ``hvd.Average`` and ``hvd.Sum``: the gradient is the same
    reduction of the output's gradient.  Works eagerly and inside ``tf.function``.

    Returns:
        A new tensor of ``tensor``'s shape and dtype (``IndexedSlices`` for
        ``IndexedSlices``).

    Raises:
        ValueError: ``op`` is unknown or given with ``average``, or ``name`` is too long.
        NotImplementedError: an ``IndexedSlices`` with an op other than Sum or Average, or
            with a scale factor (as Horovod).
    """
    rop = ops.reduce_op(average, op, name or "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(rop, prescale_factor, postscale_factor, name)
        if not tf.executing_eagerly() and name is None:
            name = _graph_name("allreduce", tensor.values)
        return _allreduce_sparse(tensor, name, rop, process_set)
    [tensor], back = carried([supported_tensor(tensor, name, "allreduce")], True)
    name = _name("allreduce", name, tensor)
    out = _compressed(
        compression,
        [tensor],
        lambda ts: _allreduce_dense(
            ts, name, False, rop, prescale_factor, postscale_factor, process_set
        ),
    )
    return back(out)[0]


@_args(tensors=_ALLREDUCE_TENSORS, raises=_RAISES_WAIT)
def grouped_allreduce(
    tensors,
    average=None,
    device_dense="",
    device_sparse="",
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
    ignore_name_scope=False,
    name=None,
):
    """Reduce a list of tensors as one operation (fused together); a list of new tensors.

    Differentiable for ``hvd.Average`` and ``hvd.Sum``.

    Returns:
        A list of new tensors, in the order of ``tensors`` (``[]`` for an empty list).

    Raises:
        ValueError: ``op`` is unknown or given with ``average``, or ``name`` is too long.
        NotImplementedError: an ``IndexedSlices`` with an op other than Sum or Average, or
            with a scale factor (as Horovod).
    """
    tensors = list(tensors)
    if not tensors:
        return []
    rop = ops.reduce_op(average, op, name or "grouped_allreduce")
    dense_at = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if len(dense_at) < len(tensors):
        _check_sparse(rop, prescale_factor, postscale_factor, name)
    dense, back = carried(
        [supported_tensor(tensors[i], name, "grouped_allreduce") for i in dense_at], True
    )
    out: list = [None] * len(tensors)
    if not tf.executing_eagerly() and name is None:
        first = dense[0] if dense else tensors[0].values
        name = _graph_name("grouped_allreduce", first)
    if dense:
        reduced = _compressed(
            compression,
            dense,
            lambda ts: _allreduce_dense(
                ts, name, True, rop, prescale_factor, postscale_factor, process_set
            ),
        )
        for i, r in zip(dense_at, back(reduced)):
            out[i] = r
    for i, t in enumerate(tensors):
        if out[i] is None:
            out[i] = _allreduce_sparse(t, _sub(name, f"sparse{i}"), rop, process_set)
    return out


# -- allgather -------------------------------------------------------------------------------
@as_tf_errors
def _allgather_eager(tensors, name, grouped, process_set) -> List[tf.Tensor]:
    bufs = [to_buffer(t) for t in tensors]
    for b, t in zip(bufs, tensors):
        if len(b.shape) == 0:
            raise ValueError(
                f"allgather of {_label(name)}: a scalar has no first dimension to "
                f"concatenate; reshape it to [1]"
            )
    res = ops.synchronize(
        ops.allgather_async(bufs, name, grouped, process_set, list if grouped else None)
    )
    return [from_buffer(r) for r in (res if grouped else [res])]


def _rows_before_me(rows: tf.Tensor, name, process_set) -> np.ndarray:
    """Every set rank's first dimensions ([set size, k]), gathered."""
    return np.asarray(_allgather_eager([rows], name, False, process_set)[0])


def _allgather(tensors, name, grouped, process_set):
    def forward(*xs):
        return _allgather_eager(xs, name, grouped, process_set)

    def backward(xs, outs, dys):
        rows = tf.stack([tf.shape(x, out_type=tf.int64)[0] for x in xs])[None, :]
        gname = _grad_name(name)

        def gradients(rows, *gs):
            summed = _allreduce_eager(gs, gname, grouped, Average, 1.0, 1.0, process_set)
            allrows = _rows_before_me(rows, _sub(gname, "rows"), process_set)
            me = ops.process_set_rank(process_set)
            offsets = allrows[:me].sum(0)
            return [s[int(o) : int(o) + int(n)] for s, o, n in zip(summed, offsets, allrows[me])]

        res = _run(gradients, [rows] + dys, [d.dtype for d in dys], gname)
        for r, x in zip(res, xs):
            r.set_shape(x.shape)
        return res

    return _collective(tensors, name, forward, _rows_shape, backward)


@_args(tensor=_ALLGATHER_TENSOR, raises=_RAISES_WAIT)
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    Differentiable: this rank's gradient is its own rows of the averaged output
    gradient.

    Returns:
        A new tensor whose rows are rank 0's, then rank 1's, and so on.

    Raises:
        ValueError: ``tensor`` is a scalar, or ``name`` is too long.
    """
    if isinstance(tensor, tf.IndexedSlices):
        if not tf.executing_eagerly() and name is None:
            name = _graph_name("allgather", tensor.values)
        return tf.IndexedSlices(
            allgather(tensor.values, _sub(name, "values"), process_set=process_set),
            allgather(tensor.indices, _sub(name, "indices"), process_set=process_set),
            dense_shape=tensor.dense_shape,
        )
    [tensor], back = carried([supported_tensor(tensor, name, "allgather")], False)
    return back(_allgather([tensor], _name("allgather", name, tensor), False, process_set))[0]


@_args(raises=_RAISES_WAIT)
def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """:func:`allgather` of several tensors as one operation (differentiable).

    Returns:
        A list of the gathered tensors, in the order of ``tensors``.

    Raises:
        ValueError: an input is a scalar, or ``name`` is too long.
    """
    tensors, back = carried(
        [supported_tensor(t, name, "grouped_allgather") for t in tensors], False
    )
    if not tensors:
        return []
    return back(
        _allgather(tensors, _name("grouped_allgather", name, tensors[0]), True, process_set)
    )


# -- broadcast -------------------------------------------------------------------------------
@as_tf_errors
def _broadcast_eager(t, root_rank, name, process_set) -> tf.Tensor:
    buf = to_buffer(t)
    out = arrays.kind().clone(buf) if rank() == root_rank else empty_buffer_like(buf)
    return from_buffer(ops.synchronize(ops.broadcast_async(buf, out, root_rank, name, process_set)))


@_args(tensor=_BROADCAST_TENSOR, raises=_RAISES_WAIT)
def broadcast(
    tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set
):
    """The root's ``tensor`` on every rank, in a new tensor.

    Differentiable: the output gradients are averaged over the ranks and flow to
    the root's input only (the others get zeros).

    Returns:
        A new tensor holding ``root_rank``'s value.

    Raises:
        ValueError: ``root_rank`` is not a member of ``process_set``, or ``name`` is too long.
    """
    [tensor], back = carried([supported_tensor(tensor, name, "broadcast")], False)
    name = _name("broadcast", name, tensor)

    def compute(x):
        [o] = _run(
            lambda v: [_broadcast_eager(v, root_rank, name, process_set)], [x], [x.dtype], name
        )
        o.set_shape(x.shape)
        return o

    if not _differentiable([tensor]):
        return back([compute(tensor)])[0]

    @tf.custom_gradient
    def op(x):
        def grad(dy):
            gname = _grad_name(name)

            def backward(g):
                [s] = _allreduce_eager([g], gname, False, Average, 1.0, 1.0, process_set)
                return [s if rank() == root_rank else tf.zeros_like(s)]

            dy = tf.convert_to_tensor(dy)
            [s] = _run(backward, [dy], [dy.dtype], gname)
            s.set_shape(x.shape)
            return s

        return compute(x), grad

    return op(tensor)


# -- alltoall / reducescatter ----------------------------------------------------------------
@as_tf_errors
def _alltoall_eager(t, splits, name, process_set):
    buf = to_buffer(t)
    if len(buf.shape) == 0:
        raise ValueError(
            f"alltoall of {_label(name)}: a scalar has no first dimension to "
            f"split; reshape it to [1]"
        )
    if splits is not None:
        splits = [int(s) for s in np.asarray(splits).reshape(-1)]
    out, received = ops.synchronize(ops.alltoall_async(buf, splits, name, process_set))
    return [from_buffer(out), tf.convert_to_tensor(np.asarray(received, dtype=np.int32))]


@_args(raises=_RAISES_WAIT)
def alltoall(
    tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set
):
    """Send ``splits[r]`` rows of ``tensor`` to rank ``r``; receive every rank's rows for
    this one.

    Differentiable: the gradient of each received row is sent back to its sender.

    Returns:
        The received rows in rank order; with ``splits`` given, the pair ``(rows,
        received_splits)``, as Horovod's TensorFlow alltoall.

    Raises:
        ValueError: ``tensor`` is a scalar, ``splits`` does not fit the first dimension
            (``None``: the set's size must divide it), or ``name`` is too long.
    """
    [tensor], back = carried([supported_tensor(tensor, name, "alltoall")], False)
    name = _name("alltoall", name, tensor)
    split_in = [] if splits is None else [tf.cast(tf.convert_to_tensor(splits), tf.int32)]

    def compute(x, *sp):
        out, received = _run(
            lambda v, *s: _alltoall_eager(v, s[0] if s else None, name, process_set),
            [x, *sp],
            [x.dtype, tf.int32],
            name,
        )
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        received.set_shape([None])
        return out, received

    if not _differentiable([tensor]):
        out, received = compute(tensor, *split_in)
        [out] = back([out])
        return out if splits is None else (out, received)

    holder = {}

    @tf.custom_gradient
    def op(x):
        out, received = compute(x, *split_in)
        holder["received"] = received

        def grad(dy, _unused=None):
            dy, gname = tf.convert_to_tensor(dy), _grad_name(name)
            [back, _] = _run(
                lambda g, s: _alltoall_eager(g, s, gname, process_set),
                [dy, received],
                [dy.dtype, tf.int32],
                gname,
            )
            back.set_shape(x.shape)
            return back

        return (out, tf.stop_gradient(received)), grad

    out, received = op(tensor)
    return out if splits is None else (out, received)


def _reducescatter(tensors, name, grouped, rop, pre, post, process_set):
    @as_tf_errors
    def forward(*xs):
        bufs = [to_buffer(x) for x in xs]
        res = ops.synchronize(
            ops.reducescatter_async(
                bufs, rop, name, grouped, pre, post, process_set, list if grouped else None
            )
        )
        return [from_buffer(r) for r in (res if grouped else [res])]

    def backward(xs, outs, dys):
        factor = pre * post
        gathered = _allgather(dys, _grad_name(name), True, process_set)
        if factor != 1.0:
            gathered = [g * tf.cast(factor, g.dtype) for g in gathered]
        if rop == Sum:
            gathered = [scaled_by_size(g, process_set, 1) for g in gathered]
        return gathered

    return _collective(tensors, name, forward, _rows_shape, backward)


@_args(op=api_docs.AVERAGE_OR_SUM, raises=_RAISES_WAIT)
def reducescatter(
    tensor,
    device_dense="",
    compression=None,
    op=Average,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """This rank's slice (along the first dimension) of the reduction of ``tensor``.

    Differentiable: the gradient is the allgather of the output gradients (times the
    set's size for ``hvd.Sum``, and times the scale factors).

    Returns:
        A new tensor: this rank's rows of the reduction; the rows are split as evenly as
        possible, the first ranks getting one extra.

    Raises:
        ValueError: ``op`` is neither Average nor Sum, or ``name`` is too long.
    """
    rop = ops.reduce_op(None, op, name or "reducescatter")
    [tensor], back = carried([supported_tensor(tensor, name, "reducescatter")], True)
    name = _name("reducescatter", name, tensor)
    return back(
        _compressed(
            compression,
            [tensor],
            lambda ts: _reducescatter(
                ts, name, False, rop, prescale_factor, postscale_factor, process_set
            ),
        )
    )[0]


@_args(op=api_docs.AVERAGE_OR_SUM, raises=_RAISES_WAIT)
def grouped_reducescatter(
    tensors,
    device_dense="",
    compression=None,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
    name=None,
    ignore_name_scope=False,
):
    """:func:`reducescatter` of several tensors as one operation (differentiable).

    Returns:
        A list of this rank's slices, in the order of ``tensors``.

    Raises:
        ValueError: ``op`` is neither Average nor Sum, or ``name`` is too long.
    """
    rop = ops.reduce_op(None, op, name or "grouped_reducescatter")
    tensors, back = carried(
        [supported_tensor(t, name, "grouped_reducescatter") for t in tensors], True
    )
    if not tensors:
        return []
    name = _name("grouped_reducescatter", name, tensors[0])
    return back(
        _compressed(
            compression,
            tensors,
            lambda ts: _reducescatter(
                ts, name, True, rop, prescale_factor, postscale_factor, process_set
            ),
        )
    )


# -- join, barrier ---------------------------------------------------------------------------
def join() -> int:
    """Block until every rank has joined; returns the rank that joined last.

    While this rank waits it takes part in the others' allreduces with neutral values,
    so ranks with fewer batches do not stall the rest.

    Returns:
        The rank that joined last (inside ``tf.function``: an int32 scalar tensor).

    Raises:
        HvdliteInternalError: the runtime stopped before every rank joined.
    """
    if not tf.executing_eagerly():
        return _run(
            lambda: [tf.constant(ops.join(), tf.int32)],
            [],
            [tf.int32],
            tf.compat.v1.get_default_graph().unique_name("join"),
        )[0]
    return ops.join()


@_args()
def barrier(process_set=global_process_set) -> None:
    """Block until every rank of the process set has reached the barrier.

    Returns:
        None eagerly; inside ``tf.function`` an int32 tensor to depend on.

    Raises:
        HvdliteInternalError: the runtime stopped before every member arrived.
    """
    if not tf.executing_eagerly():

        def fn():
            ops.barrier(process_set)
            return [tf.constant(0, tf.int32)]

        return _run(fn, [], [tf.int32], tf.compat.v1.get_default_graph().unique_name("barrier"))[0]
    ops.barrier(process_set)
