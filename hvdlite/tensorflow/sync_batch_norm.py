"""``hvd.SyncBatchNormalization``: Keras batch normalization whose batch statistics cover
every rank's batch, as Horovod's.

Each rank sums its inputs, their squares and its element count over the reduced axes; one
Sum grouped allreduce adds them over the ranks, so ranks with different batch sizes weigh
by their counts.  The mean and variance follow from the three sums.  The allreduce is
differentiable, so gradients flow through the statistics to every rank's inputs as with
batch normalization on the joined batch.  Inference (``training=False``) uses the moving
statistics, as Keras does, with no communication.
"""

import keras
import tensorflow as tf

from hvdlite.tensorflow import mpi_ops

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with batch statistics over all ranks.

    Takes Keras 3's ``BatchNormalization`` arguments (``axis``, ``momentum``, ``epsilon``,
    ``center``, ``scale``, the initializers, regularizers and constraints, ...) except
    ``synchronized=True``, which is ``tf.distribute``'s own synchronization.  Horovod's
    ``fused=False`` is accepted and dropped: Horovod passes it on to Keras, whose
    Keras 3 ``BatchNormalization`` has no ``fused`` argument and refuses it.

    Raises:
        ValueError: ``synchronized=True``, or ``fused`` True or None (as Horovod: the
            statistics cannot come from a fused kernel).
    """

    def __init__(self, *args, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError(
                f"SyncBatchNormalization: fused={fused} is not supported (the "
                f"batch statistics are summed over the ranks, not computed by "
                f"a fused kernel); leave fused out or pass fused=False"
            )
        if kwargs.get("synchronized"):
            raise ValueError(
                "SyncBatchNormalization synchronizes over the hvdlite ranks; "
                "synchronized=True (tf.distribute's) cannot be combined with it"
            )
        super().__init__(*args, **kwargs)

    def _moments(self, inputs, mask):
        x = tf.convert_to_tensor(inputs)
        wide = x.dtype in (tf.float16, tf.bfloat16)
        if wide:
            x = tf.cast(x, tf.float32)
        axes = list(self._reduction_axes)
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
        total, squares, count = mpi_ops.grouped_allreduce(
            [
                tf.reduce_sum(x * weights, axes),
                tf.reduce_sum(x * x * weights, axes),
                tf.reduce_sum(weights, axes),
            ],
            op=mpi_ops.Sum,
        )
        count = tf.maximum(count, 1.0)
        mean = total / count
        variance = tf.maximum(squares / count - mean * mean, 0.0)
        if wide:
            mean, variance = tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
        return mean, variance
