"""DiLoCo: local inner steps, and every ``sync_every`` of them one outer step on the
parameters' averaged change.

Each rank trains its copy of the model with its own (inner) optimizer on its own data.
Every ``sync_every`` inner steps the ranks average how far their parameters moved since
the last outer step (``anchor - parameters``, the *outer gradient*), and an outer
optimizer -- Nesterov SGD by default, as in the DiLoCo paper -- applies that to the anchor;
every rank then starts again from the new anchor.  One allreduce of the parameters every
``sync_every`` steps replaces one of the gradients every step: about ``sync_every`` times
less traffic.  With ``sync_every=1``, a plain SGD inner optimizer and an outer SGD of
learning rate 1 it is synchronous data-parallel SGD.

The inner optimizer's state (Adam's moments) stays each rank's own, as in the paper; the
anchors, the outer optimizer's state and the step counters are what an elastic reset must
keep, which :meth:`DiLoCo.state_dict` holds (``hvdlite.torch.elastic.TorchState`` keeps a
``DiLoCo`` given to it, and a joining rank gets rank 0's).
"""

import copy
from typing import Callable, List, Optional

import torch

from hvdlite.common.compression import NoneCompressor
from hvdlite.common.process_sets import global_process_set
from hvdlite.torch.functions import broadcast_object
from hvdlite.torch.grad_compression import StatefulCompression
from hvdlite.torch.mpi_ops import Average, grouped_allreduce
from hvdlite.torch.optimizer_hooks import HookedOptimizer

OuterFactory = Callable[[List[torch.Tensor]], torch.optim.Optimizer]


def nesterov_outer(lr: float = 0.7, momentum: float = 0.9) -> OuterFactory:
    """The DiLoCo paper's outer optimizer: SGD with Nesterov momentum (lr 0.7, 0.9)."""
    return lambda anchors: torch.optim.SGD(anchors, lr=lr, momentum=momentum, nesterov=True)


class DiLoCo:
    """Wrap ``model`` and its local ``inner_optimizer``: :meth:`step` takes an inner step,
    and every ``sync_every``-th also the outer step (one allreduce of the parameters'
    change).  Use it where the training loop used the optimizer::

        opt = hvd.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=4e-4), sync_every=50)
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

    Args:
        model: the module whose trainable parameters are trained (the inner optimizer's
            parameters must be among them).  Broadcast it before the first step, as with
            ``DistributedOptimizer`` (``hvd.broadcast_parameters``, or an elastic
            ``TorchState``'s sync): the anchors are taken at the first step.
        inner_optimizer: a plain ``torch.optim`` optimizer of this rank alone (not a
            ``DistributedOptimizer``: that would average every step).
        sync_every: inner steps per outer step (DiLoCo's H), at least 1.
        outer_optimizer: builds the outer optimizer from the anchor tensors (default:
            :func:`nesterov_outer`, lr 0.7, momentum 0.9).
        compression: how the outer gradient travels: ``hvd.Compression.fp16``, or
            ``hvd.Compression.int8()`` (8-bit with error feedback; its residuals are kept
            in :meth:`state_dict`).
        process_set: the ranks that train together (default: all).
        root_rank: whose outer state :meth:`sync` gives every rank.
        name: names the outer step's allreduce in diagnostics (stall reports, timeline).

    Raises:
        ValueError: ``sync_every`` below 1, an inner optimizer that is distributed, or one
            with parameters outside ``model``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int = 50,
        outer_optimizer: Optional[OuterFactory] = None,
        compression=NoneCompressor,
        process_set=global_process_set,
        root_rank: int = 0,
        name: str = "diloco",
    ):
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"DiLoCo: sync_every={sync_every!r}: must be an int >= 1")
        if isinstance(inner_optimizer, HookedOptimizer):
            raise ValueError(
                "DiLoCo: inner_optimizer is distributed (a DistributedOptimizer averages "
                "every step); pass the plain torch optimizer: DiLoCo averages the parameters "
                "every sync_every steps itself"
            )
        self.params = [p for p in model.parameters() if p.requires_grad]
        known = {id(p) for p in self.params}
        for group in inner_optimizer.param_groups:
            if any(id(p) not in known for p in group["params"]):
                raise ValueError(
                    "DiLoCo: inner_optimizer has parameters that are not trainable parameters "
                    "of model"
                )
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.compression = compression
        self.process_set = process_set
        self.name = name
        #: inner steps taken, and outer steps applied, since the start
        self.inner_steps = 0
        self.outer_steps = 0
        self.root_rank = root_rank
        #: the parameters as the last outer step left them (every rank holds the same);
        #: taken again at the first step, after the user's broadcast of the model
        self.anchors = [p.detach().clone() for p in self.params]
        self._anchored = False
        self.outer_optimizer = (outer_optimizer or nesterov_outer())(self.anchors)
        #: the stateful exchange of the outer gradient (``hvd.Compression.int8()``), or None
        self.exchange = None
        if isinstance(compression, StatefulCompression):
            names = {a: f"{name}.outer.{i}" for i, a in enumerate(self.anchors)}
            self.exchange = compression.make_exchange(
                self.anchors, names, {"op": Average, "process_set": process_set}
            )

    @property
    def param_groups(self):
        """The inner optimizer's groups (learning-rate schedulers act on the inner steps)."""
        return self.inner_optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One inner step; every ``sync_every``-th also the outer step.  Returns the inner
        optimizer's result (the closure's loss)."""
        if not self._anchored:  # the model as every rank starts it
            with torch.no_grad():
                for anchor, p in zip(self.anchors, self.params):
                    anchor.copy_(p)
            self._anchored = True
        loss = self.inner_optimizer.step(closure)
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.outer_step()
        return loss

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average the change since the last outer step over the ranks, apply it to the
        anchors with the outer optimizer, and start every rank from the new anchors."""
        outer_grads = [a - p.detach() for a, p in zip(self.anchors, self.params)]
        if self.exchange is not None:
            self.exchange.start(f"{self.name}.outer", self.anchors, outer_grads)
            self.exchange.finish()  # the averaged outer gradient, in place
            averaged = outer_grads
        else:
            averaged = grouped_allreduce(
                outer_grads,
                op=Average,
                name=f"{self.name}.outer",
                compression=self.compression,
                process_set=self.process_set,
            )
        for anchor, grad in zip(self.anchors, averaged):
            anchor.grad = grad.to(anchor.dtype)
        self.outer_optimizer.step()
        for anchor, p in zip(self.anchors, self.params):
            anchor.grad = None
            p.copy_(anchor)
        self.outer_steps += 1

    def state_dict(self) -> dict:
        """What a checkpoint or an elastic commit keeps: the counters, the anchors, and both
        optimizers' states (copies: later steps do not change them)."""
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "anchors": [a.detach().clone() for a in self.anchors],
            "outer_optimizer": copy.deepcopy(self.outer_optimizer.state_dict()),
            "inner_optimizer": copy.deepcopy(self.inner_optimizer.state_dict()),
            "exchange": None if self.exchange is None else self.exchange.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take ``state`` (from :meth:`state_dict`); the model's parameters are the model's
        own to restore (``TorchState`` keeps the model beside this)."""
        with torch.no_grad():
            for anchor, saved in zip(self.anchors, state["anchors"]):
                anchor.copy_(saved)
        # copies: torch's load_state_dict may keep the given tensors as its state
        self.outer_optimizer.load_state_dict(copy.deepcopy(state["outer_optimizer"]))
        self.inner_optimizer.load_state_dict(copy.deepcopy(state["inner_optimizer"]))
        if self.exchange is not None and state.get("exchange") is not None:
            self.exchange.load_state_dict(state["exchange"])
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])
        self._anchored = True

    def sync(self, root_rank: Optional[int] = None) -> None:
        """Give every rank ``root_rank``'s outer state (after an elastic reset, for a rank
        that joined); the inner optimizer's state and the exchange's residuals stay each
        rank's own."""
        root = self.root_rank if root_rank is None else root_rank
        state = self.state_dict()
        own = {k: state.pop(k) for k in ("inner_optimizer", "exchange")}
        state = broadcast_object(
            state, root, name=f"{self.name}.sync", process_set=self.process_set
        )
        self.load_state_dict({**state, **own})
