"""Fusion buffers: the flat buffers many tensors are packed into, and a joined rank's filler.

Buffers are kept per dtype and reused across cycles (grown, never shrunk
below the largest group seen), so a steady-state step allocates nothing.
Packing, unpacking and scaling are the array kind's (:mod:`hvdlite.common.arrays`: torch,
or numpy in a job without torch); the executor binds the kind's functions once.
"""

from typing import Dict

import numpy as np

from hvdlite.common import arrays
from hvdlite.common.engine.message import ReduceOp


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


def neutral(dtype: str, reduce_op: int):
    """The value a joined rank contributes so it does not change the reduction: 0 for
    sum and average (an average still divides by the full size, as in Horovod), +inf (the
    dtype's max for integers, True for bool) for min, -inf (the dtype's min, False) for
    max, 1 for product."""
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
