"""hvdlite.tensorflow held to Horovod's behaviour in its corners, at np=2 and np=3: TF1 graphs
(many collectives in one ``session.run``, gradients built in a graph), IndexedSlices, error
types, dtypes and the public names.

One launch runs every case; ``sys.argv[1:]`` may name cases.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

import hvdlite.tensorflow as hvd  # noqa: E402
from tests.worker_cases import run_cases  # noqa: E402

v1 = tf.compat.v1
#: TF1 sessions as small as the pool where the deadlock was seen
SESSION_CONFIG = v1.ConfigProto(inter_op_parallelism_threads=2, intra_op_parallelism_threads=1)
GRAPH_DTYPES = [
    tf.float32,
    tf.float64,
    tf.int32,
    tf.int64,
    tf.float16,
    tf.uint8,
    tf.int8,
    tf.bfloat16,
    tf.int16,
]


def close(what, got, want, tol=0.0):
    np.testing.assert_allclose(
        np.asarray(got, dtype=np.float64),
        np.asarray(want, dtype=np.float64),
        rtol=tol,
        atol=tol,
        err_msg=f"{what} on rank {hvd.rank()}",
    )


def session(graph):
    return v1.Session(graph=graph, config=SESSION_CONFIG)


# -- TF1 graphs --------------------------------------------------------------------------------
def _fill(k, i, shape, dt):
    """Rank k's input of collective i: small integers, exact in every dtype."""
    return tf.cast(tf.fill(shape, float((k + i) % 3 + 1)), dt)


def _collective_spec(i, n):
    """Collective i of the 50: (build(rank) -> tensor, reference value)."""
    dt = GRAPH_DTYPES[i % len(GRAPH_DTYPES)]
    rows = i % 3 + 1
    shape = (rows, i % 4 + 1)
    kind = (
        "allreduce",
        "allgather",
        "broadcast",
        "alltoall",
        "reducescatter",
        "grouped_allreduce",
        "grouped_allgather",
    )[i % 7]
    vals = [np.full(shape, float((k + i) % 3 + 1)) for k in range(n)]
    name = f"g50.{i}"
    if kind == "allreduce":
        return (
            lambda r: hvd.allreduce(_fill(r, i, shape, dt), op=hvd.Sum, name=name),
            lambda r: np.sum(vals, 0),
        )
    if kind == "grouped_allreduce":
        return (
            lambda r: hvd.grouped_allreduce([_fill(r, i, shape, dt)], op=hvd.Max, name=name)[0],
            lambda r: np.max(vals, 0),
        )
    if kind == "allgather":
        return (
            lambda r: hvd.allgather(_fill(r, i, shape, dt), name=name),
            lambda r: np.concatenate(vals),
        )
    if kind == "grouped_allgather":
        return (
            lambda r: hvd.grouped_allgather([_fill(r, i, shape, dt)], name=name)[0],
            lambda r: np.concatenate(vals),
        )
    if kind == "broadcast":
        root = i % n
        return (
            lambda r: hvd.broadcast(_fill(r, i, shape, dt), root, name=name),
            lambda r: vals[root],
        )
    if kind == "alltoall":
        big = (n, shape[1])
        return (
            lambda r: hvd.alltoall(_fill(r, i, big, dt), name=name),
            lambda r: np.stack([np.full(big[1], float((k + i) % 3 + 1)) for k in range(n)]),
        )
    big = (n, shape[1])
    return (
        lambda r: hvd.reducescatter(_fill(r, i, big, dt), op=hvd.Sum, name=name),
        lambda r: np.full((1, big[1]), float(sum((k + i) % 3 + 1 for k in range(n)))),
    )


def check_graph_fifty_collectives():
    """50 collectives of mixed kinds, dtypes and shapes in one ``session.run`` on a 2-thread
    pool, each rank building them in its own order (names given): ten runs in a row."""
    r, n = hvd.rank(), hvd.size()
    specs = [_collective_spec(i, n) for i in range(50)]
    order = np.random.RandomState(r).permutation(50)
    graph = tf.Graph()
    with graph.as_default():
        outs = {int(i): specs[i][0](r) for i in order}
    with session(graph) as s:
        for step in range(10):
            got = s.run(outs)
            for i, (_, want) in enumerate(specs):
                close(f"run {step} collective {i}", got[i].astype(np.float64), want(r))


def _ancestors(op):
    """Every op ``op`` waits for (data and control inputs, transitively)."""
    seen, todo = set(), [op]
    while todo:
        node = todo.pop()
        for parent in [t.op for t in node.inputs] + list(node.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                todo.append(parent)
    return seen


def check_function_branch_order():
    """In a ``tf.function``, collectives inside ``tf.cond`` branches that write a variable
    run in program order with the collectives outside them (a cond is otherwise ordered by
    its variable alone, and on a small inter-op pool ranks that pick different orders wait
    forever): twenty calls, and the graph orders each node after the one before it."""
    r, n = hvd.rank(), hvd.size()
    counters = [tf.Variable(0.0) for _ in range(3)]

    @tf.function
    def step(x):
        outs = []
        for i, counter in enumerate(counters):
            outs.append(hvd.allreduce(x + i, op=hvd.Sum, name=f"order.outer.{i}"))

            def branch(counter=counter, i=i):
                counter.assign_add(1.0)
                return hvd.allreduce(x * (i + 1), op=hvd.Sum, name=f"order.inner.{i}")

            outs.append(tf.cond(x[0] >= 0, branch, lambda: x))
        return outs

    x = tf.constant([float(r + 1)] * 3)
    total = n * (n + 1) / 2
    for call in range(20):
        got = step(x)
        for i in range(3):
            close(f"call {call} outer {i}", got[2 * i].numpy(), [total + n * i] * 3)
            close(f"call {call} inner {i}", got[2 * i + 1].numpy(), [total * (i + 1)] * 3)
    graph = step.get_concrete_function(x).graph
    ops_ = graph.get_operations()
    outer = [op for op in ops_ if op.type == "EagerPyFunc"]
    conds = [
        op
        for op in ops_
        if op.type in ("If", "StatelessIf")
        and not any(t.op.type == "EagerPyFunc" for t in op.inputs)
    ]  # not error checks
    assert len(outer) == 3 and len(conds) == 3, (outer, conds)
    sequence = [node for pair in zip(outer, conds) for node in pair]
    for before, after in zip(sequence, sequence[1:]):
        assert before.name in _ancestors(after), f"{after.name} is not ordered after {before.name}"
    close("counters", [c.numpy() for c in counters], [20.0] * 3)


def check_graph_feeds_and_gradients():
    """Auto-named collectives in a graph: a step fed through a placeholder, a broadcast of
    the variables built after it and run alone (no feed needed), a grouped allgather's
    gradient, and the gradients of allgather, broadcast and alltoall built in the graph."""
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 2])
        w = tf.Variable(tf.fill([2, 2], float(r + 1)))
        y = tf.matmul(x, w)
        grads = tf.gradients(tf.reduce_sum(y), [w])
        step = [hvd.allreduce(g, op=hvd.Sum) for g in grads] + [
            hvd.allreduce(tf.reduce_sum(y) * float(k), op=hvd.Sum) for k in range(5)
        ]
        bcast = hvd.broadcast_variables([w], root_rank=n - 1)
        a, b = tf.fill([r + 1, 2], float(r + 1)), tf.ones([2, 3])
        ga, gb = hvd.grouped_allgather([a, b])
        grouped_grad = tf.gradients(tf.reduce_sum(ga) * 2.0 + tf.reduce_sum(gb * gb), [a, b])
        c = tf.fill([r + 1, 2], 1.0)
        gather_grad = tf.gradients(tf.reduce_sum(hvd.allgather(c) * float(r + 1)), c)[0]
        d = tf.fill([3], 1.0)
        bcast_grad = tf.gradients(tf.reduce_sum(hvd.broadcast(d, 0) * float(r + 1)), d)[0]
        e = tf.fill([n, 2], 1.0)
        a2a_grad = tf.gradients(tf.reduce_sum(hvd.alltoall(e) * float(r + 1)), e)[0]
        init = v1.global_variables_initializer()
    with session(graph) as s:
        s.run(init)
        s.run(bcast)
        close("broadcast_variables in a graph", s.run(w), np.full((2, 2), float(n)))
        for _ in range(3):
            got = s.run(step, feed_dict={x: np.ones((r + 1, 2), np.float32)})
            rows = sum(k + 1 for k in range(n))
            close("graph gradient allreduce", got[0], np.full((2, 2), float(rows)))
        mean_w = sum(k + 1 for k in range(n)) / n
        gg = s.run(grouped_grad)
        close("grouped allgather gradient 0", gg[0], np.full((r + 1, 2), 2.0))
        close("grouped allgather gradient 1", gg[1], np.full((2, 3), 2.0))
        close("allgather gradient in a graph", s.run(gather_grad), np.full((r + 1, 2), mean_w))
        close(
            "broadcast gradient in a graph",
            s.run(bcast_grad),
            np.full(3, mean_w if r == 0 else 0.0),
        )
        close(
            "alltoall gradient in a graph",
            s.run(a2a_grad),
            np.array([[k + 1.0] * 2 for k in range(n)]),
        )


# -- IndexedSlices -----------------------------------------------------------------------------
def _slices(k, n, dt, i):
    """Rank k's IndexedSlices number i over a [n + 1, 2] table: rows k and n."""
    values = np.array([[k + 1.0 + i, 2.0 * (k + 1)], [3.0 + i, k + 5.0]])
    return values, np.array([k, n]), (n + 1, 2)


def _dense_of(values, indices, shape):
    out = np.zeros(shape)
    for v, j in zip(values, indices):
        out[j] += v
    return out


def check_indexed_slices():
    """A grouped allreduce mixing IndexedSlices and dense tensors equals the reference
    (eager, tf.function and a TF1 graph); under Average integer slices come back as floats
    (Horovod's true division ``values / size``: float32 from uint8, float64 from int32);
    other ops and scale factors raise Horovod's NotImplementedError."""
    r, n = hvd.rank(), hvd.size()
    kinds = [
        ("slices", tf.float32),
        ("dense", tf.float32),
        ("slices", tf.int32),
        ("dense", tf.float64),
        ("slices", tf.uint8),
        ("dense", tf.int64),
    ]

    def inputs(k):
        out = []
        for i, (kind, dt) in enumerate(kinds):
            values, idx, shape = _slices(k, n, dt, i)
            if kind == "slices":
                out.append(
                    tf.IndexedSlices(tf.cast(values, dt), tf.constant(idx), tf.constant(shape))
                )
            else:
                out.append(tf.cast(_dense_of(values, idx, shape), dt))
        return out

    def reference(op):
        want = []
        for i, (kind, dt) in enumerate(kinds):
            parts = []
            for k in range(n):
                values, idx, shape = _slices(k, n, dt, i)
                if kind == "dense":  # summed, then divided (integers truncated)
                    parts.append(_dense_of(values, idx, shape))
                    continue
                if op == "avg":  # each rank's values divided (true division)
                    values = values / n
                parts.append(_dense_of(values, idx, shape))
            total = np.sum(parts, 0)
            if kind == "dense" and op == "avg":
                total = np.trunc(total / n) if dt.is_integer else total / n
            want.append(total)
        return want

    truediv = {tf.uint8: tf.float32, tf.int32: tf.float64}
    for op_name, op in (("avg", hvd.Average), ("sum", hvd.Sum)):
        want = reference(op_name)

        def fn():
            return hvd.grouped_allreduce(inputs(r), op=op)

        graph = tf.Graph()
        with graph.as_default():
            graph_out = [tf.convert_to_tensor(t) for t in fn()]
        with session(graph) as s:
            from_graph = s.run(graph_out)
        for mode, got in (("eager", fn()), ("function", tf.function(fn)()), ("graph", from_graph)):
            for i, (g, w, (kind, dt)) in enumerate(zip(got, want, kinds)):
                out_dt = truediv.get(dt, dt) if kind == "slices" and op_name == "avg" else dt
                if mode != "graph":
                    assert isinstance(g, tf.IndexedSlices) == (kind == "slices"), (mode, i)
                    assert g.dtype == out_dt, (mode, i, g.dtype, out_dt)
                    g = tf.convert_to_tensor(g).numpy()
                close(
                    f"{mode} grouped {op_name} #{i} ({kind} {dt.name})",
                    g,
                    w,
                    0 if out_dt.is_integer else 1e-3,
                )
    one = inputs(r)[2]
    avg = hvd.allreduce(one, op=hvd.Average)
    assert avg.values.dtype == tf.float64, avg.values.dtype
    close(
        "allreduce of int32 slices, Average",
        tf.convert_to_tensor(avg).numpy(),
        reference("avg")[2],
        1e-12,
    )
    for kwargs in (
        {"op": hvd.Min},
        {"op": hvd.Max},
        {"op": hvd.Product},
        {"op": hvd.Adasum},
        {"prescale_factor": 2.0},
        {"postscale_factor": 0.5},
    ):
        for call in (
            lambda: hvd.allreduce(one, **kwargs),
            lambda: hvd.grouped_allreduce([one, tf.ones([2])], **kwargs),
        ):
            try:
                call()
            except NotImplementedError:
                pass
            else:
                raise AssertionError(
                    f"IndexedSlices with {kwargs} did not raise NotImplementedError"
                )


# -- error types -------------------------------------------------------------------------------
def _raises(what, want, call):
    """``call()`` raises ``want`` (a type or tuple); returns the exception."""
    try:
        call()
    except want as exc:
        return exc
    except Exception as exc:
        raise AssertionError(f"{what}: raised {type(exc).__name__} ({exc}), not {want}") from exc
    raise AssertionError(f"{what}: did not raise {want}")


def _in_graph(build):
    """``build()``'s tensor run in a TF1 session."""
    graph = tf.Graph()
    with graph.as_default():
        out = build()
    with session(graph) as s:
        return s.run(out)


def check_error_types():
    """Mismatches across ranks raise tf.errors.FailedPreconditionError eagerly (an OpError,
    and still an HvdliteMismatchError), in tf.function and in a graph; invalid
    arguments raise tf.errors.InvalidArgumentError (eagerly also a ValueError)."""
    from hvdlite.common.exceptions import HvdliteMismatchError

    r, n = hvd.rank(), hvd.size()
    fpe = tf.errors.FailedPreconditionError
    mismatches = {
        "allreduce shape": lambda k: hvd.allreduce(tf.ones([2 + r]), name=f"err.shape{k}"),
        "allgather dtype": lambda k: hvd.allgather(
            tf.ones([2], tf.float32 if r == 0 else tf.float64), name=f"err.dtype{k}"
        ),
        "broadcast root": lambda k: hvd.broadcast(tf.ones([2]), r, name=f"err.root{k}"),
        "reducescatter shape": lambda k: hvd.reducescatter(tf.ones([n, 1 + r]), name=f"err.rs{k}"),
        "allreduce op": lambda k: hvd.allreduce(
            tf.ones([2]), op=hvd.Sum if r else hvd.Max, name=f"err.op{k}"
        ),
    }
    for what, call in mismatches.items():
        exc = _raises(f"eager {what}", fpe, lambda: call(0))
        assert isinstance(exc, HvdliteMismatchError), type(exc).__mro__
        # in a graph too: FailedPreconditionError naming the tensor
        exc = _raises(f"tf.function {what}", fpe, lambda: tf.function(lambda: call(1))())
        assert "err." in exc.message and "1" in exc.message, exc.message
        exc = _raises(f"graph {what}", fpe, lambda: _in_graph(lambda: call(2)))
        assert "err." in exc.message, exc.message
    invalid = {
        "alltoall splits beyond the rows": lambda k: hvd.alltoall(
            tf.ones([n, 2]), splits=[2] * n, name=f"err.splits{k}"
        ),
        "alltoall rows the size does not divide": lambda k: hvd.alltoall(
            tf.ones([n + 1, 2]), name=f"err.even{k}"
        ),
        "broadcast root outside the job": lambda k: hvd.broadcast(
            tf.ones([2]), n, name=f"err.badroot{k}"
        ),
    }
    for what, call in invalid.items():
        exc = _raises(
            f"eager {what}", (tf.errors.InvalidArgumentError, ValueError), lambda: call(0)
        )
        assert isinstance(exc, ValueError), type(exc).__mro__
        assert isinstance(exc, tf.errors.InvalidArgumentError), type(exc).__mro__
        _raises(
            f"tf.function {what}",
            tf.errors.InvalidArgumentError,
            lambda: tf.function(lambda: call(1))(),
        )
        _raises(f"graph {what}", tf.errors.InvalidArgumentError, lambda: _in_graph(lambda: call(2)))
    close("ops after the errors", hvd.allreduce(tf.ones([2]), op=hvd.Sum), [n, n])


# -- dtypes ------------------------------------------------------------------------------------
#: every dtype Horovod's TensorFlow ops accept (bool: not for arithmetic reductions)
ALL_DTYPES = [
    tf.uint8,
    tf.int8,
    tf.uint16,
    tf.int16,
    tf.int32,
    tf.int64,
    tf.float16,
    tf.bfloat16,
    tf.float32,
    tf.float64,
    tf.bool,
]


def _ints(k, shape, dt, big=False):
    """Rank k's input: small integers (or, ``big``, values near the top of uint16)."""
    a = (np.arange(int(np.prod(shape))) % 3 + 1 + k).reshape(shape).astype(np.float64)
    if big:
        a = a + 65500
    if dt == tf.bool:
        return tf.constant(a % 2 == 0), a % 2 == 0
    return tf.cast(tf.constant(a), dt), a


def _dtype_ops(dt, r, n):
    """Each collective on ``dt``: name -> (call, reference)."""
    x, _ = _ints(r, (n, 3), dt)
    every = np.stack([_ints(k, (n, 3), dt)[1] for k in range(n)]).astype(np.float64)
    cases = {
        "allgather": (lambda: hvd.allgather(x), np.concatenate(every)),
        "grouped_allgather": (lambda: hvd.grouped_allgather([x, x])[1], np.concatenate(every)),
        "broadcast": (lambda: hvd.broadcast(x, n - 1), every[n - 1]),
        "alltoall": (lambda: hvd.alltoall(x), every[:, r]),
        "allreduce max": (lambda: hvd.allreduce(x, op=hvd.Max), every.max(0)),
        "allreduce min": (lambda: hvd.allreduce(x, op=hvd.Min), every.min(0)),
    }
    if dt == tf.bool:
        return cases
    cases.update(
        {
            "allreduce sum": (lambda: hvd.allreduce(x, op=hvd.Sum), every.sum(0)),
            "grouped_allreduce sum": (
                lambda: hvd.grouped_allreduce([x, x], op=hvd.Sum)[0],
                every.sum(0),
            ),
            "reducescatter sum": (
                lambda: hvd.reducescatter(x, op=hvd.Sum),
                every.sum(0)[r : r + 1],
            ),
            "grouped_reducescatter sum": (
                lambda: hvd.grouped_reducescatter([x], op=hvd.Sum)[0],
                every.sum(0)[r : r + 1],
            ),
        }
    )
    if dt.is_floating:
        cases["allreduce average"] = (lambda: hvd.allreduce(x), every.mean(0))
    return cases


def check_dtypes():
    """Every collective on every dtype Horovod's TensorFlow ops accept (uint16 included),
    eagerly and in tf.function: the dtype kept and the values right; uint16 beyond int16's
    range too."""
    r, n = hvd.rank(), hvd.size()
    for dt in ALL_DTYPES:
        for what, (call, want) in _dtype_ops(dt, r, n).items():
            for mode, fn in (("eager", call), ("function", tf.function(call))):
                got = fn()
                assert got.dtype == dt, (mode, what, got.dtype, dt)
                close(
                    f"{mode} {what} {dt.name}",
                    tf.cast(got, tf.float64),
                    want,
                    1e-2 if dt in (tf.float16, tf.bfloat16) else 0,
                )
    x, a = _ints(r, (n, 2), tf.uint16, big=True)
    every = np.stack([_ints(k, (n, 2), tf.uint16, big=True)[1] for k in range(n)])
    close("uint16 max beyond int16", hvd.allreduce(x, op=hvd.Max).numpy(), every.max(0))
    close("uint16 allgather beyond int16", hvd.allgather(x).numpy(), np.concatenate(every))
    close("uint16 sum wraps as uint16", hvd.allreduce(x, op=hvd.Sum).numpy(), every.sum(0) % 65536)
    v = tf.Variable(x)
    hvd.broadcast_variables([v], root_rank=0)
    close("uint16 broadcast_variables", v.numpy(), every[0])


# -- the public API ----------------------------------------------------------------------------
#: every public name of ``horovod.tensorflow`` (Horovod 0.28's __init__.py, its imports and
#: definitions; modules it imports only for itself, such as ``os`` and ``tf``, left out)
HOROVOD_TF_NAMES = [
    "elastic",
    "Compression",
    "allgather_object",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "broadcast_",
    "alltoall",
    "init",
    "shutdown",
    "is_initialized",
    "start_timeline",
    "stop_timeline",
    "size",
    "local_size",
    "cross_size",
    "rank",
    "local_rank",
    "cross_rank",
    "is_homogeneous",
    "rank_op",
    "local_rank_op",
    "size_op",
    "local_size_op",
    "process_set_included_op",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "handle_average_backwards_compatibility",
    "check_num_rank_power_of_2",
    "vars_to_refs",
    "refs_to_vars",
    "join",
    "SyncBatchNormalization",
    "LocalGradientAggregationHelper",
    "support_non_legacy_keras_optimizers",
    "allreduce",
    "reducescatter",
    "grouped_allreduce",
    "grouped_reducescatter",
    "broadcast_global_variables",
    "BroadcastGlobalVariablesHook",
    "DistributedOptimizer",
    "DistributedGradientTape",
    "PartialDistributedGradientTape",
    "util",
]
#: every public name of ``horovod.tensorflow.keras`` (the same source)
HOROVOD_KERAS_NAMES = [
    "init",
    "shutdown",
    "is_initialized",
    "start_timeline",
    "stop_timeline",
    "size",
    "local_size",
    "cross_size",
    "rank",
    "local_rank",
    "cross_rank",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "Average",
    "Sum",
    "Compression",
    "callbacks",
    "elastic",
    "DistributedOptimizer",
    "broadcast_global_variables",
    "allreduce",
    "allgather",
    "broadcast",
    "reducescatter",
    "load_model",
]
#: names of Horovod's that hvdlite leaves out on purpose, and why
EXCLUDED = {
    "handle_average_backwards_compatibility": "Horovod's internal helper, imported into its "
    "namespace; not API",
    "check_num_rank_power_of_2": "Horovod's internal helper (Adasum's GPU check)",
    "vars_to_refs": "Horovod's internal helper of its gradient grouping",
    "refs_to_vars": "Horovod's internal helper of its gradient grouping",
    "LocalGradientAggregationHelper": "Horovod's internal class behind backward_passes_per_step",
    "support_non_legacy_keras_optimizers": "Horovod's internal Keras 2 version check",
    "util": "Horovod's module of internal helpers (_executing_eagerly, _cache, ...)",
}


#: Horovod's Keras collectives take a value and the name second
KERAS_SIGNATURES = {
    "allreduce": [
        "value",
        "name",
        "average",
        "prescale_factor",
        "postscale_factor",
        "op",
        "compression",
    ],
    "allgather": ["value", "name"],
    "broadcast": ["value", "root_rank", "name"],
    "reducescatter": ["value", "name", "op"],
}


def check_public_names():
    """Every public name of horovod.tensorflow and horovod.tensorflow.keras exists here
    (hvdlite.keras too) or is excluded with a reason."""
    import hvdlite.keras
    import hvdlite.keras.callbacks
    import hvdlite.tensorflow.keras as hvdk

    for module, names in (
        (hvd, HOROVOD_TF_NAMES),
        (hvdk, HOROVOD_KERAS_NAMES),
        (hvdlite.keras, HOROVOD_KERAS_NAMES),
    ):
        missing = [n for n in names if n not in EXCLUDED and not hasattr(module, n)]
        assert not missing, f"{module.__name__} lacks Horovod's {missing}"
    assert hvdlite.keras.DistributedOptimizer is hvdk.DistributedOptimizer
    assert hvdlite.keras.callbacks is hvdk.callbacks
    assert hvdlite.keras.elastic.KerasState is hvdk.elastic.KerasState
    for name in (
        "run",
        "KerasState",
        "CommitStateCallback",
        "UpdateBatchStateCallback",
        "UpdateEpochStateCallback",
    ):
        assert hasattr(hvdk.elastic, name), f"hvdlite.tensorflow.keras.elastic.{name}"
    import inspect

    for fn, want in KERAS_SIGNATURES.items():
        got = list(inspect.signature(getattr(hvdk, fn)).parameters)
        assert got == want, f"hvdlite.tensorflow.keras.{fn}: {got}, Horovod's: {want}"
    r, n = hvd.rank(), hvd.size()
    close(
        "keras allreduce of a list",
        hvdk.allreduce([1.0, r], "keras.ar", op=hvd.Sum),
        [n, sum(range(n))],
    )
    close("keras allgather", hvdk.allgather([[r]], "keras.ag"), [[k] for k in range(n)])
    close("keras broadcast", hvdk.broadcast([r], n - 1, "keras.bc"), [n - 1])
    close("keras reducescatter", hvdk.reducescatter([[1.0]] * n, "keras.rs", hvd.Sum), [[n]])


def check_info_ops():
    """rank_op, size_op, local_rank_op, local_size_op and process_set_included_op: eager,
    tf.function and TF1 graph values (the process-set forms too)."""
    r, n = hvd.rank(), hvd.size()
    want = [
        r,
        n,
        hvd.local_rank(),
        hvd.local_size(),
        n,
        int(r in PROCESS_SET.ranks),
        len(PROCESS_SET.ranks),
    ]
    sid = PROCESS_SET.process_set_id

    def build():
        return [
            hvd.rank_op(),
            hvd.size_op(),
            hvd.local_rank_op(),
            hvd.local_size_op(),
            hvd.size_op(process_set_id=0),
            hvd.process_set_included_op(sid),
            hvd.size_op(process_set_id=sid),
        ]

    for mode, got in (
        ("eager", build()),
        ("function", tf.function(build)()),
        ("graph", _in_graph(build)),
    ):
        got = [int(g) for g in got]
        assert got == want, (mode, got, want)
    for op in (hvd.rank_op(), hvd.size_op()):
        assert op.dtype == tf.int32, op.dtype
    _raises("size_op of an unknown set", ValueError, lambda: hvd.size_op(process_set_id=99))


def check_partial_tape():
    """PartialDistributedGradientTape: a local layer's gradients stay on the rank (divided by
    the size), the others are averaged; register_local_source on a plain tape alike."""
    import keras

    r, n = hvd.rank(), hvd.size()
    shared = keras.layers.Dense(2, kernel_initializer="ones", use_bias=False)
    local = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
    x = tf.fill([1, 3], float(r + 1))
    shared(x), local(shared(x))

    def grads(make):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(local(shared(x)))
        tape = make(tape)
        return tape.gradient(loss, shared.trainable_weights + local.trainable_weights)

    def plain(tape):
        out = hvd.DistributedGradientTape(tape)
        for w in local.trainable_weights:
            out.register_local_source(w)
        return out

    own = grads(lambda t: t)
    every = [np.asarray(g) * 0 for g in own]
    for k in range(n):  # rank k's gradients: x = k + 1 everywhere, so linear in k + 1
        every = [e + np.asarray(g) * (k + 1) / (r + 1) for e, g in zip(every, own)]
    for what, make in (
        ("partial", lambda t: hvd.PartialDistributedGradientTape(t, local_layers=[local])),
        ("register_local_source", plain),
    ):
        got = grads(make)
        close(f"{what}: shared kernel averaged", got[0], every[0] / n, 1e-6)
        close(
            f"{what}: local kernel kept, divided by the size", got[1], np.asarray(own[1]) / n, 1e-6
        )
    _raises(
        "a local layer that is not a layer",
        ValueError,
        lambda: hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[1]),
    )


def check_sync_batch_norm():
    """SyncBatchNormalization on ranks with different batches equals BatchNormalization on
    the joined batch: outputs, input gradients and moving statistics."""
    import keras

    r, n = hvd.rank(), hvd.size()
    rng = np.random.RandomState(0)
    batches = [rng.normal(size=(k + 2, 3)).astype(np.float32) * (k + 1) for k in range(n)]
    full = np.concatenate(batches)
    start = sum(len(b) for b in batches[:r])
    sync = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    ref = keras.layers.BatchNormalization(momentum=0.5, epsilon=1e-3)
    mine, whole = tf.constant(batches[r]), tf.constant(full)
    for mode in ("eager", "function"):
        with tf.GradientTape() as tape:
            tape.watch(mine)
            out = (
                sync(mine, training=True)
                if mode == "eager"
                else tf.function(lambda v: sync(v, training=True))(mine)
            )
            loss = tf.reduce_sum(out * out * float(r + 1))
        g = tape.gradient(loss, mine)
        with tf.GradientTape() as tape:
            tape.watch(whole)
            ref_out = ref(whole, training=True)
            weights = np.concatenate([np.full((len(b), 1), k + 1.0) for k, b in enumerate(batches)])
            ref_loss = tf.reduce_sum(ref_out * ref_out * weights)
        ref_g = tape.gradient(ref_loss, whole)
        rows = slice(start, start + len(batches[r]))
        close(f"{mode} SyncBatchNormalization output", out, ref_out.numpy()[rows], 1e-4)
        # the statistics' Sum-allreduce sends every rank's loss gradient back: this rank's
        # rows of the gradient of the sum of the ranks' losses
        close(f"{mode} SyncBatchNormalization input gradient", g, ref_g.numpy()[rows], 1e-3)
        close(f"{mode} moving mean", sync.moving_mean, ref.moving_mean, 1e-5)
        close(f"{mode} moving variance", sync.moving_variance, ref.moving_variance, 1e-4)
    _raises("synchronized=True", ValueError, lambda: hvd.SyncBatchNormalization(synchronized=True))


def check_tf1_api():
    """The TF1 API in a session: BroadcastGlobalVariablesHook, DistributedOptimizer's
    minimize (averaged gradients), broadcast_ and broadcast_object_fn."""
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 1])
        w = tf.Variable([[float(r + 1)]])
        loss = tf.reduce_sum(x * w)
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(1.0))
        train = opt.minimize(loss, var_list=[w])
        hook = hvd.BroadcastGlobalVariablesHook(0)
        hook.begin()
        z = tf.Variable([float(r)])
        inplace = hvd.broadcast_([z], n - 1)
        init = v1.global_variables_initializer()
    with session(graph) as s:
        s.run(init)
        hook.after_create_session(s, None)
        close("after the hook", s.run(w), [[1.0]])
        s.run(train, {x: np.full((r + 1, 1), 1.0, np.float32)})
        mean_rows = sum(k + 1 for k in range(n)) / n
        close("after an averaged step", s.run(w), [[1.0 - mean_rows]], 1e-6)
        s.run(inplace)
        close("broadcast_ in a graph", s.run(z), [n - 1.0])
    _raises(
        "broadcast_global_variables eagerly",
        RuntimeError,
        lambda: hvd.broadcast_global_variables(0),
    )
    v = tf.Variable([float(r)])
    assert hvd.broadcast_([v], 0)[0] is v
    close("broadcast_ eagerly", v, [0.0])
    fn = hvd.broadcast_object_fn(root_rank=n - 1)
    assert fn({"r": r}) == {"r": n - 1} and fn(r) == n - 1


def check_load_model():
    """A model trained with DistributedOptimizer and saved by rank 0 loads on every rank
    with a distributed optimizer holding the saved state; its next step averages."""
    import tempfile
    import keras
    import hvdlite.tensorflow.keras as hvdk

    r, n = hvd.rank(), hvd.size()
    folder = hvd.broadcast_object(tempfile.mkdtemp() if r == 0 else None, 0)
    path = os.path.join(folder, "model.keras")
    x, y = np.ones((2, 3), np.float32) * (r + 1), np.zeros((2, 1), np.float32)
    if r == 0:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(
            optimizer=hvdk.DistributedOptimizer(
                keras.optimizers.SGD(0.01, momentum=0.9), process_set=PROCESS_SET
            ),
            loss="mse",
        )
        model.fit(x, y, epochs=1, verbose=0)
        model.save(path)
    hvd.barrier()
    model = hvdk.load_model(path)
    assert getattr(model.optimizer, "_hvdlite_distributed", False), type(model.optimizer)
    assert int(model.optimizer.iterations.numpy()) == 1, model.optimizer.iterations
    model.fit(x, y, epochs=1, verbose=0, batch_size=2)
    weights = [w.numpy() for w in model.weights]
    everyone = hvd.allgather_object(weights)
    for k in range(n):
        for a, b in zip(everyone[k], weights):
            close(f"weights after a step, rank {k}", a, b, 1e-6)
    assert int(model.optimizer.iterations.numpy()) == 2
    hvd.barrier()
    if r == 0:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


CASES = {
    "graph_fifty_collectives": check_graph_fifty_collectives,
    "graph_feeds_and_gradients": check_graph_feeds_and_gradients,
    "function_branch_order": check_function_branch_order,
    "indexed_slices": check_indexed_slices,
    "error_types": check_error_types,
    "dtypes": check_dtypes,
    "public_names": check_public_names,
    "info_ops": check_info_ops,
    "partial_tape": check_partial_tape,
    "sync_batch_norm": check_sync_batch_norm,
    "tf1_api": check_tf1_api,
    "load_model": check_load_model,
}

if __name__ == "__main__":
    PROCESS_SET = hvd.ProcessSet([0])
    run_cases(hvd, CASES, set(sys.argv[1:]) or None, process_sets=[PROCESS_SET])
