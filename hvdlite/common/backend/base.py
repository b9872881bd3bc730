"""The transport interface the background thread drives.

One backend object belongs to one ``init()``; every method is called from the
runtime's background thread only (never concurrently), on contiguous CPU
buffers of the process's array kind (:mod:`hvdlite.common.arrays`: torch tensors, or numpy
arrays in a job without torch, which only the MPI and local backends serve).
Implementations: :mod:`.gloo` (torch.distributed's Gloo), :mod:`.mpi` (mpi4py) and
:mod:`.local` (a 1-rank job).
"""

import abc
import struct
from typing import List

import numpy as np

from hvdlite.common import arrays
from hvdlite.common.engine.message import ReduceOp

_LEN = struct.Struct("!I")


class Waitable:
    """What an async collective returns."""

    def wait(self) -> None:
        """Block until done; raise HvdliteInternalError on failure."""


#: what an async collective that finished before returning gives back (every backend's
#: synchronous fallbacks)
DONE = Waitable()


class _ScaledWhenDone(Waitable):
    """An allreduce whose result is multiplied by ``factor`` once it is there."""

    def __init__(self, work: Waitable, tensor, factor: float):
        self._work, self._tensor, self._factor = work, tensor, factor

    def wait(self) -> None:
        self._work.wait()
        arrays.kind().scale_(self._tensor, self._factor)


class Backend(abc.ABC):
    """Collectives over all ranks of the job, and the exchanges between two ranks that
    op=Adasum is built from (:meth:`sendrecv_`, :meth:`block_allreduce_`).

    Every method blocks until the collective finished on this rank and raises
    :class:`hvdlite.common.exceptions.HvdliteInternalError` (or a subclass)
    when a peer failed or the backend's timeout (``Config.op_timeout_s``)
    passed; after such an error the backend is unusable.

    A new backend sets ``rank``, ``size``, ``local_rank``, ``local_size``,
    ``cross_rank`` and ``cross_size`` when it is built, and ``round`` (the
    rendezvous round it joined) if it joins rounds: ``init()`` remembers that
    round for the next one.  ``basics._make_backend`` chooses it from
    ``Config.cpu_operations``.
    """

    name = "abstract"
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    # -- control plane ----------------------------------------------------------------------
    @abc.abstractmethod
    def control_allreduce_min(self, vec: np.ndarray) -> np.ndarray:
        """Elementwise MIN of an int32 vector over all ranks (the per-cycle agreement)."""

    def control_allgather(self, payload: bytes, max_len: int) -> List[bytes]:
        """Every rank's ``payload`` (at most ``max_len`` bytes), in rank order."""
        width = max_len + _LEN.size
        buf = np.zeros(width, dtype=np.uint8)
        buf[: _LEN.size] = np.frombuffer(_LEN.pack(len(payload)), dtype=np.uint8)
        buf[_LEN.size : _LEN.size + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        rows = self._allgather_fixed(buf).reshape(self.size, width)
        out = []
        for row in rows:
            (n,) = _LEN.unpack(row[: _LEN.size].tobytes())
            out.append(row[_LEN.size : _LEN.size + n].tobytes())
        return out

    @abc.abstractmethod
    def _allgather_fixed(self, buf: np.ndarray) -> np.ndarray:
        """Concatenation of every rank's equally sized uint8 ``buf``, in rank order."""

    # -- data plane -------------------------------------------------------------------------
    @abc.abstractmethod
    def allreduce_(self, tensor, op: ReduceOp) -> None:
        """Reduce ``tensor`` in place with SUM, MIN, MAX or PRODUCT."""

    def allreduce_async_(self, tensor, op: ReduceOp) -> "Waitable":
        """Start :meth:`allreduce_`; the result is valid after ``.wait()``.

        Several may be in flight; they complete in the order started.  The
        default runs synchronously."""
        self.allreduce_(tensor, op)
        return DONE

    def allreduce_scaled_(self, tensor, op: ReduceOp, prescale: float, postscale: float) -> None:
        """:meth:`allreduce_` of ``tensor * prescale``, the result multiplied by
        ``postscale`` (integers in float64, truncated toward zero, as Horovod scales: see
        :meth:`ArrayKind.scale_`).  The default scales in passes of their own; a transport
        that can scale while it copies or reduces overrides it."""
        k = arrays.kind()
        k.scale_(tensor, prescale)
        self.allreduce_(tensor, op)
        k.scale_(tensor, postscale)

    def allreduce_scaled_async_(
        self, tensor, op: ReduceOp, prescale: float, postscale: float
    ) -> "Waitable":
        """:meth:`allreduce_scaled_` started as :meth:`allreduce_async_` is: the result,
        scaled, is valid after ``.wait()``."""
        k = arrays.kind()
        k.scale_(tensor, prescale)
        work = self.allreduce_async_(tensor, op)
        return work if postscale == 1.0 else _ScaledWhenDone(work, tensor, postscale)

    def allreduce_scaled_many_async_(
        self, tensors: List, op: ReduceOp, prescale: float, postscale: float
    ) -> List["Waitable"]:
        """:meth:`allreduce_scaled_async_` of several tensors of one dtype, in order; one
        waitable each.  A transport that streams them as one pipeline overrides it."""
        return [self.allreduce_scaled_async_(t, op, prescale, postscale) for t in tensors]

    def shares_buckets(self) -> bool:
        """Whether gradient buckets in the shared bucket arena are reduced where they lie
        (``shared_buckets``): the same answer on every rank, so the executor may route them
        by it."""
        return False

    def pipeline_chunk_bytes(self, requested: int) -> int:
        """The chunk size a packed allreduce is pipelined in, given the configured one
        (``fusion_chunk_bytes``): a transport whose copies are cheaper in cache-sized
        chunks asks for smaller ones."""
        return requested

    def stage(self, dtype, count: int):
        """Where to pack ``count`` elements of ``dtype`` for :meth:`allreduce_staged_`, saving
        the copy a plain allreduce makes (e.g. this rank's shared-memory slot); None when
        this backend has no such place or they do not fit.  If a buffer is returned, the
        caller's next call on this backend is :meth:`allreduce_staged_` with it."""
        return None

    def allreduce_staged_(self, staged, op: ReduceOp, scale: float):
        """Reduce a buffer from :meth:`stage` (SUM, MIN, MAX, PRODUCT), multiplied by
        ``scale``; returns where the result lies (read it before the next collective)."""
        raise NotImplementedError(f"the {self.name} backend stages nothing")

    @abc.abstractmethod
    def allgather_bytes(self, send, counts: List[int]) -> list:
        """Gather uint8 ``send`` (``counts[rank]`` bytes) from every rank.

        Returns one uint8 tensor per rank (``counts[r]`` bytes each)."""

    @abc.abstractmethod
    def broadcast_(self, tensor, root: int) -> None:
        """Overwrite ``tensor`` with the root's values on every rank."""

    @abc.abstractmethod
    def alltoall_bytes(self, send, send_counts: List[int], recv_counts: List[int]):
        """Send ``send_counts[r]`` bytes of uint8 ``send`` to rank r; returns what came in."""

    # -- point to point (Adasum) -------------------------------------------------------------
    def sendrecv_(self, send, recv, peer: int) -> None:
        """Send ``send`` to ``peer`` while receiving ``peer``'s message into ``recv``.

        The one step Adasum's vector halving needs: both ranks of a pair call this with each
        other as ``peer`` at the same point, and neither waits for the other to finish first.
        ``send`` and ``recv`` are contiguous CPU tensors of any dtype (they travel as bytes);
        ``recv`` here has as many bytes as ``send`` at the peer, and either may be empty (then
        nothing travels that way).

        Raises:
            HvdliteInternalError: the peer failed, or did not answer within the op timeout.
            NotImplementedError: this backend has no point-to-point transport.
        """
        raise NotImplementedError(
            f"the {self.name} backend has no point-to-point exchange, which op=Adasum needs"
        )

    def block_allreduce_(self, tensor, block: int) -> None:
        """Sum float64 ``tensor`` in place over the ``block`` consecutive ranks that include
        this one (ranks ``r`` with ``r // block == rank // block``).

        Adasum sums its per-tensor partial dot products and norms this way: at every level
        such an aligned block holds the pieces of the vectors.  ``block`` is a power of two
        dividing ``size``; every rank of the block calls this with the same shape.  The
        default is recursive doubling over :meth:`sendrecv_` (log2(block) exchanges of a few
        bytes); addition is commutative, so every rank of the block ends with the same bits.

        Raises:
            HvdliteInternalError: a peer failed or timed out.
            ValueError: ``block`` is not a power of two dividing ``size``.
        """
        if block < 1 or block & (block - 1) or self.size % block:
            raise ValueError(
                f"rank {self.rank}: block_allreduce_ over {block} ranks: not a "
                f"power of two dividing the job's {self.size} ranks"
            )
        if block == 1:
            return
        k = arrays.kind()
        incoming = k.clone(tensor)
        distance = 1
        while distance < block:
            self.sendrecv_(tensor, incoming, self.rank ^ distance)
            k.combine_(tensor, incoming, ReduceOp.SUM)
            distance <<= 1

    def process_set(self, ranks: List[int], set_id: int) -> "Backend":
        """A new backend whose collectives run among ``ranks`` only (sorted job ranks,
        this rank among them); its ``rank``/``size`` are the position in ``ranks`` and
        their number.

        Called on a user thread by every member of the set, with the same arguments, while
        this backend's own collectives go on in the background thread: it must not use
        this backend's transport.  ``set_id`` is the same on every member and never reused
        within one ``init()``.

        Raises:
            HvdliteTimeoutError: a member did not arrive within the start timeout.
            HvdliteInternalError: the transport could not connect the members.
            NotImplementedError: this backend has no process sets.
        """
        raise NotImplementedError(f"the {self.name} backend has no process sets")

    def newest_round(self) -> int:
        """The newest rendezvous round open for this job; backends without rounds (MPI,
        one rank) return -1 and never see membership change."""
        return -1

    def close(self) -> None:
        """Release the transport (idempotent)."""
