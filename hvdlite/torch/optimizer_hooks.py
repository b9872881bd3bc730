"""What both DistributedOptimizer flavours share: the accumulation count and the grad hooks.

``optimizer.py`` (averaging) imports ``adasum_optimizer.py`` (Adasum), so their common
methods live here, below both, rather than in either.
"""

import torch


class _HookedOptimizer(torch.optim.Optimizer):
    """Mixin for optimizers whose per-parameter hooks act every ``backward_passes_per_step``
    backward passes; expects ``_hvd_bpps``, ``_hvd_params``, ``_hvd_delay`` and
    ``_hvd_hook_handles`` to be set up by the subclass."""

    def set_backward_passes_per_step(self, passes: int):
        """Change how many backward passes accumulate before the reduction."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step={passes} must be >= 1")
        self._hvd_bpps = int(passes)
        for p in self._hvd_params:
            self._hvd_delay[p] = self._hvd_bpps

    @property
    def backward_passes_per_step(self) -> int:
        return self._hvd_bpps

    def remove_hooks(self):
        """Detach this optimizer's gradient hooks (it no longer reduces anything)."""
        for h in self._hvd_hook_handles:
            h.remove()
        self._hvd_hook_handles = []
