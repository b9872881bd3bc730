"""Layer 2: real Runtime objects, one per rank, as threads over a loopback backend.

Fast and deterministic checks of the negotiation, the cache fast path, fusion and
the failure paths, without process start-up.
"""

import threading

import pytest
import torch

from hvdlite.common.config import Config
from hvdlite.common.exceptions import HvdliteInternalError, HvdliteMismatchError
from hvdlite.common.message import JOIN_NAME, OpType, ReduceOp, Request
from hvdlite.common.runtime import Runtime
from hvdlite.common.tensor_queue import Entry, Handle
from tests.common.loopback import Hub, LoopbackBackend

pytestmark = pytest.mark.timeout(60)


def start(size, **config):
    hub = Hub(size)
    rts = [Runtime(Config(rank=r, size=size, **config), LoopbackBackend(hub, r))
           for r in range(size)]
    for rt in rts:
        rt.start()
    return hub, rts


def stop(rts):
    for rt in rts:
        rt.stop(10)
    assert not any(rt.running() for rt in rts)


def allreduce(rt, name, tensor, op=ReduceOp.SUM):
    handle = Handle(1)
    rt.enqueue([Entry(Request(name, OpType.ALLREDUCE, "float32", tuple(tensor.shape),
                              reduce_op=int(op)), tensor, tensor, handle, 0)])
    return handle


def wait(handle):
    assert handle.wait(20), "operation did not complete"
    return handle.value()


def on_every_rank(rts, fn):
    """Run fn(rank, runtime) on one thread per rank; re-raise the first failure."""
    errors = []

    def body(r):
        try:
            fn(r, rts[r])
        except BaseException as exc:       # reported below, with the rank
            errors.append((r, exc))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(rts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, f"rank {errors[0][0]} failed: {errors[0][1]!r}"


def test_different_submission_orders_give_the_same_results():
    _, rts = start(3)

    def body(r, rt):
        names = ["a", "b", "c"] if r % 2 == 0 else ["c", "b", "a"]
        handles = {n: allreduce(rt, n, torch.full((4,), float(r + ord(n)))) for n in names}
        for n, h in handles.items():
            assert wait(h).tolist() == [float(3 * ord(n) + 3)] * 4

    on_every_rank(rts, body)
    stop(rts)


def test_steady_state_uses_one_control_exchange_per_cycle():
    hub, rts = start(2)
    tensors = [[torch.ones(8) for _ in range(50)] for _ in range(2)]

    def step(r, rt):
        hs = [allreduce(rt, f"t{i}", t) for i, t in enumerate(tensors[r])]
        for h in hs:
            wait(h)

    on_every_rank(rts, step)                  # negotiates and fills the cache
    assert len(rts[0].cache) == 50 and hub.calls["control_allgather"] >= 1
    before = dict(hub.calls)
    on_every_rank(rts, step)                  # the same names again: cache hits only
    # no request exchange at all, and the 50 tensors travel fused, not one by one
    assert hub.calls["control_allgather"] == before["control_allgather"]
    assert hub.calls["allreduce"] - before["allreduce"] < 50
    assert rts[0].controller.table == {}
    for t in tensors[0]:
        assert t.tolist() == [2.0 ** 2] * 8   # summed twice over two ranks
    stop(rts)


def test_mismatch_fails_every_rank_and_runtime_continues():
    _, rts = start(2)

    def body(r, rt):
        h = allreduce(rt, "m", torch.ones(2 + r))
        with pytest.raises(HvdliteMismatchError, match="'m'"):
            wait(h)
        assert wait(allreduce(rt, "ok", torch.ones(1))).tolist() == [2.0]

    on_every_rank(rts, body)
    stop(rts)


def test_join_contributes_zeros_and_reports_last_rank():
    _, rts = start(2)

    def body(r, rt):
        if r == 0:
            j = Handle(1)
            rt.enqueue([Entry(Request(JOIN_NAME, OpType.JOIN), None, None, j, 0)])
            assert wait(j) == 1
        else:
            assert wait(allreduce(rt, "x", torch.full((3,), 5.0))).tolist() == [5.0] * 3
            j = Handle(1)
            rt.enqueue([Entry(Request(JOIN_NAME, OpType.JOIN), None, None, j, 0)])
            assert wait(j) == 1

    on_every_rank(rts, body)
    stop(rts)


def test_dead_peer_fails_pending_and_later_operations():
    _, rts = start(2, op_timeout_s=5)
    h = allreduce(rts[0], "never", torch.ones(1))
    rts[1].backend.crash()
    with pytest.raises(HvdliteInternalError):
        wait(h)
    with pytest.raises(HvdliteInternalError):
        allreduce(rts[0], "later", torch.ones(1))
    for rt in rts:
        rt.stop(10)


def test_shutdown_of_one_rank_stops_the_others():
    _, rts = start(2)
    h = allreduce(rts[1], "pending", torch.ones(1))
    assert rts[0].stop(10)
    with pytest.raises(HvdliteInternalError, match="rank 0 shut down"):
        wait(h)
    assert rts[1].stop(10) and not rts[1].running()


def test_full_negotiation_when_only_a_peer_missed_the_cache():
    """A rank holding many cache hits must be able to send them all when a peer's miss
    forces a full negotiation (its payload is longer than the peer's)."""
    _, rts = start(2)
    tensors = [[torch.ones(4) for _ in range(40)] for _ in range(2)]
    names = [f"long.tensor.name.{i:04d}" for i in range(40)]

    def step(r, rt):
        for h in [allreduce(rt, n, t) for n, t in zip(names, tensors[r])]:
            wait(h)

    on_every_rank(rts, step)                       # cache now holds all 40
    hits = [allreduce(rts[0], n, t) for n, t in zip(names, tensors[0])]
    miss = allreduce(rts[1], "x", torch.ones(1))   # rank 1: a new name first...
    for _ in range(50):                            # ...while rank 0 keeps cycling its hits
        if rts[0]._cycle > 5 + rts[1]._cycle // 2:
            break
        threading.Event().wait(0.01)
    late = [allreduce(rts[1], n, t) for n, t in zip(names, tensors[1])]
    x0 = allreduce(rts[0], "x", torch.ones(1))
    for h in hits + late:
        wait(h)
    assert wait(miss).tolist() == [2.0] and wait(x0).tolist() == [2.0]
    stop(rts)
