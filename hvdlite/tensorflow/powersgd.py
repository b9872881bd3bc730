"""PowerSGD for the Keras 3 ``DistributedOptimizer`` (the algorithm of ``hvdlite.torch``'s).

Per matrix gradient ``M`` (``shape[0]`` rows): add this rank's residual; ``P = M Q`` with
the last step's ``Q``; allreduce ``P`` (sum); orthonormalise its columns; ``Q = M^T P``;
residual ``M - P Q^T``; allreduce ``Q`` with the optimizer's op; the gradient is ``P Q^T``.
The residuals, ``Q`` and the step counter are optimizer variables (made in ``build``), so
Keras checkpoints and ``BroadcastGlobalVariablesCallback`` carry them like the slots.
Everything is TensorFlow ops, so it runs inside the traced train step; the warm-up
(``start_iter`` plain steps) is a ``tf.cond`` whose branch every rank takes alike.
"""

import zlib

import numpy as np
import tensorflow as tf

from hvdlite.common.powersgd_settings import PowerSGDSettings
from hvdlite.tensorflow import mpi_ops
from hvdlite.tensorflow.keras_apply import built_for

__all__ = ["PowerSGD"]

ORTHO_EPS = 1e-8


class PowerSGD(PowerSGDSettings):
    """PowerSGD settings for ``hvdlite.tensorflow.keras.DistributedOptimizer`` (arguments:
    :class:`~hvdlite.common.powersgd_settings.PowerSGDSettings`; the first ``Q`` is seeded
    with the variable's position and shape)."""

    def _refuse(self, *_args, **_kwargs):
        raise TypeError(
            "hvd.Compression.powersgd(...) keeps state across steps, so it works "
            "only as keras DistributedOptimizer(opt, compression=...); the "
            "collectives take hvd.Compression.none or hvd.Compression.fp16"
        )

    compress = _refuse
    decompress = _refuse

    def matrix_shape(self, shape, dtype):
        """``(n, m, rank)`` when a variable of ``shape``/``dtype`` is compressed, else None."""
        shape = [int(d) for d in shape]
        if len(shape) < 2 or not tf.as_dtype(dtype).is_floating or 0 in shape:
            return None
        return self.factor_shape(shape[0], int(np.prod(shape[1:])))

    def initial_q(self, index: int, m: int, r: int) -> np.ndarray:
        """The first ``Q`` of the ``index``-th variable: the same on every rank and run."""
        key = zlib.crc32(f"{index}:{m}x{r}".encode())
        return np.random.default_rng([self.seed, key]).standard_normal((m, r))


def orthogonalize(p):
    """Gram-Schmidt on the columns of ``p`` (each divided by ``norm + eps``)."""
    cols = []
    for i in range(p.shape[1]):
        col = p[:, i]
        for prev in cols:
            col = col - tf.reduce_sum(prev * col) * prev
        cols.append(col / (tf.norm(col) + tf.cast(ORTHO_EPS, p.dtype)))
    return tf.stack(cols, axis=1)


def keras_members(base, spec: PowerSGD, settings: dict, reduce_gradients) -> dict:
    """``build`` and ``apply`` of a Keras optimizer whose matrix gradients travel as PowerSGD
    factors; the others go through ``reduce_gradients(grads, **settings)``."""

    def build(self, variables):
        base.build(self, variables)
        self._hvdlite_powersgd = {}
        for i, v in enumerate(variables):
            shape = spec.matrix_shape(v.shape, v.dtype)
            if shape is None:
                continue
            n, m, r = shape
            error = self.add_variable(
                shape=(n, m), initializer="zeros", dtype=v.dtype, name="hvdlite_powersgd_error"
            )
            first = spec.initial_q(i, m, r)
            q = self.add_variable(
                shape=(m, r),
                dtype=v.dtype,
                name="hvdlite_powersgd_q",
                initializer=lambda shape, dtype=None, first=first: tf.constant(first, dtype=dtype),
            )
            self._hvdlite_powersgd[self._get_variable_index(v)] = (error, q)
        self._hvdlite_powersgd_step = self.add_variable(
            shape=(), initializer="zeros", dtype="int64", name="hvdlite_powersgd_step"
        )

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        trainable_variables = built_for(self, trainable_variables)
        state = [
            self._hvdlite_powersgd.get(self._get_variable_index(v)) for v in trainable_variables
        ]
        at = [
            i
            for i, (g, st) in enumerate(zip(grads, state))
            if st is not None and g is not None and not isinstance(g, tf.IndexedSlices)
        ]
        rest = [None if i in at else g for i, g in enumerate(grads)]
        reduced = reduce_gradients(rest, **settings)
        mine = [grads[i] for i in at]
        if mine:
            step = self._hvdlite_powersgd_step

            def compressed():
                return _powersgd_step(mine, [state[i] for i in at], settings)

            def plain():
                return reduce_gradients(mine, **settings)

            out = tf.cond(step >= spec.start_iter, compressed, plain)
            for i, g in zip(at, out):
                reduced[i] = g
        self._hvdlite_powersgd_step.assign_add(1)
        return base.apply(self, reduced, trainable_variables)

    return {"build": build, "apply": apply}


def _powersgd_step(grads, states, settings):
    """One PowerSGD reduction of ``grads`` (dense, each with its ``(error, q)``)."""
    ps_kw = {"process_set": settings["process_set"]}
    ms = [tf.reshape(g, tf.shape(e)) + e for g, (e, _) in zip(grads, states)]
    ps = [tf.matmul(m, q) for m, (_, q) in zip(ms, states)]
    ps = mpi_ops.grouped_allreduce(ps, op=mpi_ops.Sum, name="keras.powersgd.P", **ps_kw)
    ps = [orthogonalize(p) for p in ps]
    qs = [tf.matmul(m, p, transpose_a=True) for m, p in zip(ms, ps)]
    for m, p, q, (e, _) in zip(ms, ps, qs, states):
        e.assign(m - tf.matmul(p, q, transpose_b=True))
    factor = settings.get("gradient_predivide_factor", 1.0)
    qs = mpi_ops.grouped_allreduce(
        qs,
        op=settings["op"],
        prescale_factor=1.0 / factor,
        postscale_factor=factor,
        name="keras.powersgd.Q",
        **ps_kw,
    )
    out = []
    for g, p, q, (_, q_var) in zip(grads, ps, qs, states):
        q_var.assign(q)
        out.append(tf.reshape(tf.matmul(p, q, transpose_b=True), tf.shape(g)))
    return out
