"""MPI through mpi4py, on a private duplicate of MPI_COMM_WORLD.

MPI cannot be initialised twice in one process, so ``shutdown()`` frees only
the duplicate; the next ``init()`` duplicates the world again.  Rank identity
(rank, local and cross ranks) comes from MPI itself, not from the launcher.

Every wait is bounded by ``--op-timeout-seconds``.  MPI's blocking collectives have no
timeout, so each collective is started as its MPI-3 non-blocking twin (``MPI_Iallreduce``,
``MPI_Iallgatherv``, ``MPI_Ibcast``, ``MPI_Ialltoallv``, ``MPI_Isend`` + ``MPI_Irecv``) and
its request is polled (:func:`_poll`): without pause for :data:`_SPIN_S` (MPI moves data
only while it is polled, and a small collective between a host's ranks takes ~10 µs), then
with naps that grow with the wait.  A request that is still pending at the deadline ends in
the same :class:`HvdliteInternalError` as a Gloo timeout, naming the operation and the flag.
The two communicator constructors that have no non-blocking form (a process set's
``MPI_Comm_create_group``, Adasum's ``MPI_Comm_split``) run on a helper thread the caller
waits for with the same bound (under ``MPI_THREAD_MULTIPLE``; otherwise they block).

A timed-out collective cannot be cancelled or freed (MPI forbids both), so its request and
buffers are kept referenced for the life of the process (:data:`_ABANDONED`), the backend
refuses further collectives, and ``close()`` no longer frees its communicators.
``MPI_Finalize`` would then wait for the missing peer (MPICH's does: forever when the peer
is stopped), so at exit :func:`_finalize_bounded` gives it :data:`FINALIZE_WAIT_S` and
ends the process with code 1 if it has not returned by then.  The job is ending anyway;
the launcher ends the peers.
"""

import atexit
import faulthandler
import logging
import os
import sys
import threading
import time
from typing import List, Optional, Tuple

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
#: a wait polls its request without pause this long: MPI progresses only while polled, and
#: a 4 MiB piece (``PIECE_BYTES``) between a host's ranks takes a few ms
_SPIN_S = 5e-3
_NAP_S = 50e-6  # then the shortest nap between polls;
_NAP_SHARE = 0.25  # a nap is this share of the wait so far,
_MAX_NAP_S = 1e-3  # and at most this long
#: how long MPI_Finalize may take at exit once a wait was abandoned (see the module's
#: docstring); then the process ends with code 1
FINALIZE_WAIT_S = 3.0
#: what the timed-out waits left pending: (what, request(s), buffers), referenced until exit
_ABANDONED: List[tuple] = []
_LOCK = threading.Lock()
_FINALIZE_HOOK = []


def mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def launched_by_mpi() -> bool:
    """Whether an MPI process manager started this process (its rank variables are set)."""
    return any(
        v in os.environ
        for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")
    )


class MPIBackend(Backend):
    """Collectives on a duplicate of MPI_COMM_WORLD."""

    name = "mpi"

    def __init__(
        self,
        MPI,
        comm,
        admin,
        local: Tuple[int, int],
        cross: Tuple[int, int],
        who: Optional[str] = None,
        timeout_s: float = 60.0,
    ):
        """Collectives on ``comm`` (ours to free); ``admin``, a duplicate of it, is used only
        on user threads to make process sets' communicators while the background thread
        works on ``comm``.  ``local`` and ``cross`` are this process's ``(rank, size)`` among
        its host's processes and among the job's processes of its local rank; ``who`` names
        it in messages (default ``rank <rank>``); ``timeout_s`` bounds every wait
        (``--op-timeout-seconds``)."""
        self._MPI = MPI
        self.timeout_s = float(timeout_s)
        #: why this backend is unusable (a wait timed out), or None
        self._broken: Optional[str] = None
        # a helper thread may wait in MPI beside the background thread only under
        # MPI_THREAD_MULTIPLE (see _bounded)
        self._threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        _install_finalize_hook()
        # the buffers' array kind (torch, or numpy without torch); its MPI crossing widens
        # the dtypes MPI has no reduction for to float32
        k = self._kind = arrays.kind()
        self._reducible, self._copy, self._np, self._empty = (
            k.mpi_reducible,
            k.copy_,
            k.to_numpy,
            k.empty,
        )
        self._ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.PRODUCT: MPI.PROD,
        }
        self.comm = comm
        self._admin = admin
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._who = who or f"rank {self.rank}"
        self.local_rank, self.local_size = local
        self.cross_rank, self.cross_size = cross
        #: block size -> communicator of the aligned block of ranks holding this one (Adasum)
        self._blocks = {}

    @classmethod
    def for_job(cls, timeout_s: float, comm=None) -> "MPIBackend":
        """The job's backend.  ``comm``: the processes of the job -- None for all of
        MPI_COMM_WORLD, an mpi4py communicator, or a list of MPI_COMM_WORLD ranks (as
        ``hvd.init(comm=...)``).  ``timeout_s`` bounds every wait of its collectives
        (``Config.op_timeout_s``).

        Raises:
            ValueError: this process is not in ``comm``, or ``comm`` is not one of those.
        """
        from mpi4py import MPI

        world = _job_communicator(MPI, comm)
        job = world.Dup()
        admin = world.Dup()
        if world is not MPI.COMM_WORLD and comm is not None and not hasattr(comm, "Get_group"):
            world.Free()  # made from a list of ranks: ours to free
        rank = job.Get_rank()
        local = job.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_place = (local.Get_rank(), local.Get_size())
        local.Free()
        cross = job.Split(color=local_place[0], key=rank)
        cross_place = (cross.Get_rank(), cross.Get_size())
        cross.Free()
        return cls(MPI, job, admin, local_place, cross_place, timeout_s=timeout_s)

    def process_set(self, ranks, set_id):
        """MPI_Comm_create_group over ``ranks`` of the job's communicator: collective over
        the members only, on the spare duplicate (never the background thread's)."""
        group = self._admin.Get_group()
        members = group.Incl(list(ranks))
        try:
            comm = self._bounded(
                "communicator creation for a process set", self._admin.Create_group, members, set_id
            )
            dup = self._bounded("communicator duplication for a process set", comm.Dup)
        finally:
            members.Free()
            group.Free()
        return MPIBackend(
            self._MPI,
            comm,
            dup,
            (self.local_rank, self.local_size),
            (self.cross_rank, self.cross_size),
            who=f"rank {self.rank} (process set {set_id})",
            timeout_s=self.timeout_s,
        )

    def job_ranks_of(self, comm) -> list:
        """The job ranks of ``comm``'s processes (``comm`` made from MPI_COMM_WORLD or the
        job's communicator), in ``comm``'s rank order; [] for MPI.COMM_NULL."""
        MPI = self._MPI
        if comm == MPI.COMM_NULL:
            return []
        theirs, ours = comm.Get_group(), self.comm.Get_group()
        try:
            return [
                int(r)
                for r in MPI.Group.Translate_ranks(theirs, list(range(theirs.Get_size())), ours)
            ]
        finally:
            theirs.Free()
            ours.Free()

    def _wait(self, what, start, *args):
        """Start the non-blocking MPI call ``start(*args)`` (it returns a request, or a list
        of them) and wait until it completed, at most ``timeout_s``.

        Raises:
            HvdliteInternalError: MPI reported an error, the wait timed out (the request is
                abandoned, see the module's docstring), or an earlier wait timed out.
        """
        self._refuse_if_broken(what)
        MPI = self._MPI
        try:
            req = start(*args)
            done = _poll(
                req.Test if isinstance(req, MPI.Request) else lambda: MPI.Request.Testall(req),
                self.timeout_s,
            )
        except MPI.Exception as exc:
            raise HvdliteInternalError(f"{self._who}: MPI {what} failed: {exc}") from exc
        if not done:
            raise self._timed_out(what, req, args)

    def _refuse_if_broken(self, what) -> None:
        """Raises: HvdliteInternalError: an earlier wait timed out (the backend is done)."""
        if self._broken is not None:
            raise HvdliteInternalError(f"{self._who}: MPI {what} refused: {self._broken}")

    def _timed_out(self, what, pending, buffers) -> HvdliteInternalError:
        """Abandon what a wait left pending, refuse every later call, and the error to raise
        (worded as the Gloo path's, naming the flag)."""
        _abandon(what, pending, buffers)
        self._broken = (
            f"an earlier MPI operation timed out after --op-timeout-seconds ({self.timeout_s:g}s)"
        )
        return HvdliteInternalError(
            f"{self._who}: MPI {what} did not complete within {self.timeout_s:g}s; a peer "
            f"rank has probably exited, or stopped responding for longer than "
            f"--op-timeout-seconds ({self.timeout_s:g}s)"
        )

    def _bounded(self, what, fn, *args):
        """``fn(*args)``, a blocking MPI call with no non-blocking form, waited for at most
        ``timeout_s``: on a helper thread under MPI_THREAD_MULTIPLE, else directly (then
        unbounded).  A call that timed out is left blocked on its daemon thread.

        Raises:
            HvdliteInternalError: MPI reported an error, or the call timed out.
        """
        self._refuse_if_broken(what)
        MPI = self._MPI
        if not self._threads:
            try:
                return fn(*args)
            except MPI.Exception as exc:
                raise HvdliteInternalError(f"{self._who}: MPI {what} failed: {exc}") from exc
        box: dict = {}

        def run() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc

        thread = threading.Thread(target=run, name="hvdlite-mpi-call", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise self._timed_out(what, thread, args)
        error = box.get("error")
        if isinstance(error, MPI.Exception):
            raise HvdliteInternalError(f"{self._who}: MPI {what} failed: {error}") from error
        if error is not None:
            raise error
        return box["value"]

    def control_allreduce_min(self, vec):
        out = np.empty_like(vec)
        self._wait("control allreduce", self.comm.Iallreduce, vec, out, self._MPI.MIN)
        return out

    def _allgather_fixed(self, buf):
        out = np.empty(self.size * buf.size, dtype=np.uint8)
        self._wait("control allgather", self.comm.Iallgather, buf, out)
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
            self._allreduce_piece(flat[lo : lo + per], op)

    def _allreduce_piece(self, tensor, op):
        arr, staged = self._reducible(tensor)
        self._wait("allreduce", self.comm.Iallreduce, self._MPI.IN_PLACE, arr, self._ops[op])
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
            piece = flat[lo : lo + per]
            k.scale_(piece, prescale)
            self._allreduce_piece(piece, op)
            k.scale_(piece, postscale)

    def allreduce_scaled_async_(self, tensor, op, prescale, postscale):
        self.allreduce_scaled_(tensor, op, prescale, postscale)
        return DONE

    def allgather_bytes(self, send, counts):
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64).tolist()
        out = self._empty(sum(counts), "uint8")
        self._wait(
            "allgather",
            self.comm.Iallgatherv,
            self._np(send),
            [self._np(out), list(counts), displs, self._MPI.BYTE],
        )
        return [out[d : d + c] for d, c in zip(displs, counts)]

    def broadcast_(self, tensor, root):
        self._wait("broadcast", self.comm.Ibcast, self._np(self._kind.as_bytes(tensor)), root)

    def alltoall_bytes(self, send, send_counts, recv_counts):
        out = self._empty(sum(recv_counts), "uint8")
        sd = np.concatenate(([0], np.cumsum(send_counts)[:-1])).astype(np.int64).tolist()
        rd = np.concatenate(([0], np.cumsum(recv_counts)[:-1])).astype(np.int64).tolist()
        self._wait(
            "alltoall",
            self.comm.Ialltoallv,
            [self._np(send), list(send_counts), sd, self._MPI.BYTE],
            [self._np(out), list(recv_counts), rd, self._MPI.BYTE],
        )
        return out

    def sendrecv_(self, send, recv, peer):
        """An MPI_Irecv and an MPI_Isend of raw bytes, waited for together (MPI has no
        bfloat16; no arithmetic is needed)."""
        MPI = self._MPI
        k = self._kind
        comm = self.comm

        def start(out, into):
            return [
                comm.Irecv([into, MPI.BYTE], peer, _P2P_TAG),
                comm.Isend([out, MPI.BYTE], peer, _P2P_TAG),
            ]

        self._wait(
            f"sendrecv with rank {peer}",
            start,
            k.to_numpy(k.as_bytes(send)),
            k.to_numpy(k.as_bytes(recv)),
        )

    def block_allreduce_(self, tensor, block):
        """MPI_Allreduce on the block's own communicator, as Horovod's Adasum reduction
        communicators: one per block size, split once from the job's communicator."""
        if block == 1:
            return
        comm = self._blocks.get(block)
        if comm is None:
            if block < 1 or block & (block - 1) or self.size % block:
                raise ValueError(
                    f"rank {self.rank}: block_allreduce_ over {block} ranks: not "
                    f"a power of two dividing the job's {self.size} ranks"
                )
            # MPI_Comm_split is collective over all ranks; every rank gets here at the same
            # response (the first Adasum reduction), so the splits pair up
            comm = (
                self.comm
                if block == self.size
                else self._bounded(
                    "communicator split", self.comm.Split, self.rank // block, self.rank
                )
            )
            self._blocks[block] = comm
        self._wait(
            "block allreduce", comm.Iallreduce, self._MPI.IN_PLACE, self._np(tensor), self._MPI.SUM
        )

    def close(self):
        """Free the communicators -- unless a wait timed out: MPI_Comm_free may then wait
        for the missing peer, so they are left to the process's exit."""
        if self._broken is not None:
            self._blocks, self._admin, self.comm = {}, None, None
            return
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


def _poll(test, timeout_s: float) -> bool:
    """Call ``test()`` until it returns True (then True) or ``timeout_s`` passed (False):
    without pause for :data:`_SPIN_S`, then with naps of a quarter of the wait so far
    (:data:`_NAP_S` to :data:`_MAX_NAP_S`), so that a peer still computing on the same
    cores is not robbed of them, and one that arrives is seen soon after."""
    if test():
        return True
    start = time.monotonic()
    while True:
        if test():
            return True
        waited = time.monotonic() - start
        if waited >= _SPIN_S:
            if waited >= timeout_s:
                return False
            time.sleep(min(max(_NAP_S, waited * _NAP_SHARE), _MAX_NAP_S))


def _abandon(what: str, pending, buffers) -> None:
    """Keep what a timed-out wait left pending (requests, a blocked thread, their buffers)
    referenced until the process ends: MPI may still write into the buffers, and an
    active collective request may be neither freed nor cancelled."""
    with _LOCK:
        _ABANDONED.append((what, pending, buffers))
    log.debug("abandoned a pending MPI %s after its timeout", what)


def _install_finalize_hook() -> None:
    """Register :func:`_finalize_bounded` once, when the first backend is built: before
    ``init()`` registers ``shutdown``, so that it runs after it (atexit runs last-in,
    first-out), and before mpi4py finalizes MPI."""
    with _LOCK:
        if not _FINALIZE_HOOK:
            _FINALIZE_HOOK.append(atexit.register(_finalize_bounded))


def _finalize_bounded() -> None:
    """At exit, once a wait was abandoned: MPI_Finalize, given :data:`FINALIZE_WAIT_S`; if
    it has not returned by then (it waits for the peer the abandoned operation needs), the
    process ends with code 1 (``faulthandler``'s watchdog, a thread outside Python, ends it;
    the tracebacks it would print go nowhere).  Without an abandoned wait, mpi4py finalizes
    MPI as always."""
    with _LOCK:
        pending = [what for what, _, _ in _ABANDONED]
    MPI = sys.modules.get("mpi4py.MPI")
    if not pending or MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    sys.stderr.write(
        f"hvdlite: rank {MPI.COMM_WORLD.Get_rank()} of MPI_COMM_WORLD: MPI operations that "
        f"timed out are still pending ({', '.join(pending)}); MPI_Finalize gets "
        f"{FINALIZE_WAIT_S:g}s, then this process exits with code 1 without it\n"
    )
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    with open(os.devnull, "w") as devnull:
        faulthandler.dump_traceback_later(FINALIZE_WAIT_S, exit=True, file=devnull)
        try:
            MPI.Finalize()
        finally:
            faulthandler.cancel_dump_traceback_later()


def _job_communicator(MPI, comm):
    """The communicator whose processes form the job (see :meth:`MPIBackend.__init__`)."""
    if comm is None:
        return MPI.COMM_WORLD
    if hasattr(comm, "Get_group"):
        if comm == MPI.COMM_NULL:
            raise ValueError(
                f"rank {MPI.COMM_WORLD.Get_rank()} of MPI_COMM_WORLD: "
                f"hvd.init(comm=MPI.COMM_NULL): this process is not in the "
                f"communicator, so it cannot join the job"
            )
        return comm
    try:
        ranks = sorted({int(r) for r in comm})
    except (TypeError, ValueError):
        raise ValueError(
            f"hvd.init(comm={comm!r}): expected an mpi4py communicator or a "
            f"list of MPI_COMM_WORLD ranks"
        ) from None
    world = MPI.COMM_WORLD
    me, n = world.Get_rank(), world.Get_size()
    if not ranks or ranks[0] < 0 or ranks[-1] >= n:
        raise ValueError(
            f"hvd.init(comm={list(comm)}): ranks must be in 0..{n - 1} "
            f"(MPI_COMM_WORLD has {n} processes)"
        )
    if me not in ranks:
        raise ValueError(
            f"rank {me} of MPI_COMM_WORLD: hvd.init(comm={ranks}) does not "
            f"include this process, so it cannot join the job"
        )
    group = world.Get_group()
    members = group.Incl(ranks)
    try:
        return world.Create_group(members, 0x4856)
    finally:
        members.Free()
        group.Free()
