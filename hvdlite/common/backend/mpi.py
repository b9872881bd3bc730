"""MPI through mpi4py, on a private duplicate of MPI_COMM_WORLD.

MPI cannot be initialised twice in one process, so ``shutdown()`` frees only
the duplicate; the next ``init()`` duplicates the world again.  Rank identity
(rank, local and cross ranks) comes from MPI itself, not from the launcher.
"""

import logging
import os

import numpy as np

from hvdlite.common.backend.base import Backend
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.fusion import lazy_torch
from hvdlite.common.message import ReduceOp

log = logging.getLogger(__name__)

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

    def __init__(self, config):
        from mpi4py import MPI
        self._MPI = MPI
        torch = lazy_torch()
        # dtypes MPI has no reduction for travel as float32 (numpy cannot even view bfloat16)
        self._widen = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
                     ReduceOp.PRODUCT: MPI.PROD}
        world = MPI.COMM_WORLD
        self.comm = world.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        local.Free()
        cross = self.comm.Split(color=self.local_rank, key=self.rank)
        self.cross_rank, self.cross_size = cross.Get_rank(), cross.Get_size()
        cross.Free()
        #: block size -> communicator of the aligned block of ranks holding this one (Adasum)
        self._blocks = {}

    def _call(self, what, fn, *args):
        try:
            return fn(*args)
        except self._MPI.Exception as exc:
            raise HvdliteInternalError(f"rank {self.rank}: MPI {what} failed: {exc}") from exc

    def control_allreduce_min(self, vec):
        out = np.empty_like(vec)
        self._call("control allreduce", self.comm.Allreduce, vec, out, self._MPI.MIN)
        return out

    def _allgather_fixed(self, buf):
        out = np.empty(self.size * buf.size, dtype=np.uint8)
        self._call("control allgather", self.comm.Allgather, buf, out)
        return out

    def allreduce_(self, tensor, op):
        torch = lazy_torch()
        wide = self._widen.get(tensor.dtype)
        target = tensor.to(wide) if wide is not None else tensor
        if target.dtype == torch.bool:
            target = target.view(torch.uint8)
        arr = target.numpy()
        self._call("allreduce", self.comm.Allreduce, self._MPI.IN_PLACE, arr, self._ops[op])
        if wide is not None:
            tensor.copy_(target)

    def allgather_bytes(self, send, counts):
        torch = lazy_torch()
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64).tolist()
        out = torch.empty(sum(counts), dtype=torch.uint8)
        self._call("allgather", self.comm.Allgatherv, send.numpy(),
                   [out.numpy(), list(counts), displs, self._MPI.BYTE])
        return [out[d:d + c] for d, c in zip(displs, counts)]

    def broadcast_(self, tensor, root):
        flat = tensor.view(-1).view(lazy_torch().uint8)
        self._call("broadcast", self.comm.Bcast, flat.numpy(), root)

    def alltoall_bytes(self, send, send_counts, recv_counts):
        torch = lazy_torch()
        out = torch.empty(sum(recv_counts), dtype=torch.uint8)
        sd = np.concatenate(([0], np.cumsum(send_counts)[:-1])).astype(np.int64).tolist()
        rd = np.concatenate(([0], np.cumsum(recv_counts)[:-1])).astype(np.int64).tolist()
        self._call("alltoall", self.comm.Alltoallv,
                   [send.numpy(), list(send_counts), sd, self._MPI.BYTE],
                   [out.numpy(), list(recv_counts), rd, self._MPI.BYTE])
        return out

    def sendrecv_(self, send, recv, peer):
        """One MPI_Sendrecv of raw bytes (MPI has no bfloat16; no arithmetic is needed)."""
        MPI = self._MPI
        self._call("sendrecv", self.comm.Sendrecv, [_as_bytes(send), MPI.BYTE], peer, _P2P_TAG,
                   [_as_bytes(recv), MPI.BYTE], peer, _P2P_TAG)

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
        self._call("block allreduce", comm.Allreduce, self._MPI.IN_PLACE, tensor.numpy(),
                   self._MPI.SUM)

    def close(self):
        blocks, self._blocks = getattr(self, "_blocks", {}), {}
        for block_comm in blocks.values():
            if block_comm is not getattr(self, "comm", None):
                try:
                    block_comm.Free()
                except Exception as exc:
                    log.debug("rank %d: freeing a block communicator: %s", self.rank, exc)
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None:
            try:
                comm.Free()
            except Exception as exc:
                log.debug("rank %d: freeing the MPI communicator: %s", self.rank, exc)


def _as_bytes(tensor):
    """A contiguous tensor's storage as a flat uint8 numpy array (shares memory)."""
    return tensor.view(-1).view(lazy_torch().uint8).numpy()
