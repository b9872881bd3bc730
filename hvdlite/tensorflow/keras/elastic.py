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

__all__ = [
    "run",
    "KerasState",
    "CommitStateCallback",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
]


class KerasState(TensorFlowKerasState):
    """:class:`~hvdlite.tensorflow.elastic.TensorFlowKerasState` under Horovod's Keras name.

    Args:
        model: a built Keras model.
        optimizer: its optimizer; ``None`` takes ``model.optimizer``.
        backend: Horovod's Keras-backend argument, unused.
        kwargs: plain values by name (``epoch=0``, ``batch=0``), readable as attributes.

    Raises:
        ValueError: the model is not built yet.
    """


class CommitStateCallback(keras.callbacks.Callback):
    """Calls ``state.commit()`` every ``batches_per_commit`` batches.

    Put it last, after the callbacks that update the state.

    Args:
        state: the elastic state to commit.
        batches_per_commit: how many batches between commits.
    """

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
    """Keeps ``state.batch`` at the last finished batch of the epoch (0 after an epoch).

    Args:
        state: the elastic state whose ``batch`` it sets.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the next epoch to run.

    Args:
        state: the elastic state whose ``epoch`` it sets.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1
