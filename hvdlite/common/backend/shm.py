"""Shared memory between the ranks of one host: collectives without a network round trip.

Gloo mode uses it when every rank can (``GlooBackend._setup_shared_memory``, two
MIN-allreduces at init, so all ranks use it or none does): shared memory is on
(``--no-shared-memory`` / ``HVDLITE_SHARED_MEMORY=0`` turn it off), a host runs more
than one rank (at most 64), every host runs the same number, and every host's
segment was made and mapped.

One segment per host and rendezvous round holds a 4 KiB header (an arrival counter
and a pid per local rank, up to 64; three rows of per-rank progress counters for the
pipelined allreduce; the magic and random tag at its end) and two sets of one slot
per local rank.  A slot holds a fusion chunk plus the in-place threshold, within
4 KiB..64 MiB (:func:`slot_bytes_for`).  Every
collective alternates between the two sets: a rank only writes a set again after
every rank passed the barrier of the collective that used the other set, which
it reaches only after it finished reading this one, so one barrier per phase is
enough.  A barrier is an increment of this rank's counter and a spin (then a
yield, then sleeps: :data:`_SPIN_S` 50 µs, :data:`_YIELD_S` 0.2 ms, then naps of a
quarter of the wait so far, 50 µs to 2 ms) until every counter caught up: microseconds
when the peers are there, and few wake-ups when a peer is still computing (a rank that
launched a bucket waits for one still in its backward pass on the same cores: naps of
50 µs robbed that backward of up to 10 % of its step at np=2).  A waiting rank checks every 0.1 s that its peers' processes
still exist and gives up after the op timeout, naming the rank.

Nothing is ever left behind, whoever is killed when.  The segment never has a
name: local rank 0 makes it with ``memfd_create`` and the others open it through
``/proc/<pid of rank 0>/fd/<fd>`` (allowed to the same user only, like any
process's open files); each mapping then holds the memory, which the kernel frees
with the last one, whatever way the processes end.  A segment with a name in
/dev/shm (how earlier versions did it) stayed from its creation until every rank
had mapped it and rank 0 removed the name: a SIGKILL of the launcher (whose ranks
die with it) or of rank 0 in that window left the file for good, since no process
of the job survived to remove it.  Rank 0 keeps its fd open only until every rank
reported its mapping (or failed), then closes it (Python's mmap keeps a duplicate
per mapping, which goes with the process too).  A rank whose ticket leads to a
recycled pid's or fd's file finds another size or not the random tag rank 0 wrote
at the end of the header, and maps nothing (:meth:`SharedMemoryGroup.attach`
checks both before writing a byte).

Named segments of dead jobs (left by earlier versions) are removed by the next job's
local rank 0 (``shm_leftovers``).

Allreduce is a reduce-scatter in place: each local rank reduces its slice of
everyone's slot into slot 0; a multi-host job then allreduces that slice with
the ranks of the same local rank on the other hosts (``cross``); everyone copies
the result out, multiplied by the op's postscale (the input by its prescale on the way
in), so scaling costs no pass of its own.  On one host a tensor of several pieces is
pipelined on per-piece progress counters instead of two barriers a piece
(:meth:`SharedMemoryGroup._pipelined_allreduce`); there a rank copies in only its peers'
slices of each piece and reduces its own slice straight from its tensor.  A piece is
:data:`PIECE_BYTES` (1 MiB) or a quarter of a slot, whichever is smaller, and pieces
cycle through four places of each rank's slot.  Across hosts a piece is a quarter of a
slot, and while one piece's slice is on the wire between the hosts the rank copies in, sums
and copies out the pieces around it (:meth:`SharedMemoryGroup._pipelined_across`); a
fusion chunk packed into the slot still goes through it with two barriers, its slice's
cross-host reduction between them.  When a host's ranks outnumber its cores, pieces stay
slot-sized, two barriers each.  Each slice is reduced by one rank
only, so every rank gets the same bits; without a prescale the terms are combined in
rank order (with one, this rank's own term comes first).  Ordering between
the counter store and the data relies on the stores of one process becoming visible in
order (x86's memory model).

Tensors that lie in the ranks' bucket arenas (``shared_buckets``: ``DistributedOptimizer``'s
buckets) skip the slots altogether (:meth:`SharedMemoryGroup.zero_copy_`): after one barrier
on which every rank posts a signature of its tensors' offsets (so all take this path or
none does), each rank reduces its slice of each piece from every rank's tensor into its own,
and copies the other slices' results out of their reducers' tensors; the same arithmetic in
the same order as the copying paths, so the same bits.
"""

import hashlib
import mmap
import os
import time
from typing import List, Optional

import numpy as np

from hvdlite.common import arrays
from hvdlite.common.arrays import lazy_torch
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.engine.message import ReduceOp

SHM_DIR = "/dev/shm"
#: file-name prefix of named segments (earlier versions made them; leftovers go by it)
PREFIX = "hvdlite-"
#: what /proc/<pid>/fd/<fd> of a segment reads as ("/memfd:hvdlite-shm (deleted)")
MEMFD_NAME = "hvdlite-shm"
HEADER_BYTES = 4096
MAX_LOCAL = 64          # counters fill int64 0..63 of the header, pids 64..127
PIDS_AT = 64
#: then three rows of per-rank progress counters of the pipelined allreduce: pieces copied
#: in, reduced, copied out (monotonic over the segment's life, like the barrier's counters)
_PROGRESS_AT = 128
_COPIED_IN, _REDUCED, _COPIED_OUT = range(3)
#: then each rank's signature of the zero-copy allreduce it is about to run (0: it cannot)
_ZERO_COPY_AT = _PROGRESS_AT + 3 * MAX_LOCAL
#: zero-copy across hosts: pieces whose cross-host reduction runs while the next is summed
_CROSS_IN_FLIGHT = 2
#: zero-copy plans kept per group (each holds views, so the buckets' memory, alive)
_MAX_PLANS = 16
#: pieces of one rank's slot the pipelined allreduce cycles through: a rank copies piece k in
#: while its peers still reduce piece k - 1 and copy piece k - 2 out
_RING = 4
_TAG_AT = HEADER_BYTES - 32   # magic and the creator's random tag close the header
_MAGIC = b"hvdlite-shm-v2\0\0"
PID_MAX = 1 << 22       # Linux's largest pid_max: bigger numbers in a header are no pids
_ALIGN = 64
_SPIN_S = 50e-6          # busy-wait this long before yielding the CPU
_YIELD_S = 2e-4          # then yield for this long before sleeping between checks
_NAP_S = 50e-6           # the shortest nap;
_NAP_SHARE = 0.25        # a nap is this share of the wait so far,
_MAX_NAP_S = 2e-3        # and at most this long
_CHECK_PEERS_S = 0.1
#: on one host, big tensors are reduced a piece of this many bytes at a time: the piece's
#: copy in, reduction and copy out then stay in the CPU's caches (a slot-sized piece made
#: every one of the three passes go to memory: BERT-base's 418 MiB took 105 ms, in 1 MiB
#: pieces 72 ms at np=2).  Between hosts pieces are a slot (zero-copy) or a quarter of
#: one (the copying pipeline), so each Gloo message is big; when the host's ranks outnumber
#: its cores the slot size stays: every piece costs two barriers, and a barrier then waits
#: for the scheduler to run each rank in turn
PIECE_BYTES = 1 << 20


def available() -> bool:
    """Whether this host can make nameless segments that its other processes can map."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


def _layout(local_size: int, slot_bytes: int):
    """Slot size rounded up to the alignment, and the segment's total size."""
    slot = (slot_bytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return slot, HEADER_BYTES + 2 * local_size * slot


class SharedMemoryGroup:
    """The local ranks of one host, exchanging through one mapped segment.

    Made in two steps so the ranks can meet in between: local rank 0 calls
    :meth:`create` and hands its :attr:`ticket` to the others, who :meth:`attach` with
    it; when every rank has attached (or failed to), rank 0 calls :meth:`unlink`.
    Called from the background thread only.
    """

    def __init__(self, mapping: mmap.mmap, address: str, local_rank: int, local_size: int,
                 slot_bytes: int, job_ranks: List[int], timeout_s: float):
        self.address = address
        self.local_rank, self.local_size = local_rank, local_size
        self.slot_bytes = slot_bytes
        self.job_ranks = job_ranks
        self.timeout_s = timeout_s
        self._oversubscribed = local_size > _cores()
        self._map = mapping
        self._fd: Optional[int] = None      # rank 0's memfd, until every rank mapped it
        self._path: Optional[str] = None    # a named segment's file, until then too
        self.ticket = ""
        torch = lazy_torch()
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        header = np.frombuffer(self._map, dtype=np.int64, count=HEADER_BYTES // 8)
        self._counters = header[:local_size]
        self._pids = header[PIDS_AT:PIDS_AT + local_size]
        self._pids[local_rank] = os.getpid()
        self._generation = int(self._counters[local_rank])
        at = _PROGRESS_AT
        self._progress = [header[at + p * MAX_LOCAL:at + p * MAX_LOCAL + local_size]
                          for p in range(3)]
        self._pieces = int(self._progress[_COPIED_OUT][local_rank])
        self._signatures = header[_ZERO_COPY_AT:_ZERO_COPY_AT + local_size]
        #: the bucket arenas of this host's ranks (``shared_buckets.PeerArenas``), set by the
        #: backend once every local rank mapped every other's; None: no zero-copy
        self.arenas = None
        self._own_arena = None
        self._scratch = None
        #: zero-copy plans by signature (see _zero_copy_plan)
        self._zero_copy_plans = {}
        self._set = 0
        self._last_peer_check = 0.0
        #: elastic jobs: a ``gloo_waits.RoundWatch``; a wait ends once a newer round is open
        #: (a local peer that moved on to it will never come back to this collective)
        self.watch = None

    @classmethod
    def create(cls, local_size, slot_bytes, job_ranks, timeout_s, path=None):
        """A new segment, nameless unless ``path`` is given (tests name one to play an
        earlier version's leftover).  Its :attr:`ticket` tells :meth:`attach` where it is.

        Raises:
            HvdliteInternalError: more local ranks than the header has room for.
            OSError: the memory could not be had.
        """
        if not 1 <= local_size <= MAX_LOCAL:
            raise HvdliteInternalError(f"shared memory holds 1..{MAX_LOCAL} local ranks, "
                                       f"not {local_size}")
        slot, total = _layout(local_size, slot_bytes)
        if path is None:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
            address = f"/proc/{os.getpid()}/fd/{fd}"
        else:
            fd, address = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), path
        try:
            os.ftruncate(fd, total)
            mapping = mmap.mmap(fd, total)
        except BaseException:
            os.close(fd)
            if path is not None:
                os.unlink(path)
            raise
        tag = os.urandom(16)
        group = cls(mapping, address, 0, local_size, slot, job_ranks, timeout_s)
        mapping[_TAG_AT:HEADER_BYTES] = _MAGIC + tag
        group.ticket = f"{address} {tag.hex()}"
        if path is None:
            group._fd = fd
        else:
            os.close(fd)
            group._path = path
        return group

    @classmethod
    def attach(cls, ticket: str, local_rank, local_size, slot_bytes, job_ranks, timeout_s):
        """Map the segment whose :attr:`ticket` rank 0 handed out.

        Raises:
            HvdliteInternalError: what ``ticket`` names is not that segment (its creator
                died and the pid or fd now belongs to something else).
            OSError: it cannot be opened (gone, or another pid namespace's).
        """
        address, tag = ticket.rsplit(" ", 1)
        slot, total = _layout(local_size, slot_bytes)
        fd = os.open(address, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != total:
                raise HvdliteInternalError(
                    f"local rank {local_rank}: {address} holds {size} bytes, not the "
                    f"{total} of this job's shared-memory segment")
            mapping = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        if mapping[_TAG_AT:HEADER_BYTES] != _MAGIC + bytes.fromhex(tag):
            mapping.close()
            raise HvdliteInternalError(f"local rank {local_rank}: {address} is not this "
                                       f"job's shared-memory segment (its tag differs)")
        return cls(mapping, address, local_rank, local_size, slot, job_ranks, timeout_s)

    def unlink(self) -> None:
        """Make the segment unreachable (close rank 0's fd, or remove a named one's
        file); the memory lives on while any rank has it mapped."""
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)
        path, self._path = getattr(self, "_path", None), None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        self._zero_copy_plans = {}
        arenas, self.arenas = getattr(self, "arenas", None), None
        if arenas is not None:
            arenas.close()
        m, self._map = getattr(self, "_map", None), None
        self._bytes = None
        self._counters = self._pids = self._progress = None
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass     # a view still exists; the mapping goes with the process

    # -- synchronisation --------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every local rank reached the same barrier (same count of calls)."""
        self._generation += 1
        g = self._generation
        counters = self._counters
        counters[self.local_rank] = g
        if min(counters.tolist()) < g:
            self._wait_all(counters, g)

    def _wait_all(self, counters, g: int) -> None:
        """Wait until every local rank's entry of ``counters`` reached ``g``: a short spin,
        then yields, then naps; peers are checked every 0.1 s and given the op timeout.
        (``min(counters.tolist())`` reads the few counters in a fifth of the time of
        ``counters.min()``; the pipeline checks three counters per piece.)"""
        start = time.perf_counter()
        while time.perf_counter() - start < _SPIN_S:
            if min(counters.tolist()) >= g:
                return
        while True:
            now = time.perf_counter()
            if min(counters.tolist()) >= g:
                return
            waited = now - start
            if waited < _YIELD_S:
                os.sched_yield()
            else:
                # a nap a quarter of the wait so far: a peer still computing (a backward
                # pass on the same cores) is not robbed by thousands of wake-ups, and one
                # that arrives is noticed within a quarter of the time already waited
                time.sleep(min(max(_NAP_S, waited * _NAP_SHARE), _MAX_NAP_S))
            if now - self._last_peer_check > _CHECK_PEERS_S:
                self._last_peer_check = now
                self._check_peers(counters, g, waited)

    def _check_peers(self, counters, g: int, waited: float) -> None:
        if self.watch is not None:
            self.watch.check("shared-memory collective")
        late = [r for r in range(self.local_size) if counters[r] < g]
        for r in late:
            pid = int(self._pids[r])
            if pid <= 0:
                continue                   # not attached yet: only the timeout applies
            if process_gone(pid):
                raise HvdliteInternalError(
                    f"rank {self.job_ranks[self.local_rank]}: rank {self.job_ranks[r]} (pid "
                    f"{pid}, same host) exited while its local peers waited for it in a "
                    f"shared-memory collective")
        if waited > self.timeout_s:
            names = [self.job_ranks[r] for r in late]
            raise HvdliteInternalError(
                f"rank {self.job_ranks[self.local_rank]}: ranks {names} (same host) stopped "
                f"answering for {waited:.0f}s in a shared-memory collective "
                f"(--op-timeout-seconds {self.timeout_s:g})")

    # -- slots ------------------------------------------------------------------------------
    def _slot(self, which_set: int, local_rank: int, nbytes: int):
        start = HEADER_BYTES + (which_set * self.local_size + local_rank) * self.slot_bytes
        return self._bytes[start:start + nbytes]

    def _next_set(self) -> int:
        s = self._set
        self._set ^= 1
        return s

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def piece_bytes(self, across_hosts: bool) -> int:
        """How much of a big tensor one reduction step takes (see ``PIECE_BYTES``)."""
        if across_hosts or self._oversubscribed:
            return self.slot_bytes
        return min(self.slot_bytes, PIECE_BYTES)

    # -- collectives ------------------------------------------------------------------------
    def allreduce_(self, tensor, op: ReduceOp, cross=None, prescale: float = 1.0,
                   postscale: float = 1.0, cross_start=None) -> None:
        """Reduce ``tensor`` (contiguous) in place over the local ranks (then, with
        ``cross``, over the hosts: ``cross(slice)`` reduces a slice in place with the
        same local rank of every other host).  ``prescale`` multiplies each rank's input as
        it is copied in and ``postscale`` the result as it is copied out (integers as
        :meth:`ArrayKind.scale_` does): scaling costs no pass of its own.  With
        ``cross_start`` as well (see :meth:`zero_copy_`), a tensor of several pieces runs
        as :meth:`_pipelined_across`."""
        flat = tensor.view(-1)
        if cross is None and not self._oversubscribed and \
                flat.numel() > self._ring_piece(flat.element_size()):
            self._pipelined_allreduce([flat], op, prescale, postscale)
            return
        if cross_start is not None and not self._oversubscribed and \
                flat.numel() > self._cross_piece(flat.element_size()):
            self._pipelined_across([flat], op, prescale, postscale, cross_start)
            return
        per = self.piece_bytes(cross is not None) // flat.element_size()
        n = flat.numel()
        for lo in range(0, max(n, 1), per):
            self._allreduce_chunk(flat[lo:lo + per], op, cross, prescale, postscale)

    def pipelines(self, across_hosts: bool) -> bool:
        """Whether :meth:`allreduce_many_` runs its tensors as one pipeline (no more ranks
        than cores; across hosts, given a ``cross_start``)."""
        return not self._oversubscribed

    def allreduce_many_(self, tensors, op: ReduceOp, prescale: float = 1.0,
                        postscale: float = 1.0, cross=None, cross_start=None) -> None:
        """Reduce contiguous tensors of one dtype in place, in order, as one pipeline through
        all their pieces: its fill and drain are paid once, not per tensor (ResNet-50's 18
        tensors of 2 MiB or more took 12.2 ms one by one, 9.8 ms as one pipeline, np=2).
        Across hosts both ``cross`` and ``cross_start`` (see :meth:`zero_copy_`) are given.
        Only where :meth:`pipelines` says so."""
        flats = [t.view(-1) for t in tensors]
        if len({f.dtype for f in flats}) > 1:
            for f in flats:
                self.allreduce_(f, op, cross, prescale, postscale, cross_start)
            return
        if cross_start is not None:
            self._pipelined_across(flats, op, prescale, postscale, cross_start)
            return
        self._pipelined_allreduce(flats, op, prescale, postscale)

    def _allreduce_chunk(self, chunk, op: ReduceOp, cross, prescale, postscale) -> None:
        nbytes = chunk.numel() * chunk.element_size()
        k = arrays.kind()
        k.scaled_copy_(self._slot(self._set, self.local_rank, nbytes).view(chunk.dtype), chunk,
                       prescale)
        k.scaled_copy_(chunk, self._reduce_set(chunk.dtype, chunk.numel(), op, 1.0, cross),
                       postscale)

    def _ring(self, which_set: int, local_rank: int, dtype, per: int) -> list:
        """The ``_RING`` pieces of ``per`` elements of a rank's slot."""
        nbytes = per * _ITEMSIZE[dtype]
        slot = self._slot(which_set, local_rank, _RING * nbytes)
        return [slot[i * nbytes:(i + 1) * nbytes].view(dtype) for i in range(_RING)]

    def _ring_piece(self, itemsize: int) -> int:
        """Elements of one piece of the pipelined allreduce: ``PIECE_BYTES``, or a quarter
        of a small slot.  A tensor of one piece goes through the slot with two barriers,
        which costs a third of the pipeline's bookkeeping (11 against 32 us at np=2)."""
        return max(1, min(PIECE_BYTES, self.slot_bytes // _RING) // _ALIGN * _ALIGN // itemsize)

    def _pipeline(self, flats, per: int) -> tuple:
        """``(work, base, rings)`` of a pipelined allreduce of ``flats`` in pieces of ``per``
        elements: the pieces ``(flat, lo, hi)``, the progress count before them (taken), and
        every rank's ring in the next slot set."""
        work = [(f, lo, min(f.numel(), lo + per))
                for f in flats for lo in range(0, f.numel(), per)]
        if not work:
            return work, self._pieces, []
        s = self._next_set()
        base, self._pieces = self._pieces, self._pieces + len(work)
        dtype = flats[0].dtype
        return work, base, [self._ring(s, r, dtype, per) for r in range(self.local_size)]

    def _copy_piece_in(self, work, step: int, base: int, mine, prescale) -> None:
        """Piece ``step``'s peers' slices (scaled) into this rank's ring, once every rank
        copied out the piece that used its place; this rank reduces its own where it lies."""
        copied_in, _, copied_out = self._progress
        flat, lo, hi = work[step]
        if step >= _RING:
            self._wait_for(copied_out, base + step - _RING + 1)
        me, k = self.local_rank, arrays.kind()
        a, b = _slice(hi - lo, me, self.local_size)
        ring = mine[step % _RING]
        if a > 0:
            k.scaled_copy_(ring[:a], flat[lo:lo + a], prescale)
        if lo + b < hi:
            k.scaled_copy_(ring[b:hi - lo], flat[lo + b:hi], prescale)
        copied_in[me] = base + step + 1

    def _copy_piece_out(self, work, q: int, base: int, rings, postscale) -> None:
        """Piece ``q``'s peers' slices (scaled) from their reducers' rings, once reduced."""
        _, reduced, copied_out = self._progress
        flat, lo, hi = work[q]
        pos, me, L, k = q % _RING, self.local_rank, self.local_size, arrays.kind()
        self._wait_for(reduced, base + q + 1)
        for r in range(L):
            a, b = _slice(hi - lo, r, L)
            if r != me and b > a:
                k.scaled_copy_(flat[lo + a:lo + b], rings[r][pos][a:b], postscale)
        copied_out[me] = base + q + 1

    def _pipelined_allreduce(self, flats, op: ReduceOp, prescale, postscale) -> None:
        """One host, cores to spare: the tensors (``flats``, one dtype) go through in pieces
        that stay in the caches, and a rank waits only for the pieces it needs, not in
        lockstep: it copies piece k in (scaled by ``prescale``) while its peers still reduce
        piece k - 1 and copy piece k - 2 out (scaled by ``postscale``).  Only the peers'
        slices of a piece travel through this rank's ring: its own slice is reduced from its
        tensor into its ring (where the peers copy it out from) and into its tensor, which
        saves half a piece of copying in and half of copying out at np=2.
        Progress counters in the header say how far each rank got; a rank reuses a ring
        place only once every rank copied out the piece that used it.  Every piece of an op
        waits for every peer to have started the op, so the slot set of the op before last
        is free (as after a barrier)."""
        work, base, rings = self._pipeline(flats, self._ring_piece(flats[0].element_size()))
        pieces = len(work)
        if not pieces:
            return
        L, me = self.local_size, self.local_rank
        copied_in, reduced, _ = self._progress
        for step in range(pieces + 2):
            if step < pieces:                            # copy piece `step` in
                self._copy_piece_in(work, step, base, rings[me], prescale)
            done = step - 1
            if 0 <= done < pieces:                       # reduce my slice of piece `done`
                flat, lo, hi = work[done]
                a, b = _slice(hi - lo, me, L)
                self._wait_for(copied_in, base + done + 1)
                if b > a:
                    pos = done % _RING
                    self._reduce_own_slice(flat[lo + a:lo + b],
                                           [ring[pos][a:b] for ring in rings], op, prescale,
                                           postscale)
                reduced[me] = base + done + 1
            if step >= 2:                                # copy the peers' slices out
                self._copy_piece_out(work, step - 2, base, rings, postscale)

    def _reduce_own_slice(self, own, slices: list, op: ReduceOp, prescale, postscale) -> None:
        """This rank's slice of a piece: ``own`` (where it lies in its tensor) combined with
        the peers' ``slices`` (one per local rank, this rank's being where the result goes,
        for the peers to copy out), then the result (scaled) back into ``own``."""
        self._sum_own_slice(own, slices, op, prescale)
        arrays.kind().scaled_copy_(own, slices[self.local_rank], postscale)

    def _sum_own_slice(self, own, slices: list, op: ReduceOp, prescale) -> None:
        """:meth:`_reduce_own_slice` up to the result in ``slices[local_rank]`` (unscaled)."""
        k, me = arrays.kind(), self.local_rank
        acc = slices[me]
        terms = [own if r == me else slices[r] for r in range(len(slices))]
        if prescale == 1.0 and len(terms) > 1:        # in rank order, as everywhere
            _combine_into(acc, terms[0], terms[1], op)
            rest = terms[2:]
        else:
            k.scaled_copy_(acc, own, prescale)
            rest = terms[:me] + terms[me + 1:]
        for other in rest:
            _combine(acc, other, op)

    def _cross_piece(self, itemsize: int) -> int:
        """Elements of one piece of :meth:`_pipelined_across`: a quarter of the slot (4.5 MiB
        by default), big enough that a Gloo message's fixed cost is small beside its bytes."""
        return max(1, self.slot_bytes // _RING // _ALIGN * _ALIGN // itemsize)

    def _pipelined_across(self, flats, op: ReduceOp, prescale, postscale,
                          cross_start) -> None:
        """:meth:`_pipelined_allreduce` between hosts: once this rank summed its slice of a
        piece over the host, ``cross_start`` puts the slice on the wire, and while it is
        there the rank copies the next piece in and sums it and copies the piece before
        out; so the link is kept busy while the host's memory work runs.  One piece's
        cross-host reduction is waited for only after the next one's started, and a piece is
        marked reduced (for the peers to copy out) once its slice is back.  The same terms
        in the same order as :meth:`_allreduce_chunk`, so the same bits (pieces of
        :meth:`_cross_piece`, through the four places of each rank's slot).

        No wait can close a cycle: piece q is summed and put on the wire at step q + 1,
        waited for at step q + 2 and copied out at step q + 3, so the copy-in of step t, which
        needs piece t - 4 copied out by every rank, waits on step t - 1 at the latest; and a
        piece's cross-host wait needs only the other hosts' same step q + 1."""
        k = arrays.kind()
        work, base, rings = self._pipeline(flats, self._cross_piece(flats[0].element_size()))
        pieces = len(work)
        if not pieces:
            return
        L, me = self.local_size, self.local_rank
        copied_in, reduced, _ = self._progress
        wait_for = self._wait_for
        in_flight = []                       # (piece, own slice, its sum, the wait) in order

        def finish_oldest():                 # its slice back from the hosts: mark it reduced
            q, own, acc, wait = in_flight.pop(0)
            if wait is not None:
                wait()
                k.scaled_copy_(own, acc, postscale)
            reduced[me] = base + q + 1
            if q:
                self._copy_piece_out(work, q - 1, base, rings, postscale)

        for step in range(pieces + 1):
            if step < pieces:                # copy piece `step` in
                self._copy_piece_in(work, step, base, rings[me], prescale)
            done = step - 1
            if done >= 0:                    # sum my slice of piece `done`, put it on the wire
                flat, lo, hi = work[done]
                a, b = _slice(hi - lo, me, L)
                wait_for(copied_in, base + done + 1)
                if b > a:
                    pos = done % _RING
                    slices = [ring[pos][a:b] for ring in rings]
                    self._sum_own_slice(flat[lo + a:lo + b], slices, op, prescale)
                    in_flight.append((done, flat[lo + a:lo + b], slices[me],
                                      cross_start(slices[me], op)))
                else:
                    in_flight.append((done, None, None, None))
                if len(in_flight) > 1:       # one on the wire while the next is summed
                    finish_oldest()
        while in_flight:
            finish_oldest()
        self._copy_piece_out(work, pieces - 1, base, rings, postscale)

    def _wait_for(self, counters, g: int) -> None:
        if min(counters.tolist()) < g:
            self._wait_all(counters, g)

    # -- zero-copy buckets ------------------------------------------------------------------
    def use_arenas(self, arenas, own) -> None:
        """Reduce tensors that lie in ``own`` (this rank's ``BucketArena``) where they lie,
        reading the peers' tensors at the same offsets of their arenas (``arenas``)."""
        self.arenas, self._own_arena = arenas, own

    def _signature(self, flats, op: ReduceOp, prescale: float, across: bool) -> int:
        """What every rank must agree on to reduce ``flats`` in their arenas: the offsets,
        sizes and dtype of the tensors, the op (0: this rank cannot)."""
        if prescale != 1.0 or not flats:
            return 0
        own = self._own_arena
        places = []
        for f in flats:
            at = own.offset_of(f)
            if at < 0 or not f.is_contiguous():
                return 0
            places.append((at, f.numel()))
        key = repr((places, str(flats[0].dtype), int(op), across)).encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 2 | 1

    def zero_copy_(self, flats, op: ReduceOp, prescale: float = 1.0, postscale: float = 1.0,
                   cross=None, cross_start=None) -> bool:
        """Allreduce ``flats`` (contiguous, one dtype) in place without copying them in or out,
        when every local rank's tensors lie at the same offsets of its bucket arena; returns
        False (nothing done, every rank agreeing) otherwise, for the copying path.

        Each rank sums its slice of each piece over every rank's tensor, in rank order, into
        its own tensor (then, with ``cross``, with the same local rank of the other hosts, then
        scales it by ``postscale``), and copies the other slices' results from their reducers'
        tensors: the same operations in the same order as the copying paths, so the same
        bits.  A rank returns only once every peer copied out of its tensor, so it may write
        it again (the next backward) at once.

        Across hosts, ``cross_start(slice, op)`` (when given, instead of ``cross``) starts a
        slice's cross-host reduction and returns the call that waits for it: the next
        piece's local sum then runs while the previous piece is on the wire
        (:data:`_CROSS_IN_FLIGHT` pieces at most)."""
        if self.arenas is None or len({f.dtype for f in flats}) > 1:
            return False
        across = cross is not None
        sig = self._signature(flats, op, prescale, across)
        self._signatures[self.local_rank] = sig
        self.barrier()
        if sig == 0 or min(self._signatures.tolist()) != max(self._signatures.tolist()):
            return False
        plan = self._zero_copy_plans.get(sig)
        if plan is None:
            plan = self._zero_copy_plan(flats, across)
            if len(self._zero_copy_plans) >= _MAX_PLANS:
                self._zero_copy_plans.clear()
            self._zero_copy_plans[sig] = plan
        pieces = len(plan)
        base, self._pieces = self._pieces, self._pieces + pieces
        copied_in, reduced, copied_out = self._progress
        me = self.local_rank
        scale, wait_for = arrays.kind().scale_, self._wait_for
        sum_terms = self._sum_terms
        if cross_start is not None:
            self._zero_copy_across(plan, base, op, postscale, cross_start)
            return True
        for step in range(pieces + 1):
            if step < pieces:                         # reduce my slice of piece `step`
                terms = plan[step][0]
                if terms is not None:
                    sum_terms(terms, op)
                    if cross is not None:
                        cross(terms[me], op)
                    scale(terms[me], postscale)
                reduced[me] = base + step + 1
            if step:                                  # the peers' slices of the piece before
                wait_for(reduced, base + step)
                for dst, src in plan[step - 1][1]:
                    dst.copy_(src)
        copied_in[me] = base + pieces
        copied_out[me] = base + pieces
        self._wait_for(copied_out, base + pieces)
        return True

    def _zero_copy_across(self, plan, base: int, op: ReduceOp, postscale: float,
                          cross_start) -> None:
        """:meth:`zero_copy_` between hosts: piece k's slice is on the wire while piece k+1 is
        summed; a piece is marked reduced once back (and scaled), in order, and the peers'
        slices of the piece before it are copied out then."""
        copied_in, reduced, copied_out = self._progress
        me, pieces = self.local_rank, len(plan)
        if not pieces:
            return
        scale, wait_for = arrays.kind().scale_, self._wait_for
        in_flight = []
        finished = 0

        def finish_oldest():
            nonlocal finished
            part, wait = in_flight.pop(0)
            if part is not None:
                wait()
                scale(part, postscale)
            reduced[me] = base + finished + 1
            if finished:                      # the peers' slices of the piece before
                wait_for(reduced, base + finished)
                for dst, src in plan[finished - 1][1]:
                    dst.copy_(src)
            finished += 1

        for step in range(pieces):
            terms = plan[step][0]
            if terms is None:
                in_flight.append((None, None))
            else:
                self._sum_terms(terms, op)
                in_flight.append((terms[me], cross_start(terms[me], op)))
            if len(in_flight) > _CROSS_IN_FLIGHT:
                finish_oldest()
        while in_flight:
            finish_oldest()
        wait_for(reduced, base + pieces)
        for dst, src in plan[pieces - 1][1]:
            dst.copy_(src)
        copied_in[me] = base + pieces
        copied_out[me] = base + pieces
        wait_for(copied_out, base + pieces)

    def _zero_copy_plan(self, flats, across: bool) -> list:
        """The pieces of a zero-copy allreduce of ``flats`` (which lie in this rank's arena):
        per piece, the views of every rank's term of this rank's slice (None: it has none)
        and the (destination, source) views of the peers' slices to copy out.  Made once per
        set of tensors (a step's buckets repeat), so a piece costs its arithmetic only."""
        L, me = self.local_size, self.local_rank
        itemsize = flats[0].element_size()
        dtype = flats[0].dtype
        views = self.arenas.views
        if across or self._oversubscribed:
            per = self.piece_bytes(across) // itemsize
        else:
            per = self._ring_piece(itemsize)
        plan = []
        for f in flats:
            at, n = self._own_arena.offset_of(f), f.numel() * itemsize
            tensors = [f if r == me else views[r][at:at + n].view(dtype) for r in range(L)]
            for lo in range(0, f.numel(), per):
                hi = min(f.numel(), lo + per)
                a, b = _slice(hi - lo, me, L)
                terms = [t[lo + a:lo + b] for t in tensors] if b > a else None
                out = []
                for r in range(L):
                    a, b = _slice(hi - lo, r, L)
                    if r != me and b > a:
                        out.append((f[lo + a:lo + b], tensors[r][lo + a:lo + b]))
                plan.append((terms, out))
        return plan

    def _sum_terms(self, terms, op: ReduceOp) -> None:
        """``terms[me] := terms[0] (op) terms[1] (op) ...`` in rank order, as the copying
        paths combine.  Local rank 0 (and 1, but for bool, which copies the first term
        first) combine into their own term directly (each element is read before it is
        written); the others through a scratch piece, since their own term comes later."""
        me = self.local_rank
        out = terms[me]
        if len(terms) == 1:
            return
        if me == 0 or (me == 1 and out.dtype != lazy_torch().bool):   # bool copies first
            _combine_into(out, terms[0], terms[1], op)
            for t in terms[2:]:
                _combine(out, t, op)
            return
        n = out.numel()
        s = self._scratch
        if s is None or s.numel() < n or s.dtype != out.dtype:
            s = self._scratch = lazy_torch().empty(max(n, 1), dtype=out.dtype)
        acc = s[:n]
        _combine_into(acc, terms[0], terms[1], op)
        for t in terms[2:]:
            _combine(acc, t, op)
        out.copy_(acc)

    def stage(self, dtype, count: int):
        """This rank's slot of the next collective, as ``count`` elements of ``dtype`` (None
        if they do not fit): a caller that packs its data here saves the copy in.  The next
        call on this group must be :meth:`allreduce_staged_`."""
        nbytes = count * _ITEMSIZE[dtype]
        if nbytes > self.slot_bytes:
            return None
        return self._slot(self._set, self.local_rank, nbytes).view(dtype)

    def allreduce_staged_(self, staged, op: ReduceOp, scale: float, cross=None):
        """Reduce what :meth:`stage` handed out; returns the result, scaled by ``scale``
        (each rank scales the slice it reduced), valid until the collective after next."""
        return self._reduce_set(staged.dtype, staged.numel(), op, scale, cross)

    def _reduce_set(self, dtype, n: int, op: ReduceOp, scale: float, cross):
        """Every rank's slot of the next set holds ``n`` elements: each rank reduces its
        slice of them into slot 0 (then across hosts with ``cross``, then scales it);
        returns slot 0, the whole result once every rank passed the second barrier."""
        nbytes = n * _ITEMSIZE[dtype]
        s = self._next_set()
        L = self.local_size
        self.barrier()
        part = (n + L - 1) // L
        lo, hi = min(self.local_rank * part, n), min((self.local_rank + 1) * part, n)
        result = self._slot(s, 0, nbytes).view(dtype)
        if hi > lo:
            acc = result[lo:hi]
            for r in range(1, L):
                _combine(acc, self._slot(s, r, nbytes).view(dtype)[lo:hi], op)
            if cross is not None:
                cross(acc, op)
            arrays.kind().scale_(acc, scale)
        self.barrier()
        return result

    def allgather_bytes(self, send, counts: List[int]) -> list:
        """Every local rank's uint8 ``send`` (``counts[r]`` bytes each, each fitting a
        slot), as new tensors in local-rank order."""
        s = self._next_set()
        n = counts[self.local_rank]
        if n:
            self._slot(s, self.local_rank, n).copy_(send[:n])
        self.barrier()
        out = [self._slot(s, r, counts[r]).clone() for r in range(self.local_size)]
        return out

    def allgather_fixed(self, buf: np.ndarray) -> np.ndarray:
        torch = lazy_torch()
        rows = self.allgather_bytes(torch.from_numpy(buf), [buf.size] * self.local_size)
        return torch.cat(rows).numpy()

    def broadcast_(self, tensor, root: int) -> None:
        flat = tensor.view(-1).view(lazy_torch().uint8)
        n = flat.numel()
        for lo in range(0, max(n, 1), self.slot_bytes):
            piece = flat[lo:lo + self.slot_bytes]
            s = self._next_set()
            if self.local_rank == root:
                self._slot(s, root, piece.numel()).copy_(piece)
            self.barrier()
            if self.local_rank != root:
                piece.copy_(self._slot(s, root, piece.numel()))

    def alltoall_bytes(self, send, send_counts: List[int], recv_counts: List[int]):
        """Each local rank's ``send_counts[r]`` bytes go to local rank r.  The sender's
        counts travel in front of its data, so receivers find their part."""
        torch = lazy_torch()
        L = self.local_size
        head = 8 * L
        s = self._next_set()
        total = sum(send_counts)
        slot = self._slot(s, self.local_rank, head + total)
        slot[:head].view(torch.int64).copy_(torch.tensor(send_counts, dtype=torch.int64))
        if total:
            slot[head:head + total].copy_(send[:total])
        self.barrier()
        out = torch.empty(sum(recv_counts), dtype=torch.uint8)
        at = 0
        for r in range(L):
            counts = self._slot(s, r, head).view(torch.int64).tolist()
            offset = head + sum(counts[:self.local_rank])
            n = counts[self.local_rank]
            if n:
                out[at:at + n].copy_(self._slot(s, r, offset + n)[offset:])
            at += n
        return out


class _Itemsize(dict):
    def __missing__(self, dtype):
        size = lazy_torch().empty(0, dtype=dtype).element_size()
        self[dtype] = size
        return size


_ITEMSIZE = _Itemsize()


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not yet reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")


def _slice(m: int, rank: int, size: int):
    """``(start, end)`` of ``rank``'s share of a piece of ``m`` elements."""
    part = (m + size - 1) // size
    return min(rank * part, m), min((rank + 1) * part, m)


def _combine_into(out, a, b, op: ReduceOp) -> None:
    """``out := a (op) b``: :func:`_combine` without a copy of ``a`` first."""
    torch = lazy_torch()
    if out.dtype == torch.bool and op in (ReduceOp.SUM, ReduceOp.PRODUCT):
        out.copy_(a)
        _combine(out, b, op)
    elif op == ReduceOp.SUM:
        torch.add(a, b, out=out)
    elif op == ReduceOp.MIN:
        torch.minimum(a, b, out=out)
    elif op == ReduceOp.MAX:
        torch.maximum(a, b, out=out)
    elif op == ReduceOp.PRODUCT:
        torch.mul(a, b, out=out)
    else:
        raise ValueError(f"shared-memory allreduce: unsupported op {op!r}")


def _combine(acc, other, op: ReduceOp) -> None:
    torch = lazy_torch()
    if op == ReduceOp.SUM:
        if acc.dtype == torch.bool:
            acc.logical_or_(other)
        else:
            acc.add_(other)
    elif op == ReduceOp.MIN:
        torch.minimum(acc, other, out=acc)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    elif op == ReduceOp.PRODUCT:
        acc.mul_(other)
    else:
        raise ValueError(f"shared-memory allreduce: unsupported op {op!r}")


def slot_bytes_for(fusion_chunk_bytes: int, inplace_threshold_bytes: int = 0) -> int:
    """Slots that hold a pipelined fusion chunk (default 16 MiB; a chunk may overrun by
    less than one packed tensor, which is below the in-place threshold), within 4 KiB..64
    MiB."""
    return max(4096, min(int(fusion_chunk_bytes) + int(inplace_threshold_bytes), 64 << 20))
