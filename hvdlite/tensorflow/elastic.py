"""Elastic training for TensorFlow 2: ``hvd.elastic.run``, ``TensorFlowState``,
``TensorFlowKerasState``, with the names and semantics of ``horovod.tensorflow.elastic``::

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

The reset loop is framework-neutral (:mod:`hvdlite.common.elastic_state`).  A collective that fails
inside ``tf.function`` (Keras' compiled train step included) reaches Python as TensorFlow's
``UnknownError`` wrapping the runtime's error; :func:`run` turns it back into
``HvdliteInternalError`` so the loop restores and resets as it does in eager mode.
"""

import functools

import tensorflow as tf

from hvdlite.common.elastic_state import ObjectState, State, run_fn
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.tensorflow.functions import broadcast_object, broadcast_variables

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState"]


def _internal_names():
    """``HvdliteInternalError`` and the names of its subclasses (a wait given up for a newer
    round, a timeout, a stall): any of them inside a TensorFlow error means a reset."""
    names, todo = [], [HvdliteInternalError]
    while todo:
        cls = todo.pop()
        names.append(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def as_internal_error(text: str):
    """The ``HvdliteInternalError`` a TensorFlow error's message wraps (any subclass: a wait
    given up for a newer round, a timeout, a stall), or None when it wraps none."""
    names = [n for n in _internal_names() if n in text]
    if not names:
        return None
    # the runtime's own message, without TensorFlow's graph traceback around it
    for line in text.splitlines():
        for n in names:
            if line.startswith(n + ":"):
                return HvdliteInternalError(line[len(n) + 1 :].strip() or text)
    return HvdliteInternalError(text)


def run(func):
    """Decorate ``train(state, ...)`` so that it survives dead workers and host changes.

    The same loop as :func:`hvdlite.torch.elastic.run`.  A collective that fails inside
    ``tf.function`` surfaces as a TensorFlow ``OpError`` wrapping the runtime's error;
    it is turned back into ``HvdliteInternalError`` so the state is restored and the
    ranks reset as in eager mode.

    Args:
        func: the training function; its first argument is the state.

    Returns:
        The wrapped function; it returns what ``func`` returns once a call completes.

    Raises:
        HvdliteInternalError: (from the wrapped function) a peer failed outside elastic
            mode, or joining the next round failed for good.
    """

    @functools.wraps(func)
    def unwrapped(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            internal = as_internal_error(exc.message or "")
            if internal is None:
                raise
            raise internal from exc

    return run_fn(unwrapped)


def _bcast(obj):
    return broadcast_object(obj, root_rank=0, name="elastic.state")


def _values(variables):
    return [tf.identity(v) for v in variables]


def _assign(variables, values):
    for v, value in zip(variables, values):
        v.assign(value)


class TensorFlowState(ObjectState):
    """``variables`` (a list of ``tf.Variable``) and plain values that survive resets.

    ``save`` keeps a copy of every variable's value, ``restore`` assigns it back, ``sync``
    broadcasts rank 0's variables (then the plain values, as ``ObjectState``).

    Args:
        variables: the ``tf.Variable`` objects to keep.
        session: Horovod's TensorFlow 1 argument, unused.
        kwargs: plain values by name (``epoch=0``), kept as deep copies and
            readable as attributes.

    Raises:
        ValueError: ``variables`` not given (TensorFlow 2 has no global collection).
    """

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError(
                "TensorFlowState: pass variables= (a list of tf.Variable); "
                "TensorFlow 2 has no global variable collection"
            )
        self.variables = list(variables)
        self._saved_values = _values(self.variables)
        super().__init__(_bcast, **kwargs)

    def save(self) -> None:
        """Keep a copy of the variables and values (what a failure rolls back to)."""
        self._saved_values = _values(self.variables)
        super().save()

    def restore(self) -> None:
        """Assign the values of the last :meth:`save` back."""
        _assign(self.variables, self._saved_values)
        super().restore()

    def sync(self) -> None:
        """Give every rank rank 0's variables and values."""
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        super().sync()


class TensorFlowKerasState(ObjectState):
    """A built Keras 3 model, its optimizer and plain values that survive resets.

    The optimizer's variables are kept once it is built (Keras builds it in the first
    train step, or ``BroadcastGlobalVariablesCallback`` does).

    Args:
        model: a built Keras model.
        optimizer: its optimizer; ``None`` takes ``model.optimizer``.
        backend: Horovod's Keras-backend argument, unused.
        kwargs: plain values by name (``epoch=0``), readable as attributes.

    Raises:
        ValueError: the model is not built yet.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not model.built:
            raise ValueError(
                "TensorFlowKerasState: the model must be built first (give it an "
                "Input, call model.build(input_shape) or run it on a batch)"
            )
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._save_model()
        super().__init__(_bcast, **kwargs)

    def _optimizer_variables(self):
        opt = self.optimizer
        return list(opt.variables) if opt is not None and opt.built else []

    def _save_model(self) -> None:
        self._saved_model = _values(self.model.variables)
        self._saved_optimizer = _values(self._optimizer_variables())

    def save(self) -> None:
        """Keep a copy of the model's and optimizer's variables and the values."""
        self._save_model()
        super().save()

    def restore(self) -> None:
        """Assign the variables and values of the last :meth:`save` back."""
        _assign(self.model.variables, self._saved_model)
        opt_vars = self._optimizer_variables()
        if len(opt_vars) == len(self._saved_optimizer):
            _assign(opt_vars, self._saved_optimizer)
        super().restore()

    def sync(self) -> None:
        """Give every rank rank 0's model and optimizer variables and values."""
        broadcast_variables(list(self.model.variables) + self._optimizer_variables(), root_rank=0)
        super().sync()
