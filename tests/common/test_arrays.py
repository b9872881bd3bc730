"""The numpy array kind (the runtime without torch) against the torch kind, op by op and
dtype by dtype: what MPI jobs without torch compute must be what torch jobs compute.

Fast and in one process: both kinds live side by side here; the process-wide choice is
swapped only where a test needs the numpy kind active (Adasum, the local backend).
"""

import queue
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")

from hvdlite.common import arrays  # noqa: E402
from hvdlite.common.engine import adasum  # noqa: E402
from hvdlite.common.engine import fusion  # noqa: E402
from hvdlite.common.backend.base import Backend  # noqa: E402
from hvdlite.common.engine.message import ReduceOp  # noqa: E402

pytestmark = pytest.mark.timeout(60)

T, N = arrays.TorchArrays(), arrays.NumpyArrays()
DTYPES = list(arrays.DTYPE_NAMES)
FLOATS = ("float16", "bfloat16", "float32", "float64")


def values(dtype, seed=0, n=37):
    """Small exact values of ``dtype`` (negative where signed), as a float64 numpy array."""
    rng = np.random.default_rng(seed)
    v = rng.integers(-4 if dtype[0] in "fbi" else 0, 5, size=n).astype(np.float64)
    if dtype in FLOATS:
        v += rng.integers(0, 4, size=n) / 4.0
    if dtype == "bool":
        v = (v > 1).astype(np.float64)
    return v


def both(dtype, seed=0, n=37):
    """The same buffer in both kinds."""
    a = values(dtype, seed, n).astype(arrays.numpy_dtype(dtype))
    return T.from_numpy(a.copy()), N.from_numpy(a.copy())


def same(t_buf, n_buf, what):
    got, want = N.to_numpy(n_buf), T.to_numpy(t_buf)
    assert N.dtype_name(n_buf) == T.dtype_name(t_buf), what
    assert got.shape == want.shape, what
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64), err_msg=what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allocation_views_and_copies(dtype):
    for k in (T, N):
        assert k.dtype_name(k.empty((2, 3), dtype)) == dtype
        z = k.zeros(4, dtype)
        assert k.numel(z) == 4 and k.nbytes(z) == 4 * arrays.itemsize(dtype)
        f = k.full((2, 2), 1, dtype)
        assert k.to_numpy(f).astype(np.float64).tolist() == [[1, 1], [1, 1]]
    t, n = both(dtype)
    same(T.clone(t), N.clone(n), "clone")
    same(T.flat(t.reshape(37, 1)), N.flat(n.reshape(37, 1)), "flat")
    tb, nb = T.as_bytes(t), N.as_bytes(n)
    assert T.to_numpy(tb).tobytes() == N.to_numpy(nb).tobytes()
    same(T.view_as(tb, dtype), N.view_as(nb, dtype), "bytes viewed back")
    for other in ("float32", "int64"):
        same(T.astype(t, other), N.astype(n, other), f"astype {other}")
    dt, dn = T.empty(37, dtype), N.empty(37, dtype)
    T.copy_(dt, t)
    N.copy_(dn, n)
    same(dt, dn, "copy_")
    same(T.cat([t[:5], t[5:]]), N.cat([n[:5], n[5:]]), "cat")
    assert N.to_numpy(N.from_bytes(b"ab\x00")).tolist() == [97, 98, 0]
    assert (
        N.to_numpy(N.tensor([3, -1], "int64")).tolist()
        == T.to_numpy(T.tensor([3, -1], "int64")).tolist()
    )
    assert N.numel(N.from_bytes(b"")) == 0 == T.numel(T.from_bytes(b""))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_and_unpack(dtype):
    sizes = [5, 0, 17, 1, 14]
    t, n = both(dtype)
    for k, buf in ((T, t), (N, n)):
        flats = []
        off = 0
        for s in sizes:
            flats.append(buf[off : off + s])
            off += s
        out = k.empty(37, dtype)
        k.pack(flats, out)
        outs = [k.empty(s, dtype) for s in sizes]
        k.unpack(out, outs, sizes)
        assert k.to_numpy(k.cat(outs)).tobytes() == k.to_numpy(buf).tobytes(), k.name
        # pieces are views (kept by the executor and copied from again): a change of the
        # buffer shows in them, and copy_all_ copies them out
        pieces = k.pieces(out, sizes)
        assert [k.numel(p) for p in pieces] == sizes, k.name
        assert k.address(pieces[2]) == k.address(out) + 5 * arrays.itemsize(dtype), k.name
        k.copy_(out, k.zeros(37, dtype))
        k.copy_all_(outs, pieces)
        assert not k.to_numpy(k.cat(outs)).astype(np.float64).any(), k.name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("factor", [1.0, 0.5, 3.0, -1.5, 1.0 / 3.0])
def test_scale_follows_horovods_rules_in_both_kinds(dtype, factor):
    t, n = both(dtype, seed=1)
    T.scale_(t, factor)
    N.scale_(n, factor)
    same(t, n, f"scale_ {dtype} by {factor}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("factor", [1.0, 0.5, -1.5, 1.0 / 3.0])
def test_scaled_copy_is_a_copy_then_scale_bit_for_bit(dtype, factor):
    """What the shared-memory path multiplies while copying is exactly what a copy and a
    separate scale_ pass gave, in both kinds."""
    for kind, (src, _) in ((T, both(dtype)), (N, both(dtype)[::-1])):
        want = kind.clone(src)
        kind.scale_(want, factor)
        got = kind.empty(kind.numel(src), dtype)
        kind.scaled_copy_(got, src, factor)
        np.testing.assert_array_equal(
            kind.to_numpy(got).astype(np.float64),
            kind.to_numpy(want).astype(np.float64),
            err_msg=f"{kind.name} scaled_copy_ {dtype} by {factor}",
        )
        assert kind.dtype_name(got) == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT])
def test_combine(dtype, op):
    ta, na = both(dtype, seed=2)
    tb, nb = both(dtype, seed=3)
    T.combine_(ta, tb, op)
    N.combine_(na, nb, op)
    same(ta, na, f"combine_ {op.name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mpi_crossing_widens_half_floats_and_carries_bool_as_bytes(dtype):
    t, n = both(dtype, seed=4)
    (ta, ts), (na, ns) = T.mpi_reducible(t), N.mpi_reducible(n)
    assert ta.dtype == na.dtype and (ts is None) == (ns is None)
    np.testing.assert_array_equal(ta, na)
    if dtype in ("float16", "bfloat16"):
        assert na.dtype == np.float32
        na *= 2
        N.copy_(n, ns)
        np.testing.assert_array_equal(N.to_numpy(n).astype(np.float64), 2 * values(dtype, 4))
    if dtype == "bool":
        assert na.dtype == np.uint8


def test_neutral_values_are_kind_free():
    assert fusion.neutral("int8", ReduceOp.MIN) == 127
    assert fusion.neutral("uint8", ReduceOp.MAX) == 0
    assert fusion.neutral("bfloat16", ReduceOp.MAX) == float("-inf")
    assert fusion.neutral("bool", ReduceOp.MIN) is True
    assert fusion.neutral("float32", ReduceOp.SUM) == 0


def test_dot_and_axpby():
    t, n = both("float64", seed=5)
    assert T.dot(t, t) == N.dot(n, n)
    tb, nb = both("float64", seed=6)
    T.axpby_(t, 0.25, tb, -2.0)
    N.axpby_(n, 0.25, nb, -2.0)
    same(t, n, "axpby_")


def test_dlpack_and_alignment():
    buf = N.empty(64, "float32")
    assert N.data_ptr(buf) == buf.ctypes.data and N.is_contiguous(buf)
    assert N.dlpack(buf) is not None
    assert N.dlpack(N.empty(4, "bfloat16")) is None  # numpy cannot export it: a copy
    assert T.to_numpy(T.empty(3, "bfloat16")).dtype == arrays.numpy_dtype("bfloat16")


class _Pair(Backend):
    """Two thread-ranks exchanging numpy buffers (Adasum's sendrecv_ and nothing else)."""

    name = "pair"

    def __init__(self, rank, boxes):
        self.rank, self.size, self.boxes = rank, 2, boxes
        self.local_rank, self.local_size, self.cross_rank, self.cross_size = rank, 2, 0, 1

    def sendrecv_(self, send, recv, peer):
        self.boxes[(self.rank, peer)].put(np.array(send, copy=True))
        got = self.boxes[(peer, self.rank)].get(timeout=10)
        np.copyto(recv, got.reshape(recv.shape))

    def control_allreduce_min(self, vec):
        raise NotImplementedError

    def _allgather_fixed(self, buf):
        raise NotImplementedError

    def allreduce_(self, tensor, op):
        raise NotImplementedError

    def allgather_bytes(self, send, counts):
        raise NotImplementedError

    def broadcast_(self, tensor, root):
        raise NotImplementedError

    def alltoall_bytes(self, send, send_counts, recv_counts):
        raise NotImplementedError


@pytest.mark.parametrize("dtype", FLOATS)
def test_adasum_with_numpy_buffers_matches_torch(monkeypatch, dtype):
    counts = [7, 0, 12, 3]
    inputs = [values(dtype, seed=10 + r, n=22) for r in range(2)]
    # torch kind, as torch jobs run it
    boxes = {(a, b): queue.Queue() for a in range(2) for b in range(2)}
    results = {}

    def run(kind, r):
        buf = kind.from_numpy(inputs[r].astype(arrays.numpy_dtype(dtype)))
        adasum.allreduce_(
            _TorchPair(r, boxes) if kind is T else _Pair(r, boxes), buf, counts, "adasum.test"
        )
        results[(kind.name, r)] = kind.to_numpy(buf).astype(np.float64)

    for kind in (T, N):
        monkeypatch.setattr(arrays, "_ACTIVE", kind)
        threads = [threading.Thread(target=run, args=(kind, r)) for r in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(20)
        assert not any(th.is_alive() for th in threads), "a rank hung"
    tol = 1e-2 if dtype in ("float16", "bfloat16") else 1e-6
    for r in range(2):
        np.testing.assert_allclose(results[("numpy", r)], results[("torch", r)], rtol=tol, atol=tol)
    np.testing.assert_array_equal(results[("numpy", 0)], results[("numpy", 1)])


class _TorchPair(_Pair):
    def sendrecv_(self, send, recv, peer):
        self.boxes[(self.rank, peer)].put(send.clone())
        recv.copy_(self.boxes[(peer, self.rank)].get(timeout=10))


def test_kind_is_chosen_once_and_is_torch_here():
    assert arrays.kind() is arrays.kind() and arrays.have_torch()


def test_ml_dtypes_is_imported_only_for_a_bfloat16_numpy_array():
    """ml_dtypes costs ~0.65 s of CPU to import; a torch job that never turns a bfloat16
    buffer into numpy must not pay it (every rank did, with this module)."""
    import subprocess
    import sys

    code = (
        "import sys, torch, hvdlite.torch, hvdlite.common.arrays as a; "
        "assert 'ml_dtypes' not in sys.modules; k = a.kind(); "
        "x = torch.ones(3, dtype=torch.float32); k.from_numpy(k.to_numpy(x)); "
        "assert 'ml_dtypes' not in sys.modules; "
        "b = k.to_numpy(torch.ones(3, dtype=torch.bfloat16)); "
        "assert b.dtype.name == 'bfloat16' and 'ml_dtypes' in sys.modules; "
        "assert torch.equal(k.from_numpy(b), torch.ones(3, dtype=torch.bfloat16))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
