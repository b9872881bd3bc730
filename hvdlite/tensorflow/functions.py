"""Helpers that make every rank start from the same state: variables and Python objects.

Trust: :func:`broadcast_object` and :func:`allgather_object` unpickle bytes that come
from another rank of the same job.  When the job has a secret key (every job started by
``hvdlite-run``), the sender signs the pickle with HMAC-SHA256 under that key and the
receiver checks the signature before unpickling.
"""

import hashlib
import hmac
import pickle
from typing import Any, List, Optional

import cloudpickle
import numpy as np
import tensorflow as tf
import torch

from hvdlite.common import basics, ops, process_sets
from hvdlite.common.exceptions import HvdliteAuthError, HvdliteSerializationError
from hvdlite.common.process_sets import global_process_set
from hvdlite.tensorflow import mpi_ops

__all__ = ["broadcast_variables", "broadcast_object", "allgather_object"]

_MAC_BYTES = 32


def _check_root(root_rank, what: str, process_set) -> None:
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise TypeError(f"{what}: root_rank must be an int, got {type(root_rank).__name__}")
    n = basics.size()
    if not 0 <= root_rank < n:
        raise ValueError(f"{what}: root_rank={root_rank} is outside 0..{n - 1} (size()={n})")
    if not process_sets.is_global(process_set) and root_rank not in process_set.ranks:
        raise ValueError(f"{what}: root_rank={root_rank} is not a member of {process_set!r}")


def broadcast_variables(variables, root_rank: int, process_set=global_process_set,
                        inplace=None):
    """Assign ``root_rank``'s value to each of ``variables`` on every rank of the set.

    Eager: the broadcasts are issued together (fused by the runtime) and assigned when all
    arrived; returns None.  Inside ``tf.function``: returns the grouped assign op.
    ``variables`` must be the same list, in the same order, on every rank.
    """
    _check_root(root_rank, "broadcast_variables", process_set)
    variables = list(variables)
    if not tf.executing_eagerly():
        return tf.group(*[v.assign(mpi_ops.broadcast(v, root_rank,
                                                     name=f"broadcast_variables.{i}",
                                                     process_set=process_set))
                          for i, v in enumerate(variables)])
    me = basics.rank()
    pending = []
    for i, v in enumerate(variables):
        value = mpi_ops._check(v.read_value() if hasattr(v, "read_value") else v,
                               f"broadcast_variables.{i}", "broadcast_variables")
        buf = mpi_ops.to_buffer(value)
        out = buf.clone() if me == root_rank else torch.empty(buf.shape, dtype=buf.dtype)
        # ``value`` stays in ``pending``: the runtime reads its memory until the handle is done
        pending.append((v, value, ops.broadcast_async(
            buf, out, root_rank, f"broadcast_variables.{i}", process_set)))
    for v, _value, h in pending:
        v.assign(mpi_ops.from_buffer(ops.synchronize(h)))
    return None


# --- objects ------------------------------------------------------------------------------
def _sign(payload: bytes) -> bytes:
    key = basics.config().secret_key
    mac = hmac.new(key, payload, hashlib.sha256).digest() if key else b"\0" * _MAC_BYTES
    return mac + payload


def _verify(blob: bytes, what: str, sender: int) -> bytes:
    mac, payload = blob[:_MAC_BYTES], blob[_MAC_BYTES:]
    key = basics.config().secret_key
    if key and not hmac.compare_digest(mac, hmac.new(key, payload, hashlib.sha256).digest()):
        raise HvdliteAuthError(f"{what}: the payload from rank {sender} failed HMAC "
                               f"verification under this job's key (rank {basics.rank()}); "
                               f"refusing to unpickle it")
    return payload


def _dumps(obj):
    try:
        return _sign(cloudpickle.dumps(obj)), None
    except Exception as exc:              # reported to every rank, then raised here
        return f"{type(exc).__name__}: {exc}".encode(), exc


def _failed(what, ranks, messages, cause=None):
    err = HvdliteSerializationError(f"{what}: rank(s) {ranks} could not pickle their object "
                                    f"({'; '.join(messages)}); no rank received anything")
    err.__cause__ = cause
    return err


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


def _bcast(buf: torch.Tensor, root_rank, name, process_set) -> torch.Tensor:
    return ops.synchronize(ops.broadcast_async(buf, buf, root_rank, name, process_set))


def broadcast_object(obj: Any = None, root_rank: int = 0, session=None,
                     name: Optional[str] = None, process_set=global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (cloudpickled, signed with the job key).

    Raises:
        HvdliteSerializationError: on every rank, when the root cannot pickle ``obj``.
        HvdliteAuthError: the payload failed verification.
    """
    _check_root(root_rank, "broadcast_object", process_set)
    name = name or "broadcast_object"
    is_root = basics.rank() == root_rank
    data, error = _dumps(obj) if is_root else (b"", None)
    n = len(data)
    length = torch.tensor([-n - 1 if error is not None else n], dtype=torch.int64)
    code = int(_bcast(length, root_rank, name + ".len", process_set)[0])
    n = -code - 1 if code < 0 else code
    buf = _u8(data) if is_root else torch.empty(n, dtype=torch.uint8)
    if n:
        buf = _bcast(buf, root_rank, name + ".data", process_set)
    blob = buf.numpy().tobytes()
    if code < 0:
        raise _failed("broadcast_object", [root_rank], [blob.decode(errors="replace")], error)
    if is_root:
        return obj
    return pickle.loads(_verify(blob, "broadcast_object", root_rank))


def allgather_object(obj: Any, session=None, name: Optional[str] = None,
                     process_set=global_process_set) -> List[Any]:
    """Return the list of every set rank's ``obj``, in rank order (cloudpickled, signed).

    Raises:
        HvdliteSerializationError: on every rank, when some rank cannot pickle its object.
        HvdliteAuthError: a payload failed verification.
    """
    name = name or "allgather_object"
    mine, error = _dumps(obj)
    me = ops.process_set_rank(process_set)
    sizes = ops.synchronize(ops.allgather_async(
        [torch.tensor([-len(mine) - 1 if error else len(mine)], dtype=torch.int64)],
        name + ".sizes", False, process_set))
    data = ops.synchronize(ops.allgather_async([_u8(mine)], name + ".data", False,
                                               process_set))
    raw = np.asarray(data.numpy()).tobytes()
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
