"""Request, Response and their explicit wire encoding.

A :class:`Request` is what one rank asks for one tensor; a :class:`Response`
is what every rank agreed to execute for it.  Lists of requests travel on the
control plane as compact JSON (plain data; nothing is unpickled).
"""

import enum
import json
from typing import List, Optional, Sequence, Tuple


class OpType(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6


class ReduceOp(enum.IntEnum):
    """Reduction ops; values match horovod.torch's constants."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


#: the names every rank uses for its join / barrier request
JOIN_NAME = "__join__"
BARRIER_NAME = "__barrier__"

#: ops whose shapes must agree on every rank (allgather/alltoall only agree past dim 0)
SAME_SHAPE_OPS = (OpType.ALLREDUCE, OpType.BROADCAST, OpType.REDUCESCATTER)


class Request:
    """One rank's request for one named tensor."""

    __slots__ = (
        "name",
        "op",
        "dtype",
        "shape",
        "root",
        "reduce_op",
        "prescale",
        "postscale",
        "splits",
        "parts",
        "sig",
        "wire",
    )

    def __init__(
        self,
        name: str,
        op: OpType,
        dtype: str = "",
        shape: Tuple[int, ...] = (),
        root: int = -1,
        reduce_op: int = -1,
        prescale: float = 1.0,
        postscale: float = 1.0,
        splits: Optional[Tuple[int, ...]] = None,
        parts: Optional[Tuple[int, int]] = None,
    ):
        """``parts``: a packed grouped allreduce's (tensor count, digest of their shapes);
        the ranks must agree on it as on the shape."""
        self.name = name
        self.op = op
        self.dtype = dtype
        self.shape = tuple(shape)
        self.root = root
        self.reduce_op = reduce_op
        self.prescale = prescale
        self.postscale = postscale
        self.splits = tuple(splits) if splits is not None else None
        self.parts = tuple(parts) if parts is not None else None
        #: everything that must be equal for a cached response to be reused
        self.sig = (
            op,
            dtype,
            self.shape,
            root,
            reduce_op,
            prescale,
            postscale,
            self.splits,
            self.parts,
        )
        #: :meth:`wire_bound`, computed once
        self.wire = 12 * len(name) + 24 * (len(self.shape) + len(self.splits or ())) + 250

    def wire_bound(self) -> int:
        """An upper bound of this request's share of :func:`encode_requests` in bytes,
        computable without encoding (a name character escapes to at most 12 bytes; every
        number fits in 24)."""
        return self.wire

    def to_list(self) -> list:
        out = [
            self.name,
            int(self.op),
            self.dtype,
            list(self.shape),
            self.root,
            self.reduce_op,
            self.prescale,
            self.postscale,
            list(self.splits) if self.splits is not None else None,
        ]
        if self.parts is not None:
            out.append(list(self.parts))
        return out

    @classmethod
    def from_list(cls, item: list) -> "Request":
        name, op, dtype, shape, root, reduce_op, pre, post, splits = item[:9]
        parts = item[9] if len(item) > 9 else None
        return cls(
            str(name),
            OpType(op),
            str(dtype),
            tuple(int(s) for s in shape),
            int(root),
            int(reduce_op),
            float(pre),
            float(post),
            tuple(int(s) for s in splits) if splits is not None else None,
            (int(parts[0]), int(parts[1])) if parts is not None else None,
        )


def encode_requests(requests: Sequence[Request]) -> bytes:
    return json.dumps([r.to_list() for r in requests], separators=(",", ":")).encode()


def decode_requests(data: bytes) -> List[Request]:
    if not data:
        return []
    return [Request.from_list(item) for item in json.loads(data)]


class Response:
    """What every rank executes for one tensor (or a JOIN/BARRIER/error).

    ``first_dims`` holds each rank's first dimension (allgather); ``splits``
    each rank's send splits (alltoall); ``error`` makes every rank's handle
    for ``name`` fail with that message; ``waited_for`` names the ranks whose
    late request the others waited for (instrumentation only).
    """

    __slots__ = (
        "name",
        "op",
        "dtype",
        "shape",
        "root",
        "reduce_op",
        "prescale",
        "postscale",
        "first_dims",
        "splits",
        "error",
        "error_kind",
        "value",
        "nbytes",
        "numel",
        "waited_for",
    )

    def __init__(
        self,
        name: str,
        op: OpType,
        dtype: str = "",
        shape: Tuple[int, ...] = (),
        root: int = -1,
        reduce_op: int = -1,
        prescale: float = 1.0,
        postscale: float = 1.0,
        first_dims: Optional[List[int]] = None,
        splits: Optional[List[Tuple[int, ...]]] = None,
        error: Optional[str] = None,
        value: int = -1,
        error_kind: str = "mismatch",
    ):
        self.name = name
        self.op = op
        self.dtype = dtype
        self.shape = shape
        self.root = root
        self.reduce_op = reduce_op
        self.prescale = prescale
        self.postscale = postscale
        self.first_dims = first_dims
        self.splits = splits
        self.error = error
        self.error_kind = error_kind  # "mismatch" or "stall"
        self.value = value
        self.nbytes = 0  # payload size, for fusion planning (set by the runtime)
        self.waited_for: Tuple[int, ...] = ()  # ranks that asked last, when others waited
        n = 1
        for d in shape:
            n *= d
        self.numel = n

    @property
    def cacheable(self) -> bool:
        return self.error is None and self.op not in (OpType.JOIN, OpType.BARRIER)
