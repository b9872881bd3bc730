"""Horovod's TensorFlow 1 API: ``DistributedOptimizer`` for ``tf.compat.v1.train``
optimizers, ``broadcast_global_variables`` and ``BroadcastGlobalVariablesHook``.

They build graph ops for ``tf.compat.v1`` sessions, whose collectives run off the session's
inter-op pool (:mod:`hvdlite.tensorflow.graph.nodes`), so ranks may run them in any order.
"""

import tensorflow as tf

from hvdlite.common.ops import Average
from hvdlite.common.process_sets import global_process_set
from hvdlite.tensorflow.functions import broadcast_variables
from hvdlite.tensorflow.gradient_tape import reduce_gradients

__all__ = ["DistributedOptimizer", "broadcast_global_variables",
           "BroadcastGlobalVariablesHook"]


def broadcast_global_variables(root_rank):
    """An op that assigns ``root_rank``'s value to every global variable of the graph.

    Args:
        root_rank: the rank whose values every rank receives.

    Returns:
        The grouped assign op (run it in the session).

    Raises:
        RuntimeError: called eagerly (use ``hvd.broadcast_variables`` there), as Horovod.
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() needs a TF1 graph; eagerly use "
                           "hvd.broadcast_variables(model.variables, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A session hook that broadcasts every global variable from ``root_rank`` once the
    session exists, so that all ranks start from the same weights.

    Args:
        root_rank: the rank whose values every rank receives.
        device: accepted for Horovod compatibility and ignored.
    """

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self):
        """Build the broadcast op in the session's graph (again if the graph changed)."""
        if self.bcast_op is None or \
                self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        """Run the broadcast."""
        session.run(self.bcast_op)


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Reduces the gradients of ``compute_gradients``; everything else is the wrapped
    optimizer's."""

    def __init__(self, optimizer, name, use_locking, reduce_args):
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reduce_args = reduce_args

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, reduced over the ranks (one grouped op)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads = reduce_gradients([g for g, _ in pairs], **self._reduce_args)
        return list(zip(grads, [v for _, v in pairs]))

    def apply_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``apply_gradients``."""
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        """The wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        """The wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        """The wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=None, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap a ``tf.compat.v1.train.Optimizer`` so that ``compute_gradients`` (and so
    ``minimize``) reduces the gradients over the ranks, as Horovod's TF1 optimizer.

    For Keras optimizers use ``hvdlite.tensorflow.keras.DistributedOptimizer``.

    Args:
        optimizer: the ``tf.compat.v1.train.Optimizer`` to wrap.
        name: the optimizer's name (``None``: ``Distributed`` + the wrapped class's name).
        use_locking: passed to ``tf.compat.v1.train.Optimizer``.
        device_dense, device_sparse: accepted for Horovod compatibility and ignored.
        compression: ``hvd.Compression.fp16`` to send floating-point gradients as float16.
        sparse_as_dense: densify ``tf.IndexedSlices`` gradients before the reduction.
        backward_passes_per_step: only 1 is supported here.
        op: ``hvd.Average`` (the default), ``hvd.Sum`` or ``hvd.Adasum``.
        gradient_predivide_factor: with ``hvd.Average``, divide by this before the sum and
            by ``size / factor`` after it.
        average_aggregated_gradients: used with ``backward_passes_per_step`` only.
        num_groups, groups: accepted for Horovod compatibility; the gradients travel in
            one grouped allreduce.
        process_set: reduce among this process set only (default: all ranks).
        scale_local_gradients: accepted for Horovod compatibility and ignored.

    Returns:
        A ``tf.compat.v1.train.Optimizer``.

    Raises:
        ValueError: ``optimizer`` is not a ``tf.compat.v1.train.Optimizer``, or
            ``backward_passes_per_step`` is not 1.
    """
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise ValueError(f"hvd.DistributedOptimizer wraps a tf.compat.v1.train.Optimizer, "
                         f"got {type(optimizer).__name__}; for a Keras optimizer use "
                         f"hvdlite.tensorflow.keras.DistributedOptimizer")
    if backward_passes_per_step != 1:
        raise ValueError("hvd.DistributedOptimizer (TF1): backward_passes_per_step other "
                         "than 1 is not supported; use the Keras DistributedOptimizer")
    reduce_args = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                       gradient_predivide_factor=gradient_predivide_factor,
                       process_set=process_set)
    return _DistributedOptimizer(optimizer, name or f"Distributed{type(optimizer).__name__}",
                                 use_locking, reduce_args)
