"""MPI through mpi4py, on a private duplicate of MPI_COMM_WORLD.

MPI cannot be initialised twice in one process, so ``shutdown()`` frees only
the duplicate; the next ``init()`` duplicates the world again.  Rank identity
(rank, local and cross ranks) comes from MPI itself, not from the launcher.
"""

import logging
import os
from typing import Optional, Tuple

import numpy as np

from hvdlite.common import arrays
from hvdlite.common.backend.base import DONE, Backend
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.engine.message import ReduceOp

log = logging.getLogger(__name__)

#: big allreduces go in pieces this big: MPICH between the ranks of a host reduced one 64 MiB
#: tensor in 29 ms, in 4 MiB pieces in about half that (np=2, the 2-core machine); a scaled
#: piece is scaled while in the cache (:meth:`MPIBackend.allreduce_scaled_`)
PIECE_BYTES = 4 << 20
#: the tag of hvdlite's point-to-point messages on its private communicator
_P2P_TAG = 0x4144


def mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def launched_by_mpi() -> bool:
    """Whether an MPI process manager started this process (its rank variables are set)."""
    return any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                                         "PMIX_RANK", "MPI_LOCALRANKID"))


class MPIBackend(Backend):
    """Collectives on a duplicate of MPI_COMM_WORLD."""

    name = "mpi"

    def __init__(self, MPI, comm, admin, local: Tuple[int, int], cross: Tuple[int, int],
                 who: Optional[str] = None):
        """Collectives on ``comm`` (ours to free); ``admin``, a duplicate of it, is used only
        on user threads to make process sets' communicators while the background thread
        works on ``comm``.  ``local`` and ``cross`` are this process's ``(rank, size)`` among
        its host's processes and among the job's processes of its local rank; ``who`` names
        it in messages (default ``rank <rank>``)."""
        self._MPI = MPI
        # the buffers' array kind (torch, or numpy without torch); its MPI crossing widens
        # the dtypes MPI has no reduction for to float32
        k = self._kind = arrays.kind()
        self._reducible, self._copy, self._np, self._empty = (k.mpi_reducible, k.copy_,
                                                              k.to_numpy, k.empty)
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
                     ReduceOp.PRODUCT: MPI.PROD}
        self.comm = comm
        self._admin = admin
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._who = who or f"rank {self.rank}"
        self.local_rank, self.local_size = local
        self.cross_rank, self.cross_size = cross
        #: block size -> communicator of the aligned block of ranks holding this one (Adasum)
        self._blocks = {}

    @classmethod
    def for_job(cls, comm=None) -> "MPIBackend":
        """The job's backend.  ``comm``: the processes of the job -- None for all of
        MPI_COMM_WORLD, an mpi4py communicator, or a list of MPI_COMM_WORLD ranks (as
        ``hvd.init(comm=...)``).

        Raises:
            ValueError: this process is not in ``comm``, or ``comm`` is not one of those.
        """
        from mpi4py import MPI
        world = _job_communicator(MPI, comm)
        job = world.Dup()
        admin = world.Dup()
        if world is not MPI.COMM_WORLD and comm is not None and not hasattr(comm, "Get_group"):
            world.Free()                          # made from a list of ranks: ours to free
        rank = job.Get_rank()
        local = job.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_place = (local.Get_rank(), local.Get_size())
        local.Free()
        cross = job.Split(color=local_place[0], key=rank)
        cross_place = (cross.Get_rank(), cross.Get_size())
        cross.Free()
        return cls(MPI, job, admin, local_place, cross_place)

    def process_set(self, ranks, set_id):
        """MPI_Comm_create_group over ``ranks`` of the job's communicator: collective over
        the members only, on the spare duplicate (never the background thread's)."""
        group = self._admin.Get_group()
        members = group.Incl(list(ranks))
        try:
            comm = self._call("communicator creation for a process set",
                              self._admin.Create_group, members, set_id)
        finally:
            members.Free()
            group.Free()
        return MPIBackend(self._MPI, comm, comm.Dup(),
                          (self.local_rank, self.local_size), (self.cross_rank, self.cross_size),
                          who=f"rank {self.rank} (process set {set_id})")

    def job_ranks_of(self, comm) -> list:
        """The job ranks of ``comm``'s processes (``comm`` made from MPI_COMM_WORLD or the
        job's communicator), in ``comm``'s rank order; [] for MPI.COMM_NULL."""
        MPI = self._MPI
        if comm == MPI.COMM_NULL:
            return []
        theirs, ours = comm.Get_group(), self.comm.Get_group()
        try:
            return [int(r) for r in MPI.Group.Translate_ranks(
                theirs, list(range(theirs.Get_size())), ours)]
        finally:
            theirs.Free()
            ours.Free()

    def _call(self, what, fn, *args):
        try:
            return fn(*args)
        except self._MPI.Exception as exc:
            raise HvdliteInternalError(f"{self._who}: MPI {what} failed: {exc}") from exc

    def control_allreduce_min(self, vec):
        out = np.empty_like(vec)
        self._call("control allreduce", self.comm.Allreduce, vec, out, self._MPI.MIN)
        return out

    def _allgather_fixed(self, buf):
        out = np.empty(self.size * buf.size, dtype=np.uint8)
        self._call("control allgather", self.comm.Allgather, buf, out)
        return out

    def allreduce_(self, tensor, op):
        k = self._kind
        flat = k.flat(tensor)
        n = k.numel(flat)
        per = max(1, PIECE_BYTES // max(1, k.nbytes(flat[:1])))
        if n <= per:
            self._allreduce_piece(flat, op)
            return
        for lo in range(0, n, per):
            self._allreduce_piece(flat[lo:lo + per], op)

    def _allreduce_piece(self, tensor, op):
        arr, staged = self._reducible(tensor)
        self._call("allreduce", self.comm.Allreduce, self._MPI.IN_PLACE, arr, self._ops[op])
        if staged is not None:
            self._copy(tensor, staged)

    def allreduce_scaled_(self, tensor, op, prescale, postscale):
        """Each piece (see ``PIECE_BYTES``) is scaled, reduced and scaled again while it is
        still in the cache: MPI reduces in place with no hook for a factor, and two more
        passes over the whole tensor would cost more than the reduction itself."""
        if prescale == 1.0 and postscale == 1.0:
            self.allreduce_(tensor, op)
            return
        k = self._kind
        flat = k.flat(tensor)
        n = k.numel(flat)
        per = max(1, PIECE_BYTES // max(1, k.nbytes(flat[:1])))
        for lo in range(0, max(n, 1), per):
            piece = flat[lo:lo + per]
            k.scale_(piece, prescale)
            self._allreduce_piece(piece, op)
            k.scale_(piece, postscale)

    def allreduce_scaled_async_(self, tensor, op, prescale, postscale):
        self.allreduce_scaled_(tensor, op, prescale, postscale)
        return DONE

    def allgather_bytes(self, send, counts):
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64).tolist()
        out = self._empty(sum(counts), "uint8")
        self._call("allgather", self.comm.Allgatherv, self._np(send),
                   [self._np(out), list(counts), displs, self._MPI.BYTE])
        return [out[d:d + c] for d, c in zip(displs, counts)]

    def broadcast_(self, tensor, root):
        self._call("broadcast", self.comm.Bcast, self._np(self._kind.as_bytes(tensor)), root)

    def alltoall_bytes(self, send, send_counts, recv_counts):
        out = self._empty(sum(recv_counts), "uint8")
        sd = np.concatenate(([0], np.cumsum(send_counts)[:-1])).astype(np.int64).tolist()
        rd = np.concatenate(([0], np.cumsum(recv_counts)[:-1])).astype(np.int64).tolist()
        self._call("alltoall", self.comm.Alltoallv,
                   [self._np(send), list(send_counts), sd, self._MPI.BYTE],
                   [self._np(out), list(recv_counts), rd, self._MPI.BYTE])
        return out

    def sendrecv_(self, send, recv, peer):
        """One MPI_Sendrecv of raw bytes (MPI has no bfloat16; no arithmetic is needed)."""
        MPI = self._MPI
        k = self._kind
        self._call("sendrecv", self.comm.Sendrecv, [k.to_numpy(k.as_bytes(send)), MPI.BYTE],
                   peer, _P2P_TAG, [k.to_numpy(k.as_bytes(recv)), MPI.BYTE], peer, _P2P_TAG)

    def block_allreduce_(self, tensor, block):
        """MPI_Allreduce on the block's own communicator, as Horovod's Adasum reduction
        communicators: one per block size, split once from the job's communicator."""
        if block == 1:
            return
        comm = self._blocks.get(block)
        if comm is None:
            if block < 1 or block & (block - 1) or self.size % block:
                raise ValueError(f"rank {self.rank}: block_allreduce_ over {block} ranks: not "
                                 f"a power of two dividing the job's {self.size} ranks")
            # MPI_Comm_split is collective over all ranks; every rank gets here at the same
            # response (the first Adasum reduction), so the splits pair up
            comm = self.comm if block == self.size else self._call(
                "communicator split", self.comm.Split, self.rank // block, self.rank)
            self._blocks[block] = comm
        self._call("block allreduce", comm.Allreduce, self._MPI.IN_PLACE, self._np(tensor),
                   self._MPI.SUM)

    def close(self):
        blocks, self._blocks = self._blocks, {}
        for block_comm in blocks.values():
            if block_comm is not self.comm:
                try:
                    block_comm.Free()
                except Exception as exc:
                    log.debug("rank %d: freeing a block communicator: %s", self.rank, exc)
        admin, self._admin = self._admin, None
        if admin is not None:
            try:
                admin.Free()
            except Exception as exc:
                log.debug("rank %d: freeing the MPI communicator: %s", self.rank, exc)
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.Free()
            except Exception as exc:
                log.debug("rank %d: freeing the MPI communicator: %s", self.rank, exc)


def _job_communicator(MPI, comm):
    """The communicator whose processes form the job (see :meth:`MPIBackend.__init__`)."""
    if comm is None:
        return MPI.COMM_WORLD
    if hasattr(comm, "Get_group"):
        if comm == MPI.COMM_NULL:
            raise ValueError(f"rank {MPI.COMM_WORLD.Get_rank()} of MPI_COMM_WORLD: "
                             f"hvd.init(comm=MPI.COMM_NULL): this process is not in the "
                             f"communicator, so it cannot join the job")
        return comm
    try:
        ranks = sorted({int(r) for r in comm})
    except (TypeError, ValueError):
        raise ValueError(f"hvd.init(comm={comm!r}): expected an mpi4py communicator or a "
                         f"list of MPI_COMM_WORLD ranks") from None
    world = MPI.COMM_WORLD
    me, n = world.Get_rank(), world.Get_size()
    if not ranks or ranks[0] < 0 or ranks[-1] >= n:
        raise ValueError(f"hvd.init(comm={list(comm)}): ranks must be in 0..{n - 1} "
                         f"(MPI_COMM_WORLD has {n} processes)")
    if me not in ranks:
        raise ValueError(f"rank {me} of MPI_COMM_WORLD: hvd.init(comm={ranks}) does not "
                         f"include this process, so it cannot join the job")
    group = world.Get_group()
    members = group.Incl(ranks)
    try:
        return world.Create_group(members, 0x4856)
    finally:
        members.Free()
        group.Free()
