"""Layer 2: real Runtime objects, one per rank, as threads over a loopback backend.

Fast and deterministic checks of the negotiation, the cache fast path, fusion and
the failure paths, without process start-up.
"""

import threading

import pytest
import torch

from hvdlite.common.exceptions import HvdliteInternalError, HvdliteMismatchError, HvdliteStallError
from hvdlite.common.engine.message import JOIN_NAME, OpType, ReduceOp, Request
from hvdlite.common.diagnostics.recorder import (
    COLLECTIVE,
    COPY_IN,
    COPY_OUT,
    DONE,
    NEGOTIATE,
    NULL,
    QUEUED,
    Recorder,
)
from hvdlite.common.engine.tensor_queue import Entry, Handle
from tests.common.loopback import on_every_rank, wait
from tests.common.loopback import start_runtimes as start
from tests.common.loopback import stop_runtimes as stop

pytestmark = pytest.mark.timeout(60)


def allreduce(rt, name, tensor, op=ReduceOp.SUM):
    handle = Handle(1)
    rt.enqueue(
        [
            Entry(
                Request(name, OpType.ALLREDUCE, "float32", tuple(tensor.shape), reduce_op=int(op)),
                tensor,
                tensor,
                handle,
                0,
            )
        ]
    )
    return handle


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

    on_every_rank(rts, step)  # negotiates and fills the cache
    assert len(rts[0].cache) == 50
    before = dict(hub.calls)
    on_every_rank(rts, step)  # the same names again: cache hits only
    # no request exchange at all, and the 50 tensors travel fused, not one by one
    assert hub.calls.get("control_allgather", 0) == before.get("control_allgather", 0)
    assert hub.calls["allreduce"] - before["allreduce"] < 50
    assert rts[0].controller.table == {}
    for t in tensors[0]:
        assert t.tolist() == [2.0**2] * 8  # summed twice over two ranks
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

    on_every_rank(rts, step)  # cache now holds all 40
    hits = [allreduce(rts[0], n, t) for n, t in zip(names, tensors[0])]
    miss = allreduce(rts[1], "x", torch.ones(1))  # rank 1: a new name first...
    for _ in range(50):  # ...while rank 0 keeps cycling its hits
        if rts[0]._cycle > 5 + rts[1]._cycle // 2:
            break
        threading.Event().wait(0.01)
    late = [allreduce(rts[1], n, t) for n, t in zip(names, tensors[1])]
    x0 = allreduce(rts[0], "x", torch.ones(1))
    for h in hits + late:
        wait(h)
    assert wait(miss).tolist() == [2.0] and wait(x0).tolist() == [2.0]
    stop(rts)


class _Log(Recorder):
    """Keeps every event, to compare what ranks did and when."""

    active = True

    def __init__(self):
        self.events = []  # (phase, name, time, extra)
        self.changes = []  # (cycle, parameters)

    def queued(self, name, op, submitted, nbytes=0):
        self.events.append((QUEUED, name, submitted, op))

    def negotiated(self, name, end, waited_for):
        self.events.append((NEGOTIATE, name, end, tuple(waited_for)))

    def span(self, phase, names, start, end, chunk=0):
        for n in names:
            self.events.append((phase, n, start, (end, chunk)))

    def done(self, name, end, error):
        self.events.append((DONE, name, end, error))

    def parameters(self, cycle, params):
        self.changes.append((cycle, params))


def test_live_parameters_switch_on_every_rank_in_the_same_cycle():
    logs = [_Log() for _ in range(3)]
    _, rts = start(3, recorders=logs)
    changes = {
        8: dict(
            fusion_threshold_bytes=64,
            fusion_chunk_bytes=24,
            inplace_threshold_bytes=32,
            cycle_time_ms=0.2,
        ),
        16: dict(cache_enabled=False, fusion_threshold_bytes=0),
        24: dict(cache_enabled=True, fusion_threshold_bytes=1 << 20),
    }
    with pytest.raises(ValueError, match="only rank 0"):
        rts[1].propose_parameters(cycle_time_ms=5)

    def body(r, rt):
        for step in range(32):
            if r == 0 and step in changes:
                rt.propose_parameters(**changes[step])
            tensors = [torch.full((i + 1,), float(r + step + i)) for i in range(6)]
            handles = [allreduce(rt, f"g{i}", t) for i, t in enumerate(tensors)]
            for i, h in enumerate(handles):
                expected = float(sum(q + step + i for q in range(3)))
                assert wait(h).tolist() == [expected] * (i + 1), (r, step, i)

    on_every_rank(rts, body)
    stop(rts)
    assert len(logs[0].changes) == 3, logs[0].changes
    assert logs[1].changes == logs[0].changes and logs[2].changes == logs[0].changes
    final = logs[0].changes[-1][1]
    assert final.fusion_threshold_bytes == 1 << 20 and final.cache_enabled
    assert final.fusion_chunk_bytes == 24 and final.cycle_time_ms == 0.2
    assert all(rt.params == final for rt in rts)


def test_recorder_sees_every_phase_of_a_pipelined_fused_group():
    logs = [_Log() for _ in range(2)]
    _, rts = start(2, recorders=logs, fusion_chunk_bytes=16, inplace_threshold_bytes=0)

    def body(r, rt):
        # one submission of three tensors: drained in one cycle, so they always fuse
        handles = [Handle(1) for _ in range(3)]
        tensors = [torch.ones(4) for _ in range(3)]
        rt.enqueue(
            [
                Entry(
                    Request(
                        f"p{i}", OpType.ALLREDUCE, "float32", (4,), reduce_op=int(ReduceOp.SUM)
                    ),
                    t,
                    t,
                    h,
                    0,
                )
                for i, (t, h) in enumerate(zip(tensors, handles))
            ]
        )
        for h in handles:
            assert wait(h).tolist() == [2.0] * 4

    on_every_rank(rts, body)
    stop(rts)
    for log in logs:
        for i in range(3):
            mine = [e for e in log.events if e[1] == f"p{i}"]
            phases = [e[0] for e in mine]
            assert phases == [QUEUED, NEGOTIATE, COPY_IN, COLLECTIVE, COPY_OUT, DONE], phases
            times = [e[2] for e in mine]
            assert times == sorted(times), mine
            assert mine[-1][3] is None  # no error
        chunks = {e[3][1] for e in log.events if e[0] == COLLECTIVE}
        assert len(chunks) > 1, "16-byte chunks should pipeline the 48-byte group"


def test_a_recorder_set_at_run_time_reaches_the_executor_and_can_be_removed():
    """set_recorder swaps the recorder of the loop and of the executor at a cycle start:
    spans (the executor's) appear only while it is set, on negotiated and cached groups."""
    _, rts = start(2)
    logs = [_Log() for _ in range(2)]

    def step(tag):
        def body(r, rt):
            for name in (f"{tag}.new", "again"):  # a miss, then a cache hit
                assert wait(allreduce(rt, name, torch.ones(2))).tolist() == [2.0, 2.0]

        on_every_rank(rts, body)

    def switch(recorders):
        for rt, rec in zip(rts, recorders):
            rt.set_recorder(rec)
        for rt in rts:
            for _ in range(200):
                if rt.recorder_switched():
                    break
                threading.Event().wait(0.01)
            assert rt.recorder_switched(), f"{rt.label}: the recorder was never taken"

    step("before")
    switch(logs)
    step("during")
    switch([NULL, NULL])
    step("after")
    stop(rts)
    for log in logs:
        names = {e[1] for e in log.events}
        assert names == {"during.new", "again"}, names
        for name in names:
            phases = [e[0] for e in log.events if e[1] == name]
            assert COLLECTIVE in phases and DONE in phases, (name, phases)


def test_stall_shutdown_fails_the_tensor_on_the_ranks_that_submitted_it():
    _, rts = start(2, stall_check_shutdown_time_s=0.3, stall_check_warning_time_s=0.1)
    h = allreduce(rts[0], "only.rank0", torch.ones(1))
    with pytest.raises(HvdliteStallError, match=r"only.rank0.*never by ranks \[1\]"):
        wait(h)
    both = [allreduce(rt, "later", torch.ones(1)) for rt in rts]  # the runtime goes on
    assert [wait(x).tolist() for x in both] == [[2.0], [2.0]]
    stop(rts)
