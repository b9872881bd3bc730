"""Elastic training for PyTorch: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``.

Names and semantics follow ``horovod.torch.elastic``::

    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

The reset loop itself is framework-neutral (:mod:`hvdlite.common.elastic_state`).
"""

import copy
import math
import random
from typing import Any, Dict, Iterator, List

import torch
import torch.utils.data

from hvdlite.common import basics
from hvdlite.common.elastic_state import ObjectState, State, run_fn
from hvdlite.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hvdlite.torch.slow_links.diloco import DiLoCo
from hvdlite.torch.mpi_ops import rank, size

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]


def _import_what_optimizers_need() -> None:
    """Building the first ``torch.optim`` optimizer imports ``torch._dynamo`` (a second or
    more of a loaded host's time): done before a new worker joins running survivors,
    they do not wait for it at its first collective."""
    import torch._dynamo  # noqa: F401


basics.register_warmup(_import_what_optimizers_need)


def run(func):
    """Decorate ``train(state, ...)`` so that it survives dead workers and host changes.

    The wrapped function takes a :class:`TorchState` (or another ``State``) first; it
    starts by copying rank 0's state to every rank (``state.sync()``).  When a peer fails
    in a collective, every surviving rank rolls the state back to its last ``commit()``;
    when hosts were added or removed, ``commit()`` raises on every rank and the state is
    kept.  Either way the ranks join the next rendezvous round, the state is synced
    again, the reset callbacks run and ``func`` is called again.  A process whose host
    left the job exits with code 0.

    Args:
        func: the training function; its first argument is the state.

    Returns:
        The wrapped function, called as ``train(state, *args, **kwargs)``; it returns what
        ``func`` returns once a call completes.

    Raises:
        HvdliteInternalError: (from the wrapped function) a peer failed outside elastic
            mode (no ``--min-np``, ``--max-np`` or ``--host-discovery-script``), or
            joining the next round failed for good.
    """
    return run_fn(func)


class ElasticSampler(torch.utils.data.Sampler):
    """Shards one epoch's samples over the ranks, skipping those already processed.

    After a reset the samples not yet processed this epoch are re-sharded over
    the new set of ranks, so none is skipped or repeated.  Call
    ``record_batch(batch_index, batch_size)`` after each batch and
    ``set_epoch(epoch)`` at the start of each epoch; put the sampler in the
    :class:`TorchState` so commits keep its position.

    ``record_batch`` marks the batch of *every* rank (ranks step through their
    shards in lockstep, and the shards are known everywhere), so a commit keeps
    the samples a worker processed even if that worker dies later; Horovod's
    sampler records only its own rank's.  ``record_indices`` marks given indices.

    Args:
        dataset: the dataset to sample from (only its ``len()`` is used).
        shuffle: shuffle the remaining samples, the same way on every rank.
        seed: the shuffle's seed; the epoch is added to it, so each epoch differs.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set = set()
        self.indices: List[int] = []
        self._shards: List[List[int]] = []  # every rank's indices of the current pass
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: forget the processed samples and re-shard all of them.

        Args:
            epoch: the epoch number (it changes the shuffle).
        """
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark every rank's ``batch_idx``-th batch of the current pass as processed.

        Args:
            batch_idx: the batch's index in this pass (since the last reset or epoch).
            batch_size: the number of samples per batch.
        """
        start, end = batch_idx * batch_size, (batch_idx + 1) * batch_size
        for shard in self._shards:
            self.processed_indices.update(shard[start:end])

    def record_indices(self, indices) -> None:
        """Mark the dataset indices ``indices`` as processed.

        Args:
            indices: an iterable of dataset indices.
        """
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """The dataset indices of this rank's ``batch_idx``-th batch of the current pass.

        Args:
            batch_idx: the batch's index in this pass.
            batch_size: the number of samples per batch.

        Returns:
            A list of up to ``batch_size`` dataset indices (fewer at the end of the shard).
        """
        start = batch_idx * batch_size
        return self.indices[start : min(start + batch_size, len(self.indices))]

    def state_dict(self) -> Dict[str, Any]:
        """The sampler's position, for :class:`TorchState` to save and broadcast.

        Returns:
            ``{"epoch": ..., "processed_indices": ...}`` (a copy of the processed set).
        """
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take the position ``state`` (from :meth:`state_dict`) and re-shard what remains.

        Args:
            state: a dictionary returned by :meth:`state_dict`.
        """
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Re-shard the unprocessed samples of this epoch over the current ranks."""
        self.num_replicas, self.rank = size(), rank()
        remaining = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(remaining)
        self.remaining_indices = remaining
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        padded = (
            self.remaining_indices
            + self.remaining_indices[: self.total_size - len(self.remaining_indices)]
        )
        self._shards = [
            padded[r : self.total_size : self.num_replicas] for r in range(self.num_replicas)
        ]
        self.indices = self._shards[self.rank]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """How one kind of value in a TorchState is saved, restored and synced."""

    def __init__(self, value):
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        # every rank processed its own shard: the union is what the epoch has done
        done = set().union(
            *allgather_object(self.value.processed_indices, name="elastic.sampler.processed")
        )
        state = self.value.state_dict()
        state["processed_indices"] = done
        self.value.load_state_dict(
            broadcast_object(state, root_rank=0, name="elastic.sampler.state")
        )


class _DiLoCoHandler(_Handler):
    def sync(self) -> None:
        self.value.sync(root_rank=0)


_HANDLERS = (
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (ElasticSampler, _SamplerHandler),
    (DiLoCo, _DiLoCoHandler),
)


def _bcast(obj):
    return broadcast_object(obj, root_rank=0, name="elastic.state")


class TorchState(ObjectState):
    """A model, an optimizer, samplers and plain values that survive resets.

    Modules, optimizers, :class:`ElasticSampler` values and ``hvd.DiLoCo`` wrappers are
    kept through their ``state_dict``; anything else is a plain value (see
    ``ObjectState``).  After a reset, ``sync`` broadcasts rank 0's parameters and
    optimizer state (a DiLoCo's outer state: anchors, outer optimizer, counters).  Every
    value is also an attribute: ``state.model``, ``state.epoch``, ...

    Args:
        model: a ``torch.nn.Module`` whose ``state_dict()`` is kept (optional).
        optimizer: a ``torch.optim.Optimizer`` (a DistributedOptimizer too) or an
            ``hvd.DiLoCo`` whose state is kept (optional).
        kwargs: further values by name: modules, optimizers and samplers as above,
            anything else kept as a deep copy.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers: Dict[str, _Handler] = {}
        plain = {}
        for name, value in kwargs.items():
            kind = next((h for t, h in _HANDLERS if isinstance(value, t)), None)
            if kind is None:
                plain[name] = value
            else:
                self._handlers[name] = kind(value)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(_bcast, **plain)

    def save(self) -> None:
        """Keep a copy of every value (what a failure rolls back to); ``commit()`` calls it."""
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        """Put back the values of the last :meth:`save`; called on every rank after a failure."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        """Make every rank's values rank 0's (parameters and optimizer state broadcast, the
        samplers' processed samples combined); called after each reset.
        """
        for handler in self._handlers.values():
            handler.sync()
        super().sync()
