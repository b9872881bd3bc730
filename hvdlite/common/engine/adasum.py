"""Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training with
Adaptive Summation", MLSys 2021), over any backend with a point-to-point exchange.

Two vectors combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a zero vector's coefficient is 1).  Orthogonal gradients add up, parallel ones average, so
the result keeps the scale of one gradient however many ranks there are: the learning rate is
not scaled with the world size.  Over 2^k ranks the result is the binary tree in rank order,
``adasum(adasum(v0, v1), adasum(v2, v3))`` and so on, computed as Horovod's CPU Adasum does,
by recursive vector halving and distance doubling:

* **Reduce**, level ``d = 1, 2, 4, ...``: rank ``r`` and its partner ``r ^ d`` hold the same
  region of the buffer (the same elements of the partial results their half-blocks built).
  Each keeps one half of the region, sends the other half to the partner and receives the
  partner's copy of the half it keeps (:meth:`Backend.sendrecv_`), so it holds matching pieces
  of both operands.  The rule needs the dot product and norms of the *whole* tensors, which
  the block of ``2d`` ranks holds in pieces: every rank computes partial sums over its piece,
  the block adds them up (:meth:`Backend.block_allreduce_`), and every rank combines its piece.
* **Gather**, the levels backwards: partners swap their finished pieces until every rank
  holds the whole result.

A fused buffer holds several tensors back to back.  The partial sums are kept per tensor (as
Horovod keeps per-tensor counts), so the result is the rule applied tensor by tensor.  Data
travels in the buffer's dtype; float16/bfloat16 are combined in float32 and rounded back at
every level (as Horovod does), float32 in float32 and float64 in float64; the dot products and
norms are always summed in float64.

The executor sends every ``op=Adasum`` allreduce group here; its prescale and postscale
apply as for other reductions (before and after this rule), and a rank that has joined
contributes a zero vector, which the rule leaves out.  The exchanges run on Gloo
(``ProcessGroupGloo`` send/recv on a private tag, each bounded by
``--op-timeout-seconds``) and on MPI (``MPI_Sendrecv``).  Only power-of-two world sizes and
floating dtypes work: anything else fails the group's handles on every rank alike, naming
the tensor and the size or dtype (:func:`refusal`), and the runtime goes on.
"""

import bisect
from typing import List, Optional, Sequence, Tuple

from hvdlite.common import arrays

#: storage dtype -> the dtype pieces are combined in
_COMPUTE = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}


def refusal(size: int, dtype: str, name: str) -> Optional[Exception]:
    """The error :func:`check` raises for tensor ``name``, or None.  It depends only on what
    every rank agreed on, so every rank refuses alike."""
    if dtype not in _COMPUTE:
        return TypeError(
            f"allreduce of tensor {name!r} with op=Adasum: dtype {dtype} is not "
            f"supported; Adasum needs a floating tensor (float16, bfloat16, "
            f"float32 or float64)"
        )
    if size < 1 or size & (size - 1):
        return ValueError(
            f"allreduce of tensor {name!r} with op=Adasum: Adasum needs a "
            f"power-of-two number of ranks, but this job has {size}"
        )
    return None


def check(size: int, dtype: str, name: str) -> None:
    """Refuse what Adasum cannot reduce.

    Raises:
        TypeError: ``dtype`` is not a floating type (the rule needs real dot products).
        ValueError: ``size`` is not a power of two (the halving needs a partner at every
            level; Horovod has the same limit).
    """
    error = refusal(size, dtype, name)
    if error is not None:
        raise error


def allreduce_(backend, buffer, counts: Sequence[int], name: str = "adasum") -> None:
    """Replace flat ``buffer`` by the Adasum of every rank's ``buffer``, tensor by tensor.

    ``buffer`` is a contiguous 1-D CPU buffer (either array kind) holding tensors of
    ``counts`` elements back to back; every rank passes the same ``counts``.  ``name``
    only labels errors.

    Raises:
        TypeError: ``buffer`` is not floating.
        ValueError: ``backend.size`` is not a power of two.
        HvdliteInternalError: the backend failed (a peer died or timed out).
    """
    size, rank = backend.size, backend.rank
    k = arrays.kind()
    dtype = k.dtype_name(buffer)
    check(size, dtype, name)
    if size == 1:
        return
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    total = k.numel(buffer)
    if offsets[-1] != total:
        raise ValueError(
            f"Adasum of {name!r}: counts {list(counts)} do not add up to the "
            f"buffer's {total} elements"
        )
    scratch = k.empty((total + 1) // 2, dtype)
    lo, n = 0, total  # the region of the buffer this rank holds
    held: List[Tuple[int, int, bool]] = []  # the region before each level, and the side
    level = 1
    while level < size:
        peer = rank ^ level
        half = n // 2
        left = rank & level == 0  # left keeps the first half, its partner the second
        keep_lo, keep_n = (lo, half) if left else (lo + half, n - half)
        send_lo, send_n = (lo + half, n - half) if left else (lo, half)
        theirs = scratch[:keep_n]
        backend.sendrecv_(buffer[send_lo : send_lo + send_n], theirs, peer)
        _combine(
            backend,
            buffer[keep_lo : keep_lo + keep_n],
            theirs,
            _segments(offsets, keep_lo, keep_n),
            len(counts),
            left,
            2 * level,
        )
        held.append((lo, n, left))
        lo, n = keep_lo, keep_n
        level <<= 1
    while held:
        level >>= 1
        outer_lo, outer_n, left = held.pop()
        # the partner finished the other half of the region both held before the level
        other_lo = lo + n if left else outer_lo
        other_n = outer_n - n
        backend.sendrecv_(buffer[lo : lo + n], buffer[other_lo : other_lo + other_n], rank ^ level)
        lo, n = outer_lo, outer_n


def _segments(offsets: List[int], lo: int, n: int) -> List[Tuple[int, int, int]]:
    """(tensor index, start within the region, count) of every tensor overlapping the region
    ``[lo, lo + n)`` of the buffer, skipping empty overlaps."""
    out = []
    hi = lo + n
    i = max(bisect.bisect_right(offsets, lo) - 1, 0)
    last = len(offsets) - 1
    while i < last and offsets[i] < hi:
        start, end = max(offsets[i], lo), min(offsets[i + 1], hi)
        if end > start:
            out.append((i, start - lo, end - start))
        i += 1
    return out


def _combine(backend, mine, theirs, segments, tensors: int, left: bool, block: int) -> None:
    """``mine`` := adasum(mine, theirs), with each tensor's dot product and norms summed over
    the ``block`` ranks that hold the pieces of the two operands."""
    k = arrays.kind()
    stored = k.dtype_name(mine)
    compute = _COMPUTE[stored]
    a = mine if stored == compute else k.astype(mine, compute)
    b = theirs if stored == compute else k.astype(theirs, compute)
    a64 = a if compute == "float64" else k.astype(a, "float64")
    b64 = b if compute == "float64" else k.astype(b, "float64")
    # per tensor: [a.b, |left operand|^2, |right operand|^2], so partial sums line up
    stats = k.zeros((tensors, 3), "float64")
    na, nb = (1, 2) if left else (2, 1)
    for i, start, count in segments:
        x, y = a64[start : start + count], b64[start : start + count]
        row = stats[i]
        row[0] = k.dot(x, y)
        row[na] = k.dot(x, x)
        row[nb] = k.dot(y, y)
    backend.block_allreduce_(k.flat(stats), block)
    # a few numbers per tensor: plain float64 arithmetic, the same bits in either kind
    rows = stats.tolist()
    coeff_a = [1.0 - r[0] / (2.0 * r[na]) if r[na] > 0 else 1.0 for r in rows]
    coeff_b = [1.0 - r[0] / (2.0 * r[nb]) if r[nb] > 0 else 1.0 for r in rows]
    for i, start, count in segments:
        k.axpby_(a[start : start + count], coeff_a[i], b[start : start + count], coeff_b[i])
    if a is not mine:
        k.copy_(mine, a)
