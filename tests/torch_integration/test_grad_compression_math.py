"""The building blocks of PowerSGD and top-k in one process: the fast top-k selection equals
torch.topk (also when its sample misleads it), the gathered pairs land in the right tensor,
Gram-Schmidt gives orthonormal columns and keeps a zero matrix zero, the strip-wise low-rank
products equal the plain ones, the specs check their arguments, and the compute-only
benchmark runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hvdlite.torch.powersgd import PowerSGD, orthogonalize_, subtract_product_, write_product
from hvdlite.torch.topk import TopK, _scatter_sum, largest_entries, sparse_nonzero


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel,k", [(100_000, 1000), (5000, 7), (2000, 1500), (50, 3)])
def test_largest_entries_equal_topk(numel, k):
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    want = set(torch.topk(flat.abs(), k).indices.tolist())
    assert set(largest_entries(flat, k).tolist()) == want


@pytest.mark.timeout(60)
def test_largest_entries_when_the_sample_misleads():
    """Every sampled entry is huge, so the guessed threshold passes too few: the fallback."""
    flat = torch.randn(64 * 1000, generator=torch.Generator().manual_seed(1)) * 1e-3
    flat[::64] = 100.0 + torch.arange(1000.0)
    flat[1] = 1e6  # outside the sample, the largest of all
    got = set(largest_entries(flat, 500).tolist())
    assert got == set(torch.topk(flat.abs(), 500).indices.tolist())
    assert 1 in got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel,offset", [(10_000, 0), (10_003, 0), (5, 0), (0, 0), (64, 3)])
def test_sparse_nonzero_equals_nonzero(numel, offset):
    """Word-wise nonzero: a length not a multiple of 8 (a tail), shorter than a word, empty,
    and a view that does not start on a word (the plain fallback)."""
    gen = torch.Generator().manual_seed(numel)
    mask = torch.rand(numel + offset, generator=gen)[offset:] < 0.05
    if numel:
        mask[-1] = True  # the tail counts
    assert torch.equal(sparse_nonzero(mask), mask.nonzero().squeeze(1))


@pytest.mark.timeout(60)
def test_scatter_sum_over_several_tensors():
    """Gathered (index, value) pairs of a unit of three tensors from two ranks (each rank's
    block: two entries of the first tensor, none of the second, two of the third), with
    repeats, land summed in the right tensor; the rest is zeroed."""
    flats = [torch.full((n,), 7.0) for n in (5, 3, 4)]
    indices = torch.tensor([0, 4, 11, 8, 4, 0, 11, 9], dtype=torch.int32)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    _scatter_sum(flats, [2, 0, 2], indices, values)
    want = torch.zeros(12)
    want.index_add_(0, indices.long(), values)
    assert torch.equal(torch.cat(flats), want)
    with pytest.raises(ValueError, match="4 entries each"):
        _scatter_sum(flats, [2, 0, 2], indices[:6], values[:6])


@pytest.mark.timeout(60)
def test_orthogonalize():
    p = torch.randn(50, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    q = orthogonalize_(p.clone())
    assert torch.allclose(q.t() @ q, torch.eye(4, dtype=torch.float64), atol=1e-6)
    # same column space: projecting p onto q's columns gives p back
    assert torch.allclose(q @ (q.t() @ p), p, atol=1e-9)
    zero = orthogonalize_(torch.zeros(5, 2))
    assert torch.equal(zero, torch.zeros(5, 2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n,m,r", [(16, 12, 3), (13, 7, 2), (5, 9, 4), (21, 6, 1), (3, 3, 2)])
def test_low_rank_products_in_strips_equal_one_product(n, m, r):
    """The strip-wise ``P Q^T`` (rows a multiple of the strip, a remainder, fewer rows than
    one strip, rank 1) equals the plain product, written over and subtracted in place."""
    gen = torch.Generator().manual_seed(n * 100 + m * 10 + r)
    pt, qt, base = (
        torch.randn(*s, dtype=torch.float64, generator=gen) for s in ((r, n), (r, m), (n, m))
    )
    out = torch.full((n, m), float("nan"), dtype=torch.float64)
    write_product(out, pt, qt)
    assert torch.allclose(out, pt.t() @ qt, atol=1e-12)
    rest = base.clone()
    subtract_product_(rest, pt, qt)
    assert torch.allclose(rest, base - pt.t() @ qt, atol=1e-12)


@pytest.mark.timeout(60)
def test_which_gradients_powersgd_compresses():
    spec = PowerSGD(rank=4, min_compression_rate=2.0)
    assert spec.matrix_shape(torch.empty(64, 3, 3, 3)) == (64, 27, 4)
    assert spec.matrix_shape(torch.empty(100)) is None  # a vector
    assert spec.matrix_shape(torch.empty(8, 8)) is None  # 64 < 2 * 16 * 4
    assert spec.matrix_shape(torch.empty(8, 8, dtype=torch.int64)) is None
    assert torch.equal(
        spec.initial_q("w", 10, 2, torch.float32),
        PowerSGD(rank=4).initial_q("w", 10, 2, torch.float32),
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "make",
    [
        lambda: PowerSGD(rank=0),
        lambda: PowerSGD(start_iter=-1),
        lambda: PowerSGD(min_compression_rate=0),
        lambda: TopK(ratio=0),
        lambda: TopK(ratio=1.5),
        lambda: TopK(min_numel=0),
    ],
)
def test_bad_arguments(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.timeout(120)
def test_compression_compute_benchmark_runs():
    """benchmarks/compression_compute.py runs every variant at a tiny width (so it cannot rot)."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            str(repo / "benchmarks" / "compression_compute.py"),
            "--width",
            "64",
            "--steps",
            "1",
            "--warmup",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=110,
        env=dict(os.environ, PYTHONPATH=str(repo)),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for variant in ("powersgd-r1", "powersgd-r4", "topk-1%"):
        assert f"{variant} " in proc.stdout and "median" in proc.stdout, proc.stdout
