"""Keras 3 callbacks with the names and behaviour of ``horovod.tensorflow.keras.callbacks``."""

import keras
import numpy as np

from hvdlite.common import basics
from hvdlite.common.process_sets import global_process_set
from hvdlite.tensorflow import mpi_ops
from hvdlite.tensorflow.functions import broadcast_variables

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
]


def _optimizer_variables(model):
    opt = getattr(model, "optimizer", None)
    if opt is None or not getattr(opt, "built", True):
        return []
    return list(opt.variables)


def broadcast_model(model, root_rank, process_set=global_process_set) -> None:
    broadcast_variables(
        list(model.variables) + _optimizer_variables(model), root_rank, process_set=process_set
    )


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start from ``root_rank``'s model and optimizer state.

    Broadcasts when training begins (building the optimizer's slots from the model's
    trainable variables first, as Keras's first train step would), or after the first
    batch when the model was not built yet (no ``Input`` shape before the first batch).

    Args:
        root_rank: the rank whose values everyone receives.
        device: accepted for Horovod compatibility and ignored.
        process_set: the ranks that take part (default: all of them).
    """

    def __init__(self, root_rank, device="", process_set=global_process_set):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False

    def _broadcast(self):
        broadcast_model(self.model, self.root_rank, self.process_set)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if self.broadcast_done or not self.model.built:
            return
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and not opt.built:
            # Keras builds it from the same variables in the first train step; building it
            # now lets the first step start from the root's slots too
            opt.build(self.model.trainable_variables)
        self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch's logged metrics over the ranks.

    Put it before the callbacks that read the metrics (checkpointing, early stopping,
    schedules on plateau).  Every rank must log the same metric names.

    Args:
        device: accepted for Horovod compatibility and ignored.
        process_set: the ranks that take part (default: all of them).
    """

    def __init__(self, device="", process_set=global_process_set):
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        avg = np.asarray(
            mpi_ops.allreduce(
                values,
                op=mpi_ops.Average,
                name=f"MetricAverageCallback.{epoch}",
                process_set=self.process_set,
            )
        )
        for k, v in zip(keys, avg):
            logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` within an epoch range.

    For epochs in ``[start_epoch, end_epoch)`` the rate is set at the first batch of each
    epoch (``staircase``), or at every batch with the fractional epoch
    ``epoch + batch / steps_per_epoch``.  The rate is also logged as ``lr``.

    Args:
        initial_lr: the base rate; ``None`` reads the optimizer's when training begins.
        multiplier: a number, or a function of the (fractional) epoch; a number implies
            ``staircase``.
        start_epoch: the first epoch the schedule applies to.
        end_epoch: the epoch it stops at (exclusive); ``None`` for no end.
        staircase: change the rate once per epoch instead of every batch.
        momentum_correction: accepted but not applied: a Keras 3 optimizer's momentum is
            a Python number compiled into the train step.
        steps_per_epoch: batches per epoch, for the fractional epoch; ``None`` takes
            Keras's ``steps`` parameter.
        verbose: accepted for Horovod compatibility.

    Raises:
        ValueError: (when training begins) per-batch schedule and the steps per epoch
            cannot be found; pass ``steps_per_epoch``.
    """

    def __init__(
        self,
        initial_lr,
        multiplier,
        start_epoch=0,
        end_epoch=None,
        staircase=True,
        momentum_correction=True,
        steps_per_epoch=None,
        verbose=0,
    ):
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0
        if not callable(multiplier):
            self.staircase = True
            self.multiplier = lambda epoch: multiplier
        else:
            self.multiplier = multiplier

    def _lr(self):
        return float(np.asarray(self.model.optimizer.learning_rate))

    def _autodetect_steps_per_epoch(self):
        steps = (self.params or {}).get("steps")
        if steps:
            return steps
        raise ValueError(
            f"{type(self).__name__}: could not detect the number of steps per "
            f"epoch; pass steps_per_epoch="
        )

    def _adjust_learning_rate(self, epoch):
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = self._lr()
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (
            self.end_epoch is not None and self.current_epoch >= self.end_epoch
        ):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(self.current_epoch)
        else:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self._lr()


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs`` (Goyal et al., 2017), as Horovod's.

    The rate at fractional epoch ``e' = epoch + (batch + 1) / steps_per_epoch`` is
    ``initial_lr / size * (e' * (size - 1) / warmup_epochs + 1)``.

    Args:
        initial_lr: the rate reached at the end of the warm-up; ``None`` reads the
            optimizer's when training begins.
        warmup_epochs: the length of the warm-up in epochs.
        momentum_correction: accepted but not applied (see
            :class:`LearningRateScheduleCallback`).
        steps_per_epoch: batches per epoch; ``None`` takes Keras's ``steps`` parameter.
        verbose: ``> 0`` prints a line when the warm-up ends.

    Raises:
        ValueError: (when training begins) the steps per epoch cannot be found.
    """

    def __init__(
        self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0
    ):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            n = basics.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
            verbose=verbose,
        )
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self._lr():g}.")
