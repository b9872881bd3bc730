"""PowerSGD: low-rank gradient compression with error feedback (Vogels et al., 2019).

Each compressed gradient is viewed as a matrix ``M`` (``shape[0]`` rows, the other
dimensions flattened into columns).  One step, per matrix, on every rank:

1. ``M += E`` (this rank's residual from the last step: error feedback);
2. ``P = M Q`` with ``Q`` the reduced ``Q`` of the last step (warm start; a seeded random
   matrix, the same on every rank, before the first one); allreduce ``P`` (sum);
3. orthonormalise ``P``'s columns (Gram-Schmidt); ``Q = M^T P``; ``E = M - P Q^T``;
4. allreduce ``Q`` with the optimizer's op (average by default); the gradient is ``P Q^T``.

So a ``n x m`` matrix sends ``(n + m) * rank`` numbers instead of ``n * m``.  Gradients that
are not matrices, or whose saving ``n m / ((n + m) rank)`` is below
``min_compression_rate``, are reduced as they are, as are all gradients before
``start_iter`` optimizer steps (early gradients change fast; PyTorch's DDP hook does the same).
"""

import zlib
from typing import Dict, List

import torch

from hvdlite.common.powersgd_settings import PowerSGDSettings
from hvdlite.torch import mpi_ops
from hvdlite.torch.grad_compression import GradientExchange, StatefulCompression

__all__ = ["PowerSGD"]

#: added to each column norm in Gram-Schmidt so that a zero gradient stays zero (not NaN)
ORTHO_EPS = 1e-8


class PowerSGD(PowerSGDSettings, StatefulCompression):
    """PowerSGD settings for ``DistributedOptimizer(opt, compression=...)`` (arguments:
    :class:`~hvdlite.common.powersgd_settings.PowerSGDSettings`)."""

    kind = PowerSGDSettings.kind

    def make_exchange(self, params, names, reduce_kwargs):
        return _PowerSGDExchange(self, params, names, reduce_kwargs)

    def matrix_shape(self, p: torch.Tensor):
        """``(n, m, rank)`` when ``p``'s gradient is compressed, else ``None``."""
        if p.dim() < 2 or not p.dtype.is_floating_point or p.numel() == 0:
            return None
        return self.factor_shape(p.shape[0], p.numel() // p.shape[0])

    def initial_q(self, name: str, m: int, r: int, dtype) -> torch.Tensor:
        """The first ``Q`` of parameter ``name``: standard normal, seeded by ``seed`` and the
        name, so it is the same on every rank and in every run."""
        gen = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
        )
        return torch.randn(m, r, generator=gen, dtype=torch.float64).to(dtype)


def orthogonalize_(p: torch.Tensor, eps: float = ORTHO_EPS) -> torch.Tensor:
    """Gram-Schmidt on ``p``'s columns, in place (each column divided by ``norm + eps``)."""
    cols = p.shape[1]
    for i in range(cols):
        col = p[:, i]
        col.div_(col.norm() + eps)
        if i + 1 < cols:
            rest = p[:, i + 1 :]
            rest.sub_(torch.outer(col, col @ rest))
    return p


#: rows per strip in the rank-r products over a whole matrix (``P Q^T``): one batched call over
#: 8-row strips runs MKL's small kernels, several times faster on CPU than one ``n x m``
#: product of inner dimension ``rank`` (and bit-identical to it); rank 1 is an outer product,
#: fast as it is
STRIP_ROWS = 8


def _strips(t: torch.Tensor, pt: torch.Tensor, qt: torch.Tensor):
    """``t``'s first rows, ``P``'s and ``Q^T`` as batches of :data:`STRIP_ROWS`-row strips
    (``None`` when a plain product is as fast), and the number of rows they cover."""
    n, cols = t.shape
    r = pt.shape[0]
    whole = n - n % STRIP_ROWS
    if r == 1 or whole == 0:
        return None, 0
    b = whole // STRIP_ROWS
    return (
        t[:whole].view(b, STRIP_ROWS, cols),
        pt.t()[:whole].reshape(b, STRIP_ROWS, r),
        qt.unsqueeze(0).expand(b, r, cols),
    ), whole


def write_product(out: torch.Tensor, pt: torch.Tensor, qt: torch.Tensor) -> None:
    """``out = P Q^T`` with ``P = pt^T`` (``pt``: ``rank x n``) and ``Q^T = qt`` (``rank x
    m``); ``out`` (``n x m``, contiguous) is written once, row strip by row strip."""
    strips, whole = _strips(out, pt, qt)
    if strips is not None:
        o3, p3, q3 = strips
        torch.bmm(p3, q3, out=o3)
    if whole < out.shape[0]:
        torch.mm(pt.t()[whole:], qt, out=out[whole:])


def subtract_product_(m: torch.Tensor, pt: torch.Tensor, qt: torch.Tensor) -> None:
    """``m -= P Q^T`` in place (one read and one write of ``m``), factors as in
    :func:`write_product`."""
    strips, whole = _strips(m, pt, qt)
    if strips is not None:
        m3, p3, q3 = strips
        m3.baddbmm_(p3, q3, alpha=-1)
    if whole < m.shape[0]:
        m[whole:].addmm_(pt.t()[whole:], qt, alpha=-1)


class _PowerSGDExchange(GradientExchange):
    """Per matrix: this rank's residual ``error`` (``n x m``) and the warm-start ``q``
    (``m x rank``, equal on every rank, so broadcast with the optimizer state)."""

    def __init__(
        self,
        spec: PowerSGD,
        params: List[torch.Tensor],
        names: Dict[torch.Tensor, str],
        reduce_kwargs: dict,
    ):
        super().__init__(spec, names, reduce_kwargs, spec.start_iter)
        self.shared_keys = ("q",)
        for p in params:
            shape = spec.matrix_shape(p)
            if shape is None:
                continue
            n, m, r = shape
            name = names[p]
            self.state[name] = {
                "error": torch.zeros(n, m, dtype=p.dtype, device=p.device),
                "q": spec.initial_q(name, m, r, p.dtype).to(p.device),
            }

    def _compressed_unit(self, unit, items):
        # M = G + E is built in the residual's buffer, which then becomes M - P Q^T in place;
        # the factors travel transposed (P^T: rank x n, Q^T: rank x m, contiguous), so each
        # product reads or writes the n x m matrix once, in row order (fast on CPU)
        mats = []
        for name, g in items:
            st = self.state[name]
            m = st["error"]
            m.add_(g.view(m.shape))
            pt = torch.mm(st["q"].t().contiguous(), m.t())  # P^T = Q^T M^T
            mats.append((g, m, pt, st))
        h = mpi_ops.grouped_allreduce_async_(
            [pt for _, _, pt, _ in mats],
            name=unit + ".powersgd.P",
            op=mpi_ops.Sum,
            process_set=self.kw["process_set"],
        )
        yield
        mpi_ops.synchronize(h)
        qts = []
        for _, m, pt, _ in mats:
            orthogonalize_(pt.t())
            qt = torch.mm(pt, m)  # Q^T = P^T M
            subtract_product_(m, pt, qt)  # residual M - P Q^T
            qts.append(qt)
        h = mpi_ops.grouped_allreduce_async_(qts, name=unit + ".powersgd.Q", **self.kw)
        yield
        mpi_ops.synchronize(h)
        for (g, m, pt, st), qt in zip(mats, qts):
            st["q"].copy_(qt.t())
            write_product(g.view(m.shape), pt, qt)
