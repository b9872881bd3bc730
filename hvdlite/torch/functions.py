"""Helpers that make every rank start from the same model and optimizer.

* :func:`broadcast_parameters` — a ``state_dict()`` or ``named_parameters()``
  from ``root_rank`` to every rank, in place.
* :func:`broadcast_optimizer_state` — parameter-group hyper-parameters (lr,
  momentum, betas, ...) and per-parameter state (momentum buffers, Adam
  moments and step counts).  An optimizer with no state yet first creates it as
  Horovod does, with one step of its own on zero gradients (the parameters keep
  their values); state that the root has but a rank lacks is created on that
  rank with the root's structure.
* :func:`broadcast_object` / :func:`allgather_object` — from
  :mod:`hvdlite.common.objects` (cloudpickled, signed with the job's key).

The optimizer state's structure travels as JSON, never as a pickle.
"""

import json
import logging
from typing import List

import torch

from hvdlite.common import api_docs
from hvdlite.common.objects import (
    allgather_object,
    broadcast_bytes,  # noqa: F401
    broadcast_object,
    check_root,
)
from hvdlite.common.process_sets import global_process_set
from hvdlite.torch import mpi_ops
from hvdlite.torch.optimizer import broadcast_compression_state

log = logging.getLogger(__name__)

__all__ = [
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
    "allgather_object",
]


def _ps_kw(process_set) -> dict:
    return {} if process_set is None else {"process_set": process_set}


# --- parameters --------------------------------------------------------------------------

_PARAMS = (
    "``model.state_dict()`` (a mapping name -> tensor, buffers included) or "
    "``model.named_parameters()`` (an iterable of ``(name, tensor)``).  Names must be "
    "the same on every rank; they name the broadcasts in errors."
)
_OPTIMIZER = (
    "a ``torch.optim.Optimizer`` (a DistributedOptimizer too), or an object whose "
    "``optimizer`` attribute is one (e.g. an LR scheduler)."
)


@api_docs.documented(api_docs.ARGS, params=_PARAMS)
def broadcast_parameters(params, root_rank: int, process_set=global_process_set) -> None:
    """Overwrite ``params`` on every rank with ``root_rank``'s values, in place.

    Raises:
        TypeError: ``params`` is neither of the accepted forms, holds a value that is not a
            tensor, or ``root_rank`` is not an int.
        ValueError: ``root_rank`` is not a rank of ``process_set``, or duplicate names.
    """
    check_root(root_rank, "broadcast_parameters", process_set)
    if isinstance(params, dict) or hasattr(params, "items") and callable(params.items):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    else:
        try:
            items = list(params)
        except TypeError:
            raise TypeError(
                "broadcast_parameters: params must be model.state_dict() or "
                f"model.named_parameters(), got {type(params).__name__}"
            ) from None
        for i, item in enumerate(items):
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(
                    "broadcast_parameters: params must be model.state_dict() or "
                    f"model.named_parameters() ((name, tensor) pairs); item {i} is "
                    f"{type(item).__name__}"
                )
    seen = set()
    handles = []
    with torch.no_grad():
        for name, p in items:
            if name in seen:
                raise ValueError(f"broadcast_parameters: duplicate name {name!r}")
            seen.add(name)
            if p is None:
                continue
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a tensor; use "
                    "broadcast_object for other values"
                )
            t = p.detach()
            handles.append(
                mpi_ops.broadcast_async_(
                    t, root_rank, name=f"broadcast_parameters.{name}", **_ps_kw(process_set)
                )
            )
        for h in handles:
            mpi_ops.synchronize(h)


# --- optimizer state ---------------------------------------------------------------------


class _Encoder:
    """JSON-able description of nested optimizer values; tensors are listed aside.

    Values that JSON cannot describe (callables, custom objects) are marked
    ``skip`` and keep each rank's own value.
    """

    def __init__(self):
        self.tensors: List[torch.Tensor] = []

    def enc(self, v):
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return {"f": repr(v)}
        if isinstance(v, torch.Tensor):
            self.tensors.append(v)
            return {"T": [str(v.dtype).replace("torch.", ""), list(v.shape), v.device.type]}
        if isinstance(v, tuple):
            return {"t": [self.enc(x) for x in v]}
        if isinstance(v, list):
            return {"l": [self.enc(x) for x in v]}
        if isinstance(v, dict) and all(isinstance(k, (str, int)) for k in v):
            return {"d": [[k, self.enc(x)] for k, x in v.items()]}
        return {"skip": type(v).__name__}


_SKIP = object()


def _decode(v, new_tensor):
    if not isinstance(v, dict):
        return v
    if "f" in v:
        return float(v["f"])
    if "T" in v:
        return new_tensor(*v["T"])
    if "t" in v:
        return tuple(_decode(x, new_tensor) for x in v["t"])
    if "l" in v:
        return [_decode(x, new_tensor) for x in v["l"]]
    if "d" in v:
        return {k: _decode(x, new_tensor) for k, x in v["d"]}
    return _SKIP


@api_docs.documented(api_docs.ARGS, optimizer=_OPTIMIZER)
def broadcast_optimizer_state(optimizer, root_rank: int, process_set=global_process_set) -> None:
    """Give every rank ``root_rank``'s optimizer hyper-parameters and state, in place.

    Parameter groups are matched by position and parameters by their position
    across ``optimizer.param_groups``, so every rank must build its optimizer
    over the same model in the same order.  Tensor state is broadcast in
    place where the rank already has a tensor of the same shape and dtype;
    otherwise it is created.  An optimizer whose state is still empty (a new one)
    first creates it as Horovod does: every parameter that requires a gradient gets a
    zero ``p.grad`` and the wrapped optimizer takes one step of its own (never a
    ``DistributedOptimizer``'s, which would reduce).  Unlike Horovod, that step leaves no
    trace: the parameters get their values back (weight decay does not move them) and the
    state what the class has before its first real step (step counters 0, NAdam's momentum
    product 1, ...), so training after the broadcast equals training without it.  Parameters that require
    no gradient keep ``grad`` None and get no state; state entries that are None travel
    as None.  In a one-rank job nothing is broadcast.  A ``DistributedOptimizer`` with
    PowerSGD or top-k also takes the root's compression step count and PowerSGD's ``Q``
    (error residuals stay each rank's).

    Raises:
        TypeError: ``root_rank`` is not an int.
        ValueError: ``root_rank`` is not a rank of ``process_set``, or the ranks'
            optimizers have different numbers of groups or parameters.
    """
    check_root(root_rank, "broadcast_optimizer_state", process_set)
    if hasattr(optimizer, "optimizer") and not hasattr(optimizer, "param_groups"):
        optimizer = optimizer.optimizer
    _create_empty_state(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    is_root = mpi_ops.rank() == root_rank
    if mpi_ops.size() == 1:
        return

    enc = _Encoder()
    desc = _describe_state(optimizer, params, enc) if is_root else None
    desc = json.loads(
        broadcast_bytes(desc, root_rank, "broadcast_optimizer_state.desc", process_set)[0]
    )
    if desc["n_params"] != len(params) or desc["n_groups"] != len(optimizer.param_groups):
        raise ValueError(
            f"broadcast_optimizer_state: rank {mpi_ops.rank()} has {len(optimizer.param_groups)} "
            f"param groups / {len(params)} parameters but root rank {root_rank} has "
            f"{desc['n_groups']} / {desc['n_params']}; build the optimizer the same way on every "
            "rank"
        )
    targets = enc.tensors if is_root else _adopt_description(optimizer, params, desc)
    _broadcast_in_place(targets, root_rank, "broadcast_optimizer_state", process_set)
    # a DistributedOptimizer with PowerSGD/top-k: its step count and shared state (Q) too
    broadcast_compression_state(optimizer, root_rank, process_set)


def _create_empty_state(optimizer) -> None:
    """Give an optimizer that has no state yet its state, as Horovod's
    ``broadcast_optimizer_state`` does (scripts read ``p.grad`` afterwards): zero gradients
    for the parameters that require one, then one step of the optimizer's own class with
    its weight decay off.  The parameters are put back afterwards and the state rewound to
    what the class has before its first step.  LBFGS (its step needs a closure) is left as
    it is."""
    if any(optimizer.state.values()) or isinstance(optimizer, torch.optim.LBFGS):
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        return
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    with torch.no_grad():
        kept = [p.detach().clone() for p in params]
        for p in params:
            if p.grad is not None and not p.grad.is_sparse and not sparse:
                p.grad.zero_()  # a DistributedOptimizer's bucket view stays one
            else:
                zero = torch.zeros_like(p)
                p.grad = zero.to_sparse() if sparse else zero
    # without weight decay: coupled decay would put weight x decay into the moments
    decays = [g.get("weight_decay") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "weight_decay" in g:
            g["weight_decay"] = 0.0
    try:
        _own_step(optimizer)
    finally:
        for g, decay in zip(optimizer.param_groups, decays):
            if decay is not None:
                g["weight_decay"] = decay
    with torch.no_grad():
        for p, value in zip(params, kept):
            p.copy_(value)
        _rewind_first_step(optimizer)


def _first_values(optimizer, group) -> dict:
    """The state entries that a step on zero gradients moves away from the value the class
    gives them at its first step, with that value (None: the entry is made at the first
    step from the gradient itself): counters, running products and the like."""
    first = {"step": 0}
    if isinstance(optimizer, torch.optim.NAdam):
        first["mu_product"] = 1.0
    elif isinstance(optimizer, torch.optim.ASGD):
        first.update(eta=group["lr"], mu=1.0, ax=0.0)
    elif isinstance(optimizer, torch.optim.Adamax):
        first["exp_inf"] = 0.0  # the zero step left eps in it
    elif isinstance(optimizer, torch.optim.Rprop):
        first["step_size"] = group["lr"]
    elif isinstance(optimizer, torch.optim.SGD) and group.get("dampening", 0):
        first["momentum_buffer"] = None  # the first step copies the gradient undamped
    return first


def _rewind_first_step(optimizer) -> None:
    """Undo what the zero-gradient step counted, so the next step is the class's first
    (Adam's bias correction, NAdam's momentum product, ...): a run with the broadcast is
    then the run without it.  Moments a zero gradient leaves at zero stay as they are."""
    for group in optimizer.param_groups:
        first = _first_values(optimizer, group)
        for p in group["params"]:
            state = optimizer.state.get(p)
            for key, value in first.items():
                if not state or key not in state:
                    continue
                old = state[key]
                if value is None:
                    state[key] = None
                elif isinstance(old, torch.Tensor):
                    old.fill_(value)
                else:
                    state[key] = type(old)(value) if isinstance(old, (int, float)) else value


def _own_step(optimizer) -> None:
    """The optimizer's update without a ``DistributedOptimizer``'s reductions: the ``step``
    of the first class after hvdlite's in its MRO (the user's optimizer class).  Classes
    before them do not count: torch's ``load_state_dict`` puts a profiling wrapper of the
    inherited (reducing) ``step`` into the wrapper's own class."""
    mro = type(optimizer).__mro__
    ours = [i for i, cls in enumerate(mro) if cls.__module__.startswith("hvdlite.")]
    for cls in mro[(ours[-1] + 1 if ours else 0) :]:
        if "step" in vars(cls):
            cls.step(optimizer)
            return


def _describe_state(optimizer, params, enc: "_Encoder") -> bytes:
    """The root's groups and per-parameter state as JSON; its tensors are listed in ``enc``
    in the order every rank decodes them."""
    pidx = {id(p): i for i, p in enumerate(params)}
    groups = [
        enc.enc({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups
    ]
    owned = sorted(
        [(pidx[id(p)], st) for p, st in optimizer.state.items() if id(p) in pidx and st],
        key=lambda e: e[0],
    )
    # encode in index order: the tensors list must follow the order every rank decodes in
    state = [[i, enc.enc(dict(st))] for i, st in owned]
    return json.dumps(
        {
            "n_params": len(params),
            "n_groups": len(optimizer.param_groups),
            "groups": groups,
            "state": state,
        }
    ).encode()


def _adopt_description(optimizer, params, desc) -> List[torch.Tensor]:
    """Make a non-root rank's groups and state take the root's shape (values decoded from
    ``desc``); returns the tensors the root's tensor values are broadcast into, in order."""
    targets: List[torch.Tensor] = []

    def fresh(dtype, shape, device_type, like=None):
        device = (
            like.device
            if like is not None and like.device.type == device_type
            else torch.device(device_type)
        )
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        targets.append(t)
        return t

    # hyper-parameters: decoded values replace the local ones
    for g, gd in zip(optimizer.param_groups, desc["groups"]):
        new = _decode(gd, fresh)
        for k, v in new.items():
            if v is not _SKIP:
                g[k] = v
    root_has = {i for i, _ in desc["state"]}
    for i, sd in desc["state"]:
        p = params[i]
        optimizer.state[p] = _adopt_param_state(optimizer.state.get(p, {}), sd, p, fresh, targets)
    for i, p in enumerate(params):
        if i not in root_has and p in optimizer.state:
            del optimizer.state[p]
    return targets


def _adopt_param_state(local, sd, p, fresh, targets) -> dict:
    """One parameter's new state: local tensors that match the root's dtype, shape and device
    are reused (and broadcast into, in place), the others are created with ``fresh``."""
    new_state = {}
    for k, v in sd["d"]:
        old = local.get(k)
        if isinstance(v, dict) and "T" in v:
            dtype, shape, dev = v["T"]
            if (
                isinstance(old, torch.Tensor)
                and str(old.dtype) == "torch." + dtype
                and list(old.shape) == shape
                and old.device.type == dev
            ):
                targets.append(old)
                new_state[k] = old
            else:
                new_state[k] = fresh(dtype, shape, dev, like=p)
        else:
            val = _decode(v, fresh)
            new_state[k] = old if val is _SKIP else val
    return new_state


def _broadcast_in_place(targets, root_rank: int, what: str, process_set) -> None:
    """Broadcast each of ``targets`` in place from ``root_rank``, all started before waiting."""
    handles = []
    with torch.no_grad():
        for j, t in enumerate(targets):
            handles.append(
                mpi_ops.broadcast_async_(t, root_rank, name=f"{what}.{j}", **_ps_kw(process_set))
            )
        for h in handles:
            mpi_ops.synchronize(h)
