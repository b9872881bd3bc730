"""Fusion buffers: pack many tensors into one flat buffer and back, and scale.

Buffers are kept per dtype and reused across cycles (grown, never shrunk
below the largest group seen), so a steady-state step allocates nothing.
Packing, unpacking and scaling are the array kind's (:mod:`hvdlite.common.arrays`: torch,
or numpy in a job without torch); these functions are kept for callers outside the hot
path, which binds the kind's functions once.
"""

from typing import Dict, List, Sequence

import numpy as np

from hvdlite.common import arrays

_torch = None


def lazy_torch():
    """torch, imported on first use (Gloo's shared-memory path); the runtime itself asks
    :func:`hvdlite.common.arrays.kind` instead, which works without torch."""
    global _torch
    if _torch is None:
        import torch
        _torch = torch
    return _torch


DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
               "uint8", "bool")


def dtype_name(dtype) -> str:
    return str(dtype).rpartition(".")[2]


def dtype_of(name: str):
    """torch's dtype of a wire name (torch jobs only)."""
    return getattr(lazy_torch(), name)


def itemsize(name: str) -> int:
    return _ITEMSIZE[name]


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "int16": 2,
             "int32": 4, "int64": 8, "uint8": 1, "bool": 1}


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class FusionBuffers:
    """One growable flat buffer per dtype, owned by the background thread; ``kind`` is the
    array kind of its buffers (the executor binds its functions from it)."""

    def __init__(self, kind: arrays.ArrayKind = None):
        self.kind = kind or arrays.kind()
        self._buffers: Dict[str, object] = {}

    def get(self, dtype: str, count: int):
        buf = self._buffers.get(dtype)
        if buf is None or self.kind.numel(buf) < count:
            buf = self.kind.empty(count, dtype)
            self._buffers[dtype] = buf
        return buf[:count]


def pack(flats: List, out) -> None:
    arrays.kind().pack(flats, out)


def unpack(buffer, flat_outputs: List, sizes: List[int]) -> None:
    """Copy consecutive pieces of ``buffer`` (``sizes`` elements each) into flat outputs."""
    arrays.kind().unpack(buffer, flat_outputs, sizes)


def scale_(tensor, factor: float) -> None:
    """Multiply in place, as Horovod scales (see :meth:`arrays.ArrayKind.scale_`)."""
    arrays.kind().scale_(tensor, factor)


def neutral(dtype: str, reduce_op: int):
    """The value a joined rank contributes so it does not change the reduction."""
    from hvdlite.common.message import ReduceOp
    if reduce_op == ReduceOp.PRODUCT:
        return 1
    if reduce_op in (ReduceOp.MIN, ReduceOp.MAX):
        high = reduce_op == ReduceOp.MIN
        if dtype == "bool":
            return high
        if dtype.startswith(("float", "bfloat")):
            return float("inf") if high else float("-inf")
        info = np.iinfo(dtype)
        return int(info.max) if high else int(info.min)
    return 0
