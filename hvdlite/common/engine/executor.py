"""Runs agreed, fused response groups on the backend and fills the outputs.

Called by the background thread only.  ``entries`` maps a name to this rank's
entry; a name without an entry is one this rank contributes a neutral value to
(it has joined): :func:`fusion.neutral` for allreduce, zeros for reducescatter
and Adasum, no rows for alltoall.  An Average still divides by the full size.

Scaling costs no pass of its own where the transport allows it.  Average (a
postscale of 1/size) and the prescale / postscale factors go to the backend with
the tensor (``Backend.allreduce_scaled_`` and its async forms), which applies them
where it touches the data anyway (shared memory while it copies in and out, MPI
piece by piece; the interface's default, which Gloo over TCP keeps, scales in
passes of its own).  Packed chunks are scaled run by run of about
:data:`SCALE_RUN_BYTES` right after packing and right before unpacking, while
the run is still in the cache.  When the backend offers a staging area
(``Backend.stage``: a shared-memory slot), a chunk is packed straight into it
and unpacked straight from where ``Backend.allreduce_staged_`` leaves the
result, so a fused allreduce costs two copies and one reduction pass.
"""

import time
from typing import Callable, Dict, List, Optional

from hvdlite.common.engine import adasum
from hvdlite.common.engine import fusion
from hvdlite.common.backend.shared_buckets import BUCKET_NAME_PREFIX
from hvdlite.common.arrays import itemsize, numel
from hvdlite.common.exceptions import HvdliteMismatchError, HvdliteStallError
from hvdlite.common.engine.message import OpType, ReduceOp, Response
from hvdlite.common.engine.parameters import Parameters
from hvdlite.common.diagnostics.recorder import COLLECTIVE, COPY_IN, COPY_OUT, Recorder


#: packing and unpacking that scale go in runs of tensors about this big: each run is
#: scaled while it is still in the cache, so the scaling costs no pass over memory
SCALE_RUN_BYTES = 1 << 20
#: packed groups of at least this many tensors keep their layout and result views between
#: steps (Executor._layout); at most this many such groups are kept
_REMEMBER_FROM = 32
_MAX_LAYOUTS = 32
#: a plain int, so the allreduce path pays one int comparison for Adasum's branch
_ADASUM = int(ReduceOp.ADASUM)


def _chunks(sizes, chunk_elems: int):
    """(first, end, offset, count) runs of whole tensors of about ``chunk_elems`` elements."""
    lo, off, count = 0, 0, 0
    for i, n in enumerate(sizes):
        count += n
        if count >= chunk_elems and i + 1 < len(sizes):
            yield lo, i + 1, off, count
            lo, off, count = i + 1, off + count, 0
    yield lo, len(sizes), off, count


class Executor:
    """Executes response groups with one backend; owned by the runtime's background thread.

    ``params`` (replaced by the runtime when the live parameters change) gives the
    pipelining granularity of packed allreduces (``fusion_chunk_bytes``) and the size from
    which a fused tensor is reduced where it lies (``inplace_threshold_bytes``; 0: always
    packed).  ``recorder`` (None: off) receives the copy and collective spans.

    Buffers are the process's array kind (:mod:`hvdlite.common.arrays`); its functions are
    bound here once, so the per-tensor loops pay no lookup.
    """

    def __init__(
        self,
        backend,
        buffers: fusion.FusionBuffers,
        params: Parameters,
        recorder: Optional[Recorder] = None,
    ):
        self.params = params
        self.backend = backend
        self.buffers = buffers
        self.rank = backend.rank
        self.size = backend.size
        self._rec = recorder
        k = self._kind = buffers.kind
        self._flat, self._copy, self._clone = k.flat, k.copy_, k.clone
        self._pack, self._unpack, self._scale = k.pack, k.unpack, k.scale_
        #: per fused group of many tensors (the cache-hit cycles' plans repeat the same group
        #: objects): its sizes and chunks, and the views a result is unpacked from (see
        #: :meth:`_layout`)
        self._layouts: Dict[int, tuple] = {}
        self._splits: Dict[tuple, tuple] = {}  # see _split_by_size

    def forget(self) -> None:
        """Drop the remembered views (they hold the backend's memory): before it closes."""
        self._layouts.clear()
        self._splits.clear()

    def set_recorder(self, recorder: Optional[Recorder]) -> None:
        """Report the spans of later groups to ``recorder`` (None: report nothing).  Called
        by the background thread between groups, so no group is reported half."""
        self._rec = recorder

    def _span(self, phase: str, group, start: float, chunk: int = 0) -> float:
        """Report ``group``'s names in ``phase`` from ``start`` until now; returns now."""
        end = time.monotonic()
        self._rec.span(phase, [r.name for r in group], start, end, chunk)
        return end

    def enter_thread(self) -> None:
        """Set up the background thread: its copies and reductions are never autograd ops."""
        self._kind.enter_thread()

    def run(
        self, group: List[Response], entries: Dict[str, object], complete: Callable, fail: Callable
    ) -> None:
        first = group[0]
        if first.error is not None:
            for resp in group:
                entry = entries.get(resp.name)
                if entry is not None:
                    kind = HvdliteStallError if resp.error_kind == "stall" else HvdliteMismatchError
                    fail(entry, kind(resp.error))
            return
        op = first.op
        if op == OpType.ALLREDUCE:
            if first.reduce_op == _ADASUM:
                self._adasum(group, entries, complete, fail)
            else:
                self._allreduce(group, entries, complete)
            return
        start = time.monotonic() if self._rec is not None else 0.0
        if op == OpType.ALLGATHER:
            self._allgather(group, entries, complete)
        elif op == OpType.BROADCAST:
            self._broadcast(group, entries, complete)
        elif op == OpType.ALLTOALL:
            self._alltoall(first, entries.get(first.name), complete)
        elif op == OpType.REDUCESCATTER:
            self._reducescatter(first, entries.get(first.name), complete)
        elif op in (OpType.BARRIER, OpType.JOIN):
            entry = entries.get(first.name)
            if entry is not None:
                complete(entry, first.value if op == OpType.JOIN else None)
            return
        if self._rec is not None:  # these ops copy little; one span covers them
            self._span(COLLECTIVE, group, start)

    # -- allreduce ------------------------------------------------------------------------
    def _post_factor(self, resp: Response) -> float:
        factor = resp.postscale
        if resp.reduce_op == ReduceOp.AVERAGE:
            factor /= self.size
        return factor

    def _reduce(self, buf, resp: Response) -> None:
        op = resp.reduce_op
        self.backend.allreduce_scaled_(
            buf,
            ReduceOp.SUM if op == ReduceOp.AVERAGE else ReduceOp(op),
            resp.prescale,
            self._post_factor(resp),
        )

    def _target(self, resp: Response, entry):
        """The flat tensor this rank reduces for ``resp``: its output holding its input, or
        a neutral stand-in (result discarded) when this rank has joined."""
        if entry is None:
            return self._kind.full(
                resp.numel, fusion.neutral(resp.dtype, resp.reduce_op), resp.dtype
            )
        if entry.output is not entry.tensor:
            self._copy(entry.output, entry.tensor)
        return self._flat(entry.output)

    def _allreduce(self, group, entries, complete) -> None:
        first = group[0]
        rec = self._rec
        if len(group) == 1:
            entry = entries.get(first.name)
            start = time.monotonic() if rec is not None else 0.0
            self._reduce(self._target(first, entry), first)
            if rec is not None:
                self._span(COLLECTIVE, group, start)
            if entry is not None:
                complete(entry, entry.output)
            return
        op = ReduceOp.SUM if first.reduce_op == ReduceOp.AVERAGE else ReduceOp(first.reduce_op)
        post = self._post_factor(first)
        # Tensors big enough that a copy costs more than a collective of their own are
        # reduced where they lie; the rest are packed.  The split depends on sizes only, so
        # every rank (a joined one too) issues the same collectives in the same order.
        in_flight_direct = []
        direct_bytes = self.params.inplace_threshold_bytes
        if direct_bytes:
            packed, big = self._split_by_size(group, direct_bytes)
            start = time.monotonic() if rec is not None else 0.0
            direct = []
            for resp in big:
                entry = entries.get(resp.name)
                direct.append((self._target(resp, entry), entry, resp))
            if direct:
                works = self.backend.allreduce_scaled_many_async_(
                    [flat for flat, _, _ in direct], op, first.prescale, post
                )
                in_flight_direct = [(w, e, r) for w, (_, e, r) in zip(works, direct)]
            group = packed
        if group:
            self._allreduce_packed(group, entries, complete, op, post)
        for work, entry, resp in in_flight_direct:
            work.wait()
            if rec is not None:
                self._span(COLLECTIVE, [resp], start)
            if entry is not None:
                complete(entry, entry.output)

    def _split_by_size(self, group, direct_bytes: int) -> tuple:
        """``(packed, direct)``: the group's responses under ``direct_bytes`` and the rest.
        A group of many is split once: its packed part is then the same list on every step,
        which :meth:`_layout` recognizes."""
        key = (id(group), direct_bytes)
        known = self._splits.get(key) if len(group) >= _REMEMBER_FROM else None
        if known is not None and known[0] is group:
            return known[1], known[2]
        if self.backend.shares_buckets():  # zero-copy buckets: never packed
            prefix = BUCKET_NAME_PREFIX
            packed = [r for r in group if r.nbytes < direct_bytes and not r.name.startswith(prefix)]
            direct = (
                [r for r in group if r.nbytes >= direct_bytes or r.name.startswith(prefix)]
                if len(packed) < len(group)
                else []
            )
        else:
            packed = [r for r in group if r.nbytes < direct_bytes]
            direct = (
                [r for r in group if r.nbytes >= direct_bytes] if len(packed) < len(group) else []
            )
        if len(packed) == len(group):
            packed = group
        if len(group) >= _REMEMBER_FROM:
            if len(self._splits) >= _MAX_LAYOUTS:
                self._splits.clear()
            self._splits[key] = (group, packed, direct)
        return packed, direct

    def _layout(self, group) -> tuple:
        """``(sizes, chunks, views)`` of a packed group: its tensors' element counts, its
        pipeline chunks ``(first, end, offset, count)``, and a dict in which the unpacking
        keeps the views of result regions it saw (:meth:`_result_pieces`).  Remembered for
        groups of many tensors, whose every step would otherwise rebuild them all."""
        chunk_elems = self.backend.pipeline_chunk_bytes(self.params.fusion_chunk_bytes) // itemsize(
            group[0].dtype
        )
        if len(group) < _REMEMBER_FROM:
            sizes = [r.numel for r in group]
            return sizes, list(_chunks(sizes, chunk_elems)), None
        key = id(group)
        known = self._layouts.get(key)
        if known is not None and known[0] is group and known[1] == chunk_elems:
            return known[2]
        if len(self._layouts) >= _MAX_LAYOUTS:
            self._layouts.clear()
        sizes = [r.numel for r in group]
        layout = (sizes, list(_chunks(sizes, chunk_elems)), {})
        self._layouts[key] = (group, chunk_elems, layout)  # the group itself keeps its id
        return layout

    def _result_pieces(self, views, region, lo: int, sizes):
        """Views of ``region`` cut at ``sizes`` (those of tensors ``lo...``), kept in the
        group's ``views`` (None: not kept): a result in a shared-memory slot lies where an
        earlier step's did, so it is cut once, not on every step.  (Views of the fusion
        buffer are not kept: they would keep a buffer that has since grown alive.)"""
        if views is None:
            return self._kind.pieces(region, sizes)
        key = (lo, self._kind.address(region))
        pieces = views.get(key)
        if pieces is None:
            pieces = views[key] = self._kind.pieces(region, sizes)
        return pieces

    def _allreduce_packed(self, group, entries, complete, op, post) -> None:
        first = group[0]
        sizes, chunks, views = self._layout(group)
        flat_of = self._flat
        buf = self.buffers.get(first.dtype, sum(sizes))
        flats, out_flats, done = [], [], []
        for resp in group:
            entry = entries.get(resp.name)
            if entry is None:  # joined: contribute a neutral value, discard the result
                flat = self._kind.full(
                    resp.numel, fusion.neutral(resp.dtype, resp.reduce_op), resp.dtype
                )
                flats.append(flat)
                out_flats.append(flat)
                done.append(None)
            else:
                # a 1-D buffer is its own flat view (skips a view call per tensor)
                t = entry.tensor
                flat = t if t.ndim == 1 else flat_of(t)
                flats.append(flat)
                out = entry.output
                out_flats.append(flat if out is t else out if out.ndim == 1 else flat_of(out))
                done.append(entry)
        # Pipeline: pack chunk k+1 while chunk k is on the wire, unpack chunk k while
        # chunk k+1 is; each chunk's handles complete as soon as its data is back.
        in_flight = []
        rec = self._rec
        dtype = buf.dtype
        for chunk, (lo, hi, off, count) in enumerate(chunks):
            staged = self.backend.stage(dtype, count)
            if staged is not None:
                self._allreduce_staged(
                    staged,
                    group,
                    lo,
                    hi,
                    chunk,
                    flats,
                    out_flats,
                    sizes,
                    done,
                    complete,
                    op,
                    post,
                    views,
                )
                continue
            region = buf[off : off + count]
            start = time.monotonic() if rec is not None else 0.0
            self._pack_scaled(flats[lo:hi], region, sizes[lo:hi], first.prescale)
            if rec is not None:
                start = self._span(COPY_IN, group[lo:hi], start, chunk)
            in_flight.append(
                (self.backend.allreduce_async_(region, op), region, lo, hi, chunk, start)
            )
            if len(in_flight) > 1:
                self._finish_chunk(in_flight.pop(0), post, group, sizes, out_flats, done, complete)
        for item in in_flight:
            self._finish_chunk(item, post, group, sizes, out_flats, done, complete)

    def _allreduce_staged(
        self,
        staged,
        group,
        lo,
        hi,
        chunk,
        flats,
        out_flats,
        sizes,
        done,
        complete,
        op,
        post,
        views=None,
    ) -> None:
        """One chunk packed straight into the backend's staging area (a shared-memory slot)
        and unpacked straight from where the result lies: two copies fewer."""
        rec = self._rec
        start = time.monotonic() if rec is not None else 0.0
        self._pack(flats[lo:hi], staged)
        self._scale(staged, group[0].prescale)
        if rec is not None:
            start = self._span(COPY_IN, group[lo:hi], start, chunk)
        result = self.backend.allreduce_staged_(staged, op, post)
        if rec is not None:
            start = self._span(COLLECTIVE, group[lo:hi], start, chunk)
        self._kind.copy_all_(out_flats[lo:hi], self._result_pieces(views, result, lo, sizes[lo:hi]))
        if rec is not None:
            self._span(COPY_OUT, group[lo:hi], start, chunk)
        for e in done[lo:hi]:
            if e is not None:
                complete(e, e.output)

    def _finish_chunk(self, item, post: float, group, sizes, out_flats, done, complete) -> None:
        work, region, lo, hi, chunk, start = item
        work.wait()
        if self._rec is not None:
            start = self._span(COLLECTIVE, group[lo:hi], start, chunk)
        self._unpack_scaled(region, out_flats[lo:hi], sizes[lo:hi], post)
        if self._rec is not None:
            self._span(COPY_OUT, group[lo:hi], start, chunk)
        for e in done[lo:hi]:
            if e is not None:
                complete(e, e.output)

    def _pack_scaled(self, flats, region, sizes, factor: float) -> None:
        """Pack ``flats`` into ``region`` multiplied by ``factor``: run by run of about
        ``SCALE_RUN_BYTES``, so each run is scaled while it is still in the cache."""
        if factor == 1.0:
            self._pack(flats, region)
            return
        for lo, hi, off, count in _chunks(sizes, self._scale_run(region)):
            part = region[off : off + count]
            self._pack(flats[lo:hi], part)
            self._scale(part, factor)

    def _unpack_scaled(self, region, outs, sizes, factor: float) -> None:
        """Unpack ``region`` into ``outs`` multiplied by ``factor``, run by run as
        :meth:`_pack_scaled` packs."""
        if factor == 1.0:
            self._unpack(region, outs, sizes)
            return
        for lo, hi, off, count in _chunks(sizes, self._scale_run(region)):
            part = region[off : off + count]
            self._scale(part, factor)
            self._unpack(part, outs[lo:hi], sizes[lo:hi])

    def _scale_run(self, region) -> int:
        return max(1, SCALE_RUN_BYTES // itemsize(self._kind.dtype_name(region)))

    # -- Adasum ---------------------------------------------------------------------------
    def _adasum(self, group, entries, complete, fail) -> None:
        """Adasum of a fused group: one buffer, the rule applied per tensor (adasum.py).

        A dtype or world size Adasum cannot handle fails the group's handles on every rank
        alike (the check depends only on the agreed response), and the runtime goes on.
        """
        first = group[0]
        if adasum.refusal(self.size, first.dtype, first.name) is not None:
            for resp in group:
                entry = entries.get(resp.name)
                if entry is not None:
                    fail(entry, adasum.refusal(self.size, resp.dtype, resp.name))
            return
        start = time.monotonic() if self._rec is not None else 0.0
        sizes = [r.numel for r in group]
        if len(group) == 1:
            entry = entries.get(first.name)
            buf = self._target(first, entry)
            outs, done = [], [entry]
        else:
            buf = self.buffers.get(first.dtype, sum(sizes))
            flats, outs, done = [], [], []
            for resp in group:
                entry = entries.get(resp.name)
                if entry is None:  # joined: a zero vector, which Adasum leaves out
                    flat = self._kind.zeros(resp.numel, resp.dtype)
                    flats.append(flat)
                    outs.append(flat)
                else:
                    flats.append(self._flat(entry.tensor))
                    outs.append(self._flat(entry.output))
                done.append(entry)
            self._pack(flats, buf)
        self._scale(buf, first.prescale)
        adasum.allreduce_(self.backend, buf, sizes, first.name)
        self._scale(buf, first.postscale)
        if outs:
            self._unpack(buf, outs, sizes)
        if self._rec is not None:
            self._span(COLLECTIVE, group, start)
        for entry in done:
            if entry is not None:
                complete(entry, entry.output)

    # -- allgather ------------------------------------------------------------------------
    def _allgather(self, group, entries, complete) -> None:
        k = self._kind
        row_bytes = [numel(r.shape[1:]) * itemsize(r.dtype) for r in group]
        counts = [
            sum(r.first_dims[rank] * rb for r, rb in zip(group, row_bytes))
            for rank in range(self.size)
        ]
        pieces = []
        for resp in group:
            entry = entries.get(resp.name)
            if entry is not None and k.numel(entry.tensor):
                pieces.append(k.as_bytes(entry.tensor))
        if len(pieces) == 1:
            send = pieces[0]
        elif pieces:
            send = k.cat(pieces)
        else:
            send = k.empty(0, "uint8")
        chunks = self.backend.allgather_bytes(send, counts)
        offsets = [0] * self.size
        for resp, rb in zip(group, row_bytes):
            entry = entries.get(resp.name)
            total_rows = sum(resp.first_dims)
            parts = []
            for rank in range(self.size):
                n = resp.first_dims[rank] * rb
                parts.append(chunks[rank][offsets[rank] : offsets[rank] + n])
                offsets[rank] += n
            if entry is None:
                continue
            # a fresh buffer (clone or cat): a slice of the fused bytes may start at an
            # offset the dtype's alignment forbids viewing (e.g. int64 after 3 float32s)
            flat = k.clone(parts[0]) if self.size == 1 else k.cat(parts)
            out = k.view_as(flat, resp.dtype).reshape((total_rows,) + tuple(resp.shape[1:]))
            complete(entry, out)

    # -- broadcast ------------------------------------------------------------------------
    def _broadcast(self, group, entries, complete) -> None:
        k = self._kind
        root = group[0].root
        if len(group) == 1:
            resp = group[0]
            entry = entries.get(resp.name)
            if entry is None:
                scratch = k.empty(tuple(resp.shape), resp.dtype)
                self.backend.broadcast_(scratch, root)
                return
            out = entry.output
            if out is not entry.tensor and self.rank == root:
                k.copy_(out, entry.tensor)
            self.backend.broadcast_(out, root)
            complete(entry, out)
            return
        sizes = [numel(r.shape) * itemsize(r.dtype) for r in group]
        buf = self.buffers.get("uint8", sum(sizes))
        present = [entries.get(r.name) for r in group]
        if self.rank == root:
            k.pack([k.as_bytes(e.tensor) for e in present], buf)
        self.backend.broadcast_(buf, root)
        offset = 0
        for entry, n in zip(present, sizes):
            if entry is not None:
                if self.rank != root or entry.output is not entry.tensor:
                    k.copy_(k.as_bytes(entry.output), buf[offset : offset + n])
                complete(entry, entry.output)
            offset += n

    # -- alltoall / reducescatter -----------------------------------------------------------
    def _alltoall(self, resp, entry, complete) -> None:
        k = self._kind
        rb = numel(resp.shape[1:]) * itemsize(resp.dtype)
        send_rows = resp.splits[self.rank]
        recv_rows = [resp.splits[r][self.rank] for r in range(self.size)]
        if entry is None:  # joined: send nothing, take in (and drop) what comes
            send = k.empty(0, "uint8")
        else:
            send = k.as_bytes(entry.tensor)
        out = self.backend.alltoall_bytes(
            send, [n * rb for n in send_rows], [n * rb for n in recv_rows]
        )
        if entry is None:
            return
        result = k.view_as(out, resp.dtype).reshape((sum(recv_rows),) + tuple(resp.shape[1:]))
        complete(entry, (result, k.tensor(recv_rows, "int32")))

    def _reducescatter(self, resp, entry, complete) -> None:
        if entry is None:  # joined: contribute zeros, drop this rank's slice
            self._reduce(self._kind.zeros(resp.numel, resp.dtype), resp)
            return
        full = self._clone(entry.tensor)
        self._reduce(self._flat(full), resp)
        rows = resp.shape[0] if resp.shape else 1
        base, extra = divmod(rows, self.size)
        start = self.rank * base + min(self.rank, extra)
        count = base + (1 if self.rank < extra else 0)
        complete(entry, self._clone(full[start : start + count]))
