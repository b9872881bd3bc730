"""Batch normalization whose statistics cover the batch of every rank.

In training mode each rank computes its local per-channel count, mean and
(biased) variance; one allgather combines them exactly (parallel-variance
formula, so ranks may hold different numbers of samples), and the
normalization uses the global statistics.  Backward reduces the two
per-channel sums the input gradient needs with one allreduce.  Weight and bias
gradients stay local (DistributedOptimizer averages them like any gradient).

In eval mode, or when ``size() == 1``, it behaves exactly like
``torch.nn.BatchNorm*d``.
"""

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hvdlite.common import ops
from hvdlite.common.process_sets import global_process_set
from hvdlite.torch import mpi_ops

__all__ = ["SyncBatchNorm"]


def _ps_kw(process_set) -> dict:
    return {} if process_set is None else {"process_set": process_set}


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        count = xf.numel() // c
        if count:
            var_l, mean_l = torch.var_mean(xf, dim=dims, correction=0)
        else:
            mean_l = xf.new_zeros(c)
            var_l = xf.new_zeros(c)
        local = torch.cat([xf.new_tensor([float(count)]), mean_l, var_l]).unsqueeze(0)
        stats = mpi_ops.allgather(local, **_ps_kw(process_set))
        counts = stats[:, 0:1]
        means = stats[:, 1 : 1 + c]
        variances = stats[:, 1 + c :]
        total = counts.sum()
        if total.item() <= 0:
            raise ValueError("SyncBatchNorm: every rank's batch is empty")
        mean = (counts * means).sum(0) / total
        var = (counts * (variances + (means - mean) ** 2)).sum(0) / total
        invstd = torch.rsqrt(var + eps)

        if running_mean is not None:
            with torch.no_grad():
                n = total.item()
                unbiased = var * (n / (n - 1)) if n > 1 else var
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        shape = [1, c] + [1] * (x.dim() - 2)
        xhat = (xf - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape).to(y.dtype)
        if bias is not None:
            y = y + bias.view(shape).to(y.dtype)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total = total.item()
        ctx.process_set = process_set
        ctx.has_bias = bias is not None
        ctx.in_dtype = x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        xhat, weight, invstd = ctx.saved_tensors
        c = xhat.shape[1]
        dims = [0] + list(range(2, xhat.dim()))
        shape = [1, c] + [1] * (xhat.dim() - 2)
        g = grad_out.to(xhat.dtype)
        sum_dy = g.sum(dims)
        sum_dy_xhat = (g * xhat).sum(dims)
        sums = mpi_ops.allreduce(
            torch.cat([sum_dy, sum_dy_xhat]), op=mpi_ops.Sum, **_ps_kw(ctx.process_set)
        )
        mean_dy = sums[:c] / ctx.total
        mean_dy_xhat = sums[c:] / ctx.total
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        grad_in = (g - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
        grad_w = (
            sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        )
        grad_b = (
            sum_dy.to(weight.dtype if weight is not None else sum_dy.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]
            else None
        )
        return grad_in.to(ctx.in_dtype), grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the union of all ranks' batches (any input of dim >= 2).

    Same constructor as ``torch.nn.BatchNorm2d`` plus ``process_set``.  Every
    rank must call forward (and backward) the same number of times, since each
    call is a collective.

    Args:
        num_features: the number of channels ``C`` of the ``(N, C, ...)`` input.
        eps: added to the variance for numerical stability.
        momentum: the running statistics' update factor; ``None`` keeps a cumulative
            average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running mean and variance for eval mode.
        device: the device of the parameters and buffers.
        dtype: the dtype of the parameters and buffers.
        process_set: the ranks whose batches are normalized together (default: all).
    """

    def __init__(
        self,
        num_features,
        eps=1e-5,
        momentum=0.1,
        affine=True,
        track_running_stats=True,
        device=None,
        dtype=None,
        process_set=global_process_set,
    ):
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm: expected an input of at least 2 dimensions (N, C, ...), got "
                f"{input.dim()}D"
            )

    def forward(self, input):
        """Normalize ``input`` with statistics gathered from every rank of the process set.

        In eval mode, or in a process set of one rank, this is ``BatchNorm``'s forward.

        Args:
            input: a tensor of shape ``(N, C, ...)``; ranks may have different ``N``.

        Returns:
            The normalized tensor, of ``input``'s shape and dtype.

        Raises:
            ValueError: ``input`` has fewer than 2 dimensions, a channel count other than
                ``num_features``, or every rank's batch is empty.
        """
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm: input has {input.shape[1]} channels but num_features="
                f"{self.num_features}"
            )
        if not self.training or ops.process_set_size(self.process_set) == 1:
            return super().forward(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        return _SyncBatchNormFn.apply(
            input,
            self.weight,
            self.bias,
            running_mean,
            running_var,
            self.eps,
            momentum,
            self.process_set,
        )

    @classmethod
    def convert_sync_batchnorm(cls, module, process_set=global_process_set):
        """Return ``module`` with every ``BatchNorm*d`` replaced by a SyncBatchNorm (same state).

        Args:
            module: a module (or a batch-norm layer itself); its children are converted
                recursively.
            process_set: the process set of the new layers.

        Returns:
            ``module`` with converted children, or a new SyncBatchNorm when ``module`` is
            itself a batch-norm layer.  Parameters and buffers are shared, not copied.
        """
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_set=process_set,
            )
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out
