"""What both DistributedOptimizer flavours share: the accumulation count, the grad hooks and
the rebinding of the user's optimizer to a wrapper class.

``optimizer.py`` (averaging) imports ``adasum_optimizer.py`` (Adasum), so their common
methods live here, below both, rather than in either.
"""

import weakref

import torch

from hvdlite.common import basics

#: Attribute set on each parameter: the token of the DistributedOptimizer whose
#: hooks act on it.  When a parameter is wrapped again, the older optimizer's
#: hooks become no-ops.
_OWNER_ATTR = "_hvdlite_grad_owner"


def _make_hook(opt_ref, token):
    """A ``post_accumulate_grad`` hook that hands ``p`` to the optimizer behind ``opt_ref``.

    It holds the optimizer weakly (parameters outlive their optimizers) and does nothing once
    another optimizer has claimed the parameter (its ``_OWNER_ATTR`` is no longer ``token``).
    """

    def hook(p):
        opt = opt_ref()
        if opt is None or getattr(p, _OWNER_ATTR, None) is not token:
            return
        opt._hvd_grad_ready(p)

    return hook


class HookedOptimizer(torch.optim.Optimizer):
    """Mixin for optimizers whose per-parameter hooks act every ``backward_passes_per_step``
    backward passes; expects ``_hvd_bpps``, ``_hvd_params``, ``_hvd_delay`` and
    ``_hvd_names`` to be set up by the subclass, which also defines ``_hvd_grad_ready(p)``
    and ``_hvd_reset()``."""

    def _hvd_attach_hooks(self) -> None:
        """Claim every parameter and hook its gradient; a runtime reset (shutdown/init, e.g.
        elastic recovery mid-step) calls ``_hvd_reset`` to drop in-flight reductions."""
        self._hvd_token = object()
        basics.register_reset_hook(self._hvd_reset)
        for p in self._hvd_params:
            setattr(p, _OWNER_ATTR, self._hvd_token)
        ref = weakref.ref(self)
        self._hvd_hook_handles = [
            p.register_post_accumulate_grad_hook(_make_hook(ref, self._hvd_token))
            for p in self._hvd_params
        ]

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
                "each accumulation window"
            )
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


def rebind(optimizer: torch.optim.Optimizer, mixin: type) -> HookedOptimizer:
    """A new object of class ``(mixin, type(optimizer))`` sharing ``optimizer``'s attributes
    (state, parameter groups, hooks), so it stays an instance of the user's class; both
    wrappers are made so, ``mixin`` being their :class:`HookedOptimizer` subclass."""
    base = optimizer.__class__
    cls = type(base.__name__, (mixin, base), {"__module__": base.__module__})
    obj = cls.__new__(cls)
    state = dict(optimizer.__dict__)
    state.pop("step", None)  # an instance-level step wrapper (LR scheduler) would bypass ours
    obj.__dict__.update(state)
    return obj
