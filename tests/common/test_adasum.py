"""op=Adasum, layers 1 and 2: the algorithm (hvdlite/common/engine/adasum.py) on thread-ranks over the
loopback backend against the plainly written rule, then through real Runtime objects.
"""

import threading

import pytest
import torch

from hvdlite.common.engine import adasum
from hvdlite.common.backend.local import LocalBackend
from hvdlite.common.engine.message import OpType, ReduceOp, Request
from hvdlite.common.engine.tensor_queue import Entry, Handle
from tests.common.adasum_reference import pair, tolerance, tree
from tests.common.loopback import Hub, LoopbackBackend, on_every_rank, wait
from tests.common.loopback import start_runtimes as start
from tests.common.loopback import stop_runtimes as stop

pytestmark = pytest.mark.timeout(60)

#: the tensors of one fused buffer: sizes below, at and above the number of ranks, an empty one
COUNTS = [7, 1, 0, 33, 2, 16]


def ranks(size, body):
    """body(rank, backend) on one thread per rank; returns the results in rank order and
    re-raises the first failure."""
    hub = Hub(size)
    results, errors = [None] * size, []

    def run(r):
        try:
            results[r] = body(r, LoopbackBackend(hub, r))
        except BaseException as exc:  # reported below, with the rank
            errors.append((r, exc))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, f"rank {errors[0][0]} failed: {errors[0][1]!r}"
    return results, hub


def inputs(rank, dtype, counts=COUNTS):
    """One rank's tensors: a shared direction plus rank noise (so the coefficients are neither
    0 nor 1), a vector that is zero on ranks 1 and 2, and one that is zero everywhere."""
    g = torch.Generator().manual_seed(1000 + rank)
    common = torch.Generator().manual_seed(7)
    out = []
    for i, n in enumerate(counts):
        t = torch.randn(n, generator=common, dtype=torch.float64) * 0.5 + torch.randn(
            n, generator=g, dtype=torch.float64
        )
        if i == 3 and rank in (1, 2):
            t.zero_()
        if i == 4:
            t.zero_()
        out.append(t.to(dtype))
    return out


def fused_adasum(size, dtype, counts=COUNTS):
    def body(r, backend):
        buf = torch.cat(inputs(r, dtype, counts))
        adasum.allreduce_(backend, buf, counts)
        return buf

    return ranks(size, body)


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_fused_buffer_is_the_rule_tensor_by_tensor(size, dtype):
    results, _ = fused_adasum(size, dtype)
    for r in range(1, size):  # the gather phase hands every rank the same bytes
        assert torch.equal(results[r], results[0]), r
    per_rank = [inputs(r, dtype) for r in range(size)]
    rtol, atol = tolerance(dtype)
    for i, got in enumerate(results[0].split(COUNTS)):
        expected = tree([ts[i] for ts in per_rank])
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=f"tensor {i}")
    assert not results[0].split(COUNTS)[4].any()  # zero everywhere stays zero


@pytest.mark.parametrize("counts", [[1], [3], [0, 2, 0], [0]])
def test_buffers_smaller_than_the_job(counts):
    """Some ranks hold nothing at the deeper levels; the exchanges must still pair up."""
    results, _ = fused_adasum(8, torch.float64, counts)
    per_rank = [inputs(r, torch.float64, counts) for r in range(8)]
    for i, got in enumerate(results[0].split(counts)):
        torch.testing.assert_close(got, tree([ts[i] for ts in per_rank]))
    assert all(torch.equal(res, results[0]) for res in results)


def test_per_tensor_rule_differs_from_the_rule_on_the_whole_buffer():
    """Guards the test above: fusing must not change the result, and it would if the dot
    products covered the whole buffer."""
    results, _ = fused_adasum(2, torch.float64)
    whole = pair(torch.cat(inputs(0, torch.float64)), torch.cat(inputs(1, torch.float64)))
    assert not torch.allclose(results[0], whole)


def test_zero_vector_is_left_out():
    def body(r, backend):
        t = torch.zeros(5, dtype=torch.float64) if r == 1 else torch.arange(5.0).double() + r
        adasum.allreduce_(backend, t, [5])
        return t

    results, _ = ranks(2, body)
    assert torch.equal(results[0], torch.arange(5.0).double())


def test_parallel_vectors_average_and_orthogonal_ones_add():
    def body(r, backend):
        same = torch.tensor([3.0, 4.0])
        orth = torch.tensor([1.0, 0.0]) if r == 0 else torch.tensor([0.0, 2.0])
        buf = torch.cat([same, orth])
        adasum.allreduce_(backend, buf, [2, 2])
        return buf

    results, _ = ranks(2, body)
    assert results[0].tolist() == [3.0, 4.0, 1.0, 2.0]


def test_non_power_of_two_raises_on_every_rank_naming_the_size():
    def body(r, backend):
        with pytest.raises(ValueError, match="power-of-two number of ranks, but this job has 3"):
            adasum.allreduce_(backend, torch.ones(4), [4], name="grad")
        return True

    results, hub = ranks(3, body)
    assert results == [True] * 3 and hub.calls["sendrecv"] == 0


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_integer_dtype_raises(dtype):
    with pytest.raises(TypeError, match=f"dtype {str(dtype)[6:]} is not supported"):
        adasum.allreduce_(LocalBackend(None), torch.ones(3, dtype=dtype), [3])


def test_one_rank_is_the_identity():
    t = torch.tensor([1.0, -2.0, 3.0])
    adasum.allreduce_(LocalBackend(None), t, [1, 2])
    assert t.tolist() == [1.0, -2.0, 3.0]


def test_block_allreduce_sums_within_aligned_blocks():
    def body(r, backend):
        out = {}
        for block in (1, 2, 4):
            t = torch.tensor([float(r), 1.0], dtype=torch.float64)
            backend.block_allreduce_(t, block)
            out[block] = t.tolist()
        return out

    results, _ = ranks(4, body)
    for r, got in enumerate(results):
        lo = r // 2 * 2
        assert got[1] == [float(r), 1.0]
        assert got[2] == [float(lo + lo + 1), 2.0]
        assert got[4] == [6.0, 4.0]


# -- layer 2: through the runtime --------------------------------------------------------------


def submit(rt, tensors, names, pre=1.0, post=1.0):
    """One enqueue for all tensors, so every rank negotiates them in one cycle (one group)."""
    handles, entries = [], []
    for t, name in zip(tensors, names):
        h = Handle(1)
        req = Request(
            name,
            OpType.ALLREDUCE,
            str(t.dtype)[6:],
            tuple(t.shape),
            reduce_op=int(ReduceOp.ADASUM),
            prescale=pre,
            postscale=post,
        )
        entries.append(Entry(req, t, t, h, 0))
        handles.append(h)
    rt.enqueue(entries)
    return handles


def test_runtime_fuses_adasum_tensors_and_applies_the_rule_per_tensor():
    hub, rts = start(4)
    counts = [5, 12, 3]
    per_rank = [inputs(r, torch.float32, counts) for r in range(4)]
    shapes = [(5,), (3, 4), (3,)]

    def body(r, rt):
        tensors = [t.clone().reshape(s) for t, s in zip(per_rank[r], shapes)]
        handles = submit(rt, tensors, ["a", "b", "c"], pre=0.5, post=3.0)
        for i, h in enumerate(handles):
            expected = tree([ts[i] * 0.5 for ts in per_rank]) * 3.0
            torch.testing.assert_close(wait(h).reshape(-1), expected, rtol=1e-5, atol=1e-6)

    on_every_rank(rts, body)
    # one fused group: 2 halving + 2 gathering exchanges, and the norms' sums over blocks of
    # 2 and 4 ranks (1 + 2 exchanges); three separate groups would need three times as many
    assert hub.calls["sendrecv"] == 7, hub.calls
    stop(rts)


def test_runtime_refuses_integers_and_carries_on():
    _, rts = start(2)

    def body(r, rt):
        [h] = submit(rt, [torch.ones(3, dtype=torch.int32)], ["ints"])
        with pytest.raises(TypeError, match="'ints' with op=Adasum: dtype int32"):
            wait(h)
        [h] = submit(rt, [torch.full((2,), 2.0)], ["after"])
        assert wait(h).tolist() == [2.0, 2.0]  # parallel vectors: their average

    on_every_rank(rts, body)
    stop(rts)


def test_runtime_refuses_three_ranks_on_every_rank():
    _, rts = start(3)

    def body(r, rt):
        [h] = submit(rt, [torch.ones(4)], ["g"])
        with pytest.raises(ValueError, match="this job has 3"):
            wait(h)

    on_every_rank(rts, body)
    stop(rts)


def test_joined_rank_contributes_a_zero_vector():
    _, rts = start(4)
    vals = [torch.randn(6, generator=torch.Generator().manual_seed(r)) for r in range(4)]

    def body(r, rt):
        if r < 3:
            [h] = submit(rt, [vals[r].clone()], ["j"])
            expected = tree(vals[:3] + [torch.zeros(6)])
            torch.testing.assert_close(wait(h), expected, rtol=1e-5, atol=1e-6)
        j = Handle(1)
        rt.enqueue([Entry(Request("__join__", OpType.JOIN), None, None, j, 0)])
        wait(j)

    on_every_rank(rts, body)
    stop(rts)
