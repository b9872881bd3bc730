"""Elastic Keras 3 training: ``KerasState`` and the callbacks that keep it current, as
``horovod.tensorflow.keras.elastic``::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(..., initial_epoch=state.epoch, callbacks=[
            hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.UpdateEpochStateCallback(state)])
"""

import keras

from hvdlite.tensorflow.elastic import TensorFlowKerasState, run

__all__ = ["run", "KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback"]


class KerasState(TensorFlowKerasState):
    """:class:`~hvdlite.tensorflow.elastic.TensorFlowKerasState` under Horovod's Keras name."""


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` every ``batches_per_commit`` batches (put it last, after the
    callbacks that update the state)."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the last finished batch of the epoch (0 after an epoch)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the next epoch to run."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1
