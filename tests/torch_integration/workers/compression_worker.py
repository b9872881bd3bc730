"""The synchronous collectives with ``compression=``: results come back in the input's dtype
(each tensor of a group with its own), equal to the uncompressed reduction, and gradients
flow through the compression (run per rank)."""

import sys

import torch

from _common import assert_close, hvd, run_cases

FP16 = hvd.Compression.fp16


def _rows(rank, n_rows, dtype=torch.float32):
    """Small multiples of 1/4 (exact in float16) that differ by rank."""
    return ((torch.arange(n_rows * 3) % 5 + rank) / 4).reshape(n_rows, 3).to(dtype)


def _average_of(n_rows, dtype=torch.float32):
    return sum(_rows(r, n_rows, torch.float64) for r in range(hvd.size())).div(hvd.size()).to(dtype)


def _my_slice(full):
    rows = full.shape[0] // hvd.size()
    return full[hvd.rank() * rows : (hvd.rank() + 1) * rows]


def _expect(name, got, want):
    if got.dtype != want.dtype:
        raise AssertionError(
            f"{name}: dtype {got.dtype}, expected {want.dtype} on rank {hvd.rank()}"
        )
    assert_close(name, got.double(), want.double(), 0, 1e-6)


def allreduce_fp16():
    for dtype in (torch.float32, torch.float64):
        out = hvd.allreduce(_rows(hvd.rank(), 2, dtype), name=f"c.ar.{dtype}", compression=FP16)
        _expect(f"allreduce {dtype}", out, _average_of(2, dtype))


def allreduce_fp16_gradient():
    x = _rows(hvd.rank(), 2).requires_grad_()
    hvd.allreduce(x, name="c.ar.grad", compression=FP16, op=hvd.Sum).sum().backward()
    _expect("allreduce grad", x.grad, torch.full_like(x, float(hvd.size())))


def grouped_allreduce_mixed_dtypes():
    """A float64, an int64 (passed through uncompressed) and a float32 tensor: each result
    is decompressed with its own tensor's context."""
    ins = [_rows(hvd.rank(), 2, torch.float64), torch.arange(4) + hvd.rank(), _rows(hvd.rank(), 3)]
    outs = hvd.grouped_allreduce(ins, name="c.gar", compression=FP16, op=hvd.Sum)
    n = hvd.size()
    _expect("grouped[0]", outs[0], _average_of(2, torch.float64) * n)
    _expect("grouped[1]", outs[1], sum(torch.arange(4) + r for r in range(n)))
    _expect("grouped[2]", outs[2], _average_of(3) * n)


def grouped_allreduce_fp16_gradient():
    xs = [_rows(hvd.rank(), 2).requires_grad_(), _rows(hvd.rank(), 1).requires_grad_()]
    outs = hvd.grouped_allreduce(xs, name="c.gar.grad", compression=FP16)
    sum(o.sum() for o in outs).backward()
    for i, x in enumerate(xs):
        _expect(f"grouped grad[{i}]", x.grad, torch.ones_like(x))


def reducescatter_fp16():
    n_rows = 2 * hvd.size()
    out = hvd.reducescatter(_rows(hvd.rank(), n_rows), name="c.rs", compression=FP16)
    _expect("reducescatter", out, _my_slice(_average_of(n_rows)))


def reducescatter_fp16_gradient():
    n_rows = 2 * hvd.size()
    x = _rows(hvd.rank(), n_rows).requires_grad_()
    hvd.reducescatter(x, name="c.rs.grad", compression=FP16, op=hvd.Sum).sum().backward()
    _expect("reducescatter grad", x.grad, torch.full_like(x, float(hvd.size())))


def grouped_reducescatter_mixed_dtypes():
    n_rows = 2 * hvd.size()
    ins = [_rows(hvd.rank(), n_rows, torch.float64), _rows(hvd.rank(), n_rows)]
    outs = hvd.grouped_reducescatter(ins, name="c.grs", compression=FP16)
    _expect("grouped_reducescatter[0]", outs[0], _my_slice(_average_of(n_rows, torch.float64)))
    _expect("grouped_reducescatter[1]", outs[1], _my_slice(_average_of(n_rows)))


CASES = {
    "allreduce_fp16": allreduce_fp16,
    "allreduce_fp16_gradient": allreduce_fp16_gradient,
    "grouped_allreduce_mixed_dtypes": grouped_allreduce_mixed_dtypes,
    "grouped_allreduce_fp16_gradient": grouped_allreduce_fp16_gradient,
    "reducescatter_fp16": reducescatter_fp16,
    "reducescatter_fp16_gradient": reducescatter_fp16_gradient,
    "grouped_reducescatter_mixed_dtypes": grouped_reducescatter_mixed_dtypes,
}

if __name__ == "__main__":
    run_cases(CASES, only=set(sys.argv[1:]) or None)
