"""Negotiation: which tensors are ready on every rank, validated, ordered and fused.

Rank 0 is not special here: every rank receives the same gathered requests
(one allgather on the control plane) and runs this same deterministic code on
them, so every rank holds the same message table and computes the same
ordered response list without a second round trip to broadcast it.  The
invariant docs/architecture.md relies on (every rank executes the same responses in the
same order) follows from determinism: no wall clock, randomness or local state
enters :meth:`Controller.ingest`.
"""

import logging
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

from hvdlite.common.engine.message import (
    JOIN_NAME,
    OpType,
    ReduceOp,
    Request,
    Response,
    SAME_SHAPE_OPS,
)

log = logging.getLogger(__name__)


class _Pending:
    __slots__ = ("requests", "first_cycle", "first_time", "last_cycle", "last_ranks")

    def __init__(self, cycle: int):
        self.requests: Dict[int, Request] = {}
        self.first_cycle = cycle
        self.first_time = time.monotonic()
        self.last_cycle = cycle  # when the latest request arrived, and from whom
        self.last_ranks: List[int] = []

    def add(self, rank: int, req: Request, cycle: int) -> None:
        self.requests[rank] = req
        if cycle != self.last_cycle:
            self.last_cycle, self.last_ranks = cycle, []
        self.last_ranks.append(rank)


class Controller:
    """The message table of one job (identical on every rank)."""

    def __init__(self, size: int, ranks: Optional[List[int]] = None):
        """``ranks``: the job ranks of a process set's members (messages name those)."""
        self.size = size
        self._job = list(ranks) if ranks is not None else list(range(size))
        self.table: Dict[str, _Pending] = {}
        self.joined: Set[int] = set()
        self.last_joined = -1

    # -- negotiation -------------------------------------------------------------------------
    def ingest(self, gathered: Sequence[Sequence[Request]], cycle: int) -> List[Response]:
        """Add every rank's new requests; return the responses now ready, in order."""
        ready: List[str] = []
        for rank, requests in enumerate(gathered):
            for req in requests:
                if req.op == OpType.JOIN:
                    self.joined.add(rank)
                    self.last_joined = rank
                    continue
                entry = self.table.get(req.name)
                if entry is None:
                    entry = self.table[req.name] = _Pending(cycle)
                entry.add(rank, req, cycle)
                if self._complete(entry) and req.name not in ready:
                    ready.append(req.name)
        # Joining can complete tensors submitted earlier by the other ranks.
        if self.joined:
            for name, entry in self.table.items():
                if name not in ready and self._complete(entry):
                    ready.append(name)
        responses = [self._respond(name, self.table.pop(name)) for name in ready]
        if self.joined and len(self.joined) == self.size:
            responses.append(Response(JOIN_NAME, OpType.JOIN, value=self.last_joined))
            self.joined.clear()
        return responses

    def ingest_uniform(self, requests: Sequence[Request], cycle: int) -> List[Response]:
        """:meth:`ingest` for the case where every rank sent exactly ``requests`` (their
        digests agreed): O(len(requests)), whatever the number of ranks.  Every name is then
        new and complete at once; anything unusual (a join, a name already waiting) takes
        the general path with ``requests`` as every rank's list."""
        if self.joined or any(r.op == OpType.JOIN or r.name in self.table for r in requests):
            return self.ingest([requests] * self.size, cycle)
        out = []
        n = self.size
        for req in requests:
            resp = Response(
                req.name,
                req.op,
                req.dtype,
                req.shape,
                req.root,
                req.reduce_op,
                req.prescale,
                req.postscale,
            )
            if req.op == OpType.ALLGATHER:
                resp.first_dims = [req.shape[0]] * n
            elif req.op == OpType.ALLTOALL:
                error = self._validate(req.name, {0: req})
                if error is not None:
                    resp = Response(req.name, req.op, req.dtype, req.shape, error=error)
                else:
                    resp.splits = [req.splits] * n
            out.append(resp)
        return out

    def _complete(self, entry: _Pending) -> bool:
        have = entry.requests
        if not self.joined:  # the common case, O(1): no set built per request
            return len(have) == self.size
        missing = sum(1 for r in self.joined if r not in have)
        return len(have) > 0 and len(have) + missing >= self.size

    def _respond(self, name: str, entry: _Pending) -> Response:
        reqs = entry.requests
        ranks = sorted(reqs)
        first = reqs[ranks[0]]
        error = self._validate(name, reqs)
        if error is None:
            error = self._join_conflict(name, first, reqs)
        if error is not None:
            return Response(name, first.op, first.dtype, first.shape, error=error)
        resp = Response(
            name,
            first.op,
            first.dtype,
            first.shape,
            first.root,
            first.reduce_op,
            first.prescale,
            first.postscale,
        )
        if entry.last_cycle != entry.first_cycle:
            resp.waited_for = tuple(entry.last_ranks)
        if first.op == OpType.ALLGATHER:
            resp.first_dims = [reqs[r].shape[0] if r in reqs else 0 for r in range(self.size)]
        elif first.op == OpType.ALLTOALL:  # a joined rank sends nothing
            resp.splits = [
                reqs[r].splits if r in reqs else (0,) * self.size for r in range(self.size)
            ]
        return resp

    def _join_conflict(self, name: str, first: Request, reqs: Dict[int, Request]) -> Optional[str]:
        """As Horovod: allgather and broadcast cannot complete while a rank has joined
        without submitting them (the others get this error at once; the job goes on)."""
        if first.op not in (OpType.ALLGATHER, OpType.BROADCAST):
            return None
        absent = sorted(self._job[r] for r in self.joined if r not in reqs)
        if not absent:
            return None
        what = "Allgather" if first.op == OpType.ALLGATHER else "Broadcast"
        hint = (
            " (DistributedOptimizer reduces sparse gradients with allgathers: pass "
            "sparse_as_dense=True)"
            if first.op == OpType.ALLGATHER
            else ""
        )
        return (
            f"{what} is not supported with join at this time: {what.lower()} of tensor "
            f"{name!r} while rank(s) {absent} have joined{hint}"
        )

    def _validate(self, name: str, reqs: Dict[int, Request]) -> Optional[str]:
        ranks = sorted(reqs)
        first = reqs[ranks[0]]

        def disagree(what: str, value_of) -> Optional[str]:
            groups: Dict[str, List[int]] = {}
            for r in ranks:
                groups.setdefault(str(value_of(reqs[r])), []).append(r)
            if len(groups) == 1:
                return None
            seen = "; ".join(
                f"ranks {[self._job[r] for r in rs]} sent {val}" for val, rs in groups.items()
            )
            return f"mismatched {what} for tensor {name!r}: {seen}"

        checks = [("operation", lambda q: q.op.name.lower()), ("dtype", lambda q: q.dtype)]
        if first.op in SAME_SHAPE_OPS:
            checks.append(("shape", lambda q: list(q.shape)))
        elif first.op in (OpType.ALLGATHER, OpType.ALLTOALL):
            checks.append(
                (
                    "rank (number of dimensions) or trailing shape",
                    lambda q: ["*"] + list(q.shape[1:]) if q.shape else "scalar",
                )
            )
        if first.op == OpType.BROADCAST:
            checks.append(
                ("root_rank", lambda q: self._job[q.root] if 0 <= q.root < self.size else q.root)
            )
        if first.op in (OpType.ALLREDUCE, OpType.REDUCESCATTER):
            checks.append(("reduce op", lambda q: ReduceOp(q.reduce_op).name.lower()))
            checks.append(("prescale/postscale factors", lambda q: (q.prescale, q.postscale)))
            checks.append(
                (
                    "grouped tensors (count, digest of their shapes)",
                    lambda q: list(q.parts) if q.parts else "one tensor",
                )
            )
        for what, fn in checks:
            msg = disagree(what, fn)
            if msg:
                return msg
        if first.op == OpType.ALLTOALL:
            for r in ranks:
                splits = reqs[r].splits
                if len(splits) != self.size or sum(splits) != reqs[r].shape[0]:
                    return (
                        f"alltoall of tensor {name!r}: rank {self._job[r]} sent splits "
                        f"{list(splits)}, "
                        f"which must have {self.size} entries summing to its first "
                        f"dimension {reqs[r].shape[0]}"
                    )
        return None

    # -- stall inspection --------------------------------------------------------------------
    def stalled(self, older_than_s: float) -> List[Tuple[str, List[int], List[int], float]]:
        """(name, ranks that submitted, ranks missing, seconds waiting) past the threshold."""
        now = time.monotonic()
        out = []
        for name, entry in self.table.items():
            waited = now - entry.first_time
            if waited >= older_than_s:
                have = sorted(entry.requests)
                missing = [
                    r for r in range(self.size) if r not in entry.requests and r not in self.joined
                ]
                out.append((name, have, missing, waited))
        return out

    def missing_since(self, cycle: int) -> List[int]:
        """Set ranks missing from any tensor first seen at or before ``cycle`` (the same
        answer on every rank: the table is)."""
        missing = set()
        for entry in self.table.values():
            if entry.first_cycle <= cycle:
                missing.update(
                    r for r in range(self.size) if r not in entry.requests and r not in self.joined
                )
        return sorted(missing)

    def fail_older_than(self, cycle: int) -> List[Response]:
        """Error responses for every incomplete tensor first seen at or before ``cycle``."""
        out = []
        for name in [n for n, e in self.table.items() if e.first_cycle <= cycle]:
            entry = self.table.pop(name)
            first = next(iter(entry.requests.values()))
            job = self._job
            missing = [job[r] for r in range(self.size) if r not in entry.requests]
            out.append(
                Response(
                    name,
                    first.op,
                    first.dtype,
                    first.shape,
                    error=(
                        f"tensor {name!r} stalled: submitted by ranks "
                        f"{[job[r] for r in sorted(entry.requests)]} but "
                        f"never by ranks {missing} (stall shutdown time exceeded; see "
                        f"--stall-check-shutdown-time-seconds)"
                    ),
                    error_kind="stall",
                )
            )
        return out


def plan_fusion(responses: Sequence[Response], threshold_bytes: int) -> List[List[Response]]:
    """Group responses that can share one collective; deterministic on every rank.

    Allreduces fuse when dtype, reduce op and scale factors match; allgathers
    and broadcasts (same root) fuse as raw bytes.  A group never exceeds
    ``threshold_bytes`` (0 disables fusion); groups keep the responses' order.
    """
    groups: List[List[Response]] = []
    open_groups: Dict[tuple, Tuple[List[Response], int]] = {}
    for resp in responses:
        if (
            resp.error is not None
            or threshold_bytes <= 0
            or resp.op not in (OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST)
        ):
            groups.append([resp])
            continue
        if resp.op == OpType.ALLREDUCE:
            key = (resp.op, resp.dtype, resp.reduce_op, resp.prescale, resp.postscale)
        elif resp.op == OpType.BROADCAST:
            key = (resp.op, resp.root)
        else:
            key = (resp.op,)
        nbytes = resp.nbytes
        current = open_groups.get(key)
        if current is not None and current[1] + nbytes <= threshold_bytes:
            current[0].append(resp)
            open_groups[key] = (current[0], current[1] + nbytes)
        else:
            group = [resp]
            groups.append(group)
            open_groups[key] = (group, nbytes)
    return groups
