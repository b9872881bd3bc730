"""NumPy references of PowerSGD and top-k with error feedback, shared by the torch and
TensorFlow workers that check the real implementations against them."""

import numpy as np


def grads(rank, step, shapes, seed=0):
    """The fixed gradient of each parameter on ``rank`` at ``step`` (float64)."""
    g = np.random.default_rng([seed, rank, step])
    return [g.standard_normal(s) for s in shapes]


def orthogonalize(p, eps=1e-8):
    """Gram-Schmidt on the columns (each divided by ``norm + eps``), as the implementations."""
    p = p.copy()
    for i in range(p.shape[1]):
        p[:, i] /= np.linalg.norm(p[:, i]) + eps
        rest = p[:, i + 1 :]
        rest -= np.outer(p[:, i], p[:, i] @ rest)
    return p


def powersgd_reference(grads_by_step, q, start_iter, n):
    """Per step: the reduced matrix and every rank's residual after it."""
    errors = [np.zeros_like(grads_by_step[0][0]) for _ in range(n)]
    out = []
    for s, step_grads in enumerate(grads_by_step):
        if s < start_iter:
            out.append((sum(step_grads) / n, [e.copy() for e in errors]))
            continue
        ms = [g + e for g, e in zip(step_grads, errors)]
        p = orthogonalize(sum(m @ q for m in ms))
        qs = [m.T @ p for m in ms]
        errors = [m - p @ qr.T for m, qr in zip(ms, qs)]
        q = sum(qs) / n
        out.append((p @ q.T, [e.copy() for e in errors]))
    return out


def topk_reference(grads_by_step, k, n):
    """Per step: the reduced gradient and every rank's (flat) residual after it."""
    errors = [np.zeros(grads_by_step[0][0].size) for _ in range(n)]
    out = []
    for step_grads in grads_by_step:
        total = np.zeros_like(errors[0])
        for r in range(n):
            m = step_grads[r].ravel() + errors[r]
            idx = np.argsort(-np.abs(m), kind="stable")[:k]
            total[idx] += m[idx]
            errors[r] = m.copy()
            errors[r][idx] = 0
        out.append(((total / n).reshape(step_grads[0].shape), [e.copy() for e in errors]))
    return out
