"""The executor's kept layouts (Executor._layout): a group's result views are reused only
where the result lies in the same place, and every step unpacks its own values."""

import pytest
import torch

from hvdlite.common.engine import fusion
from hvdlite.common.engine.executor import Executor
from hvdlite.common.engine.message import OpType, ReduceOp, Response
from hvdlite.common.engine.parameters import Parameters
from hvdlite.common.engine.tensor_queue import Entry, Handle


class AlternatingStage:
    """One rank's stand-in for shared memory: staging areas in two places used in turn (as
    the two slot sets are), the result where the data was staged, scaled; one chunk per
    ``chunk_bytes``."""

    rank, size = 0, 1

    def __init__(self, chunk_bytes):
        self.chunk_bytes = chunk_bytes
        self.places = [torch.zeros(1 << 16), torch.zeros(1 << 16)]
        self.turn = 0

    def pipeline_chunk_bytes(self, _):
        return self.chunk_bytes

    def shares_buckets(self):
        return False

    def stage(self, dtype, count):
        self.turn ^= 1
        return self.places[self.turn][:count]

    def allreduce_staged_(self, staged, op, scale):
        staged.mul_(scale)
        return staged


def _group(shapes):
    group = []
    for i, shape in enumerate(shapes):
        resp = Response(f"t.{i}", OpType.ALLREDUCE, "float32", shape, reduce_op=int(ReduceOp.SUM))
        resp.nbytes = resp.numel * 4
        group.append(resp)
    return group


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 400])
def test_a_kept_group_unpacks_each_steps_values_wherever_its_result_lies(chunk_bytes):
    backend = AlternatingStage(chunk_bytes)
    params = Parameters(
        fusion_threshold_bytes=1 << 20,
        fusion_chunk_bytes=chunk_bytes,
        inplace_threshold_bytes=1 << 20,
        cycle_time_ms=1.0,
        cache_enabled=True,
    )
    ex = Executor(backend, fusion.FusionBuffers(), params)
    shapes = [(3 + i % 5,) if i % 3 else (2, 3 + i % 4) for i in range(40)]
    group = _group(shapes)  # the same object every step, as cached
    for step in range(5):  # an odd count: both places, each twice+
        ins = [torch.full(s, float(step * 100 + i)) for i, s in enumerate(shapes)]
        outs = [torch.empty(s) for s in shapes]
        entries = {r.name: Entry(None, t, o, Handle(1), 0) for r, t, o in zip(group, ins, outs)}
        done = {}
        ex.run(
            group,
            entries,
            lambda e, result: done.__setitem__(id(e.output), result),
            lambda e, err: pytest.fail(f"{err}"),
        )
        assert len(done) == len(group)
        for i, (o, s) in enumerate(zip(outs, shapes)):
            assert torch.equal(o, torch.full(s, float(step * 100 + i))), (step, i)
    layouts = list(ex._layouts.values())
    assert len(layouts) == 1 and layouts[0][0] is group
    views = layouts[0][2][2]
    chunks = len(layouts[0][2][1])
    assert chunks <= len(views) <= 2 * chunks  # one set of views per chunk and place
    ex.forget()
    assert not ex._layouts and not ex._splits
