"""hvdlite.tensorflow at np=2: every op against a local reference (eager and tf.function),
gradients, DistributedGradientTape and Keras 3 training equal to one process on the full batch.

One launch runs every case (TensorFlow's import is slow); ``sys.argv[1:]`` may name cases.
With ``--no-torch`` (run under ``--mpi``) torch is blocked before anything is imported, so the
whole suite runs as on a machine without torch, and the last case checks it stayed out.
"""

import os
import sys

NO_TORCH = "--no-torch" in sys.argv
if NO_TORCH:
    sys.argv.remove("--no-torch")
    from tests.tf_integration.no_torch import block_torch, torch_modules

    block_torch()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402
import hvdlite.tensorflow.keras as hvdk  # noqa: E402
from hvdlite.common import arrays  # noqa: E402
from hvdlite.common.exceptions import HvdliteMismatchError  # noqa: E402
from tests.worker_cases import run_cases  # noqa: E402

if arrays.have_torch():
    import torch  # noqa: E402

    torch.set_num_threads(1)

DTYPES = [tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64, tf.uint8]
OPS = {"avg": hvd.Average, "sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}
MODES = ("eager", "function")


def close(what, got, want, tol=0.0):
    got = (
        np.asarray(tf.cast(got, tf.float64))
        if isinstance(got, tf.Tensor)
        else np.asarray(got, dtype=np.float64)
    )
    np.testing.assert_allclose(
        got,
        np.asarray(want, dtype=np.float64),
        rtol=tol,
        atol=tol,
        err_msg=f"{what} on rank {hvd.rank()}",
    )


def value(r, dtype, shape=(3, 4)):
    """Rank r's input: small integers, exact in every dtype (products stay below 255)."""
    n = int(np.prod(shape))
    a = (np.arange(n) % 3 + 1 + r).reshape(shape)
    return tf.cast(tf.constant(a, tf.float64), dtype), a.astype(np.float64)


def run(mode, fn, *args):
    return fn(*args) if mode == "eager" else tf.function(fn)(*args)


def all_values(dtype, shape=(3, 4)):
    return [value(k, dtype, shape)[1] for k in range(hvd.size())]


# -- ops ---------------------------------------------------------------------------------------
def check_allreduce():
    r, n = hvd.rank(), hvd.size()
    for mode in MODES:
        for dt in DTYPES:
            x, _ = value(r, dt)
            vals = np.stack(all_values(dt))
            want = {
                "avg": vals.mean(0),
                "sum": vals.sum(0),
                "min": vals.min(0),
                "max": vals.max(0),
                "prod": vals.prod(0),
            }

            def fn(x):
                out = {
                    k: hvd.allreduce(x, op=op)
                    for k, op in OPS.items()
                    if not (k == "avg" and dt.is_integer)
                }
                out["scaled"] = hvd.allreduce(
                    x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5
                )
                return out

            got = run(mode, fn, x)
            for k, g in got.items():
                assert g.dtype == dt and g.shape == x.shape, (k, g.dtype, g.shape)
                close(f"{mode} allreduce {k} {dt.name}", g, want.get(k, want["sum"]))
        # bool: Min is logical and, Max logical or
        b = tf.constant([True, r == 0, False])
        lo, hi = run(
            mode, lambda b: (hvd.allreduce(b, op=hvd.Min), hvd.allreduce(b, op=hvd.Max)), b
        )
        assert lo.numpy().tolist() == [True, n == 1, False], lo
        assert hi.numpy().tolist() == [True, True, False], hi
        # Adasum of equal vectors is that vector (power-of-two sizes)
        a = run(mode, lambda v: hvd.allreduce(v, op=hvd.Adasum), tf.constant([1.0, -2.0, 3.0]))
        close(f"{mode} allreduce adasum", a, [1.0, -2.0, 3.0], 1e-6)
        # fp16 compression keeps the dtype
        x, _ = value(r, tf.float32)
        c = run(mode, lambda x: hvd.allreduce(x, compression=hvd.Compression.fp16), x)
        assert c.dtype == tf.float32
        close(f"{mode} allreduce fp16", c, np.stack(all_values(tf.float32)).mean(0))


def check_grouped_allreduce():
    r = hvd.rank()
    for mode in MODES:
        xs = [value(r, dt, (2 + i, 3))[0] for i, dt in enumerate(DTYPES[:5])]
        got = run(mode, lambda *xs: hvd.grouped_allreduce(list(xs), op=hvd.Sum), *xs)
        for i, (g, dt) in enumerate(zip(got, DTYPES[:5])):
            close(f"{mode} grouped {dt.name}", g, np.stack(all_values(dt, (2 + i, 3))).sum(0))
        got = run(
            mode,
            lambda a, b: hvd.grouped_allreduce([a, b], compression=hvd.Compression.fp16),
            xs[0],
            xs[1],
        )
        close(f"{mode} grouped avg", got[1], np.stack(all_values(tf.float64, (3, 3))).mean(0))


def _ragged(r, dt):
    rows = 1 + r
    a = (np.arange(rows * 3) + 10 * r).reshape(rows, 3) % 100
    return tf.cast(tf.constant(a, tf.float64), dt), a


def check_allgather():
    r, n = hvd.rank(), hvd.size()
    for mode in MODES:
        for dt in DTYPES + [tf.bool]:
            x, _ = _ragged(r, dt)
            want = np.concatenate([_ragged(k, tf.float64)[1] for k in range(n)])
            if dt == tf.bool:
                want = want != 0
            g = run(mode, hvd.allgather, x)
            assert g.dtype == dt and g.shape[0] == want.shape[0], (g.dtype, g.shape)
            close(f"{mode} allgather {dt.name}", tf.cast(g, tf.float64), want)
        a, b = _ragged(r, tf.float32)[0], _ragged(r, tf.int64)[0][:, :2]
        ga, gb = run(mode, lambda a, b: hvd.grouped_allgather([a, b]), a, b)
        close(
            f"{mode} grouped_allgather",
            ga,
            np.concatenate([_ragged(k, tf.float64)[1] for k in range(n)]),
        )
        close(
            f"{mode} grouped_allgather 2",
            gb,
            np.concatenate([_ragged(k, tf.float64)[1][:, :2] for k in range(n)]),
        )


def check_broadcast():
    r, n = hvd.rank(), hvd.size()
    for mode in MODES:
        for dt in DTYPES + [tf.bool]:
            for root in range(n):
                x, _ = value(r, dt)
                g = run(mode, lambda x: hvd.broadcast(x, root), x)
                assert g.dtype == dt
                close(
                    f"{mode} broadcast {dt.name} root {root}",
                    tf.cast(g, tf.float64),
                    np.asarray(tf.cast(value(root, dt)[0], tf.float64)),
                )


def check_alltoall():
    r, n = hvd.rank(), hvd.size()
    for mode in MODES:
        for dt in (tf.float32, tf.int64, tf.bfloat16):
            # rank k sends k + j + 1 rows to rank j; each row holds (sender, receiver)
            splits = [r + j + 1 for j in range(n)]
            rows = np.concatenate([np.full((s, 2), (r, j)) for j, s in enumerate(splits)])
            x = tf.cast(tf.constant(rows, tf.float64), dt)
            got, received = run(
                mode, lambda x, s: hvd.alltoall(x, splits=s), x, tf.constant(splits, tf.int32)
            )
            want = np.concatenate([np.full((k + r + 1, 2), (k, r)) for k in range(n)])
            close(f"{mode} alltoall {dt.name}", got, want)
            assert received.numpy().tolist() == [k + r + 1 for k in range(n)], received
        x = tf.constant(np.arange(2 * n, dtype=np.float32) + 100 * r)
        got = run(mode, hvd.alltoall, x)
        assert isinstance(got, tf.Tensor), type(got)
        close(
            f"{mode} alltoall even", got, [100 * k + 2 * r + i for k in range(n) for i in range(2)]
        )


def check_reducescatter():
    r, n = hvd.rank(), hvd.size()
    for mode in MODES:
        for dt in (tf.float32, tf.float64, tf.int32, tf.bfloat16):
            x, _ = value(r, dt, (5, 2))
            vals = np.stack(all_values(dt, (5, 2)))
            lo = [0, 3, 5] if n == 2 else [0, 5]  # earlier ranks get the extra row
            out_sum = run(mode, lambda x: hvd.reducescatter(x, op=hvd.Sum), x)
            close(f"{mode} reducescatter sum {dt.name}", out_sum, vals.sum(0)[lo[r] : lo[r + 1]])
            if dt.is_floating:
                out = run(mode, hvd.reducescatter, x)
                close(f"{mode} reducescatter avg {dt.name}", out, vals.mean(0)[lo[r] : lo[r + 1]])
        a, _ = value(r, tf.float32, (4, 3))
        b, _ = value(r, tf.float64, (2, 1))
        ga, gb = run(mode, lambda a, b: hvd.grouped_reducescatter([a, b], op=hvd.Sum), a, b)
        close(
            f"{mode} grouped_reducescatter",
            ga,
            np.stack(all_values(tf.float32, (4, 3))).sum(0)[2 * r : 2 * r + 2],
        )
        close(
            f"{mode} grouped_reducescatter 2",
            gb,
            np.stack(all_values(tf.float64, (2, 1))).sum(0)[r : r + 1],
        )
        # fp16 compression on the wire, the input's dtype back (small integers: exact)
        fp16 = hvd.Compression.fp16
        ca = run(mode, lambda a: hvd.reducescatter(a, op=hvd.Sum, compression=fp16), a)
        assert ca.dtype == tf.float32, ca.dtype
        close(
            f"{mode} reducescatter fp16",
            ca,
            np.stack(all_values(tf.float32, (4, 3))).sum(0)[2 * r : 2 * r + 2],
        )
        cb = run(
            mode, lambda a, b: hvd.grouped_reducescatter([a, b], op=hvd.Sum, compression=fp16), a, b
        )[1]
        assert cb.dtype == tf.float64, cb.dtype
        close(
            f"{mode} grouped_reducescatter fp16",
            cb,
            np.stack(all_values(tf.float64, (2, 1))).sum(0)[r : r + 1],
        )


def check_misc():
    r, n = hvd.rank(), hvd.size()
    assert 0 <= hvd.local_rank() < hvd.local_size() and hvd.is_initialized()
    assert hvd.cross_size() * hvd.local_size() == n
    obj = hvd.broadcast_object({"from": r, "f": (lambda v: v + 1)} if r == 0 else None, 0)
    assert obj["from"] == 0 and obj["f"](1) == 2
    assert hvd.allgather_object(("r", r)) == [("r", k) for k in range(n)]
    hvd.barrier()
    tf.function(lambda: hvd.barrier())()
    v = tf.Variable(tf.fill([3], float(r)))
    w = tf.Variable(tf.fill([2, 2], r + 1), dtype=tf.int32)
    hvd.broadcast_variables([v, w], root_rank=n - 1)
    close("broadcast_variables", v, [n - 1] * 3)
    close("broadcast_variables int", w, np.full((2, 2), n))
    v.assign(tf.fill([3], float(r)))

    @tf.function
    def bcast():
        hvd.broadcast_variables([v], root_rank=0)

    bcast()
    close("broadcast_variables in tf.function", v, [0] * 3)
    # result buffers cross back without a copy when aligned, by copy when not
    from hvdlite.tensorflow.mpi_ops import from_buffer

    k = arrays.kind()
    bf16 = arrays.numpy_dtype("bfloat16")
    for what, buf in (
        ("offset 1", k.from_numpy(np.arange(1001.0))[1:]),
        ("bfloat16 offset 1", k.from_numpy(np.arange(8).astype(bf16))[1:]),
        ("bfloat16", k.from_numpy(np.arange(8).astype(bf16))),
        ("whole", k.from_numpy(np.arange(8.0))),
    ):
        close(
            f"from_buffer {what} ({k.name} buffers)",
            tf.reduce_sum(tf.cast(from_buffer(buf), tf.float64)),
            float(k.to_numpy(buf).astype(np.float64).sum()),
        )
    # a rank that feeds another shape gets the same clear error as in torch
    try:
        hvd.allreduce(tf.ones([2 + r]), name="tf.mismatch")
    except HvdliteMismatchError as exc:
        assert "tf.mismatch" in str(exc) and "shape" in str(exc), str(exc)
    else:
        raise AssertionError("mismatched shapes did not raise")
    try:
        hvd.allreduce(tf.constant(["a"]))
    except TypeError as exc:
        assert "string" in str(exc), exc
    else:
        raise AssertionError("a string tensor did not raise TypeError")
    # join: the rank with fewer batches joins first and still takes part
    if r == 0:
        close(
            "allreduce beside join", hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="j"), [1.0, 1.0]
        )
    assert hvd.join() in range(n)


def check_process_set():
    r, n = hvd.rank(), hvd.size()
    ps = PROCESS_SET
    if r in ps.ranks:
        for mode in MODES:
            x = tf.constant([1.0 + r])
            close(
                f"{mode} allreduce on a set",
                run(mode, lambda x: hvd.allreduce(x, op=hvd.Sum, process_set=ps), x),
                [1.0 + r],
            )
            close(
                f"{mode} allgather on a set",
                run(mode, lambda x: hvd.allgather(x, process_set=ps), x),
                [1.0 + r],
            )
        hvd.barrier(process_set=ps)
    else:
        try:
            hvd.allreduce(tf.constant([1.0]), process_set=ps)
        except ValueError:
            pass
        else:
            raise AssertionError("an op on a set this rank is not in did not raise")
    close(
        "global set",
        hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, process_set=hvd.global_process_set),
        [float(n)],
    )
    # the optimizers of a set, on every rank (as Horovod's test_optimizer_process_sets): a
    # rank outside it keeps its own gradients, a member of this one-rank set gets its own
    v = tf.Variable([2.0 + r])
    with tf.GradientTape() as tape:
        loss = v * v
    tape = hvd.DistributedGradientTape(tape, process_set=ps)
    close("tape gradient on a set", tape.gradient(loss, [v])[0], [2 * (2.0 + r)])
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.25), process_set=ps)
    opt.apply_gradients([(tf.constant([4.0 + r]), v)])
    close("keras step on a set", v, [2.0 + r - 0.25 * (4.0 + r)])


def check_indexed_slices():
    r, n = hvd.rank(), hvd.size()
    # a gather's gradient is IndexedSlices: the tape allgathers it, or densifies on request
    table = tf.Variable(tf.ones([4, 2]))
    ids = tf.constant([r, 3])

    def grads(sparse_as_dense):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids) * float(r + 1))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, [table])[0]

    want = np.zeros((4, 2))
    for k in range(n):
        want[k] += (k + 1) / n
        want[3] += (k + 1) / n
    for mode in MODES:
        for dense in (False, True):
            g = run(mode, lambda: grads(dense))
            assert isinstance(g, tf.IndexedSlices) != dense, (mode, dense, type(g))
            close(f"{mode} tape IndexedSlices dense={dense}", tf.convert_to_tensor(g), want)
    s = tf.IndexedSlices(
        tf.constant([[1.0 + r, 2.0]]), tf.constant([r]), dense_shape=tf.constant([n, 2])
    )
    for mode in MODES:
        out = run(
            mode,
            lambda v, i: hvd.allreduce(tf.IndexedSlices(v, i, tf.constant([n, 2]))),
            s.values,
            s.indices,
        )
        assert isinstance(out, tf.IndexedSlices)
        dense = tf.convert_to_tensor(out)
        close(f"{mode} IndexedSlices", dense, [[(1.0 + k) / n, 2.0 / n] for k in range(n)])


# -- gradients (Horovod's: allgather's and broadcast's average over ranks) ----------------------
def check_gradients():
    r, n = hvd.rank(), hvd.size()
    ws = [np.arange(6.0).reshape(3, 2) + 10 * k for k in range(n)]  # each rank's weights
    w = tf.constant(ws[r])
    x0 = np.ones((3, 2))

    def grad(fn, x):
        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = fn(x)
        return tape.gradient(loss, x)

    for mode in MODES:

        def g(fn, x):
            return run(mode, lambda: grad(fn, x)) if mode == "function" else grad(fn, x)

        close(
            f"{mode} grad allreduce avg",
            g(lambda x: tf.reduce_sum(w * hvd.allreduce(x)), x0),
            np.mean(ws, 0),
        )
        close(
            f"{mode} grad allreduce sum",
            g(lambda x: tf.reduce_sum(w * hvd.allreduce(x, op=hvd.Sum)), x0),
            np.sum(ws, 0),
        )
        close(
            f"{mode} grad grouped allreduce",
            g(lambda x: tf.reduce_sum(w * hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)[1]), x0),
            2 * np.sum(ws, 0),
        )
        # allgather: rank k contributes k + 1 rows; each rank weighs the gathered rows
        total = sum(k + 1 for k in range(n))
        wg = [np.arange(total * 2.0).reshape(total, 2) * (k + 1) for k in range(n)]
        start = sum(k + 1 for k in range(r))
        close(
            f"{mode} grad allgather",
            g(lambda x: tf.reduce_sum(tf.constant(wg[r]) * hvd.allgather(x)), np.ones((r + 1, 2))),
            np.mean(wg, 0)[start : start + r + 1],
        )
        close(
            f"{mode} grad broadcast",
            g(lambda x: tf.reduce_sum(w * hvd.broadcast(x, 0)), x0),
            np.mean(ws, 0) if r == 0 else np.zeros((3, 2)),
        )
        wr = [np.arange(2.0).reshape(1, 2) + k for k in range(n)] if n == 2 else None
        if n == 2:
            close(
                f"{mode} grad reducescatter",
                g(
                    lambda x: tf.reduce_sum(tf.constant(wr[r]) * hvd.reducescatter(x)),
                    np.ones((2, 2)),
                ),
                np.concatenate(wr),
            )
            close(
                f"{mode} grad reducescatter sum",
                g(
                    lambda x: tf.reduce_sum(tf.constant(wr[r]) * hvd.reducescatter(x, op=hvd.Sum)),
                    np.ones((2, 2)),
                ),
                np.concatenate(wr) * n,
            )
            splits = tf.constant([1, 1])
            close(
                f"{mode} grad alltoall",
                g(
                    lambda x: tf.reduce_sum(tf.constant(wr[r]) * hvd.alltoall(x, splits)[0]),
                    np.ones((2, 2)),
                ),
                np.concatenate(wr),
            )  # row j went to rank j


# -- IndexedSlices averaged as Horovod averages them (true division) ---------------------------
#: the dtype Horovod's ``values / size`` gives integer values (TensorFlow's true division)
_TRUEDIV_DTYPE = {
    tf.int8: tf.float32,
    tf.uint8: tf.float32,
    tf.int16: tf.float32,
    tf.uint16: tf.float32,
    tf.int32: tf.float64,
    tf.int64: tf.float64,
}
SLICE_DTYPES = [
    tf.int8,
    tf.uint8,
    tf.int16,
    tf.uint16,
    tf.int32,
    tf.int64,
    tf.float16,
    tf.float32,
    tf.float64,
]
#: the dtypes allreduced one by one too (every dtype goes through grouped_allreduce)
SINGLE_DTYPES = (tf.int8, tf.uint16, tf.int64, tf.float16)
GRAPH_SESSION = tf.compat.v1.ConfigProto(
    inter_op_parallelism_threads=2, intra_op_parallelism_threads=1
)


def _in_three_modes(build):
    """``build()``'s list run eagerly, in a ``tf.function`` and in a TF1 session: yields
    ``(mode, outputs, fetched)``, ``outputs`` the tensors (for their dtypes and types) and
    ``fetched`` their numpy values (an ``IndexedSlices`` as ``(values, indices)``)."""
    for mode in ("eager", "function"):
        # autograph=False: these cases test the ops' tracing; autograph's conversion of the
        # op layer's Python (seconds for tens of ops) is left to the other cases
        outs = build() if mode == "eager" else tf.function(build, autograph=False)()
        yield (
            mode,
            outs,
            [
                (o.values.numpy(), o.indices.numpy())
                if isinstance(o, tf.IndexedSlices)
                else o.numpy()
                for o in outs
            ],
        )
    graph = tf.Graph()
    with graph.as_default():
        outs = build()
    with tf.compat.v1.Session(graph=graph, config=GRAPH_SESSION) as s:
        got = s.run(outs)
    yield (
        "graph",
        outs,
        [
            (g.values, g.indices) if isinstance(o, tf.IndexedSlices) else g
            for o, g in zip(outs, got)
        ],
    )


def _rank_slices(k, i):
    """Rank k's IndexedSlices number i: rows k and k + 2 of an [n + 2, 3] table; half its
    values are odd, so a truncating average would differ from Horovod's."""
    return np.arange(6.0).reshape(2, 3) + 2 * k + i + 1, np.array([k, k + 2])


def check_indexed_slices_average():
    """allreduce / grouped_allreduce of IndexedSlices with hvd.Average: values / size with
    true division (integers come back float32 or float64, as in Horovod), every dtype,
    single, grouped and mixed with dense tensors (which keep their dtype), eagerly, in
    tf.function and in a TF1 graph."""
    r, n = hvd.rank(), hvd.size()

    def slices(dt, i):
        values, idx = _rank_slices(r, i)
        return tf.IndexedSlices(
            tf.cast(tf.constant(values), dt),
            tf.constant(idx, tf.int64),
            tf.constant([n + 2, 3], tf.int64),
        )

    def dense(dt):  # rank k: [k + 1, k + 2, k + 3]; the sums are odd at n=2
        return tf.cast(tf.constant([r + 1.0, r + 2.0, r + 3.0]), dt)

    def build():
        single = [
            hvd.allreduce(slices(dt, i), op=hvd.Average)
            for i, dt in enumerate(SLICE_DTYPES)
            if dt in SINGLE_DTYPES
        ]
        grouped = hvd.grouped_allreduce(
            [slices(dt, i) for i, dt in enumerate(SLICE_DTYPES)], op=hvd.Average
        )
        mixed = hvd.grouped_allreduce(
            [slices(tf.int32, 0), dense(tf.int32), slices(tf.uint8, 1), dense(tf.float32)],
            op=hvd.Average,
        )
        return single + grouped + mixed + [hvd.allreduce(slices(tf.int32, 2), op=hvd.Sum)]

    def gathered(i, scale):
        return (
            np.concatenate([_rank_slices(k, i)[0] for k in range(n)]) * scale,
            np.concatenate([_rank_slices(k, i)[1] for k in range(n)]),
        )

    dense_sum = np.sum([[k + 1.0, k + 2.0, k + 3.0] for k in range(n)], 0)
    avg = [(dt, gathered(i, 1 / n)) for i, dt in enumerate(SLICE_DTYPES)]
    mixed = [
        (tf.int32, gathered(0, 1 / n)),
        (tf.int32, np.trunc(dense_sum / n)),
        (tf.uint8, gathered(1, 1 / n)),
        (tf.float32, dense_sum / n),
    ]
    want = [a for a in avg if a[0] in SINGLE_DTYPES] + avg + mixed + [(tf.int32, gathered(2, 1))]
    for mode, outs, got in _in_three_modes(build):
        assert len(outs) == len(want), (mode, len(outs), len(want))
        for j, (out, g, (dt, w)) in enumerate(zip(outs, got, want)):
            what = f"{mode} output {j} ({dt.name})"
            if isinstance(w, tuple):
                assert isinstance(out, tf.IndexedSlices), (what, type(out))
                # Average divides (true division: Horovod's dtype), Sum keeps the dtype
                to = _TRUEDIV_DTYPE.get(dt, dt) if j < len(want) - 1 else dt
                assert out.values.dtype == to, (what, out.values.dtype, to)
                tol = 1e-3 if to == tf.float16 else 1e-6  # exact at n=2, not at n=3
                close(f"{what} values", np.asarray(g[0], np.float64), w[0], tol)
                close(f"{what} indices", np.asarray(g[1], np.float64), w[1])
            else:
                assert not isinstance(out, tf.IndexedSlices) and out.dtype == dt, (
                    what,
                    type(out),
                    out.dtype,
                )
                close(what, np.asarray(g, np.float64), w)


# -- gradients built in graphs equal the eager ones ---------------------------------------------
def _gradient_specs(r, n, dt):
    """name -> (inputs, op(inputs) -> outputs): the collectives whose gradients are built
    in graphs.  Each output's gradient (see :func:`_output_grads`) is float32 whatever the
    dtype, as in Horovod's tests (``grad_ys = tf.ones(...)`` for a float64 output)."""

    def rows(k, shape):
        return tf.cast(tf.reshape(tf.range(k * shape[1]) + 10 * r, [k, shape[1]]), dt)

    splits = [r + j + 1 for j in range(n)]
    return {
        "allgather": ([rows(r + 1, (0, 2))], lambda xs: [hvd.allgather(xs[0])]),
        "grouped_allgather": (
            [rows(r + 1, (0, 2)), rows(2, (0, 3))],
            lambda xs: hvd.grouped_allgather(xs),
        ),
        "broadcast": ([rows(3, (0, 2))], lambda xs: [hvd.broadcast(xs[0], n - 1)]),
        "alltoall": ([rows(2 * n, (0, 2))], lambda xs: [hvd.alltoall(xs[0])]),
        "alltoall_splits": (
            [rows(sum(splits), (0, 2))],
            lambda xs: [hvd.alltoall(xs[0], splits=splits)[0]],
        ),
    }


def _output_grads(outs, r):
    """Float32 output gradients that differ by position and rank (a wrong slice shows)."""
    return [
        tf.reshape(tf.cast(tf.range(tf.size(o)), tf.float32), tf.shape(o)) * (r + 1.0) for o in outs
    ]


def _gradients_in_branch(r, n):
    """The float32 gradients taken inside a ``tf.cond`` branch of a ``tf.function``, of ops
    reading eager tensors the function captured.  A captured tensor is named by its
    process-wide id (``cond/748:0`` in the branch), which differs between ranks; an op
    named after it would wait for a name the other rank never submits."""
    if r == 0:
        tf.constant(0.0)  # one more eager tensor here: the ids below differ
    specs = _gradient_specs(r, n, tf.float32)

    def grads():
        out = {}
        for name, (xs, op) in specs.items():

            def taken(xs=xs, op=op):
                with tf.GradientTape() as tape:
                    for x in xs:
                        tape.watch(x)
                    outs = op(xs)
                return tape.gradient(outs, xs, output_gradients=_output_grads(outs, r))

            out[name] = tf.cond(
                tf.constant(True), taken, lambda xs=xs: [tf.zeros_like(x) for x in xs]
            )
        return out

    return tf.function(grads, autograph=False)()


def check_graph_gradients():
    """tf.gradients in a TF1 graph and GradientTape in tf.function give the eager
    gradients of allgather, grouped_allgather, broadcast and alltoall (equal and given
    splits), float32 and float64 inputs, the output gradients float32 (one trace and one
    graph per dtype for every op); and inside a tf.cond branch of a tf.function."""
    r, n = hvd.rank(), hvd.size()

    def tape_grads(dt):
        out = {}
        for name, (xs, op) in _gradient_specs(r, n, dt).items():
            with tf.GradientTape() as tape:
                for x in xs:
                    tape.watch(x)
                outs = op(xs)
            out[name] = tape.gradient(outs, xs, output_gradients=_output_grads(outs, r))
        return out

    def graph_grads(dt):
        out = {}
        for name, (xs, op) in _gradient_specs(r, n, dt).items():
            outs = op(xs)
            out[name] = tf.gradients(outs, xs, grad_ys=_output_grads(outs, r))
        return out

    for dt in (tf.float32, tf.float64):
        eager = tape_grads(dt)
        traced = tf.function(lambda: tape_grads(dt), autograph=False)()
        if dt == tf.float32:
            for name, grads in _gradients_in_branch(r, n).items():
                for i, g in enumerate(grads):
                    close(f"{name} #{i}: gradient in a tf.cond branch", g, eager[name][i])
        graph = tf.Graph()
        with graph.as_default():
            built = graph_grads(dt)
        with tf.compat.v1.Session(graph=graph, config=GRAPH_SESSION) as s:
            from_graph = s.run(built)
        for name, grads in eager.items():
            for i, e in enumerate(grads):
                what = f"{name} {dt.name} #{i}"
                assert e.dtype == traced[name][i].dtype == built[name][i].dtype, (
                    what,
                    e.dtype,
                    traced[name][i].dtype,
                    built[name][i].dtype,
                )
                close(f"{what}: tf.function gradient", traced[name][i], e.numpy())
                close(f"{what}: TF1 graph gradient", from_graph[name][i], e.numpy())


# -- Keras 3: PartialDistributedGradientTape and SyncBatchNormalization train ------------------
def _weights(seed, rows, cols):
    rng = np.random.RandomState(seed)
    return [
        rng.randn(rows, cols).astype(np.float32) * 0.5,
        rng.randn(cols).astype(np.float32) * 0.1,
    ]


def _shared_local_model(shared, local):
    """Dense(3, tanh) (the shared layer) then Dense(1) (the local one), with these weights."""
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)]
    )
    model.layers[0].set_weights(shared)
    model.layers[1].set_weights(local)
    return model


def _mse(model, X, y):
    return tf.reduce_mean((model(X) - y) ** 2)


def _partial_reference(shards, shared, locals_, lr, steps):
    """Every rank's model trained in this process: the shared layer by the mean of the
    ranks' gradients, each local layer by its own rank's gradient divided by the size."""
    n = len(shards)
    models = [_shared_local_model(shared, locals_[k]) for k in range(n)]
    for _ in range(steps):
        grads = []
        for model, (X, y) in zip(models, shards):
            with tf.GradientTape() as tape:
                loss = _mse(model, X, y)
            grads.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
        mean = [np.mean([g[i] for g in grads], 0) for i in range(2)]
        for model, g in zip(models, grads):
            model.layers[0].set_weights(
                [w - lr * m for w, m in zip(model.layers[0].get_weights(), mean)]
            )
            model.layers[1].set_weights(
                [w - lr * d / n for w, d in zip(model.layers[1].get_weights(), g[2:])]
            )
    return models


def check_partial_tape_training():
    """PartialDistributedGradientTape(local_layers=) in a tf.function step, and
    register_local_source (given the tf.Variable under a Keras 3 variable) eagerly, train a
    Keras 3 model to the weights of every rank simulated in one process."""
    r, n = hvd.rank(), hvd.size()
    X, y = _data(16)
    shards = [
        (X[k * 16 // n : (k + 1) * 16 // n], y[k * 16 // n : (k + 1) * 16 // n]) for k in range(n)
    ]
    shared, locals_ = _weights(0, 4, 3), [_weights(10 + k, 3, 1) for k in range(n)]
    lr, steps = 0.1, 3
    want = _partial_reference(shards, shared, locals_, lr, steps)[r].get_weights()

    def partial(model, tape):
        return hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[1]])

    def registered(model, tape):
        tape = hvd.DistributedGradientTape(tape)
        for w in model.layers[1].trainable_weights:
            tape.register_local_source(w.value)  # the tf.Variable a Keras 3 one holds
        return tape

    for what, wrap, traced in (
        ("PartialDistributedGradientTape", partial, True),
        ("register_local_source", registered, False),
    ):
        model = _shared_local_model(shared, locals_[r])
        opt = keras.optimizers.SGD(lr)

        def step(X, y):
            with tf.GradientTape() as tape:
                loss = _mse(model, X, y)
            grads = wrap(model, tape).gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        step = tf.function(step) if traced else step
        for _ in range(steps):
            step(*shards[r])
        for i, (a, b) in enumerate(zip(model.get_weights(), want)):
            close(f"{what}: weight {i}", a, b, 1e-5)


def _bn_model(norm):
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), norm, keras.layers.Dense(1)])


def check_sync_batch_norm_training():
    """A Keras 3 model with SyncBatchNormalization (Horovod's fused=False accepted) trained
    by model.fit on half batches per rank ends with the weights and moving statistics of
    BatchNormalization trained on the full batches in one process."""
    r, n = hvd.rank(), hvd.size()
    X, y = _data(16)
    ref = _bn_model(keras.layers.BatchNormalization(momentum=0.5))
    model = _bn_model(hvd.SyncBatchNormalization(momentum=0.5, fused=False))
    start = hvd.broadcast_object(ref.get_weights(), 0)
    ref.set_weights(start)
    model.set_weights(start)
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    ref.fit(X, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    idx = np.concatenate(
        [np.arange(8 * b + 8 * r // n, 8 * b + 8 * (r + 1) // n) for b in range(2)]
    )
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    model.fit(X[idx], y[idx], batch_size=8 // n, epochs=2, shuffle=False, verbose=0)
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights())):
        close(f"SyncBatchNormalization training: weight {i}", a, b, 1e-4)
    for fused in (True, None):
        try:
            hvd.SyncBatchNormalization(fused=fused)
        except ValueError as exc:
            assert "fused" in str(exc), exc
        else:
            raise AssertionError(f"SyncBatchNormalization(fused={fused}) did not raise")


# -- training equal to one process on the full batch -------------------------------------------
def _data(rows=16, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.randn(rows, 4).astype(np.float32)
    y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return X, y


def check_gradient_tape_training():
    r, n = hvd.rank(), hvd.size()
    X, y = _data(8)
    shard = slice(r * 8 // n, (r + 1) * 8 // n)

    def make(seed):
        rng = np.random.RandomState(seed)
        return [tf.Variable(rng.randn(4, 1).astype(np.float32)), tf.Variable(tf.zeros([1]))]

    def step(vars_, X, y, distributed, predivide=1.0):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((X @ vars_[0] + vars_[1] - y) ** 2)
        if distributed:
            tape = hvd.DistributedGradientTape(tape, gradient_predivide_factor=predivide)
        grads = tape.gradient(loss, vars_)
        for v, g in zip(vars_, grads):
            v.assign_sub(0.05 * g)

    for mode in MODES:
        ref = make(0)
        mine = make(r)  # different on every rank until broadcast
        hvd.broadcast_variables(mine, root_rank=0)
        dstep = step if mode == "eager" else tf.function(step)
        for _ in range(4):
            step(ref, X, y, False)
            dstep(mine, X[shard], y[shard], True, 1.0 if mode == "eager" else 2.0)
        for a, b in zip(mine, ref):
            close(f"{mode} GradientTape training", a, b.numpy(), 1e-5)


def _model(seed):
    keras.utils.set_random_seed(seed)
    m = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)]
    )
    return m


class _Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch_logs, self.lrs = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))


def check_keras_fit():
    r, n = hvd.rank(), hvd.size()
    X, y = _data(16)
    ref = _model(0)
    model = _model(100 + r)  # different on every rank until the callback
    ref.set_weights(hvd.broadcast_object(model.get_weights(), 0))
    ref.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    ref.fit(X, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    # rank r's batch b is rows [8b + 4r, 8b + 4r + 4): the two halves of global batch b
    idx = np.concatenate(
        [np.arange(8 * b + 8 * r // n, 8 * b + 8 * (r + 1) // n) for b in range(2)]
    )
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))
    assert getattr(opt, "_hvdlite_distributed", False) and isinstance(opt, keras.optimizers.SGD)
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    before, after = _Record(), _Record()
    model.fit(
        X[idx],
        y[idx],
        batch_size=8 // n,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
            before,
            hvdk.callbacks.MetricAverageCallback(),
            after,
        ],
    )
    for a, b in zip(model.get_weights(), ref.get_weights()):
        close("keras fit", a, b, 1e-5)
    # MetricAverageCallback: the logged metrics are the mean of every rank's own
    raw = hvd.allgather_object(before.epoch_logs)
    for e, logs in enumerate(after.epoch_logs):
        for k in ("loss", "mae"):
            close(
                f"MetricAverageCallback {k}",
                logs[k],
                np.mean([raw[q][e][k] for q in range(n)]),
                1e-6,
            )


def check_keras_backward_passes():
    """backward_passes_per_step=2: two passes on half batches then one reduction equal one
    pass on the full batch (model.fit's tf.function, and eager apply calls)."""
    r, n = hvd.rank(), hvd.size()
    X, y = _data(16)
    ref = _model(0)
    model = _model(100 + r)  # different on every rank until the callback
    ref.set_weights(hvd.broadcast_object(model.get_weights(), 0))
    start = ref.get_weights()
    ref.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    ref.fit(X, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # 4 updates
    # global batch b (rows 8b..8b+8): rank r holds its half, fed as 2 passes of 8/(2n) rows
    idx = np.concatenate(
        [np.arange(8 * b + 8 * r // n, 8 * b + 8 * (r + 1) // n) for b in range(2)]
    )
    if r == 1:  # advance TensorFlow's branch-graph counter on one rank only: the
        # reduction inside the optimizer's tf.cond must still get the same name on every rank
        tf.function(lambda: tf.cond(tf.constant(True), lambda: 1, lambda: 2))()
    opt = hvdk.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9),
        backward_passes_per_step=2,
        average_aggregated_gradients=True,
    )
    model.compile(optimizer=opt, loss="mse")
    model.fit(
        X[idx],
        y[idx],
        batch_size=4 // n,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    for a, b in zip(model.get_weights(), ref.get_weights()):
        close("keras fit, backward_passes_per_step=2", a, b, 1e-5)
    assert int(opt.iterations) == 8, int(opt.iterations)  # every batch counts
    # eager: sums (no averaging) with half the learning rate make the same update
    eager = _model(0)
    eager.set_weights(start)
    opt = hvdk.DistributedOptimizer(
        keras.optimizers.SGD(0.025, momentum=0.9), backward_passes_per_step=2
    )
    for b in range(4):  # 2 updates of global batches 0 and 1
        rows = idx[b * len(idx) // 4 : (b + 1) * len(idx) // 4]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((eager(X[rows]) - y[rows]) ** 2)
        opt.apply(tape.gradient(loss, eager.trainable_variables), eager.trainable_variables)
    ref2 = _model(0)
    ref2.set_weights(start)
    ref2.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    ref2.fit(X, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(eager.get_weights(), ref2.get_weights()):
        close("eager apply, backward_passes_per_step=2", a, b, 1e-5)
    try:
        hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)
    except ValueError as exc:
        assert "backward_passes_per_step" in str(exc), exc
    else:
        raise AssertionError("backward_passes_per_step=0 did not raise")


def check_keras_lr_callbacks():
    n = hvd.size()
    X, y = _data(16)
    model = _model(1)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    rec = _Record()
    model.fit(
        X,
        y,
        batch_size=4,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[hvdk.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2), rec],
    )
    spe = 4
    want = [
        0.1 / n * ((e + b / spe + 1 / spe) * (n - 1) / 2 + 1) for e in range(2) for b in range(spe)
    ]
    close("warm-up schedule", rec.lrs[:8], want, 1e-6)
    close("after warm-up", rec.lrs[8:], [rec.lrs[7]] * 4, 1e-7)
    model.optimizer.learning_rate = 0.1
    rec = _Record()
    model.fit(
        X,
        y,
        batch_size=4,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[
            hvdk.callbacks.LearningRateScheduleCallback(
                0.1, multiplier=lambda e: 0.5**e, start_epoch=1
            ),
            rec,
        ],
    )
    close("schedule", rec.lrs, [0.1] * 4 + [0.05] * 4 + [0.025] * 4, 1e-7)


def check_elastic_state():
    """TensorFlowState / KerasState save, restore and sync; the Keras elastic callbacks
    (the reset path itself runs in test_tf_elastic.py)."""
    r = hvd.rank()
    v = tf.Variable([float(r), 1.0])
    state = hvd.elastic.TensorFlowState([v], step=r)
    state.sync()  # every rank takes rank 0's values
    close("TensorFlowState sync", v, [0.0, 1.0])
    assert state.step == 0, state.step
    v.assign([5.0, 5.0])
    state.step = 3
    state.commit()
    v.assign([7.0, 7.0])
    state.step = 4
    state.restore()
    close("TensorFlowState restore", v, [5.0, 5.0])
    assert state.step == 3
    X, y = _data(16)
    model = _model(200 + r)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    kstate = hvdk.elastic.KerasState(model, batch=0, epoch=0)
    kstate.sync()
    first = hvd.allgather_object([w.tolist() for w in model.get_weights()])
    assert first[0] == first[-1], "KerasState.sync left the ranks' weights apart"
    commits = []
    orig_commit = kstate.commit
    kstate.commit = lambda: (commits.append(1), orig_commit())
    model.fit(
        X,
        y,
        batch_size=4,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            hvdk.elastic.UpdateBatchStateCallback(kstate),
            hvdk.elastic.UpdateEpochStateCallback(kstate),
            hvdk.elastic.CommitStateCallback(kstate, batches_per_commit=2),
        ],
    )
    assert (kstate.epoch, kstate.batch, len(commits)) == (2, 0, 4), (
        kstate.epoch,
        kstate.batch,
        len(commits),
    )
    saved = [w.copy() for w in model.get_weights()]
    model.set_weights([w + 1 for w in saved])
    kstate.restore()
    for a, b in zip(model.get_weights(), saved):
        close("KerasState restore", a, b)


#: horovod.tensorflow's parameters, in its order (ours may add keyword parameters after them)
_AR = [
    "average",
    "device_dense",
    "device_sparse",
    "compression",
    "op",
    "prescale_factor",
    "postscale_factor",
]
HOROVOD_TF = {
    "allreduce": ["tensor"] + _AR + ["name", "process_set", "ignore_name_scope"],
    "grouped_allreduce": ["tensors"] + _AR + ["process_set", "ignore_name_scope", "name"],
    "allgather": ["tensor", "name", "ignore_name_scope", "process_set"],
    "grouped_allgather": ["tensors", "name", "ignore_name_scope", "process_set"],
    "broadcast": ["tensor", "root_rank", "name", "ignore_name_scope", "process_set"],
    "alltoall": ["tensor", "splits", "name", "ignore_name_scope", "process_set"],
    "reducescatter": [
        "tensor",
        "device_dense",
        "compression",
        "op",
        "name",
        "process_set",
        "ignore_name_scope",
        "prescale_factor",
        "postscale_factor",
    ],
    "grouped_reducescatter": [
        "tensors",
        "device_dense",
        "compression",
        "op",
        "process_set",
        "prescale_factor",
        "postscale_factor",
    ],
    "broadcast_variables": ["variables", "root_rank", "process_set", "inplace"],
    "broadcast_object": ["obj", "root_rank", "session", "name", "process_set"],
    "allgather_object": ["obj", "session", "name", "process_set"],
    "DistributedGradientTape": [
        "gradtape",
        "device_dense",
        "device_sparse",
        "compression",
        "sparse_as_dense",
        "op",
        "gradient_predivide_factor",
        "num_groups",
        "groups",
        "process_set",
        "scale_local_gradients",
    ],
    "join": [],
    "barrier": ["process_set"],
}


def check_signatures():
    import inspect

    for fn, want in HOROVOD_TF.items():
        got = list(inspect.signature(getattr(hvd, fn)).parameters)[: len(want)]
        assert got == want, f"hvd.{fn}: parameters {got}, Horovod's are {want}"
    got = list(inspect.signature(hvdk.DistributedOptimizer).parameters)[:2]
    assert got == ["optimizer", "name"], got


def check_no_torch():
    """Without torch (``--no-torch``): numpy buffers on MPI, and torch never imported."""
    if not NO_TORCH:
        return
    assert arrays.kind().name == "numpy", arrays.kind().name
    assert hvd.mpi_enabled() and not hvd.gloo_built()
    assert not torch_modules(), f"torch was imported: {torch_modules()[:5]}"


CASES = {
    "allreduce": check_allreduce,
    "grouped_allreduce": check_grouped_allreduce,
    "allgather": check_allgather,
    "broadcast": check_broadcast,
    "alltoall": check_alltoall,
    "reducescatter": check_reducescatter,
    "misc": check_misc,
    "process_set": check_process_set,
    "indexed_slices": check_indexed_slices,
    "gradients": check_gradients,
    "gradient_tape_training": check_gradient_tape_training,
    "indexed_slices_average": check_indexed_slices_average,
    "graph_gradients": check_graph_gradients,
    "partial_tape_training": check_partial_tape_training,
    "sync_batch_norm_training": check_sync_batch_norm_training,
    "keras_fit": check_keras_fit,
    "keras_backward_passes": check_keras_backward_passes,
    "keras_lr_callbacks": check_keras_lr_callbacks,
    "elastic_state": check_elastic_state,
    "signatures": check_signatures,
    "no_torch": check_no_torch,
}

if not NO_TORCH:
    # the Keras PowerSGD cases (tf_powersgd_worker.py) share this launch: one TF import less
    from tf_powersgd_worker import CASES as POWERSGD_CASES  # noqa: E402

    CASES.update({f"powersgd_{name}": fn for name, fn in POWERSGD_CASES.items()})

if __name__ == "__main__":
    PROCESS_SET = hvd.ProcessSet([0])
    hvd.init(process_sets=[PROCESS_SET])
    run_cases(hvd, CASES, set(sys.argv[1:]) or None)
