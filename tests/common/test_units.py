"""Layer 1: the deterministic pieces on their own (no processes, no transport)."""

import pytest

from hvdlite.common.config import Config
from hvdlite.runner.hosts import SlotInfo
from hvdlite.runner.processes.workers import slot_env
from hvdlite.common.engine.controller import Controller, plan_fusion
from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.common.engine.message import (
    OpType,
    ReduceOp,
    Request,
    Response,
    decode_requests,
    encode_requests,
)
from hvdlite.common.engine.response_cache import ResponseCache

pytestmark = pytest.mark.timeout(30)


def ar(name, shape=(4,), dtype="float32", op=ReduceOp.SUM, **kw):
    return Request(name, OpType.ALLREDUCE, dtype, shape, reduce_op=int(op), **kw)


def test_requests_round_trip_through_the_wire_encoding():
    reqs = [
        ar("a", (2, 3), prescale=0.5),
        Request("b", OpType.ALLTOALL, "int64", (5,), splits=(2, 3)),
    ]
    back = decode_requests(encode_requests(reqs))
    assert [r.sig for r in back] == [r.sig for r in reqs]
    assert [r.name for r in back] == ["a", "b"]


def test_wire_bound_covers_the_encoding():
    reqs = [
        ar("w" * 300),
        ar(
            "\u00e9\U0001f600" * 50,
            shape=(2**62, 3, 1),
            prescale=-1.2345678901234567e-300,
            postscale=float("inf"),
        ),
        Request("s", OpType.ALLTOALL, "bfloat16", (10**18,), splits=(10**18,) * 7),
        Request("j", OpType.JOIN),
    ]
    for r in reqs:
        assert len(encode_requests([r])) <= r.wire_bound() + 2
    assert len(encode_requests(reqs)) <= sum(r.wire_bound() for r in reqs) + 2


def test_ready_only_when_every_rank_submitted_and_same_order_everywhere():
    c = Controller(2)
    assert c.ingest([[ar("a"), ar("b")], []], cycle=1) == []
    out = c.ingest([[], [ar("b"), ar("a")]], cycle=2)
    # rank order then submission order decides, the same on every rank
    assert [r.name for r in out] == ["b", "a"]
    assert c.table == {}


def test_mismatch_names_tensor_and_disagreeing_ranks():
    c = Controller(3)
    out = c.ingest([[ar("w", (4,))], [ar("w", (4,))], [ar("w", (5,))]], cycle=1)
    assert len(out) == 1 and out[0].error is not None
    assert "'w'" in out[0].error and "ranks [0, 1] sent [4]" in out[0].error
    assert "ranks [2] sent [5]" in out[0].error


def test_allgather_response_carries_every_first_dimension():
    c = Controller(2)
    reqs = [[Request("g", OpType.ALLGATHER, "float32", (r + 1, 3))] for r in range(2)]
    [resp] = c.ingest(reqs, cycle=1)
    assert resp.error is None and resp.first_dims == [1, 2]


def test_join_completes_tensors_and_reports_last_rank():
    c = Controller(2)
    assert c.ingest([[ar("x")], []], cycle=1) == []
    out = c.ingest([[], [Request("__join__", OpType.JOIN)]], cycle=2)
    assert [r.name for r in out] == ["x"]
    out = c.ingest([[Request("__join__", OpType.JOIN)], []], cycle=3)
    assert out[-1].op == OpType.JOIN and out[-1].value == 0
    assert not c.joined


def test_stalled_tensors_fail_with_missing_ranks():
    c = Controller(3)
    c.ingest([[ar("s")], [ar("s")], []], cycle=4)
    [(name, have, missing, _)] = c.stalled(0.0)
    assert (name, have, missing) == ("s", [0, 1], [2])
    [resp] = c.fail_older_than(4)
    assert resp.error_kind == "stall" and "never by ranks [2]" in resp.error


def _resp(name, nbytes, op=OpType.ALLREDUCE, dtype="float32", root=-1):
    r = Response(name, op, dtype, (nbytes // 4,), root=root, reduce_op=int(ReduceOp.SUM))
    r.nbytes = nbytes
    return r


def test_fusion_respects_threshold_dtype_and_root():
    rs = [
        _resp("a", 40),
        _resp("b", 40),
        _resp("c", 40),
        _resp("d", 8, dtype="float64"),
        _resp("e", 4, OpType.BROADCAST, root=0),
        _resp("f", 4, OpType.BROADCAST, root=1),
    ]
    groups = plan_fusion(rs, threshold_bytes=80)
    assert [[r.name for r in g] for g in groups] == [["a", "b"], ["c"], ["d"], ["e"], ["f"]]
    assert all(len(g) == 1 for g in plan_fusion(rs, threshold_bytes=0))


def test_cache_slots_are_deterministic_and_evict_lru():
    caches = [ResponseCache(2), ResponseCache(2)]
    for cache in caches:
        for name in ("a", "b", "c"):  # "a" is evicted, "c" takes its slot
            cache.put(Response(name, OpType.ALLREDUCE, "float32", (4,)), ar(name))
    for cache in caches:
        assert cache.lookup(ar("a")) == -1
        assert cache.lookup(ar("c")) == 0 and cache.lookup(ar("b")) == 1
        assert cache.lookup(ar("c", (5,))) == -1  # changed signature: a miss
        cache.erase("b")
        assert cache.lookup(ar("b")) == -1


def test_config_reads_env_and_rejects_bad_values(caplog):
    cfg = Config.from_env(
        {
            "HVDLITE_FUSION_THRESHOLD": "1024",
            "HVDLITE_CYCLE_TIME": "2.5",
            "HVDLITE_RANK": "1",
            "HVDLITE_SIZE": "2",
            "HVDLITE_TYPO": "1",
        }
    )
    assert (cfg.fusion_threshold_bytes, cfg.cycle_time_ms, cfg.rank) == (1024, 2.5, 1)
    assert "HVDLITE_TYPO" in caplog.text
    with pytest.raises(HvdliteConfigError, match="HVDLITE_CACHE_CAPACITY"):
        Config.from_env({"HVDLITE_CACHE_CAPACITY": "lots"})
    with pytest.raises(HvdliteConfigError, match="HVDLITE_RANK"):
        Config.from_env({"HVDLITE_RANK": "2", "HVDLITE_SIZE": "2"})
    env = slot_env(
        SlotInfo("h", rank=1, local_rank=1, cross_rank=0, size=2, local_size=2, cross_size=1),
        {},
        {},
    )
    assert env["HOROVOD_RANK"] == env["HVDLITE_RANK"] == "1"
    assert env["HOROVOD_LOCAL_SIZE"] == env["HVDLITE_LOCAL_SIZE"] == "2"


def test_common_imports_no_framework_at_module_level():
    """DESIGN.md: common/ stays framework-neutral (only backend/gloo may import torch)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import hvdlite.common.basics, hvdlite.common.engine.runtime, hvdlite.common.engine.executor\n"
        "import hvdlite.common.engine.controller, hvdlite.common.engine.fusion\n"
        "import hvdlite.common.backend.local, hvdlite.common.backend.mpi\n"
        "bad = [m for m in ('torch', 'tensorflow') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_requests_in_flight_are_bounded_and_released():
    """The sum of in-flight requests' wire bounds stays under the negotiation payload's
    bound (its length travels in the int32 control vector): past it, push refuses."""
    from hvdlite.common.engine import tensor_queue as tq

    q = tq.TensorQueue()
    handle = tq.Handle(1)
    name = "n" * 4096
    per = Request(f"{name}.{0:06d}", OpType.ALLREDUCE, "float32", (4,)).wire_bound()
    fits = tq.MAX_IN_FLIGHT_WIRE_BYTES // per
    for i in range(fits):
        q.push(
            [
                tq.Entry(
                    Request(f"{name}.{i:06d}", OpType.ALLREDUCE, "float32", (4,)),
                    None,
                    None,
                    handle,
                    0,
                )
            ],
            0.0,
        )
    extra = tq.Entry(
        Request(f"{name}.xxxxxx", OpType.ALLREDUCE, "float32", (4,)), None, None, handle, 0
    )
    with pytest.raises(ValueError, match="synchronize some handles first"):
        q.push([extra], 0.0)
    q.finish([f"{name}.{0:06d}"])  # a completed one makes room again
    q.push([extra], 0.0)
