"""Fusion buffers: pack many tensors into one flat buffer and back, and scale.

Buffers are kept per dtype and reused across cycles (grown, never shrunk
below the largest group seen), so a steady-state step allocates nothing.
Packing is one ``torch.cat(out=...)`` and unpacking one ``_foreach_copy_``.
torch is imported lazily: ``common`` stays importable without it.
"""

from typing import Dict, List, Sequence

_torch = None


def lazy_torch():
    """torch, imported on first use so that ``common`` imports without it."""
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
    """One growable flat buffer per dtype, owned by the background thread."""

    def __init__(self):
        self._buffers: Dict[str, object] = {}

    def get(self, dtype: str, count: int):
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < count:
            buf = lazy_torch().empty(count, dtype=dtype_of(dtype))
            self._buffers[dtype] = buf
        return buf[:count]


def pack(flats: List, out) -> None:
    lazy_torch().cat(flats, out=out)


def unpack(buffer, flat_outputs: List, sizes: List[int]) -> None:
    """Copy consecutive pieces of ``buffer`` (``sizes`` elements each) into flat outputs."""
    # split_with_sizes, not Tensor.split: the Python wrapper of the latter costs ~5x more
    # with a thousand sizes
    lazy_torch()._foreach_copy_(flat_outputs, list(buffer.split_with_sizes(sizes)))


def scale_(tensor, factor: float) -> None:
    """Multiply in place, as Horovod scales: integers in float64, truncated toward zero when
    cast back; 16-bit floats in float32 (CPU half arithmetic loses more)."""
    if factor == 1.0:
        return
    dtype = tensor.dtype
    torch = lazy_torch()
    if dtype in (torch.float16, torch.bfloat16):
        tensor.copy_(tensor.float().mul_(factor))
    elif tensor.is_floating_point():
        tensor.mul_(factor)
    else:
        tensor.copy_(tensor.double().mul_(factor).trunc_())


def neutral(dtype: str, reduce_op: int):
    """The value a joined rank contributes so it does not change the reduction."""
    from hvdlite.common.message import ReduceOp
    torch = lazy_torch()
    dt = dtype_of(dtype)
    if reduce_op == ReduceOp.PRODUCT:
        return 1
    if reduce_op in (ReduceOp.MIN, ReduceOp.MAX):
        high = reduce_op == ReduceOp.MIN
        if dt == torch.bool:
            return high
        if dt.is_floating_point:
            return float("inf") if high else float("-inf")
        info = torch.iinfo(dt)
        return info.max if high else info.min
    return 0
