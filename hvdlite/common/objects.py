"""Python objects between ranks: ``broadcast_object`` and ``allgather_object``, for every
framework (they move bytes in the runtime's own buffers).

Any object cloudpickle can serialise travels (lambdas and locally defined classes too).
Trust: these functions unpickle bytes that come from another rank of the same job.  When
the job has a secret key (every job started by ``hvdlite-run``), the sender signs the
pickle with HMAC-SHA256 under the job's key and the receiver checks the signature before
unpickling; a job of several ranks without a key (plain ``mpiexec``) is refused rather
than trusted.  A rank that cannot pickle its object makes every rank raise, instead of
leaving the others waiting.
"""

import hashlib
import hmac
import pickle
from typing import Any, List, Optional, Tuple

import cloudpickle

from hvdlite.common import arrays, basics, ops, process_sets
from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteAuthError, HvdliteSerializationError
from hvdlite.common.process_sets import global_process_set

_MAC_BYTES = 32


def check_root(root_rank, what: str, process_set=global_process_set) -> None:
    """Raises TypeError / ValueError naming ``what`` unless ``root_rank`` is a rank of the
    job that belongs to ``process_set``."""
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise TypeError(f"{what}: root_rank must be an int, got {type(root_rank).__name__}")
    n = basics.size()
    if not 0 <= root_rank < n:
        raise ValueError(f"{what}: root_rank={root_rank} is outside 0..{n - 1} (size()={n})")
    if not process_sets.is_global(process_set) and root_rank not in process_set.ranks:
        raise ValueError(f"{what}: root_rank={root_rank} is not a member of {process_set!r}")


def _job_secret() -> Optional[bytes]:
    return basics.config().secret_key


def _sign(payload: bytes) -> bytes:
    key = _job_secret()
    mac = hmac.new(key, payload, hashlib.sha256).digest() if key else b"\0" * _MAC_BYTES
    return mac + payload


def require_key(what: str) -> None:
    """Refuse, on every rank alike and before any exchange, to move pickles between ranks
    of a job without a key: they could not be authenticated, and unpickling unauthenticated
    bytes runs whatever code they name.  (Only a job started by plain ``mpiexec`` lacks a
    key; ``hvdlite-run`` gives every job one, ``--mpi`` included.)

    Raises:
        HvdliteAuthError: the job has several ranks and no key.
    """
    if not _job_secret() and basics.size() > 1:
        raise HvdliteAuthError(
            f"{what}: this job has no secret key, so objects from other ranks cannot be "
            f"authenticated and are never unpickled; launch with hvdlite-run (--mpi for MPI), "
            f"or give every rank the same random hex key in {cfg.SECRET_KEY} through the "
            f"environment (not on a command line)"
        )


def _verify(blob: bytes, what: str, sender: int) -> bytes:
    mac, payload = blob[:_MAC_BYTES], blob[_MAC_BYTES:]
    key = _job_secret()
    require_key(what)
    if key:
        want = hmac.new(key, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, want):
            raise HvdliteAuthError(
                f"{what}: the payload from rank {sender} failed HMAC verification under this "
                f"job's key (rank {basics.rank()}); refusing to unpickle it"
            )
    return payload


def _bytes_to_buffer(data: bytes):
    return arrays.kind().from_bytes(data)


def _dumps(obj: Any) -> Tuple[bytes, Optional[BaseException]]:
    """``(signed pickle, None)``, or ``(error text, the error)`` when ``obj`` cannot be
    pickled; cloudpickle handles lambdas and locally defined classes."""
    try:
        return _sign(cloudpickle.dumps(obj)), None
    except Exception as exc:  # reported to every rank, then raised here
        return f"{type(exc).__name__}: {exc}".encode(), exc


def _failed(what: str, ranks: List[int], messages: List[str], cause=None):
    err = HvdliteSerializationError(
        f"{what}: rank(s) {ranks} could not pickle their object ({'; '.join(messages)}); "
        f"no rank received anything"
    )
    err.__cause__ = cause
    return err


def _broadcast_(buf, root_rank: int, name: str, process_set) -> None:
    ops.synchronize(ops.broadcast_async(buf, buf, root_rank, name, process_set))


def broadcast_bytes(
    data: Optional[bytes], root_rank: int, name: str, process_set, failed: bool = False
) -> Tuple[bytes, bool]:
    """Send ``data`` (given on the root only) to every rank, as ``(data, failed)``; with
    ``failed`` the root's ``data`` is its error text instead of a payload (a negative length
    tells the others).  It signs nothing: ``broadcast_object`` signs its pickle first, and
    the torch optimizer state's JSON description, never unpickled, travels as it is."""
    k = arrays.kind()
    is_root = basics.rank() == root_rank
    n = len(data) if is_root else 0
    length = k.tensor([-n - 1 if is_root and failed else n], "int64")
    _broadcast_(length, root_rank, name + ".len", process_set)
    code = int(length.item())
    n = -code - 1 if code < 0 else code
    buf = _bytes_to_buffer(data) if is_root else k.empty(n, "uint8")
    if n:
        _broadcast_(buf, root_rank, name + ".data", process_set)
    return k.to_numpy(buf).tobytes(), code < 0


def broadcast_object(
    obj: Any = None, root_rank: int = 0, name: Optional[str] = None, process_set=global_process_set
) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (cloudpickled; signed with the job key).

    Args:
        obj: the object (only the root's value matters).
        root_rank: the sending rank (a rank of the job, a member of ``process_set``).
        name: names the underlying broadcasts (use distinct names for concurrent calls).
        process_set: broadcast among this process set only.

    Returns:
        The root's object.

    Raises:
        TypeError: ``root_rank`` is not an int.
        ValueError: ``root_rank`` is not a rank of ``process_set``.
        HvdliteSerializationError: on every rank, when the root cannot pickle ``obj``.
        HvdliteAuthError: the payload failed verification, or the job has no key.
    """
    check_root(root_rank, "broadcast_object", process_set)
    name = name or "broadcast_object"
    require_key("broadcast_object")
    data, error = None, None
    if basics.rank() == root_rank:
        data, error = _dumps(obj)
    blob, failed = broadcast_bytes(data, root_rank, name, process_set, error is not None)
    if failed:
        raise _failed("broadcast_object", [root_rank], [blob.decode(errors="replace")], error)
    if basics.rank() == root_rank:
        return obj
    return pickle.loads(_verify(blob, "broadcast_object", root_rank))


def allgather_object(
    obj: Any, name: Optional[str] = None, process_set=global_process_set
) -> List[Any]:
    """Return the list of every member's ``obj``, in set-rank order (cloudpickled, signed).

    Args:
        obj: this rank's object.
        name: names the underlying allgathers (use distinct names for concurrent calls).
        process_set: gather among this process set only.

    Returns:
        A list with one object per member of the set.

    Raises:
        HvdliteSerializationError: on every rank, when some rank cannot pickle its object.
        HvdliteAuthError: a payload failed verification, or the job has no key.
    """
    k = arrays.kind()
    require_key("allgather_object")
    name = name or "allgather_object"
    mine, error = _dumps(obj)
    me = ops.process_set_rank(process_set)
    job = list(range(basics.size())) if process_sets.is_global(process_set) else process_set.ranks
    sizes = ops.synchronize(
        ops.allgather_async(
            [k.tensor([-len(mine) - 1 if error else len(mine)], "int64")],
            name + ".sizes",
            False,
            process_set,
        )
    )
    data = ops.synchronize(
        ops.allgather_async([_bytes_to_buffer(mine)], name + ".data", False, process_set)
    )
    raw = k.to_numpy(data).tobytes()
    out, offset, bad, messages = [], 0, [], []
    for sender, code in enumerate(sizes.tolist()):
        n = -code - 1 if code < 0 else code
        blob = raw[offset : offset + n]
        offset += n
        if code < 0:
            bad.append(job[sender])
            messages.append(blob.decode(errors="replace"))
        elif sender == me:
            out.append(obj)
        else:
            out.append(pickle.loads(_verify(blob, "allgather_object", job[sender])))
    if bad:
        raise _failed("allgather_object", bad, messages, error)
    return out
