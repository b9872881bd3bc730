"""Runs on every rank: each check computes its expected values from rank() and size().

Prints ``OK <check> rank=R`` per passing check and ``FAIL <check> rank=R`` with a
traceback per failing one; exits 1 if anything failed.  ``--only a,b`` runs a subset;
``--variants JSON`` runs sets of checks under different tunables in one job.
"""

import argparse
import json
import os
import sys
import time

import torch

import hvdlite.torch as hvd
from tests.worker_cases import run_cases, run_each
from hvdlite.common.exceptions import HvdliteDuplicateNameError, HvdliteMismatchError

torch.set_num_threads(1)

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


def value(rank, dtype, shape=(3, 4)):
    """A deterministic, rank-dependent input small enough for every dtype and product."""
    n = 1
    for s in shape:
        n *= s
    base = (torch.arange(n, dtype=torch.int64) % 3) + 1 + (rank % 2)
    if dtype == torch.bool:
        return ((torch.arange(n) + rank) % 2 == 0).reshape(shape)
    return base.to(dtype).reshape(shape)


def reference(dtype, op, shape=(3, 4), pre=1.0, post=1.0):
    n = hvd.size()
    vals = [value(r, dtype, shape).to(torch.float64) * pre for r in range(n)]
    if not dtype.is_floating_point:  # integer buffers are scaled in place: truncated
        vals = [v.trunc() for v in vals]
    stack = torch.stack(vals)
    if op == hvd.Sum:
        out = stack.sum(0)
    elif op == hvd.Average:
        out = stack.sum(0) / n
    elif op == hvd.Min:
        out = stack.min(0).values
    elif op == hvd.Max:
        out = stack.max(0).values
    else:
        out = stack.prod(0)
    out = out * post
    if not dtype.is_floating_point:
        out = out.trunc()
    return out


def close(a, b, dtype):
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-6)
    return torch.allclose(a.to(torch.float64), b.to(torch.float64), rtol=tol, atol=tol)


def check_allreduce_all_dtypes_ops():
    for dtype in FLOATS + INTS:
        for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
            x = value(hvd.rank(), dtype)
            got = hvd.allreduce(x, op=op, name=f"ar.{dtype}.{op}")
            assert got.dtype == dtype, (dtype, op, got.dtype)
            ref = reference(dtype, op)
            assert close(got, ref, dtype), f"{dtype} {op}: {got} != {ref}"
            assert torch.equal(x, value(hvd.rank(), dtype)), "input was modified"
    for op in (hvd.Min, hvd.Max):
        x = value(hvd.rank(), torch.bool)
        got = hvd.allreduce(x, op=op, name=f"ar.bool.{op}")
        stack = torch.stack([value(r, torch.bool) for r in range(hvd.size())])
        ref = stack.all(0) if op == hvd.Min else stack.any(0)
        assert torch.equal(got, ref), (op, got, ref)


def check_allreduce_scaling_and_variants():
    for dtype in (torch.float32, torch.float64, torch.int32):
        x = value(hvd.rank(), dtype)
        got = hvd.allreduce(
            x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name=f"scaled.{dtype}"
        )
        assert close(got, reference(dtype, hvd.Sum, pre=0.5, post=3.0), dtype), (dtype, got)
    # tensors of several pieces (MPI reduces 4 MiB at a time, scaling each piece)
    for dtype in (torch.float32, torch.int32):
        x = value(hvd.rank(), dtype, (1_200_001,))
        got = hvd.allreduce(
            x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name=f"scaled.big.{dtype}"
        )
        want = reference(dtype, hvd.Sum, (1_200_001,), pre=0.5, post=3.0)
        assert close(got, want, dtype), (dtype, got[:4], want[:4])
        got = hvd.allreduce(x, op=hvd.Average, name=f"avg.big.{dtype}")
        assert close(got, reference(dtype, hvd.Average, (1_200_001,)), dtype), dtype
    # integer average truncates toward zero, as Horovod's does (also for negative sums)
    n = hvd.size()
    total = sum(q + 1 for q in range(n))
    got = hvd.allreduce(torch.tensor([-(hvd.rank() + 1), hvd.rank() + 1]), name="int.avg")
    assert got.tolist() == [-(total // n), total // n], got
    # in place, async, async in place, deprecated average=
    x = value(hvd.rank(), torch.float32)
    out = hvd.allreduce_(x, op=hvd.Sum, name="inplace")
    assert out is x and close(x, reference(torch.float32, hvd.Sum), torch.float32)
    h = hvd.allreduce_async(value(hvd.rank(), torch.float32), name="async")
    assert close(hvd.synchronize(h), reference(torch.float32, hvd.Average), torch.float32)
    y = value(hvd.rank(), torch.float32)
    h = hvd.allreduce_async_(y, op=hvd.Max, name="async_")
    hvd.synchronize(h)
    assert hvd.poll(h) and close(y, reference(torch.float32, hvd.Max), torch.float32)
    got = hvd.allreduce(value(hvd.rank(), torch.float32), average=False, name="deprecated")
    assert close(got, reference(torch.float32, hvd.Sum), torch.float32)
    # grouped, in and out of place
    ts = [value(hvd.rank(), torch.float32, (i + 1, 2)) for i in range(5)]
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="grouped")
    for i, o in enumerate(outs):
        assert close(o, reference(torch.float32, hvd.Sum, (i + 1, 2)), torch.float32)
    hvd.grouped_allreduce_(ts, op=hvd.Sum, name="grouped_")
    for i, t in enumerate(ts):
        assert close(t, reference(torch.float32, hvd.Sum, (i + 1, 2)), torch.float32)
    # a repeated in-place group (kept buffer): 1-D, N-D and non-contiguous tensors, each
    # call with its own values, and a second synchronize
    for step in (1, 2, 3):
        one_d = [value(hvd.rank(), torch.float32, (i + 2,)) * step for i in range(4)]
        mixed = [
            value(hvd.rank(), torch.float32, (2, 3)) * step,
            value(hvd.rank(), torch.float32, (3, 2)).t() * step,
        ]
        mixed.append(torch.zeros(4, 3).t())
        mixed[-1].copy_(value(hvd.rank(), torch.float32, (3, 4)) * step)
        for group, tag in ((one_d, "1d"), (mixed, "nd")):
            want = [reference(torch.float32, hvd.Sum, tuple(t.shape)) * step for t in group]
            if tag == "nd":
                want[1] = reference(torch.float32, hvd.Sum, (3, 2)).t() * step
                want[2] = reference(torch.float32, hvd.Sum, (3, 4)) * step
            h = hvd.grouped_allreduce_async_(group, op=hvd.Sum, name=f"kept.{tag}")
            hvd.synchronize(h)
            if step == 3:
                hvd.synchronize(h)
            for got, exp in zip(group, want):
                assert close(got, exp, torch.float32), (tag, step, got, exp)
    # non-contiguous input, in and out of place
    base = value(hvd.rank(), torch.float32, (4, 6))
    view = base.t()
    got = hvd.allreduce(view, op=hvd.Sum, name="noncontig")
    assert close(got, reference(torch.float32, hvd.Sum, (4, 6)).t(), torch.float32)
    hvd.allreduce_(view, op=hvd.Sum, name="noncontig_")
    assert close(base, reference(torch.float32, hvd.Sum, (4, 6)), torch.float32)
    # a scalar
    got = hvd.allreduce(torch.tensor(float(hvd.rank() + 1)), op=hvd.Sum, name="scalar")
    assert got.dim() == 0 and got.item() == sum(range(1, hvd.size() + 1))


def check_allgather():
    r, n = hvd.rank(), hvd.size()
    for dtype in FLOATS + INTS + [torch.bool]:
        x = value(r, dtype, (r + 1, 3))
        got = hvd.allgather(x, name=f"ag.{dtype}")
        ref = torch.cat([value(q, dtype, (q + 1, 3)) for q in range(n)])
        assert got.dtype == dtype and torch.equal(got, ref), (dtype, got, ref)
    # a rank with zero rows, and grouped allgather of different dtypes
    x = torch.ones(0 if r == 0 else 2, 2)
    got = hvd.allgather(x, name="ag.empty")
    assert got.shape == (2 * (n - 1), 2)
    outs = hvd.grouped_allgather(
        [torch.full((r + 1,), r, dtype=torch.int64), torch.full((1, 2), float(r))],
        name="ag.grouped",
    )
    assert outs[0].tolist() == [q for q in range(n) for _ in range(q + 1)], outs[0]
    assert outs[1].tolist() == [[float(q)] * 2 for q in range(n)], outs[1]
    h = hvd.allgather_async(torch.tensor([r]), name="ag.async")
    assert hvd.synchronize(h).tolist() == list(range(n))


def check_broadcast():
    r, n = hvd.rank(), hvd.size()
    for root in sorted({0, n - 1}):
        for dtype in FLOATS + INTS + [torch.bool]:
            x = value(r, dtype, (2, 5))
            got = hvd.broadcast(x, root_rank=root, name=f"bc.{root}.{dtype}")
            assert torch.equal(got, value(root, dtype, (2, 5))), (root, dtype)
            assert torch.equal(x, value(r, dtype, (2, 5))), "broadcast modified its input"
        y = torch.full((3,), float(r))
        hvd.broadcast_(y, root_rank=root, name=f"bc_.{root}")
        assert y.tolist() == [float(root)] * 3
    # several broadcasts in flight fuse into one; each must land in its own tensor
    ts = [torch.full((i + 1,), float(r * 10 + i)) for i in range(20)]
    hs = [hvd.broadcast_async_(t, root_rank=0, name=f"bc.many.{i}") for i, t in enumerate(ts)]
    for i, h in enumerate(hs):
        hvd.synchronize(h)
        assert ts[i].tolist() == [float(i)] * (i + 1), (i, ts[i])


def check_alltoall():
    r, n = hvd.rank(), hvd.size()
    # rank r sends (q + r) % 3 rows to rank q, each row tagged with (sender, receiver)
    splits = [(q + r) % 3 for q in range(n)]
    rows = []
    for q in range(n):
        rows += [[r, q]] * splits[q]
    x = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)
    out, received = hvd.alltoall(x, splits=splits, name="a2a")
    expect_splits = [(r + s) % 3 for s in range(n)]
    assert received.tolist() == expect_splits, (received, expect_splits)
    expect = []
    for s in range(n):
        expect += [[s, r]] * expect_splits[s]
    assert out.tolist() == expect, (out, expect)
    # default splits: even division
    x = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    out = hvd.alltoall(x, name="a2a.even")  # no splits: the tensor alone, as Horovod
    received = hvd.synchronize(hvd.alltoall_async(x, name="a2a.even.async"))[1]
    assert received.tolist() == [2] * n, received
    assert out.tolist() == [float(2 * r + k + 100 * s) for s in range(n) for k in range(2)]


def check_reducescatter():
    r, n = hvd.rank(), hvd.size()
    rows = 2 * n + 1  # uneven: the first rank gets one row more
    x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * (r + 1)
    total = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * sum(
        q + 1 for q in range(n)
    )
    base, extra = divmod(rows, n)
    start = r * base + min(r, extra)
    count = base + (1 if r < extra else 0)
    got = hvd.reducescatter(x, op=hvd.Sum, name="rs.sum")
    assert torch.equal(got, total[start : start + count]), (got, total)
    got = hvd.reducescatter(x, "rs.avg")  # the second positional is the name
    assert torch.allclose(got, total[start : start + count] / n)
    outs = hvd.grouped_reducescatter([x, x * 2], op=hvd.Sum, name="rs.grouped")
    assert torch.equal(outs[1], 2 * total[start : start + count])


def check_submission_order():
    r = hvd.rank()
    names = ["order.a", "order.b", "order.c"]
    if r % 2:
        names = names[::-1]
    handles = {
        nm: hvd.allreduce_async(torch.full((4,), float(ord(nm[-1]))), name=nm, op=hvd.Sum)
        for nm in names
    }
    for nm, h in handles.items():
        assert hvd.synchronize(h).tolist() == [float(ord(nm[-1]) * hvd.size())] * 4


def check_many_small_tensors():
    n = hvd.size()
    for step in range(3):
        ts = [torch.full((i % 7 + 1,), float(i + hvd.rank())) for i in range(500)]
        hs = [hvd.allreduce_async_(t, name=f"small.{i}", op=hvd.Sum) for i, t in enumerate(ts)]
        for i, h in enumerate(hs):
            hvd.synchronize(h)
            expect = float(i * n + sum(range(n)))
            assert ts[i].tolist() == [expect] * (i % 7 + 1), (step, i, ts[i])


def check_mismatch_errors():
    r = hvd.rank()
    if hvd.size() == 1:
        return  # a single rank cannot disagree with itself
    cases = [
        ("mm.shape", lambda: hvd.allreduce(torch.ones(2 + r), name="mm.shape"), "shape"),
        (
            "mm.dtype",
            lambda: hvd.allreduce(
                torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64), name="mm.dtype"
            ),
            "dtype",
        ),
        (
            "mm.op",
            lambda: hvd.allreduce(torch.ones(2), name="mm.op", op=hvd.Sum if r == 0 else hvd.Max),
            "reduce op",
        ),
        ("mm.root", lambda: hvd.broadcast(torch.ones(2), root_rank=r, name="mm.root"), "root_rank"),
        (
            "mm.kind",
            lambda: (
                hvd.allreduce(torch.ones(2), name="mm.kind")
                if r == 0
                else hvd.allgather(torch.ones(2), name="mm.kind")
            ),
            "operation",
        ),
        (
            "mm.trailing",
            lambda: hvd.allgather(torch.ones(2, 1 + r), name="mm.trailing"),
            "trailing shape",
        ),
    ]
    for name, fn, what in cases:
        try:
            fn()
        except HvdliteMismatchError as exc:
            msg = str(exc)
            assert name in msg and what in msg, msg
            assert "ranks [0]" in msg and "ranks [1]" in msg, msg
        else:
            raise AssertionError(f"{name}: no mismatch error")
    # the runtime keeps working afterwards, and a cached name may change shape later
    assert (
        hvd.allreduce(torch.ones(3), name="mm.after", op=hvd.Sum).tolist()
        == [float(hvd.size())] * 3
    )
    assert (
        hvd.allreduce(torch.ones(5), name="mm.after", op=hvd.Sum).tolist()
        == [float(hvd.size())] * 5
    )


def check_duplicate_name():
    if hvd.size() == 1:
        return  # the first op may finish before the second is pushed
    if hvd.rank() == 1:
        time.sleep(0.5)  # keeps "dup" in flight on rank 0 meanwhile
    h = hvd.allreduce_async(torch.ones(2), name="dup")
    try:
        if hvd.rank() == 0:
            hvd.allreduce_async(torch.ones(2), name="dup")
        else:
            raise HvdliteDuplicateNameError("dup: rank 1 does not try")
    except HvdliteDuplicateNameError as exc:
        assert "dup" in str(exc)
    else:
        raise AssertionError("duplicate name in flight was accepted")
    hvd.synchronize(h)


def check_bad_input():
    for fn, kind, text in [
        (lambda: hvd.allreduce([1, 2], name="bad.list"), TypeError, "torch.Tensor"),
        (
            lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64), name="bad.complex"),
            TypeError,
            "complex64",
        ),
        (
            lambda: hvd.broadcast(torch.ones(2), root_rank=hvd.size(), name="bad.root"),
            ValueError,
            "root_rank",
        ),
        (
            lambda: hvd.alltoall(torch.ones(3), splits=[1] * (hvd.size() + 1), name="bad.splits"),
            ValueError,
            "splits",
        ),
        (
            lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool), name="bad.boolsum"),
            TypeError,
            "bool",
        ),
        (
            lambda: hvd.allreduce(
                torch.ones(2, dtype=torch.int32), op=hvd.Adasum, name="bad.adasum"
            ),
            TypeError,
            "Adasum",
        ),
        (lambda: hvd.allgather(torch.tensor(1.0), name="bad.scalar"), ValueError, "scalar"),
    ]:
        try:
            fn()
        except kind as exc:
            assert text in str(exc), str(exc)
        else:
            raise AssertionError(f"no {kind.__name__} for {text}")


def check_join_uneven():
    r, n = hvd.rank(), hvd.size()
    steps = 3 * (r + 1)
    for step in range(steps):
        # ranks that already joined contribute zeros: count the active ranks
        active = [q for q in range(n) if 3 * (q + 1) > step]
        got = hvd.allreduce(torch.full((5,), float(r + 1)), op=hvd.Sum, name=f"join.{step}")
        assert got.tolist() == [float(sum(q + 1 for q in active))] * 5, (step, got)
        mx = hvd.allreduce(torch.full((2,), -5.0 + r), op=hvd.Max, name=f"join.max.{step}")
        assert mx.tolist() == [max(-5.0 + q for q in active)] * 2, (step, mx)
        if len(active) == n:  # no rank has joined yet: allgather works
            ag = hvd.allgather(torch.tensor([r]), name=f"join.ag.{step}")
            assert ag.tolist() == active, (step, ag)
    last = hvd.join()
    assert last == n - 1, last
    # after everybody joined, normal operation resumes
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="join.after").item() == n


def check_barrier():
    r = hvd.rank()
    path = os.path.join(os.environ["HVD_TEST_DIR"], f"barrier.{r}")
    if r == 0:
        time.sleep(0.5)
    open(path, "w").close()
    hvd.barrier()
    for q in range(hvd.size()):
        assert os.path.exists(os.path.join(os.environ["HVD_TEST_DIR"], f"barrier.{q}")), q


def check_unnamed_ops():
    a = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    b = hvd.allgather(torch.ones(1, 1))
    c = hvd.broadcast(torch.ones(1) * hvd.rank(), 0)
    assert a.tolist() == [float(hvd.size())] * 2 and b.shape == (hvd.size(), 1)
    assert c.tolist() == [0.0]


def check_autograd():
    r, n = hvd.rank(), hvd.size()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum, name="grad.ar")
    (y * torch.arange(3.0)).sum().backward()
    # d/dx_r of sum_q (sum_p x_p) . w, every rank with the same w: the summed gradient
    assert x.grad.tolist() == [0.0 * n, 1.0 * n, 2.0 * n], x.grad
    x = torch.ones(r + 1, 2, requires_grad=True)
    g = hvd.allgather(x, name="grad.ag")
    assert g.shape == (sum(q + 1 for q in range(n)), 2) and g.requires_grad
    (g * 2).sum().backward()
    assert x.grad.tolist() == [[2.0, 2.0]] * (r + 1), x.grad
    x = torch.ones(2, requires_grad=True)
    b = hvd.broadcast(x, root_rank=0, name="grad.bc")
    b.sum().backward()
    assert x.grad.tolist() == ([1.0, 1.0] if r == 0 else [0.0, 0.0]), x.grad


def check_autograd_every_op():
    """Gradients of the other differentiable ops, against Horovod's definitions."""
    r, n = hvd.rank(), hvd.size()
    # grouped allreduce (Sum): each input's gradient is the sum of every rank's upstream one
    xs = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    ys = hvd.grouped_allreduce(xs, op=hvd.Sum, name="grad.gar")
    (ys[0].sum() * (r + 1) + ys[1].sum() * 2).backward()
    assert xs[0].grad.tolist() == [float(sum(q + 1 for q in range(n)))] * 2, xs[0].grad
    assert xs[1].grad.tolist() == [2.0 * n] * 3, xs[1].grad
    # grouped allgather: this rank's rows of the averaged upstream gradient
    xs = [torch.ones(r + 1, requires_grad=True), torch.ones(1, 2, requires_grad=True)]
    gs = hvd.grouped_allgather(xs, name="grad.gag")
    w = torch.arange(float(gs[0].numel())) * (r + 1)
    (gs[0] * w).sum().backward()
    mean_w = torch.arange(float(gs[0].numel())) * sum(q + 1 for q in range(n)) / n
    start = sum(q + 1 for q in range(r))
    assert torch.allclose(xs[0].grad, mean_w[start : start + r + 1]), xs[0].grad
    # alltoall with splits: each row's gradient comes back from the rank it was sent to
    splits = [1] * n
    x = torch.full((n, 2), float(r), requires_grad=True)
    out, received = hvd.alltoall(x, splits=splits, name="grad.a2a")
    assert received.tolist() == [1] * n and not received.requires_grad
    (out * (r + 1)).sum().backward()
    assert x.grad.tolist() == [[float(q + 1)] * 2 for q in range(n)], x.grad
    # reducescatter: the allgather of the upstream gradients (times size for Sum), as Horovod
    for op, factor in ((hvd.Average, 1.0), (hvd.Sum, float(n))):
        x = torch.ones(2 * n, 1, requires_grad=True)
        y = hvd.reducescatter(x, op=op, name=f"grad.rs.{op}")
        (y * (r + 1)).sum().backward()
        expect = [[factor * (q + 1)] for q in range(n) for _ in range(2)]
        assert x.grad.tolist() == expect, (op, x.grad)
    xs = [torch.ones(n, requires_grad=True), torch.ones(2 * n, requires_grad=True)]
    ys = hvd.grouped_reducescatter(xs, op=hvd.Average, name="grad.grs")
    (ys[0].sum() + 3 * ys[1].sum()).backward()
    assert xs[0].grad.tolist() == [1.0] * n and xs[1].grad.tolist() == [3.0] * (2 * n)


def check_join_every_collective():
    """Ranks that joined take part in the collectives the others still run (allgather and
    broadcast fail, as in Horovod)."""
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        assert hvd.join() == n - 1
    else:
        s = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="jc.ar")
        assert s.tolist() == [float(n - 1)] * 2, s
        for call in (
            lambda: hvd.allgather(torch.tensor([r]), name="jc.ag"),
            lambda: hvd.broadcast(torch.tensor([float(r)]), root_rank=1, name="jc.bc"),
        ):
            try:  # as in Horovod: not supported while a rank joined
                call()
            except RuntimeError as exc:
                assert "not supported with join" in str(exc), exc
            else:
                raise AssertionError("allgather/broadcast beside a joined rank did not raise")
        out, received = hvd.alltoall(torch.full((n,), float(r)), splits=[1] * n, name="jc.a2a")
        assert received.tolist() == [0] + [1] * (n - 1), received
        assert out.tolist() == [float(q) for q in range(1, n)], out
        rs = hvd.reducescatter(torch.ones(n, 1), op=hvd.Sum, name="jc.rs")
        assert rs.tolist() == [[float(n - 1)]], rs
        assert hvd.join() == n - 1
    # the runtime is usable right after on every rank
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="jc.after").item() == n


def check_objects_and_their_errors():
    import threading

    class Local:  # a locally defined class: cloudpickle's job
        def __init__(self, v):
            self.v = v

    r, n = hvd.rank(), hvd.size()
    got = hvd.broadcast_object(Local(lambda k: k + 41), root_rank=0, name="obj.lambda")
    assert got.v(1) == 42
    assert [o.v for o in hvd.allgather_object(Local(r), name="obj.local")] == list(range(n))
    for name, fn in (
        (
            "obj.bad.bcast",
            lambda: hvd.broadcast_object(
                threading.Lock() if r == 0 else None, root_rank=0, name="obj.bad.bcast"
            ),
        ),
        (
            "obj.bad.gather",
            lambda: hvd.allgather_object(
                threading.Lock() if r == n - 1 else r, name="obj.bad.gather"
            ),
        ),
    ):
        try:
            fn()
        except hvd.HvdliteError as exc:
            assert isinstance(exc, RuntimeError) and "could not pickle" in str(exc), exc
            bad = 0 if name == "obj.bad.bcast" else n - 1
            assert f"[{bad}]" in str(exc), exc
        else:
            raise AssertionError(f"{name}: no error on rank {r}")


def check_error_classes_are_runtime_errors():
    x = torch.ones(2 + hvd.rank())
    try:
        hvd.allreduce(x, name="err.shape")
    except RuntimeError as exc:
        assert "err.shape" in str(exc)
    else:
        if hvd.size() > 1:  # one rank cannot disagree with itself
            raise AssertionError("a shape mismatch did not raise a RuntimeError")
    h = hvd.allreduce_async(torch.ones(1), name="err.dup")
    try:
        hvd.allreduce_async(torch.ones(1), name="err.dup")
    except ValueError as exc:  # Horovod: an invalid argument, a ValueError
        assert "already in flight" in str(exc)
    else:
        raise AssertionError("a duplicate name did not raise a ValueError")
    hvd.synchronize(h)


def check_sparse_allreduce():
    r, n = hvd.rank(), hvd.size()
    t = torch.sparse_coo_tensor(
        torch.tensor([[r % 3]]), torch.tensor([float(r + 1)]), (3,), check_invariants=True
    )
    h = hvd.sparse_allreduce_async(t, name="sparse", op=hvd.Sum)
    dense = hvd.synchronize(h).to_dense()
    expect = torch.zeros(3)
    for q in range(n):
        expect[q % 3] += q + 1
    assert torch.equal(dense, expect), dense


def check_torch_distributed_coexists():
    """The runtime leaves torch.distributed's default group to the user (e.g. for DDP), here
    on a tcp:// port of the job's own, served by rank 0: so every rank must not be a client
    of hvdlite-run's torch store (torchrun's TORCHELASTIC_USE_AGENT_STORE), as a user with
    such code would run with --no-torch-env."""
    import os
    import socket
    import torch.distributed as dist

    if hvd.size() == 1 or hvd.mpi_enabled():
        return
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    port = torch.tensor([0])
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    hvd.broadcast_(port, 0, name="coexist.port")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{int(port)}", rank=hvd.rank(), world_size=hvd.size()
    )
    t = torch.ones(2)
    dist.all_reduce(t)
    h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="coexist")
    assert t.tolist() == [float(hvd.size())] * 2
    assert hvd.synchronize(h).tolist() == [float(hvd.size())] * 2
    dist.destroy_process_group()


def check_identity():
    n = hvd.size()
    assert 0 <= hvd.rank() < n and hvd.local_size() * hvd.cross_size() == n
    expected = os.environ.get("HVD_EXPECT_BACKEND")
    if expected == "gloo":
        assert hvd.gloo_enabled() and not hvd.mpi_enabled()
    elif expected == "mpi":
        assert hvd.mpi_enabled() and not hvd.gloo_enabled()
    assert hvd.gloo_built() and hvd.mpi_built()


CHECKS = {
    name[len("check_") :]: fn for name, fn in list(globals().items()) if name.startswith("check_")
}


def run_variants(variants) -> None:
    """Each ``name -> (env, checks)`` in turn in this one job: set its tunables (and a
    test directory of its own under ``HVD_TEST_DIR``), init(), its checks (printed
    ``OK name/check rank=R``), shutdown(), unset them; exit 1 if any check failed."""
    failed = 0
    base = os.environ["HVD_TEST_DIR"]
    for name, (env, checks) in variants.items():
        os.environ.update(env)
        os.environ["HVD_TEST_DIR"] = os.path.join(base, name)
        os.makedirs(os.environ["HVD_TEST_DIR"], exist_ok=True)
        hvd.init()
        rank = hvd.rank()
        failed += run_each({f"{name}/{c}": CHECKS[c] for c in checks}, lambda: rank)
        hvd.shutdown()
        for key in env:
            del os.environ[key]
    sys.exit(1 if failed else 0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument(
        "--variants",
        help="JSON: {name: [tunables env, [checks]]}, run one "
        "after another with a shutdown and init between them",
    )
    args = parser.parse_args()
    if args.variants:
        run_variants(json.loads(args.variants))
    run_cases(hvd, CHECKS, only=[c for c in args.only.split(",") if c])


if __name__ == "__main__":
    main()
