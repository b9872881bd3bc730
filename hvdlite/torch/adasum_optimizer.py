"""``DistributedOptimizer(op=hvd.Adasum)``: Adasum-combine every rank's *update*.

Horovod's CPU Adasum optimizer (``_DistributedAdasumOptimizer``), with the same semantics:
each rank applies the wrapped optimizer's step to its own gradient first, and what travels is
the resulting change of every parameter (``delta = new - old``).  The deltas are combined with
``op=Adasum`` and the parameter becomes ``old + adasum(deltas)``.  Reducing deltas rather than
gradients makes Adasum work with any optimizer (momentum, Adam, ...): the rule compares the
steps the ranks would take, not raw gradients.  Adasum keeps the scale of one rank's step, so
the learning rate is *not* multiplied by ``size()``.

Each parameter's local step runs in its ``post_accumulate_grad`` hook, as soon as its gradient
is final (the wrapped optimizer steps over that one parameter), and its delta's reduction
starts at once while backward continues; ``step()`` starts the ones whose hook did not fire
and then applies the reduced deltas.

Unlike Horovod, the parameter keeps its old value (not the delta) while the reduction is in
flight, so the model stays usable between ``backward()`` and ``step()``; the delta lives in a
buffer of the parameter's size (Horovod keeps one such buffer, of the old value).  The old
value is restored by copy, never recomputed as ``new - delta``: every rank must add the same
reduced delta to the same bits, or the replicas drift apart.
"""

from typing import Dict, List

import torch

from hvdlite.torch import mpi_ops
from hvdlite.torch.optimizer_hooks import HookedOptimizer, rebind


class _DistributedAdasumOptimizer(HookedOptimizer):
    """Mixin placed in front of the user's optimizer class; never instantiated directly."""

    def _hvd_adasum_setup(
        self,
        names: Dict[torch.Tensor, str],
        compression,
        backward_passes_per_step: int,
        process_set,
    ):
        """Set up the wrapper's state and hooks; the arguments are checked by the caller."""
        self._hvd_names = names
        self._parameter_names = names  # Horovod's attribute, read by user code
        self._hvd_compression = compression
        self._hvd_bpps = int(backward_passes_per_step)
        self._hvd_process_set = process_set
        self._hvd_params: List[torch.Tensor] = [
            p for g in self.param_groups for p in g["params"] if p.requires_grad
        ]
        self._hvd_delay = {p: self._hvd_bpps for p in self._hvd_params}
        # per parameter: its delta (and the reduction's result, for Compression.none)
        self._hvd_deltas = {
            p: torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self._hvd_params
        }
        self._hvd_handles: Dict[torch.Tensor, tuple] = {}  # p -> (handle, ctx, compressed)
        self._hvd_attach_hooks()

    # -- one parameter: local step, then the reduction of its delta ----------------------

    def _hvd_grad_ready(self, p: torch.Tensor):
        if self._hvd_count_pass(p, "DistributedOptimizer(op=Adasum)"):
            self._hvd_launch(p)

    def _hvd_launch(self, p: torch.Tensor):
        """Step the wrapped optimizer on ``p`` alone, put ``p`` back and reduce the change."""
        delta = self._hvd_deltas[p]
        with torch.no_grad():
            delta.copy_(p)  # the old value, until the delta replaces it
        stashed = [g["params"] for g in self.param_groups]
        try:
            for g in self.param_groups:
                g["params"] = [p] if any(p is q for q in g["params"]) else []
            super(_DistributedAdasumOptimizer, self).step()
        finally:
            for g, params in zip(self.param_groups, stashed):
                g["params"] = params
        with torch.no_grad():
            change = torch.sub(p, delta)  # new - old, as Horovod computes it
            p.copy_(delta)  # the exact old value: every rank adds the same
            delta.copy_(change)  # reduced delta to the same bits in step()
        compressed, ctx = self._hvd_compression.compress(delta)
        kw = {} if self._hvd_process_set is None else {"process_set": self._hvd_process_set}
        h = mpi_ops.allreduce_async_(
            compressed, name="allreduce." + self._hvd_names[p], op=mpi_ops.Adasum, **kw
        )
        self._hvd_handles[p] = (h, ctx, compressed)

    # -- public API --------------------------------------------------------------------

    def step(self, closure=None):
        """Start the reductions not started by backward (a parameter without gradient has a
        zero delta, which Adasum leaves out), wait for all and apply the combined deltas."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            for p in self._hvd_params:
                if p not in self._hvd_handles:
                    self._hvd_launch(p)
            for p, (h, ctx, compressed) in list(self._hvd_handles.items()):
                mpi_ops.synchronize(h)
                reduced = self._hvd_compression.decompress(compressed, ctx)
                with torch.no_grad():
                    p.add_(reduced)
        finally:
            self._hvd_reset()
        return loss

    def synchronize(self):
        """Nothing to do: with Adasum the local step runs as each gradient is ready, and
        ``step()`` applies the reduced updates (as Horovod's Adasum optimizer)."""

    def skip_synchronize(self):
        """Not supported with Adasum (as in Horovod).

        Raises:
            NotImplementedError: always; gradients cannot be edited between ``synchronize()``
                and ``step()`` because the local step has already used them.
        """
        raise NotImplementedError(
            "DistributedOptimizer(op=Adasum): skip_synchronize() is not supported; each "
            "parameter's local step runs as soon as its gradient is ready, so gradients "
            "cannot be modified (e.g. clipped) before step()"
        )

    def zero_grad(self, set_to_none: bool = True):
        if self._hvd_handles:
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step(); the Adasum reductions started by backward are still in "
                "flight. Call step() before zero_grad()."
            )
        for p in self._hvd_params:
            self._hvd_delay[p] = self._hvd_bpps
        return super().zero_grad(set_to_none)

    def _hvd_reset(self):
        """Forget this step's reductions (after step, or when the runtime resets)."""
        self._hvd_handles.clear()
        for p in self._hvd_params:
            self._hvd_delay[p] = self._hvd_bpps


def wrap(
    optimizer: torch.optim.Optimizer,
    names: Dict[torch.Tensor, str],
    compression,
    backward_passes_per_step: int,
    process_set,
) -> _DistributedAdasumOptimizer:
    """``optimizer`` as an Adasum DistributedOptimizer (still an instance of the user's
    class), ``names`` naming every parameter; ``DistributedOptimizer(op=Adasum)`` checks
    the arguments, this module sets up what it alone knows."""
    obj = rebind(optimizer, _DistributedAdasumOptimizer)
    obj._hvd_adasum_setup(names, compression, backward_passes_per_step, process_set)
    return obj
