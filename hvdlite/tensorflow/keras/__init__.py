"""hvdlite for Keras 3 on TensorFlow (``import hvdlite.tensorflow.keras as hvd``).

The ``keras`` that ships with TensorFlow 2.21 is Keras 3; Horovod's Keras integration
supports only Keras 2.  Here: :func:`DistributedOptimizer` and the callbacks of
:mod:`hvdlite.tensorflow.keras.callbacks`, beside the TensorFlow ops.

``model.fit`` compiles its train step with ``tf.function``; the collectives run in it as
``tf.py_function`` nodes, which XLA cannot compile: do not compile the model with
``jit_compile=True`` (Keras 3's default ``"auto"`` means no XLA on a CPU-only machine).
"""

import keras

from hvdlite.common.ops import Average
from hvdlite.common.process_sets import global_process_set
from hvdlite.tensorflow import (Adasum, Compression, ProcessSet, Sum,  # noqa: F401
                                add_process_set, allgather, allgather_object, allreduce,
                                barrier, broadcast, broadcast_object, broadcast_variables,
                                cross_rank, cross_size, init, is_initialized, join, local_rank,
                                local_size, rank, remove_process_set, shutdown, size)
from hvdlite.tensorflow.gradient_tape import reduce_gradients
from hvdlite.tensorflow.keras import callbacks, elastic  # noqa: F401

__all__ = ["DistributedOptimizer", "broadcast_global_variables", "callbacks", "elastic", "init",
           "shutdown", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
           "is_initialized", "allreduce", "allgather", "broadcast", "join", "barrier",
           "broadcast_object", "allgather_object", "broadcast_variables", "Compression",
           "Average", "Sum", "Adasum", "ProcessSet", "add_process_set", "remove_process_set"]


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True):
    """A copy of the Keras 3 ``optimizer`` (same class and config) whose ``apply`` /
    ``apply_gradients`` first reduce the gradients over the process set (one grouped
    allreduce; ``op`` hvd.Average by default), as ``horovod.tensorflow.keras``'s.

    Raises:
        ValueError: ``backward_passes_per_step`` other than 1 (not implemented yet).
    """
    if backward_passes_per_step != 1:
        raise ValueError("DistributedOptimizer: backward_passes_per_step > 1 is not "
                         "implemented for Keras 3 yet (use the optimizer's "
                         "gradient_accumulation_steps)")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer: expected a keras.optimizers.Optimizer (Keras "
                        f"3), got {type(optimizer).__name__}")
    base = optimizer.__class__
    settings = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                    gradient_predivide_factor=gradient_predivide_factor,
                    process_set=process_set)

    def apply(self, grads, trainable_variables=None):
        return base.apply(self, reduce_gradients(list(grads), **settings),
                          trainable_variables)

    cls = type(base.__name__, (base,), {"apply": apply, "_hvdlite_distributed": True,
                                        "__module__": base.__module__})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return cls.from_config(config)


def broadcast_global_variables(root_rank, model=None):
    """Broadcast ``model``'s variables (and its optimizer's) from ``root_rank``."""
    if model is None:
        raise ValueError("broadcast_global_variables: Keras 3 has no global variable "
                         "collection; pass model=")
    callbacks.broadcast_model(model, root_rank)
