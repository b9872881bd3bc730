"""hvdlite for Keras 3 on TensorFlow (``import hvdlite.tensorflow.keras as hvd``).

The ``keras`` that ships with TensorFlow 2.21 is Keras 3; Horovod's Keras integration
supports only Keras 2.  Here: :func:`DistributedOptimizer` and the callbacks of
:mod:`hvdlite.tensorflow.keras.callbacks`, beside the TensorFlow ops.

``model.fit`` compiles its train step with ``tf.function``; the collectives run in it as
``tf.py_function`` nodes, which XLA cannot compile: do not compile the model with
``jit_compile=True`` (Keras 3's default ``"auto"`` means no XLA on a CPU-only machine).
"""

import keras
import tensorflow as tf

from hvdlite.common.ops import Average
from hvdlite.common.process_sets import global_process_set
from hvdlite.tensorflow import (Adasum, Compression, ProcessSet, Sum,  # noqa: F401
                                SyncBatchNormalization, add_process_set,
                                allgather_object, barrier,
                                broadcast_object, broadcast_variables, ccl_built, cross_rank,
                                cross_size, cuda_built, ddl_built, gloo_built,
                                gloo_enabled, init, is_initialized, join,
                                local_rank, local_size, mpi_built, mpi_enabled,
                                mpi_threads_supported, nccl_built, rank,
                                remove_process_set, rocm_built, shutdown, size,
                                start_timeline, stop_timeline)
from hvdlite.tensorflow.gradient_tape import reduce_gradients
from hvdlite.tensorflow.keras_apply import built_for
from hvdlite.tensorflow.powersgd import PowerSGD
from hvdlite.tensorflow.powersgd import keras_members as powersgd_members
from hvdlite.tensorflow.keras import callbacks, elastic  # noqa: F401
from hvdlite.tensorflow.keras.collectives import (allgather, allreduce,  # noqa: F401
                                                  broadcast, reducescatter)

__all__ = ["DistributedOptimizer", "broadcast_global_variables", "callbacks", "elastic", "init",
           "shutdown", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
           "is_initialized", "allreduce", "allgather", "broadcast", "join", "barrier",
           "broadcast_object", "allgather_object", "broadcast_variables", "Compression",
           "Average", "Sum", "Adasum", "ProcessSet", "add_process_set", "remove_process_set",
           "global_process_set", "reducescatter", "start_timeline", "stop_timeline",
           "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
           "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
           "SyncBatchNormalization", "load_model"]


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True):
    """A copy of the Keras 3 ``optimizer`` whose updates use gradients reduced over the ranks.

    The copy has the same class and config; its ``apply`` / ``apply_gradients`` first
    reduce the gradients over the process set (one grouped allreduce; ``op``
    hvd.Average by default), as ``horovod.tensorflow.keras``'s.

    ``backward_passes_per_step`` N > 1 aggregates locally: each call adds the gradients to
    accumulators (optimizer variables, so they are saved and broadcast with it), and every
    N-th call reduces the sums over the ranks -- divided by N first when
    ``average_aggregated_gradients`` -- and applies them; the other calls only count the
    step (``iterations`` counts every batch, as Keras's own accumulation does).  N passes
    on N smaller batches then make the update one pass on their union would, at one
    allreduce per N batches.

    Args:
        optimizer: a Keras 3 optimizer; it is copied through its config, not modified.
        name: the copy's name (default: the original's).
        device_dense, device_sparse: accepted for Horovod compatibility and ignored.
        compression: ``hvd.Compression.fp16`` to send floating-point gradients as float16;
            ``None`` sends them as they are; ``hvd.Compression.powersgd(...)`` sends matrix
            gradients as PowerSGD factors with error feedback (its residuals, ``Q`` and step
            count are optimizer variables; not with Adasum or ``backward_passes_per_step``).
        sparse_as_dense: densify ``tf.IndexedSlices`` gradients before the reduction
            (otherwise they are allgathered).
        gradient_predivide_factor: with ``hvd.Average``, divide by this before the sum and
            by ``size / factor`` after it.
        op: ``hvd.Average`` (the default), ``hvd.Sum`` or ``hvd.Adasum``.
        backward_passes_per_step: how many calls accumulate locally per reduction.
        average_aggregated_gradients: divide the accumulated gradients by
            ``backward_passes_per_step`` before reducing them.
        num_groups, groups: accepted for Horovod compatibility; every gradient already
            travels in one grouped allreduce, which the runtime fuses.
        process_set: reduce among this process set only (default: all ranks).
        scale_local_gradients: accepted for Horovod compatibility and ignored.

    Returns:
        A new optimizer of a subclass of ``optimizer``'s class.

    Raises:
        ValueError: ``backward_passes_per_step`` is not a positive integer; PowerSGD with
            Adasum or ``backward_passes_per_step`` > 1.
        TypeError: ``optimizer`` is not a Keras 3 optimizer.
    """
    _check_wrappable(optimizer, backward_passes_per_step)
    compression, powersgd = _split_powersgd(compression, op, backward_passes_per_step)
    settings = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                    gradient_predivide_factor=gradient_predivide_factor,
                    process_set=process_set)
    cls = _distributed_class(optimizer.__class__, settings, backward_passes_per_step,
                             average_aggregated_gradients, powersgd)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return cls.from_config(config)


def _check_wrappable(optimizer, backward_passes_per_step) -> None:
    if isinstance(backward_passes_per_step, bool) or \
            not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"DistributedOptimizer: backward_passes_per_step="
                         f"{backward_passes_per_step!r} must be a positive integer")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer: expected a keras.optimizers.Optimizer (Keras "
                        f"3), got {type(optimizer).__name__}")


def _distributed_class(base, settings: dict, passes: int, average: bool, powersgd=None):
    """The subclass of ``base`` whose ``apply`` reduces the gradients first (every
    ``passes``-th call, the ones summed since, when ``passes`` > 1; compressed by
    ``powersgd`` when given)."""

    def apply(self, grads, trainable_variables=None):
        return base.apply(self, reduce_gradients(list(grads), **settings),
                          trainable_variables)

    members = {"apply": apply, "_hvdlite_distributed": True, "__module__": base.__module__}
    if passes > 1:
        members.update(_aggregating_members(base, passes, average, settings))
    if powersgd is not None:
        members.update(powersgd_members(base, powersgd, settings, reduce_gradients))
    return type(base.__name__, (base,), members)


def _split_powersgd(compression, op, backward_passes_per_step):
    """``(compression for reduce_gradients, PowerSGD settings or None)``."""
    if not isinstance(compression, PowerSGD):
        return compression, None
    _check_powersgd(compression, op, backward_passes_per_step)
    return None, compression


def _check_powersgd(spec, op, backward_passes_per_step) -> None:
    """Raises: ValueError: PowerSGD with ``op=hvd.Adasum`` or with local aggregation."""
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer: compression={spec!r} needs op=hvd.Average or "
                         "hvd.Sum")
    if backward_passes_per_step > 1:
        raise ValueError(f"DistributedOptimizer: compression={spec!r} does not combine with "
                         "backward_passes_per_step > 1 in Keras (accumulate in the train step "
                         "instead)")


def _aggregating_members(base, passes: int, average: bool, settings: dict) -> dict:
    """``build`` and ``apply`` of an optimizer that reduces and applies every ``passes``-th
    call the gradients summed locally since the last one (see :func:`DistributedOptimizer`).

    Every rank takes the same branch at the same call (the counter advances alike), so the
    grouped allreduce inside the branch is issued by all ranks or by none.
    """
    scale = 1.0 / passes if average else 1.0

    def build(self, variables):
        base.build(self, variables)
        self._hvdlite_aggregated = [
            self.add_variable_from_reference(v, name="hvdlite_aggregated_gradient")
            for v in variables]
        self._hvdlite_passes = self.add_variable(shape=(), initializer="zeros",
                                                 dtype="int64", name="hvdlite_passes")

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        trainable_variables = built_for(self, trainable_variables)
        sums = [self._hvdlite_aggregated[self._get_variable_index(v)]
                for v in trainable_variables]
        for total, g in zip(sums, grads):
            if g is not None:
                total.assign_add(tf.cast(tf.convert_to_tensor(g), total.dtype))
        count = self._hvdlite_passes.assign_add(1)

        def reduce_and_apply():
            local = [None if g is None else total * tf.cast(scale, total.dtype)
                     for g, total in zip(grads, sums)]
            base.apply(self, reduce_gradients(local, **settings), trainable_variables)
            for total in sums:
                total.assign(tf.zeros_like(total))
            self._hvdlite_passes.assign(0)
            return tf.constant(True)

        def count_only():
            self._iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(count >= passes, reduce_and_apply, count_only)

    return {"build": build, "apply": apply}


def broadcast_global_variables(root_rank, model=None):
    """Broadcast ``model``'s variables (and its built optimizer's) from ``root_rank``.

    Args:
        root_rank: the rank whose values everyone receives.
        model: the Keras model; required, since Keras 3 has no global variable
            collection.

    Raises:
        ValueError: ``model`` not given, or ``root_rank`` is not a rank of the job.
        TypeError: ``root_rank`` is not an int.
    """
    if model is None:
        raise ValueError("broadcast_global_variables: Keras 3 has no global variable "
                         "collection; pass model=")
    callbacks.broadcast_model(model, root_rank)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=None):
    """Load a saved Keras model and wrap its optimizer in ``DistributedOptimizer``, keeping
    the optimizer's state (iterations, slots), so that training resumes where it stopped.

    A model saved with a ``DistributedOptimizer`` stores its base optimizer (the wrapper
    keeps the class's name and module), so any saved model loads.

    Args:
        filepath: the saved model (a ``.keras`` file or what ``keras.models.load_model``
            takes).
        custom_optimizers: optimizer classes of your own the file refers to.
        custom_objects: other custom classes or functions, by name.
        compression: ``hvd.Compression.fp16`` to send floating-point gradients as float16.

    Returns:
        The model; compiled models get the wrapped optimizer.
    """
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    saved = getattr(model, "optimizer", None)
    if saved is None or getattr(saved, "_hvdlite_distributed", False):
        return model
    wrapped = DistributedOptimizer(saved, compression=compression)
    if saved.built:
        wrapped.build(model.trainable_variables)
        for mine, theirs in zip(wrapped.variables, saved.variables):
            mine.assign(theirs)
    model.optimizer = wrapped
    return model
