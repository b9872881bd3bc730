"""Gradient compression applied around a collective.

The interface is Horovod's: a compressor has static ``compress(tensor)``
returning ``(compressed, ctx)`` and ``decompress(tensor, ctx)`` returning a
tensor of the original dtype.  :func:`hvdlite.torch.mpi_ops.allreduce` and
:class:`~hvdlite.torch.optimizer.DistributedOptimizer` call them duck-typed,
so a user-defined class with the same two static methods works too.
"""

import torch

from hvdlite.common.compression import Compressor, NoneCompressor
from hvdlite.torch.powersgd import PowerSGD
from hvdlite.torch.topk import TopK
from hvdlite.torch.slow_links.int8 import Int8

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16, restoring the original dtype after.

    Integer, bool and already-16-bit tensors pass through unchanged.  The
    reduction itself then runs in float16, so sums of many large values can
    overflow; prefer ``op=Average`` with a ``prescale_factor`` for huge worlds.
    """

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype not in (torch.float16, torch.bfloat16):
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class Compression:
    """The built-in compressors, under Horovod's names, and hvdlite's stateful ones.

    ``powersgd(...)``, ``topk(...)`` and ``int8(...)`` build settings objects
    (:class:`~hvdlite.torch.powersgd.PowerSGD`, :class:`~hvdlite.torch.topk.TopK`,
    :class:`~hvdlite.torch.slow_links.int8.Int8`) for
    ``DistributedOptimizer(opt, compression=...)`` only: they keep error-feedback state
    across steps, so the plain collectives refuse them with a ``TypeError``.
    """

    #: no compression
    none = NoneCompressor
    #: float16 on the wire for floating-point tensors
    fp16 = FP16Compressor
    #: low-rank PowerSGD with error feedback (DistributedOptimizer only)
    powersgd = PowerSGD
    #: top-k sparsification with error feedback (DistributedOptimizer only)
    topk = TopK
    #: 8-bit values with a scale per chunk and error feedback (DistributedOptimizer and
    #: DiLoCo's outer step)
    int8 = Int8
