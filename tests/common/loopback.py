"""A Backend for N ranks that are threads of one process (tests only).

Each collective: every rank deposits its contribution, waits at a barrier,
computes its result from all deposits, and waits again before the slots are
reused.  Point-to-point exchanges (``sendrecv_``, which Adasum uses) go through
one mailbox per (sender, receiver) pair.  A barrier that times out (a rank never
arrived) raises HvdliteInternalError, like a dead peer does on a real transport.
"""

import collections
import queue
import threading

import numpy as np
import torch

from hvdlite.common.backend.base import Backend
from hvdlite.common.config import Config
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.engine.message import ReduceOp
from hvdlite.common.diagnostics.recorder import NULL
from hvdlite.common.engine.runtime import Runtime

_REDUCE = {
    ReduceOp.SUM: lambda s: torch.stack(s).sum(0),
    ReduceOp.MIN: lambda s: torch.stack(s).min(0).values,
    ReduceOp.MAX: lambda s: torch.stack(s).max(0).values,
    ReduceOp.PRODUCT: lambda s: torch.stack(s).prod(0),
}


class Hub:
    def __init__(self, size: int, timeout_s: float = 10.0):
        self.size = size
        self.slots = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.calls = collections.Counter()  # by kind, counted by rank 0, for traffic checks
        self.timeout_s = timeout_s
        # point-to-point messages in flight, by (sender, receiver)
        self.mail = {(s, d): queue.Queue() for s in range(size) for d in range(size)}


class LoopbackBackend(Backend):
    name = "loopback"

    def __init__(self, hub: Hub, rank: int):
        self.hub = hub
        self.rank, self.size = rank, hub.size
        self.local_rank, self.local_size = rank, hub.size
        self.cross_rank, self.cross_size = 0, 1

    def _exchange(self, contribution, kind: str):
        hub = self.hub
        hub.slots[self.rank] = contribution
        try:
            hub.barrier.wait()
            slots = list(hub.slots)
            hub.barrier.wait()
        except threading.BrokenBarrierError:
            raise HvdliteInternalError(f"rank {self.rank}: a peer thread never arrived") from None
        if self.rank == 0:
            hub.calls[kind] += 1
        return slots

    def control_allreduce_min(self, vec):
        return np.minimum.reduce(self._exchange(vec.copy(), "control_allreduce"))

    def _allgather_fixed(self, buf):
        return np.concatenate(self._exchange(buf.copy(), "control_allgather"))

    def allreduce_(self, tensor, op):
        slots = self._exchange(tensor.clone(), "allreduce")
        tensor.copy_(_REDUCE[ReduceOp(op)](slots))

    def allgather_bytes(self, send, counts):
        return self._exchange(send.clone(), "allgather")

    def broadcast_(self, tensor, root):
        tensor.copy_(self._exchange(tensor.clone(), "broadcast")[root])

    def alltoall_bytes(self, send, send_counts, recv_counts):
        slots = self._exchange((send.clone(), list(send_counts)), "alltoall")
        parts = []
        for data, counts in slots:
            start = sum(counts[: self.rank])
            parts.append(data[start : start + counts[self.rank]])
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    def sendrecv_(self, send, recv, peer):
        hub = self.hub
        hub.mail[(self.rank, peer)].put(send.clone())
        if self.rank == 0:
            hub.calls["sendrecv"] += 1
        waited = 0.0
        while True:
            try:
                got = hub.mail[(peer, self.rank)].get(timeout=0.05)
                break
            except queue.Empty:
                waited += 0.05
                if hub.barrier.broken or waited >= hub.timeout_s:
                    raise HvdliteInternalError(
                        f"rank {self.rank}: peer thread {peer} never answered"
                    ) from None
        if got.numel() * got.element_size() != recv.numel() * recv.element_size():
            raise AssertionError(
                f"rank {self.rank}: rank {peer} sent {got.numel()} "
                f"{got.dtype} elements, {recv.numel()} expected"
            )
        recv.view(-1).view(torch.uint8).copy_(got.view(-1).view(torch.uint8))

    def crash(self):
        """Simulate this rank dying: every peer's pending collective fails."""
        self.hub.barrier.abort()


# -- runtimes as threads over the loopback backend (layer-2 tests) ----------------------------
def start_runtimes(size, recorders=None, **config):
    """One started Runtime per rank over one Hub; returns ``(hub, runtimes)``."""
    hub = Hub(size)
    recorders = recorders or [NULL] * size
    rts = [
        Runtime(Config(rank=r, size=size, **config), LoopbackBackend(hub, r), recorders[r])
        for r in range(size)
    ]
    for rt in rts:
        rt.start()
    return hub, rts


def stop_runtimes(rts):
    for rt in rts:
        rt.stop(10)
    assert not any(rt.running() for rt in rts)


def wait(handle):
    assert handle.wait(20), "operation did not complete"
    return handle.value()


def on_every_rank(rts, fn):
    """Run fn(rank, runtime) on one thread per rank; re-raise the first failure with its rank."""
    errors = []

    def body(r):
        try:
            fn(r, rts[r])
        except BaseException as exc:  # reported below, with the rank
            errors.append((r, exc))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(rts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"ranks {hung} did not finish within 30s"
    assert not errors, f"rank {errors[0][0]} failed: {errors[0][1]!r}"
