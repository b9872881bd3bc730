"""Gradient buckets that live in memory this host's other ranks can read: zero-copy allreduce.

A rank's gradient bucket (``DistributedOptimizer``'s flat buffer) normally lives in the
rank's private memory, so a shared-memory allreduce copies it into the host's segment and
the result back out.  When the bucket is allocated here instead, autograd writes the
gradients straight into memory the peers can map, and the reduction reads them where they
lie: each local rank sums its slice of every rank's bucket into its own bucket, then copies
the other slices' results from the peers' buckets (:meth:`SharedMemoryGroup.zero_copy_`).
Nothing is copied in, and no staging slot is used.

Each process has one :class:`BucketArena`: a nameless ``memfd`` of :data:`CAPACITY` bytes
of address space (pages exist only once written, and go back to the kernel when a bucket is
freed), made when the job's shared-memory group is set up and kept for the process's life,
so buckets outlive elastic rounds.  The peers of each round open it through
``/proc/<pid>/fd/<fd>`` (:class:`PeerArenas`), as they open the segment; the random tag at
its start tells a recycled pid's or fd's file apart.  Like the segment, it can never be
left behind: it has no name and the kernel frees it with the last mapping.

Buckets are found by their offset in the arena, so a peer's bucket is the one at the same
offset in its arena: ranks that build the same optimizer allocate the same offsets.  That is
checked on every reduction, never assumed (see ``shm``'s ``zero_copy_``): when any rank's
tensor is elsewhere, every rank takes the copying path.
"""

import mmap
import os
import threading
import weakref
from typing import List, Optional

import numpy as np

from hvdlite.common.arrays import lazy_torch

#: what the names of ``DistributedOptimizer``'s buckets start with: the executor reduces
#: them where they lie whatever their size when the backend shares buckets (a name is the
#: same on every rank, so every rank routes them alike)
BUCKET_NAME_PREFIX = "DistributedOptimizer.bucket."
#: address space of one rank's arena; only written pages cost memory
CAPACITY = 1 << 36
#: buckets start on a page, so a freed one gives its pages back whole
_PAGE = 4096
_TAG_BYTES = 16

_lock = threading.Lock()
_arena: Optional["BucketArena"] = None


class BucketArena:
    """This process's arena: a bump-and-free-list allocator over one mapped memfd."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._fd = os.memfd_create("hvdlite-buckets", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, capacity)
            self._map = mmap.mmap(self._fd, capacity)
        except BaseException:
            os.close(self._fd)
            raise
        tag = os.urandom(_TAG_BYTES)
        self._map[:_TAG_BYTES] = tag
        #: what a peer needs to map it: the path to our fd, the tag, the size
        self.ticket = f"/proc/{os.getpid()}/fd/{self._fd} {tag.hex()} {capacity}"
        self._free: List[List[int]] = [[_PAGE, capacity - _PAGE]]  # [offset, bytes], sorted
        self._lock = threading.Lock()
        self.base = np.frombuffer(self._map, dtype=np.uint8, count=1).ctypes.data

    def allocate(self, numel: int, dtype):
        """A zeroed 1-D tensor of ``numel`` elements of ``dtype`` in the arena, or None when
        it has no room.  Its pages return to the kernel when the last view of it is gone."""
        torch = lazy_torch()
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = max(numel * itemsize, 1)
        size = (nbytes + _PAGE - 1) // _PAGE * _PAGE
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = [start + size, length - size]
                    break
            else:
                return None
        raw = np.frombuffer(self._map, dtype=np.uint8, count=numel * itemsize, offset=start)
        tensor = torch.from_numpy(raw).view(dtype)
        tensor.zero_()
        # the numpy array lives exactly as long as torch's storage of the tensor and its views
        weakref.finalize(raw, self._release, start, size)
        return tensor

    def _release(self, start: int, size: int) -> None:
        try:
            self._map.madvise(mmap.MADV_REMOVE, start, size)
        except (OSError, ValueError):
            pass
        with self._lock:
            self._free.append([start, size])
            self._free.sort()
            merged: List[List[int]] = []
            for s, n in self._free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1][1] += n
                else:
                    merged.append([s, n])
            self._free = merged

    def offset_of(self, tensor) -> int:
        """Where ``tensor``'s data starts in the arena, or -1 when it is not in it."""
        at = tensor.data_ptr() - self.base
        end = at + tensor.numel() * tensor.element_size()
        return at if 0 <= at and end <= self.capacity else -1


def arena() -> Optional[BucketArena]:
    """This process's arena, or None until a shared-memory group opened it."""
    return _arena


def open_arena() -> Optional[BucketArena]:
    """This process's arena, made at the first call (None if memfd is unavailable)."""
    global _arena
    with _lock:
        if _arena is None:
            try:
                _arena = BucketArena()
            except (OSError, AttributeError, ValueError):
                return None
        return _arena


def allocate(numel: int, dtype):
    """A zeroed tensor in this process's arena, or None (no arena yet, or no room)."""
    a = _arena
    return a.allocate(numel, dtype) if a is not None else None


class PeerArenas:
    """The arenas of this host's ranks of one round, mapped by their tickets (this rank's own
    is its arena's mapping).  ``views[r]`` is local rank r's arena as one uint8 tensor."""

    def __init__(self, tickets: List[str], local_rank: int, own: BucketArena):
        torch = lazy_torch()
        self._maps = []
        self.views = []
        for r, ticket in enumerate(tickets):
            if r == local_rank:
                m = own._map
            else:
                m = _map_ticket(ticket)
                self._maps.append(m)
            self.views.append(torch.frombuffer(m, dtype=torch.uint8))

    def close(self) -> None:
        self.views = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a view still exists; the mapping goes with the process
        self._maps = []


def _map_ticket(ticket: str) -> mmap.mmap:
    """Map the arena a ticket names, checking its size and tag.

    Raises:
        OSError: it cannot be opened or has another size or tag (its owner died and the pid
            or fd belongs to something else now).
    """
    path, tag, capacity = ticket.split(" ")
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != int(capacity):
            raise OSError(f"{path} is not a bucket arena of {capacity} bytes")
        m = mmap.mmap(fd, int(capacity))
    finally:
        os.close(fd)
    if m[:_TAG_BYTES] != bytes.fromhex(tag):
        m.close()
        raise OSError(f"{path} is not the bucket arena it was announced as (tag differs)")
    return m
