"""Helpers that make every rank start from the same model and optimizer.

* :func:`broadcast_parameters` — a ``state_dict()`` or ``named_parameters()``
  from ``root_rank`` to every rank, in place.
* :func:`broadcast_optimizer_state` — parameter-group hyper-parameters (lr,
  momentum, betas, ...) and per-parameter state (momentum buffers, Adam
  moments and step counts).  State that the root has but a rank has not yet
  created (optimizers create it lazily on the first ``step()``) is created on
  that rank with the root's structure; no optimizer step is taken, so the
  optimizer's trajectory (e.g. Adam's bias correction) is unchanged.
* :func:`broadcast_object` / :func:`allgather_object` — any object cloudpickle can
  serialise (lambdas and locally defined classes too).

Trust: the object functions unpickle bytes that come from another rank of the
same job.  When the job has a secret key (every job started by
``hvdlite-run``), the sender signs the pickle with HMAC-SHA256 under the job's
key and the receiver checks the signature before unpickling; a job of several
ranks without a key (plain ``mpiexec``) is refused rather than trusted.  The
optimizer state's structure travels as JSON, never as a pickle.
"""

import hashlib
import hmac
import json
import logging
import pickle
from typing import Any, List, Optional, Tuple

import cloudpickle
import torch

from hvdlite.common import basics, ops, process_sets
from hvdlite.common.exceptions import HvdliteAuthError, HvdliteSerializationError
from hvdlite.common.process_sets import global_process_set
from hvdlite.torch import mpi_ops

log = logging.getLogger(__name__)

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]

_MAC_BYTES = 32


def _ps_kw(process_set) -> dict:
    return {} if process_set is None else {"process_set": process_set}


def _check_root(root_rank: int, what: str, process_set=global_process_set):
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise TypeError(f"{what}: root_rank must be an int, got {type(root_rank).__name__}")
    n = mpi_ops.size()
    if not 0 <= root_rank < n:
        raise ValueError(f"{what}: root_rank={root_rank} is outside 0..{n - 1} (size()={n})")
    if not process_sets.is_global(process_set) and root_rank not in process_set.ranks:
        raise ValueError(f"{what}: root_rank={root_rank} is not a member of {process_set!r}")


# --- parameters --------------------------------------------------------------------------

def broadcast_parameters(params, root_rank: int, process_set=global_process_set) -> None:
    """Overwrite ``params`` on every rank with ``root_rank``'s values, in place.

    Args:
        params: ``model.state_dict()`` (a mapping name -> tensor, buffers included) or
            ``model.named_parameters()`` (an iterable of ``(name, tensor)``).  Names must be
            the same on every rank; they name the broadcasts in errors.
        root_rank: the rank whose values everyone receives.
        process_set: broadcast among this process set only.

    Raises:
        TypeError: ``params`` is neither of the accepted forms.
        ValueError: a bad ``root_rank``, or duplicate names.
    """
    _check_root(root_rank, "broadcast_parameters", process_set)
    if isinstance(params, dict) or hasattr(params, "items") and callable(params.items):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    else:
        try:
            items = list(params)
        except TypeError:
            raise TypeError(
                "broadcast_parameters: params must be model.state_dict() or "
                f"model.named_parameters(), got {type(params).__name__}") from None
        for i, item in enumerate(items):
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(
                    "broadcast_parameters: params must be model.state_dict() or "
                    f"model.named_parameters() ((name, tensor) pairs); item {i} is "
                    f"{type(item).__name__}")
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
                    "broadcast_object for other values")
            t = p.detach()
            handles.append(mpi_ops.broadcast_async_(
                t, root_rank, name=f"broadcast_parameters.{name}", **_ps_kw(process_set)))
        for h in handles:
            mpi_ops.synchronize(h)


# --- bytes and objects -------------------------------------------------------------------

def _job_secret() -> Optional[bytes]:
    return basics.config().secret_key


def _sign(payload: bytes) -> bytes:
    key = _job_secret()
    mac = hmac.new(key, payload, hashlib.sha256).digest() if key else b"\0" * _MAC_BYTES
    return mac + payload


def _require_key(what: str) -> None:
    """Refuse, on every rank alike and before any exchange, to move pickles between ranks
    of a job without a key: they could not be authenticated, and unpickling unauthenticated
    bytes runs whatever code they name.  (Only a job started by plain ``mpiexec`` lacks a
    key; ``hvdlite-run`` gives every job one, ``--mpi`` included.)

    Raises:
        HvdliteAuthError: the job has several ranks and no key.
    """
    if not _job_secret() and mpi_ops.size() > 1:
        from hvdlite.common import config as cfg
        raise HvdliteAuthError(
            f"{what}: this job has no secret key, so objects from other ranks cannot be "
            f"authenticated and are never unpickled; launch with hvdlite-run (--mpi for MPI), "
            f"or give every rank the same random hex key in {cfg.SECRET_KEY} through the "
            f"environment (not on a command line)")


def _verify(blob: bytes, what: str, sender: int) -> bytes:
    mac, payload = blob[:_MAC_BYTES], blob[_MAC_BYTES:]
    key = _job_secret()
    _require_key(what)
    if key:
        want = hmac.new(key, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, want):
            raise HvdliteAuthError(
                f"{what}: the payload from rank {sender} failed HMAC verification under this "
                f"job's key (rank {mpi_ops.rank()}); refusing to unpickle it")
    return payload


def _bytes_to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


def _dumps(obj: Any) -> Tuple[bytes, Optional[BaseException]]:
    """``(signed pickle, None)``, or ``(error text, the error)`` when ``obj`` cannot be
    pickled; cloudpickle handles lambdas and locally defined classes."""
    try:
        return _sign(cloudpickle.dumps(obj)), None
    except Exception as exc:              # reported to every rank, then raised here
        return f"{type(exc).__name__}: {exc}".encode(), exc


def _failed(what: str, ranks: List[int], messages: List[str], cause=None):
    err = HvdliteSerializationError(
        f"{what}: rank(s) {ranks} could not pickle their object ({'; '.join(messages)}); "
        f"no rank received anything")
    err.__cause__ = cause
    return err


def _broadcast_bytes(data: Optional[bytes], failed: bool, root_rank: int, name: str,
                     process_set) -> Tuple[bytes, bool]:
    """Send ``data`` (given on the root only) to every rank; a negative length tells the
    others that ``data`` is the root's error text instead of a payload."""
    is_root = mpi_ops.rank() == root_rank
    n = len(data) if is_root else 0
    length = torch.tensor([-n - 1 if is_root and failed else n], dtype=torch.int64)
    mpi_ops.broadcast_(length, root_rank, name=name + ".len", **_ps_kw(process_set))
    code = int(length.item())
    n = -code - 1 if code < 0 else code
    buf = _bytes_to_tensor(data) if is_root else torch.empty(n, dtype=torch.uint8)
    if n:
        mpi_ops.broadcast_(buf, root_rank, name=name + ".data", **_ps_kw(process_set))
    return buf.numpy().tobytes(), code < 0


def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None,
                     process_set=global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (cloudpickled; signed with the job key).

    Args:
        obj: the object (only the root's value matters).
        root_rank: the sending rank.
        name: names the underlying broadcasts (use distinct names for concurrent calls).

    Raises:
        HvdliteSerializationError: on every rank, when the root cannot pickle ``obj``.
        HvdliteAuthError: the payload failed verification.
    """
    _check_root(root_rank, "broadcast_object", process_set)
    name = name or "broadcast_object"
    _require_key("broadcast_object")
    data, error = None, None
    if mpi_ops.rank() == root_rank:
        data, error = _dumps(obj)
    blob, failed = _broadcast_bytes(data, error is not None, root_rank, name, process_set)
    if failed:
        raise _failed("broadcast_object", [root_rank], [blob.decode(errors="replace")], error)
    if mpi_ops.rank() == root_rank:
        return obj
    return pickle.loads(_verify(blob, "broadcast_object", root_rank))


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set=global_process_set) -> List[Any]:
    """Return the list of every rank's ``obj``, indexed by rank (cloudpickled, signed).

    Raises:
        HvdliteSerializationError: on every rank, when some rank cannot pickle its object.
        HvdliteAuthError: a payload failed verification.
    """
    _require_key("allgather_object")
    name = name or "allgather_object"
    mine, error = _dumps(obj)
    kw = _ps_kw(process_set)
    me = ops.process_set_rank(process_set)
    sizes = mpi_ops.allgather(torch.tensor([-len(mine) - 1 if error else len(mine)],
                                           dtype=torch.int64), name=name + ".sizes", **kw)
    data = mpi_ops.allgather(_bytes_to_tensor(mine), name=name + ".data", **kw)
    raw = data.numpy().tobytes()
    out, offset, bad, messages = [], 0, [], []
    for sender, code in enumerate(sizes.tolist()):
        n = -code - 1 if code < 0 else code
        blob = raw[offset:offset + n]
        offset += n
        if code < 0:
            bad.append(sender)
            messages.append(blob.decode(errors="replace"))
        elif sender == me:
            out.append(obj)
        else:
            out.append(pickle.loads(_verify(blob, "allgather_object", sender)))
    if bad:
        raise _failed("allgather_object", bad, messages, error)
    return out


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


def broadcast_optimizer_state(optimizer, root_rank: int,
                              process_set=global_process_set) -> None:
    """Give every rank ``root_rank``'s optimizer hyper-parameters and state, in place.

    Parameter groups are matched by position and parameters by their position
    across ``optimizer.param_groups``, so every rank must build its optimizer
    over the same model in the same order.  Tensor state is broadcast in
    place where the rank already has a tensor of the same shape and dtype;
    otherwise it is created.  No optimizer step is taken.

    Raises:
        ValueError: the ranks' optimizers have different numbers of groups or parameters.
    """
    _check_root(root_rank, "broadcast_optimizer_state", process_set)
    if hasattr(optimizer, "optimizer") and not hasattr(optimizer, "param_groups"):
        optimizer = optimizer.optimizer
    params = [p for g in optimizer.param_groups for p in g["params"]]
    is_root = mpi_ops.rank() == root_rank
    kw = _ps_kw(process_set)
    if mpi_ops.size() == 1:
        return

    desc = None
    enc = _Encoder()
    if is_root:
        pidx = {id(p): i for i, p in enumerate(params)}
        groups = [enc.enc({k: v for k, v in g.items() if k != "params"})
                  for g in optimizer.param_groups]
        owned = sorted([(pidx[id(p)], st) for p, st in optimizer.state.items()
                        if id(p) in pidx and st], key=lambda e: e[0])
        # encode in index order: the tensors list must follow the order every rank decodes in
        state = [[i, enc.enc(dict(st))] for i, st in owned]
        desc = json.dumps({"n_params": len(params), "n_groups": len(optimizer.param_groups),
                           "groups": groups, "state": state}).encode()
    desc = json.loads(_broadcast_bytes(desc, False, root_rank, "broadcast_optimizer_state.desc",
                                       process_set)[0])
    if desc["n_params"] != len(params) or desc["n_groups"] != len(optimizer.param_groups):
        raise ValueError(
            f"broadcast_optimizer_state: rank {mpi_ops.rank()} has {len(optimizer.param_groups)} "
            f"param groups / {len(params)} parameters but root rank {root_rank} has "
            f"{desc['n_groups']} / {desc['n_params']}; build the optimizer the same way on every "
            "rank")

    if is_root:
        targets = enc.tensors
    else:
        targets = []

        def fresh(dtype, shape, device_type, like=None):
            device = like.device if like is not None and like.device.type == device_type \
                else torch.device(device_type)
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            targets.append(t)
            return t

        # hyper-parameters: decoded values replace the local ones
        for g, gd in zip(optimizer.param_groups, desc["groups"]):
            new = _decode(gd, fresh)
            for k, v in new.items():
                if v is not _SKIP:
                    g[k] = v
        # per-parameter state: reuse matching tensors (in place), create the rest
        root_has = {i for i, _ in desc["state"]}
        for i, sd in desc["state"]:
            p = params[i]
            local = optimizer.state.get(p, {})
            new_state = {}
            for k, v in sd["d"]:
                old = local.get(k)
                if isinstance(v, dict) and "T" in v:
                    dtype, shape, dev = v["T"]
                    if (isinstance(old, torch.Tensor) and str(old.dtype) == "torch." + dtype
                            and list(old.shape) == shape and old.device.type == dev):
                        targets.append(old)
                        new_state[k] = old
                    else:
                        new_state[k] = fresh(dtype, shape, dev, like=p)
                else:
                    val = _decode(v, fresh)
                    new_state[k] = old if val is _SKIP else val
            optimizer.state[p] = new_state
        for i, p in enumerate(params):
            if i not in root_has and p in optimizer.state:
                del optimizer.state[p]

    handles = []
    with torch.no_grad():
        for j, t in enumerate(targets):
            handles.append(mpi_ops.broadcast_async_(
                t, root_rank, name=f"broadcast_optimizer_state.{j}", **kw))
        for h in handles:
            mpi_ops.synchronize(h)
