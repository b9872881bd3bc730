"""Elastic training for PyTorch: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``.

Names and semantics follow ``horovod.torch.elastic``::

    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

The reset loop itself is framework-neutral (:mod:`hvdlite.common.elastic`).
"""

import copy
import math
import random
from typing import Any, Dict, Iterator, List

import torch
import torch.utils.data

from hvdlite.common.elastic import ObjectState, State, run_fn
from hvdlite.torch.functions import (allgather_object, broadcast_object,
                                     broadcast_optimizer_state, broadcast_parameters)
from hvdlite.torch.mpi_ops import rank, size

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]


def run(func):
    """Decorate ``train(state, ...)`` so it survives dead workers and host changes."""
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
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set = set()
        self.indices: List[int] = []
        self._shards: List[List[int]] = []       # every rank's indices of the current pass
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark every rank's ``batch_idx``-th batch of the current pass as processed."""
        start, end = batch_idx * batch_size, (batch_idx + 1) * batch_size
        for shard in self._shards:
            self.processed_indices.update(shard[start:end])

    def record_indices(self, indices) -> None:
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
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
        padded = self.remaining_indices + \
            self.remaining_indices[:self.total_size - len(self.remaining_indices)]
        self._shards = [padded[r:self.total_size:self.num_replicas]
                        for r in range(self.num_replicas)]
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
        done = set().union(*allgather_object(self.value.processed_indices,
                                             name="elastic.sampler.processed"))
        state = self.value.state_dict()
        state["processed_indices"] = done
        self.value.load_state_dict(broadcast_object(state, root_rank=0,
                                                    name="elastic.sampler.state"))


_HANDLERS = ((torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
             (ElasticSampler, _SamplerHandler))


def _bcast(obj):
    return broadcast_object(obj, root_rank=0, name="elastic.state")


class TorchState(ObjectState):
    """A model, an optimizer, samplers and plain values that survive resets.

    Modules, optimizers and :class:`ElasticSampler` values are kept through their
    ``state_dict``; anything else is a plain value (see ``ObjectState``).  After a
    reset, ``sync`` broadcasts rank 0's parameters and optimizer state.
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
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()
