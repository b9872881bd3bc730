"""The Adasum rule written out plainly, as the tests' reference (shared by the thread tests
and the multi-process worker).

``tree`` combines every rank's tensor pairwise in rank order, level by level --
``adasum(adasum(v0, v1), adasum(v2, v3))`` -- which is what the recursive halving computes.
float16/bfloat16 are combined in float32 and rounded back after every pair, as the runtime
does at every level.
"""

import torch


def pair(a, b):
    """adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b; a zero vector's coefficient
    is 1.  Dot products in float64."""
    compute = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    dot = float(a64 @ b64)
    na, nb = float(a64 @ a64), float(b64 @ b64)
    ca = 1.0 - dot / (2.0 * na) if na > 0 else 1.0
    cb = 1.0 - dot / (2.0 * nb) if nb > 0 else 1.0
    return (a.to(compute) * ca + b.to(compute) * cb).to(a.dtype)


def tree(tensors):
    """The Adasum of one tensor over ranks (a power-of-two list, in rank order)."""
    level = list(tensors)
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def tolerance(dtype):
    """(rtol, atol) for comparing the runtime's result with :func:`tree`: the partial dot
    products are summed in another order, which may move a 16-bit result by an ulp per level."""
    return {
        torch.float16: (1e-2, 1e-3),
        torch.bfloat16: (4e-2, 1e-2),
        torch.float32: (1e-5, 1e-6),
    }.get(dtype, (1e-11, 1e-12))
