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
            (self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
        return torch.randn(m, r, generator=gen, dtype=torch.float64).to(dtype)


def orthogonalize_(p: torch.Tensor, eps: float = ORTHO_EPS) -> torch.Tensor:
    """Gram-Schmidt on ``p``'s columns, in place (each column divided by ``norm + eps``)."""
    cols = p.shape[1]
    for i in range(cols):
        col = p[:, i]
        col.div_(col.norm() + eps)
        if i + 1 < cols:
            rest = p[:, i + 1:]
            rest.sub_(torch.outer(col, col @ rest))
    return p


class _PowerSGDExchange(GradientExchange):
    """Per matrix: this rank's residual ``error`` (``n x m``) and the warm-start ``q``
    (``m x rank``, equal on every rank, so broadcast with the optimizer state)."""

    def __init__(self, spec: PowerSGD, params: List[torch.Tensor],
                 names: Dict[torch.Tensor, str], reduce_kwargs: dict):
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
                "q": spec.initial_q(name, m, r, p.dtype).to(p.device)}

    def _compressed_unit(self, unit, items):
        mats = []
        for name, g in items:
            st = self.state[name]
            m = g.view(st["error"].shape)
            m.add_(st["error"])
            # the small factors enter the products transposed-contiguous: MKL's skinny
            # products are several times faster so than with row-major (n x rank) operands
            mats.append((m, torch.mm(m, st["q"].t().contiguous().t()), st))
        h = mpi_ops.grouped_allreduce_async_(
            [p for _, p, _ in mats], name=unit + ".powersgd.P", op=mpi_ops.Sum,
            process_set=self.kw["process_set"])
        yield
        mpi_ops.synchronize(h)
        for m, p, st in mats:
            orthogonalize_(p)
            # Q = M^T P computed as (P^T M)^T: a transposed M is many times slower on CPU
            q_t = torch.mm(p.t(), m)
            torch.addmm(m, p, q_t, alpha=-1, out=st["error"])
            st["q"].copy_(q_t.t())
        h = mpi_ops.grouped_allreduce_async_(
            [st["q"] for _, _, st in mats], name=unit + ".powersgd.Q", **self.kw)
        yield
        mpi_ops.synchronize(h)
        for m, p, st in mats:
            torch.mm(p, st["q"].t().contiguous(), out=m)
