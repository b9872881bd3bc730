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

Streaming DiLoCo (``fragments > 1``) splits the parameters into fragments of about equal
size, each with its own anchors and outer optimizer, synced every ``sync_every`` steps in
turn (fragment ``f`` at steps ``(f + 1) * sync_every // fragments`` past each multiple), so
the traffic of an outer step is spread over the cycle instead of arriving at once.  With
``overlap=True`` each outer allreduce runs in the background during the next inner step and
is applied after it; the rank keeps that step's own progress on top of the new anchors.

The inner optimizer's state (Adam's moments) stays each rank's own, as in the paper; the
anchors, the outer optimizer's state and the step counters are what an elastic reset must
keep, which :meth:`DiLoCo.state_dict` holds (``hvdlite.torch.elastic.TorchState`` keeps a
``DiLoCo`` given to it, and a joining rank gets rank 0's).
"""

import copy
from typing import Callable, List, Optional, Sequence

import torch

from hvdlite.common.compression import NoneCompressor
from hvdlite.common.process_sets import global_process_set
from hvdlite.torch.functions import broadcast_object
from hvdlite.torch.grad_compression import StatefulCompression
from hvdlite.torch.mpi_ops import Average, grouped_allreduce_async, synchronize
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
        fragments: Streaming DiLoCo's fragments (default 1: the whole model at once),
            at most ``sync_every`` and the number of trainable parameters.
        overlap: run each outer allreduce during the next inner step (default False).

    Raises:
        ValueError: ``sync_every`` below 1, ``fragments`` out of range, an inner optimizer
            that is distributed, or one with parameters outside ``model``.
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
        fragments: int = 1,
        overlap: bool = False,
    ):
        if not _is_count(sync_every):
            raise ValueError(f"DiLoCo: sync_every={sync_every!r}: must be an int >= 1")
        self.params = _trainable_params(model, inner_optimizer)
        if not _is_count(fragments) or fragments > min(sync_every, len(self.params)):
            raise ValueError(
                f"DiLoCo: fragments={fragments!r}: must be an int from 1 to "
                f"min(sync_every, trainable parameters) = {min(sync_every, len(self.params))}"
            )
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.overlap = bool(overlap)
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
        #: each fragment's parameter indices, its outer optimizer, and the step past each
        #: multiple of ``sync_every`` at which it is synced
        self.fragments = split_evenly([p.numel() for p in self.params], fragments)
        factory = outer_optimizer or nesterov_outer()
        self.outer_optimizers = [factory([self.anchors[i] for i in f]) for f in self.fragments]
        self.offsets = [(f + 1) * sync_every // fragments % sync_every for f in range(fragments)]
        #: the outer allreduce under way (overlap): fragment, handle, the parameters it began at
        self._pending: Optional[tuple] = None
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
        self._finish_pending()
        due = self.inner_steps % self.sync_every
        for f, offset in enumerate(self.offsets):
            if offset == due:
                self.outer_step(f)
        return loss

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        """The outer optimizer (of the one fragment; see ``outer_optimizers``)."""
        if len(self.outer_optimizers) != 1:
            raise AttributeError("DiLoCo with fragments has one outer optimizer per fragment")
        return self.outer_optimizers[0]

    @torch.no_grad()
    def outer_step(self, fragment: int = 0) -> None:
        """Average ``fragment``'s change since its last outer step over the ranks, apply it
        to its anchors with its outer optimizer, and start every rank from the new anchors
        (with ``overlap``, after the next inner step)."""
        self._finish_pending()
        idx = self.fragments[fragment]
        anchors = [self.anchors[i] for i in idx]
        outer_grads = [a - self.params[i].detach() for a, i in zip(anchors, idx)]
        unit = f"{self.name}.outer" + (f".{fragment}" if len(self.fragments) > 1 else "")
        if self.exchange is not None:
            self.exchange.start(unit, anchors, outer_grads)
            handle, contexts = None, None
        else:
            pairs = [self.compression.compress(g) for g in outer_grads]
            contexts = [ctx for _, ctx in pairs]
            handle = grouped_allreduce_async(
                [t for t, _ in pairs], op=Average, name=unit, process_set=self.process_set
            )
        began = [self.params[i].detach().clone() for i in idx] if self.overlap else None
        self._pending = (fragment, handle, contexts, outer_grads, began)
        if not self.overlap:
            self._finish_pending()

    @torch.no_grad()
    def _finish_pending(self) -> None:
        """Apply the outer allreduce under way, if any."""
        if self._pending is None:
            return
        fragment, handle, contexts, outer_grads, began = self._pending
        self._pending = None
        if handle is None:
            self.exchange.finish()  # the averaged outer gradient, in place
            averaged = outer_grads
        else:
            averaged = [
                self.compression.decompress(t, ctx) for t, ctx in zip(synchronize(handle), contexts)
            ]
        idx = self.fragments[fragment]
        anchors = [self.anchors[i] for i in idx]
        for anchor, grad in zip(anchors, averaged):
            anchor.grad = grad.to(anchor.dtype)
        self.outer_optimizers[fragment].step()
        for k, (anchor, i) in enumerate(zip(anchors, idx)):
            anchor.grad = None
            p = self.params[i]
            if began is None:
                p.copy_(anchor)
            else:  # keep the progress made while the allreduce ran
                p.sub_(began[k]).add_(anchor)
        if fragment == len(self.fragments) - 1:
            self.outer_steps += 1

    def state_dict(self) -> dict:
        """What a checkpoint or an elastic commit keeps: the counters, the anchors, and both
        optimizers' states (copies: later steps do not change them); an outer allreduce
        under way is applied first."""
        self._finish_pending()
        outer = [copy.deepcopy(o.state_dict()) for o in self.outer_optimizers]
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "anchors": [a.detach().clone() for a in self.anchors],
            "outer_optimizer": outer[0] if len(outer) == 1 else outer,
            "inner_optimizer": copy.deepcopy(self.inner_optimizer.state_dict()),
            "exchange": None if self.exchange is None else self.exchange.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take ``state`` (from :meth:`state_dict`); the model's parameters are the model's
        own to restore (``TorchState`` keeps the model beside this); an outer allreduce
        under way is dropped (after an elastic reset it cannot finish)."""
        self._pending = None
        with torch.no_grad():
            for anchor, saved in zip(self.anchors, state["anchors"]):
                anchor.copy_(saved)
        # copies: torch's load_state_dict may keep the given tensors as its state
        outer = state["outer_optimizer"]
        for opt, saved in zip(self.outer_optimizers, outer if isinstance(outer, list) else [outer]):
            opt.load_state_dict(copy.deepcopy(saved))
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


def _trainable_params(model, inner_optimizer) -> List[torch.Tensor]:
    """``model``'s trainable parameters, once ``inner_optimizer`` is known to be a plain
    optimizer of some of them."""
    if isinstance(inner_optimizer, HookedOptimizer):
        raise ValueError(
            "DiLoCo: inner_optimizer is distributed (a DistributedOptimizer averages "
            "every step); pass the plain torch optimizer: DiLoCo averages the parameters "
            "every sync_every steps itself"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    known = {id(p) for p in params}
    for group in inner_optimizer.param_groups:
        if any(id(p) not in known for p in group["params"]):
            raise ValueError(
                "DiLoCo: inner_optimizer has parameters that are not trainable parameters of model"
            )
    return params


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def split_evenly(sizes: Sequence[int], parts: int) -> List[List[int]]:
    """``parts`` runs of consecutive indices of ``sizes``, none empty, each holding about
    ``sum(sizes) / parts`` (a run ends once it reaches its share of what is left)."""
    runs: List[List[int]] = []
    start, left = 0, sum(sizes)
    for part in range(parts):
        still = parts - part
        if still == 1:
            runs.append(list(range(start, len(sizes))))
            break
        share, end, held = left / still, start, 0
        while end < len(sizes) - (still - 1) and (end == start or held + sizes[end] / 2 <= share):
            held += sizes[end]
            end += 1
        runs.append(list(range(start, end)))
        start, left = end, left - held
    return runs
