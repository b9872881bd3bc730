"""Shared memory between the ranks of one host: collectives without a network round trip.

One segment per host and rendezvous round holds a small header (per-rank arrival
counters, pids and job ranks) and two sets of one slot per local rank.  Every
collective alternates between the two sets: a rank only writes a set again after
every rank passed the barrier of the collective that used the other set, which
it reaches only after it finished reading this one, so one barrier per phase is
enough.  A barrier is an increment of this rank's counter and a spin (then a
yield, then short sleeps) until every counter caught up: microseconds when the
peers are there.  A waiting rank checks that its peers' processes still exist
and gives up after the op timeout, naming the rank.

The segment is unlinked as soon as every local rank has mapped it, so it
disappears with the last process whatever way they end (even SIGKILL).

Allreduce is a reduce-scatter in place: each local rank reduces its slice of
everyone's slot into slot 0; a multi-host job then allreduces that slice with
the ranks of the same local rank on the other hosts (``cross``); everyone copies
the result out.  Ordering between the counter store and the data relies on the
stores of one process becoming visible in order (x86's memory model).
"""

import hashlib
import hmac
import mmap
import os
import time
from typing import List, Optional

import numpy as np

from hvdlite.common import arrays
from hvdlite.common.arrays import lazy_torch
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.message import ReduceOp

SHM_DIR = "/dev/shm"
#: file-name prefix of every segment (the launcher and tests look for leftovers by it)
PREFIX = "hvdlite-"
_HEADER = 4096
_ALIGN = 64
_SPIN_S = 50e-6          # busy-wait this long before yielding the CPU
_YIELD_S = 2e-3          # then yield for this long before sleeping between checks
_NAP_S = 50e-6
_CHECK_PEERS_S = 0.1
#: on one host, big tensors are reduced a piece of this many bytes at a time: the piece's
#: copy in, reduction and copy out then stay in the CPU's caches (a slot-sized piece made
#: every one of the three passes go to memory: BERT-base's 418 MiB took 105 ms, in 1 MiB
#: pieces 72 ms at np=2).  Between hosts the slot size stays, so each Gloo message is big,
#: and so it does when the host's ranks outnumber its cores: every piece costs two
#: barriers, and a barrier then waits for the scheduler to run each rank in turn
PIECE_BYTES = 1 << 20


def segment_name(job_id: str, key: bytes, round_: int, host_index: int) -> str:
    """The segment's file name: derived from the job's key, so another user's job cannot
    guess it, and from the round and host, so rounds and hosts never share one."""
    tag = hmac.new(key, f"{job_id}/{round_}/{host_index}".encode(), hashlib.sha256)
    return f"{PREFIX}{tag.hexdigest()[:24]}"


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class SharedMemoryGroup:
    """The local ranks of one host, exchanging through one mapped segment.

    Made in two steps so the ranks can meet in between: local rank 0 calls
    :meth:`create`, the others :meth:`attach` once it exists; when every rank has
    attached, rank 0 calls :meth:`unlink`.  Called from the background thread only.
    """

    def __init__(self, path: str, local_rank: int, local_size: int, slot_bytes: int,
                 job_ranks: List[int], timeout_s: float, create: bool):
        self.path = path
        self.local_rank, self.local_size = local_rank, local_size
        self.slot_bytes = (slot_bytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.job_ranks = job_ranks
        self.timeout_s = timeout_s
        self._oversubscribed = local_size > _cores()
        total = _HEADER + 2 * local_size * self.slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, total)
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        torch = lazy_torch()
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        header = np.frombuffer(self._map, dtype=np.int64, count=_HEADER // 8)
        self._counters = header[:local_size]
        self._pids = header[64:64 + local_size]
        self._pids[local_rank] = os.getpid()
        self._generation = int(self._counters[local_rank])
        self._set = 0
        self._last_peer_check = 0.0

    @classmethod
    def create(cls, path, local_size, slot_bytes, job_ranks, timeout_s):
        return cls(path, 0, local_size, slot_bytes, job_ranks, timeout_s, True)

    @classmethod
    def attach(cls, path, local_rank, local_size, slot_bytes, job_ranks, timeout_s):
        return cls(path, local_rank, local_size, slot_bytes, job_ranks, timeout_s, False)

    def unlink(self) -> None:
        """Remove the name; the memory lives on while any rank has it mapped."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        m, self._map = getattr(self, "_map", None), None
        self._bytes = None
        self._counters = self._pids = None
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
        if counters.min() >= g:
            return
        start = time.perf_counter()
        while time.perf_counter() - start < _SPIN_S:
            if counters.min() >= g:
                return
        while True:
            now = time.perf_counter()
            if counters.min() >= g:
                return
            waited = now - start
            if waited < _YIELD_S:
                os.sched_yield()
            else:
                time.sleep(_NAP_S)
            if now - self._last_peer_check > _CHECK_PEERS_S:
                self._last_peer_check = now
                self._check_peers(g, waited)

    def _check_peers(self, g: int, waited: float) -> None:
        late = [r for r in range(self.local_size) if self._counters[r] < g]
        for r in late:
            pid = int(self._pids[r])
            if pid <= 0:
                continue                   # not attached yet: only the timeout applies
            if _process_gone(pid):
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
        start = _HEADER + (which_set * self.local_size + local_rank) * self.slot_bytes
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
    def allreduce_(self, tensor, op: ReduceOp, cross=None) -> None:
        """Reduce ``tensor`` (contiguous) in place over the local ranks (then, with
        ``cross``, over the hosts: ``cross(slice)`` reduces a slice in place with the
        same local rank of every other host)."""
        flat = tensor.view(-1)
        itemsize = flat.element_size()
        per = self.piece_bytes(cross is not None) // itemsize
        n = flat.numel()
        for lo in range(0, max(n, 1), per):
            self._allreduce_chunk(flat[lo:lo + per], op, cross)

    def _allreduce_chunk(self, chunk, op: ReduceOp, cross) -> None:
        nbytes = chunk.numel() * chunk.element_size()
        self._slot(self._set, self.local_rank, nbytes).view(chunk.dtype).copy_(chunk)
        chunk.copy_(self._reduce_set(chunk.dtype, chunk.numel(), op, 1.0, cross))

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
        torch = lazy_torch()
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
                _combine(torch, acc, self._slot(s, r, nbytes).view(dtype)[lo:hi], op)
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


def _process_gone(pid: int) -> bool:
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


def _combine(torch, acc, other, op: ReduceOp) -> None:
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


def leftover_segments(prefix: Optional[str] = None) -> List[str]:
    """Segment files of hvdlite still named in /dev/shm (there should be none)."""
    if not os.path.isdir(SHM_DIR):
        return []
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(prefix or PREFIX))


def segment_owners(name: str) -> List[int]:
    """The pids recorded in the header of the segment ``name`` in /dev/shm."""
    with open(os.path.join(SHM_DIR, name), "rb") as f:
        head = f.read(_HEADER)
    pids = np.frombuffer(head[:len(head) // 8 * 8], dtype=np.int64)[64:]
    return [int(p) for p in pids if p > 0]
