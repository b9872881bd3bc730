"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are reduced over ranks."""

import tensorflow as tf

from hvdlite.common import ops
from hvdlite.common.ops import Average
from hvdlite.common.process_sets import global_process_set
from hvdlite.tensorflow import mpi_ops

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "reduce_gradients"]


def reduce_gradients(grads, compression=None, sparse_as_dense=False, op=Average,
                     gradient_predivide_factor=1.0, process_set=global_process_set,
                     name=None):
    """Reduce a list of gradients (None kept as None) with one grouped allreduce.

    ``tf.IndexedSlices`` are allgathered, or densified first when ``sparse_as_dense``.
    ``gradient_predivide_factor`` f splits Average's division: by f before the sum and by
    size/f after it, as Horovod does (the size is read when the reduction runs).  On a rank
    outside ``process_set`` the gradients come back as they are (Horovod's optimizers are
    local there).
    """
    grads = list(grads)
    if not ops.is_member(process_set):
        return grads
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
                 process_set, scale_local_gradients=True):
        self.__dict__.update(tape.__dict__)
        self._hvd_args = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              process_set=process_set)
        self._local_sources = set()
        self._scale_local_gradients = scale_local_gradients

    def register_local_source(self, source):
        """Keep ``source``'s gradient on this rank (model-parallel weights): it is not
        reduced, only divided by the process set's size when ``scale_local_gradients``
        (as Horovod does, so that it weighs as the averaged ones)."""
        self._local_sources.add(_source_key(source))

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        local = [_source_key(s) in self._local_sources for s in tf.nest.flatten(sources)]
        reduced = reduce_gradients([None if loc else g for g, loc in zip(flat, local)],
                                   **self._hvd_args)
        out = [_local_gradient(g, self._hvd_args["process_set"], self._scale_local_gradients)
               if loc else r for g, r, loc in zip(flat, reduced, local)]
        return tf.nest.pack_sequence_as(grads, out)


def _source_key(source):
    """A hashable key for a source, the same for a Keras 3 variable and the ``tf.Variable``
    it holds.

    Horovod keys sources by ``source.ref()``, which a Keras 3 variable lacks ("'Variable'
    object has no attribute 'ref'" on TensorFlow 2.16 and later).  A Keras 3 variable on
    the TensorFlow backend keeps its ``tf.Variable`` in ``.value``; keying by that
    variable's ``ref()`` matches a layer's weight however it reaches ``gradient()``
    (``model.trainable_variables`` or the underlying ``tf.Variable``).  Anything else
    hashable is keyed by identity.
    """
    if hasattr(source, "ref"):
        return source.ref()
    inner = getattr(source, "value", None)
    if isinstance(inner, tf.Variable):
        return inner.ref()
    return ("id", id(source))


def _local_gradient(grad, process_set, scale: bool):
    """A registered local source's gradient: kept, divided by the set's size if ``scale``
    (read when it runs: an elastic job's size changes)."""
    if grad is None or not scale:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(mpi_ops.scaled_by_size(grad.values, process_set, -1),
                                grad.indices, grad.dense_shape)
    return mpi_ops.scaled_by_size(grad, process_set, -1)


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
        scale_local_gradients: divide the gradients of sources registered with
            ``register_local_source`` (kept, not reduced) by the set's size.

    Returns:
        A tape of a subclass of ``gradtape``'s class whose ``gradient()`` reduces.

    Raises:
        ValueError: (from ``gradient()``) ``gradient_predivide_factor`` other than 1 with
            an ``op`` other than ``hvd.Average``.
    """
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__), {})
    return cls(gradtape, compression, sparse_as_dense, op, gradient_predivide_factor,
               process_set, scale_local_gradients)


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=None, sparse_as_dense=False, op=Average,
                                   gradient_predivide_factor=1.0, num_groups=0, groups=None,
                                   process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """:func:`DistributedGradientTape` whose ``local_layers``' weights keep their gradients
    on this rank (model-parallel layers), as Horovod's.

    Each trainable weight of ``local_layers`` is registered with
    ``register_local_source``; the other arguments are :func:`DistributedGradientTape`'s.

    Args:
        gradtape: the ``tf.GradientTape`` to wrap; its recording is shared, not copied.
        device_dense, device_sparse: accepted for Horovod compatibility and ignored.
        compression, sparse_as_dense, op: as for :func:`DistributedGradientTape`.
        gradient_predivide_factor, num_groups, groups: as for
            :func:`DistributedGradientTape`.
        process_set, scale_local_gradients: as for :func:`DistributedGradientTape`.
        local_layers: a Keras layer or a list of them (``None``: none, the tape is then a
            plain :func:`DistributedGradientTape`).

    Returns:
        The distributed tape, its local sources registered.

    Raises:
        ValueError: an entry of ``local_layers`` is not a Keras layer.
    """
    import keras
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("PartialDistributedGradientTape: every entry of local_layers must be "
                         "a Keras layer (keras.layers.Layer)")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape
