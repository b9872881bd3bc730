"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are reduced over ranks."""

import tensorflow as tf

from hvdlite.common import ops
from hvdlite.common.ops import Average
from hvdlite.common.process_sets import global_process_set
from hvdlite.tensorflow import mpi_ops

__all__ = ["DistributedGradientTape", "reduce_gradients"]


def reduce_gradients(grads, compression=None, sparse_as_dense=False, op=Average,
                     gradient_predivide_factor=1.0, process_set=global_process_set,
                     name=None):
    """Reduce a list of gradients (None kept as None) with one grouped allreduce.

    ``tf.IndexedSlices`` are allgathered, or densified first when ``sparse_as_dense``.
    ``gradient_predivide_factor`` f splits Average's division: by f before the sum and by
    size/f after it, as Horovod does (the size is read when the reduction runs).
    """
    grads = list(grads)
    at = [i for i, g in enumerate(grads) if g is not None]
    todo = [grads[i] for i in at]
    if sparse_as_dense:
        todo = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                for g in todo]
    rop = ops.reduce_op(None, op, name or "DistributedGradientTape")
    pre, post = 1.0, 1.0
    if gradient_predivide_factor != 1.0:
        if rop != Average:
            raise ValueError("gradient_predivide_factor needs op=hvd.Average")
        # Average divides by the size when it runs (a traced step survives elastic resizes)
        pre, post = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    reduced = mpi_ops.grouped_allreduce(todo, compression=compression, op=rop,
                                        prescale_factor=pre, postscale_factor=post,
                                        name=name, process_set=process_set) if todo else []
    out = list(grads)
    for i, r in zip(at, reduced):
        out[i] = r
    return out


class _DistributedGradientTape(tf.GradientTape):
    """Shares the wrapped tape's recording (its state is taken over, not copied); only
    :meth:`gradient` differs."""

    def __init__(self, tape, compression, sparse_as_dense, op, gradient_predivide_factor,
                 process_set):
        self.__dict__.update(tape.__dict__)
        self._hvd_args = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              process_set=process_set)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        return tf.nest.pack_sequence_as(grads, reduce_gradients(flat, **self._hvd_args))


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=global_process_set,
                            scale_local_gradients=True):
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients reduced over the ranks.

    As ``horovod.tensorflow.DistributedGradientTape``: the gradients are averaged (``op``)
    over the process set with one grouped allreduce.  Works before or after the tape
    recorded (``with`` block) and inside ``tf.function``; ``None`` gradients stay ``None``.

    Args:
        gradtape: the ``tf.GradientTape`` to wrap; its recording is shared, not copied.
        device_dense, device_sparse: accepted for Horovod compatibility and ignored.
        compression: ``hvd.Compression.fp16`` to send floating-point gradients as float16;
            ``None`` sends them as they are.
        sparse_as_dense: densify ``tf.IndexedSlices`` gradients before the reduction
            (otherwise they are allgathered).
        op: ``hvd.Average`` (the default), ``hvd.Sum`` or ``hvd.Adasum``.
        gradient_predivide_factor: with ``hvd.Average``, divide by this before the sum and
            by ``size / factor`` after it.
        num_groups, groups: accepted for Horovod compatibility; every gradient already
            travels in one grouped allreduce, which the runtime fuses.
        process_set: reduce among this process set only (default: all ranks).
        scale_local_gradients: accepted for Horovod compatibility and ignored.

    Returns:
        A tape of a subclass of ``gradtape``'s class whose ``gradient()`` reduces.

    Raises:
        ValueError: (from ``gradient()``) ``gradient_predivide_factor`` other than 1 with
            an ``op`` other than ``hvd.Average``.
    """
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__), {})
    return cls(gradtape, compression, sparse_as_dense, op, gradient_predivide_factor,
               process_set)
