"""What both DistributedOptimizer flavours share: the accumulation count and the grad hooks.

``optimizer.py`` (averaging) imports ``adasum_optimizer.py`` (Adasum), so their common
methods live here, below both, rather than in either.
"""

import torch


class _HookedOptimizer(torch.optim.Optimizer):
    """Mixin for optimizers whose per-parameter hooks act every ``backward_passes_per_step``
    backward passes; expects ``_hvd_bpps``, ``_hvd_params``, ``_hvd_delay``, ``_hvd_names``
    and ``_hvd_hook_handles`` to be set up by the subclass."""

    def _hvd_count_pass(self, p: torch.Tensor, what: str) -> bool:
        """Count one backward pass of ``p``'s gradient; True when it completes the window.

        Raises:
            RuntimeError: more passes than ``backward_passes_per_step`` before the step.
        """
        left = self._hvd_delay[p] - 1
        if left < 0:
            raise RuntimeError(
                f"{what}: the gradient of {self._hvd_names[p]!r} was computed more than "
                f"backward_passes_per_step={self._hvd_bpps} times before optimizer.step() or "
                "optimizer.synchronize(); raise backward_passes_per_step or call step() after "
                "each accumulation window")
        self._hvd_delay[p] = left
        return left == 0

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
