"""The Lightning 2.x strategy that trains through hvdlite (see the package docstring).

Unlike Lightning 1.x's Horovod strategy, the learning rate is not multiplied by the
number of ranks: gradients are averaged, so a job of N ranks on N shards of each batch
takes the steps one process takes on the whole batch -- the same contract as
Lightning's ``ddp``, which makes the two strategies interchangeable.  Pass
``scale_lr=True`` for the old behaviour.
"""

import contextlib
from typing import Any, Dict, List, Optional

import torch
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor

import hvdlite.torch as hvd

#: the name ``Trainer(strategy=...)`` knows the strategy by
NAME = "hvdlite"


def _hvd_value(getter, before_init: int) -> property:
    """A read-only property: hvdlite's value once ``init()`` ran, ``before_init`` until then
    (Lightning asks for ranks before the strategy sets up its environment)."""
    return property(lambda self: getter() if hvd.is_initialized() else before_init)


class HvdliteStrategy(ParallelStrategy):
    """Data-parallel training with hvdlite's DistributedOptimizer, one process per rank
    (started by ``hvdlite-run``, not by Lightning).

    Args:
        scale_lr: multiply every learning rate (and LR schedulers' base rates) by the
            number of ranks, as Lightning 1.x's Horovod strategy did.  Default: no.
        kwargs: passed to Lightning's ``ParallelStrategy``.
    """

    strategy_name = NAME

    def __init__(self, scale_lr: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self._scale_lr = scale_lr
        self._exit_stack: Optional[contextlib.ExitStack] = None

    # -- the ranks: hvdlite's, whatever cluster environment Lightning detected -------------
    global_rank = _hvd_value(hvd.rank, 0)
    local_rank = _hvd_value(hvd.local_rank, 0)
    node_rank = _hvd_value(hvd.cross_rank, 0)
    world_size = _hvd_value(hvd.size, 1)

    @property
    def root_device(self) -> torch.device:
        if self.parallel_devices:
            return self.parallel_devices[self.local_rank % len(self.parallel_devices)]
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        """Lightning then gives each dataloader a DistributedSampler (each rank its share)."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        hvd.init()
        rank_zero_only.rank = hvd.rank()
        super().setup_environment()

    def model_to_device(self) -> None:
        if self.model is not None:
            self.model.to(self.root_device)

    # -- training -------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        """Wrap the optimizers, then broadcast rank 0's parameters and optimizer state."""
        self.model_to_device()
        super().setup(trainer)
        self._exit_stack = contextlib.ExitStack()
        if not trainer.training:
            return
        optimizers = [_unwrap(opt) for opt in self.optimizers]
        if self._scale_lr:
            _scale_learning_rates(optimizers, self.lr_scheduler_configs, self.world_size)
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        for optimizer in optimizers:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        passes = trainer.accumulate_grad_batches
        named = list(self.lightning_module.named_parameters())
        self.optimizers = [
            hvd.DistributedOptimizer(opt, named_parameters=named, backward_passes_per_step=passes)
            for opt in optimizers
        ]
        for optimizer in self.optimizers:
            # the reductions are waited for right after backward (post_backward), so a
            # closure-driven optimizer.step() must not wait again
            self._exit_stack.enter_context(optimizer.skip_synchronize())

    def post_backward(self, closure_loss: Tensor) -> None:
        """Wait for this backward's gradient reductions (Lightning steps right after)."""
        for optimizer in self.optimizers:
            optimizer.synchronize()

    def teardown(self) -> None:
        if self._exit_stack is not None:
            self._exit_stack.close()
            self._exit_stack = None
        super().teardown()

    # -- collectives Lightning asks for ----------------------------------------------------
    def reduce(
        self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"
    ) -> Any:
        """Average (``"mean"``, the default) or sum a tensor over the ranks; anything else
        passes through, as in Lightning's other strategies."""
        if not isinstance(tensor, Tensor) or self.world_size == 1:
            return tensor
        return hvd.allreduce(tensor.detach(), op=_reduce_op(reduce_op))

    def barrier(self, name: Optional[str] = None) -> None:
        if hvd.is_initialized() and self.world_size > 1:
            hvd.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not hvd.is_initialized() or self.world_size == 1:
            return obj
        return hvd.broadcast_object(obj, root_rank=src)

    def all_gather(
        self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False
    ) -> Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension (rank order)."""
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        return hvd.allgather(tensor.detach().unsqueeze(0))

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            NAME,
            cls,
            description="data parallel through hvdlite "
            "(DistributedOptimizer, started by hvdlite-run)",
        )


def register() -> None:
    """Make ``Trainer(strategy="hvdlite")`` known to Lightning (idempotent)."""
    if NAME not in StrategyRegistry:
        HvdliteStrategy.register_strategies(StrategyRegistry)


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's wrapper."""
    return getattr(optimizer, "_optimizer", optimizer)


def _reduce_op(reduce_op: Any) -> Any:
    """hvdlite's op for Lightning's (a string or torch's ``ReduceOp``).

    Raises:
        ValueError: an op other than mean/average and sum.
    """
    name = str(getattr(reduce_op, "name", reduce_op)).lower() if reduce_op is not None else "mean"
    if name.endswith(("mean", "avg", "average")):
        return hvd.Average
    if name.endswith("sum"):
        return hvd.Sum
    raise ValueError(
        f"HvdliteStrategy.reduce: reduce_op={reduce_op!r}: only 'mean' and 'sum' are supported"
    )


def _scale_learning_rates(optimizers: List[Any], scheduler_configs: List[Any], factor: int) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] *= factor
    for config in scheduler_configs:
        scheduler = config.scheduler
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
