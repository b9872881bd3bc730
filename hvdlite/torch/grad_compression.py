"""Stateful gradient compression: what PowerSGD and top-k share.

A stateless compressor (``hvd.Compression.fp16``) maps one tensor to one tensor around a
single allreduce.  PowerSGD and top-k cannot: they keep per-parameter state across steps
(error-feedback residuals, PowerSGD's warm-started ``Q``, a step counter) and need more
than one collective per step (PowerSGD: an allreduce of ``P``, then one of ``Q``; top-k:
allgathers of values and indices).  So they work only inside ``DistributedOptimizer``:

* ``hvd.Compression.powersgd(...)`` / ``hvd.Compression.topk(...)`` return a
  :class:`StatefulCompression`, a *spec* (just the settings);
* the optimizer wrapper asks it for a :class:`GradientExchange` over its own parameters,
  which holds the state, so it lives (and is checkpointed) with the wrapper: its
  ``state_dict()`` adds the state under ``"hvdlite_compression"``.  Nothing goes into
  ``optimizer.state``, because Adam and friends initialise a parameter's state there
  when it is empty;
* the wrapper calls :meth:`GradientExchange.start` where it would start an allreduce (one
  bucket, group or parameter) and :meth:`GradientExchange.finish` in ``synchronize()``.

Each started unit is a generator that launches its first collectives and yields; ``finish``
resumes all units round-robin, so the second round of every unit (PowerSGD's ``Q``) is in
flight at once rather than one unit after another.
"""

from typing import Dict, Iterator, List

import torch

from hvdlite.common import ops
from hvdlite.torch import mpi_ops

__all__ = ["StatefulCompression", "GradientExchange"]

#: what ``next`` returns for a unit whose generator has finished
_DONE = object()


class StatefulCompression:
    """Settings of a compressor that keeps state across steps (base of PowerSGD and top-k).

    Pass it as ``DistributedOptimizer(opt, compression=...)``; each wrapper builds its own
    :class:`GradientExchange` from it, so one spec may serve several optimizers.
    """

    #: the name written in checkpoints (``state_dict()["hvdlite_compression"]["kind"]``)
    kind = ""

    def make_exchange(
        self, params: List[torch.Tensor], names: Dict[torch.Tensor, str], reduce_kwargs: dict
    ) -> "GradientExchange":
        """The state and the collectives for ``params`` (named by ``names``), reducing with
        the optimizer's ``op``/``prescale_factor``/``postscale_factor``/``process_set``."""
        raise NotImplementedError

    def _refuse(self, *_args, **_kwargs):
        raise TypeError(
            f"hvd.Compression.{self.kind}(...) keeps state across steps (error feedback) and "
            "needs several collectives per step, so it works only as "
            "DistributedOptimizer(opt, compression=...); hvd.allreduce and the other "
            "collectives take hvd.Compression.none or hvd.Compression.fp16"
        )

    # hvd.allreduce(t, compression=spec) calls these: refuse with a message that says why
    compress = _refuse
    decompress = _refuse


class GradientExchange:
    """The per-optimizer state of a stateful compressor and the collectives of each step.

    Subclasses fill ``self.state`` (parameter name -> dict of tensors) in ``__init__`` and
    write :meth:`_compressed_unit`; this class does the rest: plain allreduce of what is not
    compressed, the step counter, checkpoints and broadcasts.
    """

    def __init__(
        self,
        spec: StatefulCompression,
        names: Dict[torch.Tensor, str],
        reduce_kwargs: dict,
        start_iter: int,
    ):
        self.spec = spec
        self.names = names
        self.kw = dict(reduce_kwargs)
        self.start_iter = int(start_iter)
        self.step = 0
        self.state: Dict[str, Dict[str, torch.Tensor]] = {}
        #: state entries kept equal on every rank (broadcast); the others are this rank's own
        self.shared_keys: tuple = ()
        self._pending: List[Iterator[None]] = []
        #: (gradient, row-major stand-in) pairs of the step in flight
        self._copy_back: List[tuple] = []

    # -- per step --------------------------------------------------------------------------

    @torch.no_grad()
    def start(self, unit: str, params: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
        """Start reducing ``grads`` (the gradients of ``params``, written in place with the
        result by :meth:`finish`); ``unit`` names the collectives (same on every rank)."""
        compressed, plain = [], []
        for p, g in zip(params, grads):
            name = self.names[p]
            if self.step >= self.start_iter and name in self.state:
                if not g.is_contiguous():
                    # a channels_last (or strided) gradient: compressed as a row-major copy,
                    # so every rank builds the same matrix whatever its layout, copied back
                    # by finish()
                    c = g.contiguous()
                    self._copy_back.append((g, c))
                    g = c
                compressed.append((name, g))
            else:
                plain.append(g)
        units = []
        if plain:
            units.append(self._plain_unit(unit + ".dense", plain))
        if compressed:
            units.append(self._compressed_unit(unit, compressed))
        for u in units:
            next(u)  # runs up to the first yield: the first collectives start
            self._pending.append(u)

    @torch.no_grad()
    def finish(self) -> None:
        """Complete every started unit (round-robin, one collective round at a time) and
        count one step."""
        pending, self._pending = self._pending, []
        while pending:
            pending = [u for u in pending if next(u, _DONE) is not _DONE]
        copies, self._copy_back = self._copy_back, []
        for g, c in copies:
            g.copy_(c)
        self.step += 1

    @torch.no_grad()
    def drain(self) -> None:
        """Complete the units in flight without counting a step (an error is being raised
        while they run; see ``DistributedOptimizer._hvd_drain``)."""
        pending, self._pending = self._pending, []
        try:
            while pending:
                pending = [u for u in pending if next(u, _DONE) is not _DONE]
        finally:
            for u in pending:
                u.close()
            self._copy_back = []

    def reset(self) -> None:
        """Drop the units in flight (the runtime was reset)."""
        for u in self._pending:
            u.close()
        self._pending = []
        self._copy_back = []

    def _add_residuals(self, params: List[torch.Tensor], min_numel: int) -> None:
        """A zero residual ``error`` (flat, this rank's own) for each floating-point
        parameter of at least ``min_numel`` entries: the ones this exchange compresses."""
        for p in params:
            if p.dtype.is_floating_point and p.numel() >= min_numel:
                self.state[self.names[p]] = {
                    "error": torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                }

    def _plain_unit(self, name: str, grads: List[torch.Tensor]) -> Iterator[None]:
        h = mpi_ops.grouped_allreduce_async_(grads, name=name, **self.kw)
        yield
        mpi_ops.synchronize(h)

    def _compressed_unit(self, unit: str, items) -> Iterator[None]:
        """Generator: start the collectives of ``items`` ((name, grad) pairs), yield, ...,
        and finally write the reduced gradients into the grads."""
        raise NotImplementedError

    def _average_scale(self) -> float:
        """The factor turning a plain sum over the ranks into what the optimizer's op asks."""
        scale = self.kw.get("prescale_factor", 1.0) * self.kw.get("postscale_factor", 1.0)
        if self.kw.get("op") == mpi_ops.Average:
            scale /= ops.process_set_size(self.kw.get("process_set"))
        return scale

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """A copy of the state: the kind, the step counter, each parameter's tensors, and
        the rank (in the optimizer's process set) and size that saved them."""
        ps = self.kw.get("process_set")
        return {
            "kind": self.spec.kind,
            "step": self.step,
            "rank": ops.process_set_rank(ps),
            "size": ops.process_set_size(ps),
            "tensors": {
                n: {k: t.detach().clone() for k, t in st.items()} for n, st in self.state.items()
            },
        }

    def _saved_here(self, saved: dict) -> bool:
        """Whether ``saved`` holds this rank's own residuals: saved by the same rank of a
        world of the same size (or by a version that did not record it)."""
        if "rank" not in saved:
            return True
        ps = self.kw.get("process_set")
        return (saved["rank"], saved.get("size")) == (
            ops.process_set_rank(ps),
            ops.process_set_size(ps),
        )

    def load_state_dict(self, saved: dict) -> None:
        """Take the state of :meth:`state_dict` (copied into this exchange's tensors).

        The step counter and the shared tensors (PowerSGD's ``Q``) are taken on every rank;
        the error-feedback residuals only on the rank that saved them.  Another rank loading
        the same file (every rank restoring rank 0's checkpoint) starts from zero residuals
        instead: rank 0's residual applied on every rank would add it ``size - 1`` times
        too often to the next step's gradient.

        Raises:
            ValueError: ``saved`` is of another kind, or a tensor's shape differs from this
                optimizer's (the message names the parameter).
        """
        if saved.get("kind") != self.spec.kind:
            raise ValueError(
                f"DistributedOptimizer.load_state_dict: the checkpoint's compression state is "
                f"{saved.get('kind')!r} but this optimizer uses {self.spec.kind!r}"
            )
        own = self._saved_here(saved)
        for name, tensors in saved.get("tensors", {}).items():
            mine = self.state.get(name)
            if mine is None:
                continue  # that parameter is not compressed here: nothing to keep
            for key, value in tensors.items():
                if key in mine and tuple(mine[key].shape) != tuple(value.shape):
                    raise ValueError(
                        f"DistributedOptimizer.load_state_dict: compression state {key!r} of "
                        f"parameter {name!r} has shape {tuple(value.shape)} in the checkpoint "
                        f"but {tuple(mine[key].shape)} here (a different rank= or model?)"
                    )
                if key in mine and (own or key in self.shared_keys):
                    mine[key].copy_(value)
                elif key in mine:
                    mine[key].zero_()
        self.step = int(saved.get("step", self.step))

    def broadcast_state(self, root_rank: int, process_set) -> None:
        """Give every rank ``root_rank``'s step counter and shared tensors (PowerSGD's ``Q``);
        the error-feedback residuals stay each rank's own."""
        kw = {"process_set": process_set}
        step = torch.tensor([self.step], dtype=torch.int64)
        handles = [mpi_ops.broadcast_async_(step, root_rank, name="hvdlite_compression.step", **kw)]
        for name in sorted(self.state):
            for key in self.shared_keys:
                handles.append(
                    mpi_ops.broadcast_async_(
                        self.state[name][key],
                        root_rank,
                        name=f"hvdlite_compression.{key}.{name}",
                        **kw,
                    )
                )
        for h in handles:
            mpi_ops.synchronize(h)
        self.step = int(step.item())
