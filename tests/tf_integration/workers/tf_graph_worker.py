"""hvdlite.tensorflow collectives in TF1 graphs (``tf.compat.v1.Session``) at np=2: many
collectives in one ``session.run`` are submitted together and fused, fetching one runs only
it, a one-thread inter-op pool with ranks building in different orders does not deadlock,
and a mismatch still raises ``FailedPreconditionError``.

Sessions use TensorFlow's default inter-op pool unless a case says otherwise.  Each timed case
prints ``TIME <case> <seconds>s`` (the ``session.run`` calls only) and asserts
:data:`BOUND_S`.  One launch runs every case; ``sys.argv[1:]`` may name cases.
"""

import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")

import hvdlite.tensorflow as hvd  # noqa: E402
from hvdlite.common import ops  # noqa: E402
from tests.worker_cases import run_cases  # noqa: E402

v1 = tf.compat.v1
#: seconds the ``session.run`` calls of one timed case may take (Horovod: well under one)
BOUND_S = 3.0
#: a bound on every ``session.run`` here: a deadlock fails the case instead of hanging it
RUN_OPTIONS = v1.RunOptions(timeout_in_ms=60_000)
#: the ten dtypes of the allgather graph
DTYPES = [
    tf.uint8,
    tf.int8,
    tf.uint16,
    tf.int16,
    tf.int32,
    tf.int64,
    tf.float16,
    tf.float32,
    tf.float64,
    tf.bool,
]


def rows_of(k):
    """Rank k's first dimension: 17, 32, 47, ..."""
    return 17 + 15 * k


class Counted:
    """Counts the calls of ``ops.<name>`` (which ``hvdlite.tensorflow`` calls through the
    module), so a case can tell how many collectives really ran."""

    def __init__(self, name):
        self.name, self.calls, self._lock = name, 0, threading.Lock()
        self._original = getattr(ops, name)

    def __enter__(self):
        def counting(*args, **kwargs):
            with self._lock:
                self.calls += 1
            return self._original(*args, **kwargs)

        setattr(ops, self.name, counting)
        return self

    def __exit__(self, *exc):
        setattr(ops, self.name, self._original)


class Timed:
    """Sums the seconds spent in ``run(session, fetches)``; ``check(case)`` prints the total
    and asserts :data:`BOUND_S`."""

    def __init__(self):
        self.seconds = 0.0

    def run(self, session, fetches, **kwargs):
        start = time.monotonic()
        try:
            return session.run(fetches, options=RUN_OPTIONS, **kwargs)
        finally:
            self.seconds += time.monotonic() - start

    def check(self, case, note=""):
        print(f"TIME {case} rank={hvd.rank()} {self.seconds:.3f}s {note}", flush=True)
        assert self.seconds <= BOUND_S, f"{case}: {self.seconds:.2f}s > {BOUND_S}s"


def _filled(k, dims, dt):
    """Rank k's input: ``rows_of(k)`` rows of value k."""
    return tf.cast(tf.fill([rows_of(k), *dims], float(k)), dt)


def _want_gathered(n, dims):
    return np.concatenate([np.full([rows_of(k), *dims], float(k)) for k in range(n)])


def _check_gathered(what, got, dims, n):
    np.testing.assert_array_equal(
        np.asarray(got, np.float64), _want_gathered(n, dims), err_msg=f"{what} on rank {hvd.rank()}"
    )


def _check_static(what, out, dims, dt):
    assert out.dtype == dt, (what, out.dtype, dt)
    assert out.shape.as_list() == [None, *dims], (what, out.shape)


def _dims(i):
    """Collective i's trailing dimensions: 1 to 3 dimensions in all."""
    return [[], [2], [2, 3]][i % 3]


def check_graph_thirty_allgathers():
    """30 variable-size allgathers over ten dtypes and one to three dimensions in one
    ``session.run``: values, static shapes, and the time."""
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        specs = [(DTYPES[i % 10], _dims(i)) for i in range(30)]
        outs = [
            hvd.allgather(_filled(r, dims, dt), name=f"g30.{i}")
            for i, (dt, dims) in enumerate(specs)
        ]
    for i, (dt, dims) in enumerate(specs):
        _check_static(f"allgather {i}", outs[i], dims, dt)
    _check_graph_shape(graph, 30)
    timed = Timed()
    with v1.Session(graph=graph) as s, Counted("allgather_async") as counted:
        for step in range(3):
            got = timed.run(s, outs)
            for i, (dt, dims) in enumerate(specs):
                assert got[i].dtype == dt.as_numpy_dtype, (i, got[i].dtype)
                _check_gathered(f"run {step} allgather {i}", got[i], dims, n)
    timed.check("graph_thirty_allgathers", f"{counted.calls} allgathers ran for 90 fetched")
    assert counted.calls == 90, counted.calls


#: whether this launch runs TF1 collectives as the asynchronous kernel: unless the launcher
#: turned it off or the test made its build fail (``CXX=false``), it must
WANT_KERNEL = os.environ.get("HVDLITE_TF_ASYNC_KERNEL") != "0" and os.environ.get("CXX") != "false"


def _check_graph_shape(graph, collectives):
    """Every node and library function a TF1 graph holds for its collectives slows each
    later new fetch of it: with the kernel, one ``HvdliteAsyncCall`` node per collective
    and no function; with the pipelines, one map function per output signature."""
    types = [op.type for op in graph.get_operations()]
    library = [f.signature.name for f in graph.as_graph_def().library.function]
    if WANT_KERNEL:
        assert types.count("HvdliteAsyncCall") == collectives, types
        assert "IteratorGetNext" not in types and not library, library
        return
    assert "HvdliteAsyncCall" not in types, types
    signatures = {
        tuple(op.get_attr("output_types"))
        for op in graph.get_operations()
        if op.type == "IteratorGetNext"
    }
    assert 1 < len(library) == len(signatures), (library, signatures)


def check_graph_grouped_allgathers():
    """Ten grouped allgathers of three tensors each (three dtypes, variable rows) in one
    ``session.run``."""
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        groups = [[(DTYPES[(3 * g + j) % 10], _dims(g + j)) for j in range(3)] for g in range(10)]
        outs = [
            hvd.grouped_allgather([_filled(r, dims, dt) for dt, dims in group], name=f"gg.{g}")
            for g, group in enumerate(groups)
        ]
    timed = Timed()
    with v1.Session(graph=graph) as s:
        for step in range(3):
            got = timed.run(s, outs)
            for g, group in enumerate(groups):
                for j, (dt, dims) in enumerate(group):
                    _check_static(f"group {g}.{j}", outs[g][j], dims, dt)
                    _check_gathered(f"run {step} group {g}.{j}", got[g][j], dims, n)
    timed.check("graph_grouped_allgathers")


def _slices(k, i, n):
    """Rank k's IndexedSlices number i of a [n + 2, 3] table: rows k and the last."""
    values = np.array([[k + 1.0 + i, 2.0, 3.0], [k + 4.0, i + 1.0, 1.0]])
    return values, [k, n + 1]


def check_graph_grouped_indexed_slices():
    """Grouped allreduces of IndexedSlices (Sum on float and int values, Average on float)
    in one ``session.run``, against the dense reference."""
    r, n = hvd.rank(), hvd.size()
    shape = (n + 2, 3)
    kinds = [(hvd.Sum, tf.float32), (hvd.Sum, tf.int32), (hvd.Average, tf.float64)]
    graph = tf.Graph()
    with graph.as_default():
        fetches = []
        for g, (op, dt) in enumerate(kinds):
            group = []
            for i in range(4):
                values, indices = _slices(r, i, n)
                group.append(
                    tf.IndexedSlices(
                        tf.constant(values.astype(dt.as_numpy_dtype)),
                        tf.constant(indices),
                        dense_shape=tf.constant(shape),
                    )
                )
            reduced = hvd.grouped_allreduce(group, op=op, name=f"gis.{g}")
            fetches.append([tf.convert_to_tensor(t) for t in reduced])
    timed = Timed()
    with v1.Session(graph=graph) as s:
        for step in range(3):
            got = timed.run(s, fetches)
            for g, (op, dt) in enumerate(kinds):
                for i in range(4):
                    want = np.zeros(shape)
                    for k in range(n):
                        values, indices = _slices(k, i, n)
                        np.add.at(want, indices, values)
                    if op == hvd.Average:
                        want /= n
                    np.testing.assert_allclose(
                        got[g][i], want, rtol=1e-6, err_msg=f"run {step} group {g} slices {i}"
                    )
    timed.check("graph_grouped_indexed_slices")


def check_graph_evaluate_loop():
    """Horovod's test style: a loop that builds one allgather in the graph and runs it, 21
    times; each run executes the one collective it fetches, none built before it."""
    r, n = hvd.rank(), hvd.size()
    timed, built = Timed(), 0
    with (
        tf.Graph().as_default() as graph,
        v1.Session(graph=graph) as s,
        Counted("allgather_async") as counted,
    ):
        for i in range(21):
            dt, dims = DTYPES[i % 10], _dims(i)
            out = hvd.allgather(_filled(r, dims, dt))
            built += 1
            _check_gathered(f"loop {i}", timed.run(s, out), dims, n)
    ran = f"{counted.calls} allgathers ran for {built} built"
    timed.check("graph_evaluate_loop", ran)
    assert counted.calls == built, ran


def check_graph_one_thread_pool_orders():
    """More collectives than inter-op threads (one), each rank building them in its own
    order (explicit names), some fed by others: no deadlock, right values, five runs."""
    r, n = hvd.rank(), hvd.size()
    order = np.random.RandomState(r + 7).permutation(12)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.fill([2, 2], float(r + 1))
        outs = {}
        for i in order:
            outs[int(i)] = hvd.allreduce(x * float(i), op=hvd.Sum, name=f"one.{i}")
        chained = hvd.allgather(outs[0] + outs[11], name="one.chained")
    config = v1.ConfigProto(inter_op_parallelism_threads=1)
    total = n * (n + 1) / 2
    with v1.Session(graph=graph, config=config) as s:
        for _ in range(5):
            got, gathered = s.run([outs, chained], options=RUN_OPTIONS)
            for i in range(12):
                np.testing.assert_array_equal(got[i], np.full([2, 2], total * i))
            np.testing.assert_array_equal(gathered, np.full([2 * n, 2], total * 11))


def check_graph_mismatch():
    """Ranks that disagree on a shape in a TF1 graph get FailedPreconditionError naming
    the tensor; a collective beside it in the same graph still works afterwards."""
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        bad = hvd.allreduce(tf.ones([2 + r]), name="mismatch.shape")
        good = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="mismatch.after")
        fed = v1.placeholder(tf.float32, [None])
        again = hvd.allreduce(fed, op=hvd.Sum, name="mismatch.fed")
    with v1.Session(graph=graph) as s:
        try:
            s.run(bad, options=RUN_OPTIONS)
        except tf.errors.FailedPreconditionError as exc:
            assert "mismatch.shape" in exc.message, exc.message
        else:
            raise AssertionError("a shape mismatch in a TF1 graph did not raise")
        np.testing.assert_array_equal(s.run(good, options=RUN_OPTIONS), [n, n])
        # the node that raised runs again once the ranks agree (its pipeline survives)
        try:
            s.run(again, {fed: np.ones(2 + r, np.float32)}, options=RUN_OPTIONS)
        except tf.errors.FailedPreconditionError as exc:
            assert "mismatch.fed" in exc.message, exc.message
        else:
            raise AssertionError("a fed shape mismatch in a TF1 graph did not raise")
        np.testing.assert_array_equal(
            s.run(again, {fed: np.ones(2, np.float32)}, options=RUN_OPTIONS), [n, n]
        )


def _grouped_forward(n, r, watch):
    """Five tensors through grouped allgather and five through grouped reducescatter (Sum),
    each source passed through ``watch`` (a tape's, or nothing); returns (outputs, sources,
    upstream gradients).  Rank q's upstream gradients hold q + 1 (per owner block for the
    allgather), so both the average and the gather show in the values."""
    xs = [watch(tf.fill([rows_of(r), 3], float(r))) for _ in range(5)]
    ys = [watch(tf.fill([4 * n, 2], float(r - i))) for i in range(5)]
    outs = hvd.grouped_allgather(xs, name="ggrad.gather") + hvd.grouped_reducescatter(
        ys, op=hvd.Sum, name="ggrad.scatter"
    )
    up = tf.concat([tf.fill([rows_of(k), 3], float((k + 1) * (r + 1))) for k in range(n)], 0)
    dys = [up] * 5 + [tf.fill([4, 2], float(r + 1)) for _ in range(5)]
    return outs, xs + ys, dys


def _check_grouped_gradients(what, got, n, r):
    want_gather = np.full([rows_of(r), 3], (r + 1) * (n + 1) / 2)
    # Horovod's rule for hvd.Sum: the allgather of the upstream gradients, times the size
    want_scatter = np.concatenate([np.full([4, 2], (q + 1.0) * n) for q in range(n)])
    assert len(got) == 10, (what, len(got))
    for i, g in enumerate(got):
        want = want_gather if i < 5 else want_scatter
        np.testing.assert_allclose(
            np.asarray(g), want, rtol=1e-6, err_msg=f"{what}: gradient {i} on rank {r}"
        )


def _taped_grouped_gradients(n, r):
    """The gradients through a persistent tape, one ``tape.gradient`` per output."""
    with tf.GradientTape(persistent=True) as tape:

        def watch(t):
            tape.watch(t)
            return t

        outs, sources, dys = _grouped_forward(n, r, watch)
    return [tape.gradient(o, x, d) for o, x, d in zip(outs, sources, dys)]


def check_graph_grouped_gradients():
    """Horovod's grouped allgather / reducescatter gradient tests: one ``tf.gradients`` per
    output of a grouped op, all fetched in one ``session.run`` (so several gradient
    collectives of one op run together and need names of their own), then the same in a
    ``tf.function`` with a persistent tape, and eagerly: all equal the expected values."""
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        outs, sources, dys = _grouped_forward(n, r, lambda t: t)
        fetches = [tf.gradients(o, x, d)[0] for o, x, d in zip(outs, sources, dys)]
    with v1.Session(graph=graph) as s:
        for step in range(2):
            _check_grouped_gradients(
                f"session run {step}", s.run(fetches, options=RUN_OPTIONS), n, r
            )
    in_function = tf.function(lambda: _taped_grouped_gradients(n, r))
    for step in range(2):
        _check_grouped_gradients(f"tf.function call {step}", in_function(), n, r)
    _check_grouped_gradients("eager", _taped_grouped_gradients(n, r), n, r)


def check_graph_kernel_edges():
    """What the kernel moves as raw bytes: a scalar, an empty tensor, bfloat16 and bool;
    an argument error keeps its TensorFlow code (InvalidArgumentError, as a
    ``py_function`` gives it) and the node runs again afterwards."""
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        scalar = hvd.allreduce(tf.constant(float(r + 1)), op=hvd.Sum, name="edge.scalar")
        empty = hvd.allgather(tf.zeros([0, 3]), name="edge.empty")
        half = hvd.allreduce(
            tf.fill([3], tf.constant(r + 1, tf.bfloat16)), op=hvd.Sum, name="edge.bf16"
        )
        flags = hvd.allgather(tf.constant([r % 2 == 0, True]), name="edge.bool")
        splits = v1.placeholder(tf.int32, [None])
        spread, _ = hvd.alltoall(tf.range(4.0), splits=splits, name="edge.alltoall")
    with v1.Session(graph=graph) as s:
        got = s.run([scalar, empty, half, flags], options=RUN_OPTIONS)
        assert got[0] == n * (n + 1) / 2 and got[0].shape == (), got[0]
        assert got[1].shape == (0, 3), got[1].shape
        assert got[2].dtype == tf.bfloat16.as_numpy_dtype, got[2].dtype
        np.testing.assert_array_equal(got[2].astype(np.float32), [n * (n + 1) / 2] * 3)
        want = np.array([[k % 2 == 0, True] for k in range(n)]).reshape(-1)
        np.testing.assert_array_equal(got[3], want)
        try:
            s.run(spread, {splits: [5] * n}, options=RUN_OPTIONS)
        except tf.errors.InvalidArgumentError as exc:
            assert "split" in exc.message.lower(), exc.message
        else:
            raise AssertionError("alltoall splits larger than the tensor did not raise")
        out = s.run(spread, {splits: [4 // n] * n}, options=RUN_OPTIONS)
        assert out.shape == (4,), out.shape


CASES = {
    "graph_thirty_allgathers": check_graph_thirty_allgathers,
    "graph_grouped_allgathers": check_graph_grouped_allgathers,
    "graph_grouped_indexed_slices": check_graph_grouped_indexed_slices,
    "graph_evaluate_loop": check_graph_evaluate_loop,
    "graph_one_thread_pool_orders": check_graph_one_thread_pool_orders,
    "graph_mismatch": check_graph_mismatch,
    "graph_grouped_gradients": check_graph_grouped_gradients,
    "graph_kernel_edges": check_graph_kernel_edges,
}

if __name__ == "__main__":
    run_cases(hvd, CASES, set(sys.argv[1:]) or None)
