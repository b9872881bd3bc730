"""Keras DistributedOptimizer with hvd.Compression.powersgd at np=2: the applied updates equal
the NumPy reference over several steps, eagerly and in a tf.function; the state is optimizer
variables (a copy of them gives the same next step); refusals (run per rank).  Its cases
run in tf_worker.py's launch (test_tensorflow.py)."""

import sys

import keras
import numpy as np
import tensorflow as tf

import hvdlite.tensorflow.keras as hvd
from tests.compression_reference import grads, powersgd_reference
from tests.worker_cases import run_cases

SHAPES = [(12, 10), (10,)]
STEPS = 4


def _check(what, got, want, atol=1e-9):
    diff = np.abs(np.asarray(got) - want).max()
    if not diff <= atol:
        raise AssertionError(f"{what}: max abs diff {diff:.3g} > {atol} on rank {hvd.rank()}")


def _setup(spec):
    """Variables of SHAPES and an SGD(lr=1) optimizer: each update is minus the gradient."""
    variables = [tf.Variable(tf.zeros(s, tf.float64)) for s in SHAPES]
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=spec)
    opt.build(variables)
    return variables, opt


def _state(opt, what):
    return next(v for v in opt.variables if v.path.endswith(what)).numpy()


def _apply_fn(opt, variables, traced):
    def apply(gs):
        opt.apply([tf.constant(g) for g in gs], variables)

    if not traced:
        return apply
    fn = tf.function(lambda a, b: opt.apply([a, b], variables))
    return lambda gs: fn(tf.constant(gs[0]), tf.constant(gs[1]))


def matches_reference():
    n, rank = hvd.size(), hvd.rank()
    for traced in (False, True):
        variables, opt = _setup(hvd.Compression.powersgd(rank=2, start_iter=1))
        q0 = _state(opt, "hvdlite_powersgd_q")
        by_step = [[grads(r, s, SHAPES)[0] for r in range(n)] for s in range(STEPS)]
        want = powersgd_reference(by_step, q0, 1, n)
        apply = _apply_fn(opt, variables, traced)
        for s in range(STEPS):
            before = [v.numpy() for v in variables]
            apply(grads(rank, s, SHAPES))
            tag = f"traced={traced} step {s}"
            _check(f"{tag} matrix", before[0] - variables[0].numpy(), want[s][0])
            _check(
                f"{tag} vector",
                before[1] - variables[1].numpy(),
                sum(grads(r, s, SHAPES)[1] for r in range(n)) / n,
            )
            _check(f"{tag} residual", _state(opt, "hvdlite_powersgd_error"), want[s][1][rank])


def state_in_variables():
    """Copying the optimizer variables (what a Keras checkpoint saves) into a fresh optimizer
    gives the same next step; a fresh one without them, a different one."""
    spec = hvd.Compression.powersgd(rank=1, start_iter=1)
    variables, opt = _setup(spec)
    for s in range(3):
        opt.apply([tf.constant(g) for g in grads(hvd.rank(), s, SHAPES)], variables)
    saved = [v.numpy() for v in variables]
    saved_opt = [v.numpy() for v in opt.variables]
    opt.apply([tf.constant(g) for g in grads(hvd.rank(), 3, SHAPES)], variables)
    for load in (True, False):
        fresh, fresh_opt = _setup(spec)
        for v, value in zip(fresh, saved):
            v.assign(value)
        if load:
            for v, value in zip(fresh_opt.variables, saved_opt):
                v.assign(value)
        fresh_opt.apply([tf.constant(g) for g in grads(hvd.rank(), 3, SHAPES)], fresh)
        same = np.array_equal(fresh[0].numpy(), variables[0].numpy())
        if same != load:
            raise AssertionError(
                f"loaded={load} but the next step is {'the same' if same else 'different'}"
            )


def refusals():
    spec = hvd.Compression.powersgd()
    for kw, word in (
        ({"op": hvd.Adasum}, "Average"),
        ({"backward_passes_per_step": 2}, "backward_passes_per_step"),
    ):
        try:
            hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=spec, **kw)
            raise AssertionError(f"accepted PowerSGD with {kw}")
        except ValueError as e:
            assert word in str(e), e
    try:
        hvd.allreduce(tf.ones(3), name="refused", compression=spec)
        raise AssertionError("allreduce accepted PowerSGD")
    except TypeError as e:
        assert "DistributedOptimizer" in str(e), e


CASES = {
    "matches_reference": matches_reference,
    "state_in_variables": state_in_variables,
    "refusals": refusals,
}


if __name__ == "__main__":
    run_cases(hvd, CASES, set(sys.argv[1:]) or None)
