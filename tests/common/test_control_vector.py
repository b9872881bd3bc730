"""The O(1) control vector: packed cache bits (and their second round), the straggler
summary, uniform negotiation without an allgather, and packed grouped allreduces."""

import random

import numpy as np
import pytest
import torch

from hvdlite.common.engine import control_vector as cv
from hvdlite.common.engine.controller import Controller
from hvdlite.common.exceptions import HvdliteMismatchError
from hvdlite.common.engine.message import BARRIER_NAME, OpType, ReduceOp, Request
from hvdlite.common.diagnostics.stragglers import NOT_PENDING
from hvdlite.common.engine.tensor_queue import Entry, Handle
from tests.common.loopback import on_every_rank, wait
from tests.common.loopback import start_runtimes as start
from tests.common.loopback import stop_runtimes as stop

pytestmark = pytest.mark.timeout(60)


def _agree(vectors):
    return np.minimum.reduce(vectors)


def test_vector_is_small_and_independent_of_the_job_size():
    # 1,024-slot cache (the default): well under 1 KB, at any number of ranks
    assert cv.length(1024) * 4 <= 1024
    assert cv.template(1024).nbytes == cv.length(1024) * 4


@pytest.mark.parametrize("seed", range(5))
def test_packed_bits_and_second_round_give_the_intersection(seed):
    rng = random.Random(seed)
    capacity, words = 200, cv.words_for(200)
    hits = [sorted(rng.sample(range(capacity), rng.randint(0, 60))) for _ in range(3)]
    hits[1] = sorted(set(hits[1]) | set(hits[0][:5]))  # some overlap for sure
    vecs = []
    for h in hits:
        v = cv.template(capacity)
        if h:
            cv.put_slots(v, h, words)
        vecs.append(v)
    agreed = _agree(vecs)
    ragged = cv.ragged_words(agreed, words)
    second = _agree([cv.own_bits(h, ragged) for h in hits]) if len(ragged) else None
    expected = sorted(set(hits[0]) & set(hits[1]) & set(hits[2]))
    assert cv.ready_slots(agreed, words, ragged, second) == expected


def test_identical_hits_need_no_second_round():
    words = cv.words_for(64)
    vecs = []
    for _ in range(4):
        v = cv.template(64)
        cv.put_slots(v, [0, 30, 31, 63], words)
        vecs.append(v)
    agreed = _agree(vecs)
    assert len(cv.ragged_words(agreed, words)) == 0
    assert cv.ready_slots(agreed, words, np.array([], dtype=np.int64), None) == [0, 30, 31, 63]


def test_straggler_summary_names_the_newest_rank():
    size = 5
    ages = [9000, 4000, 12000, 3000, NOT_PENDING]
    vecs = []
    for r, age in enumerate(ages):
        v = cv.template(16)
        cv.put_age(v, age, r, size)
        vecs.append(v)
    newest, youngest, oldest = cv.read_ages(_agree(vecs[:4] + [cv.template(16)]), size)
    assert (newest, youngest) == (3, 3000) and oldest == NOT_PENDING
    newest, youngest, oldest = cv.read_ages(_agree(vecs[:4]), size)
    assert (newest, youngest, oldest) == (3, 3000, 12000)


def test_digests_agree_only_when_every_rank_sent_the_same_payload():
    a = [Request("x", OpType.ALLREDUCE, "float32", (4,), reduce_op=1)]
    b = [Request("y", OpType.ALLREDUCE, "float32", (4,), reduce_op=1)]
    from hvdlite.common.engine.message import encode_requests

    vecs = []
    for reqs in (a, a, a):
        v = cv.template(8)
        cv.put_digest(v, encode_requests(reqs))
        vecs.append(v)
    assert cv.uniform(_agree(vecs))
    other = cv.template(8)
    cv.put_digest(other, encode_requests(b))
    assert not cv.uniform(_agree(vecs + [other]))
    assert not cv.uniform(_agree(vecs + [cv.template(8)]))  # a rank with no payload


def test_uniform_ingest_matches_the_general_ingest():
    reqs = [
        Request(
            "ar", OpType.ALLREDUCE, "float32", (3, 2), reduce_op=int(ReduceOp.SUM), prescale=0.5
        ),
        Request("ag", OpType.ALLGATHER, "int64", (5, 2)),
        Request("bc", OpType.BROADCAST, "float64", (7,), root=1),
        Request("a2a", OpType.ALLTOALL, "float32", (6,), splits=(2, 1, 3)),
        Request("bad", OpType.ALLTOALL, "float32", (6,), splits=(2, 1)),
        Request("g", OpType.ALLREDUCE, "float32", (10,), reduce_op=0, parts=(3, 77)),
        Request(BARRIER_NAME, OpType.BARRIER),
    ]
    general = Controller(3).ingest([reqs] * 3, 1)
    uniform = Controller(3).ingest_uniform(reqs, 1)
    fields = (
        "name",
        "op",
        "dtype",
        "shape",
        "root",
        "reduce_op",
        "prescale",
        "postscale",
        "first_dims",
        "splits",
        "error",
    )
    assert [[getattr(r, f) for f in fields] for r in uniform] == [
        [getattr(r, f) for f in fields] for r in general
    ]
    assert uniform[4].error and "splits" in uniform[4].error


def _submit(rt, name, tensor, parts=None):
    handle = Handle(1)
    rt.enqueue(
        [
            Entry(
                Request(
                    name,
                    OpType.ALLREDUCE,
                    "float32",
                    tuple(tensor.shape),
                    reduce_op=int(ReduceOp.SUM),
                    parts=parts,
                ),
                tensor,
                tensor,
                handle,
                0,
            )
        ]
    )
    return handle


def test_ragged_cache_hits_complete_when_a_rank_waits_between_ops():
    """Rank 0 submits a and b together; rank 1 submits b only after a completed.  The
    ranks' hit words differ, so the second round must run a alone (no deadlock)."""
    hub, rts = start(2)
    bufs = [{n: torch.ones(4) for n in "ab"} for _ in range(2)]

    def step(r, rt):
        if r == 0:
            ha, hb = _submit(rt, "a", bufs[r]["a"]), _submit(rt, "b", bufs[r]["b"])
            wait(ha)
            wait(hb)
        else:
            wait(_submit(rt, "a", bufs[r]["a"]))
            wait(_submit(rt, "b", bufs[r]["b"]))

    on_every_rank(rts, step)  # negotiated: fills the cache
    on_every_rank(rts, step)  # cache hits, ragged in their word
    for r in range(2):
        assert bufs[r]["a"].tolist() == [4.0] * 4 and bufs[r]["b"].tolist() == [4.0] * 4
    stop(rts)


def test_grouped_parts_mismatch_names_the_group():
    _, rts = start(2)

    def body(r, rt):
        h = _submit(rt, "grp", torch.ones(6), parts=(2 + r, 5))
        with pytest.raises(HvdliteMismatchError, match="grouped tensors.*'grp'|'grp'.*grouped"):
            wait(h)

    on_every_rank(rts, body)
    stop(rts)


def test_lists_that_differ_wait_to_become_the_same_instead_of_allgathering(monkeypatch):
    """Rank 1 submits its second tensor later: the negotiation waits for its list to match
    rank 0's (here without bound), then needs no allgather."""
    import time
    from hvdlite.common.engine import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "_CONVERGE_US", 10**9)
    hub, rts = start(2)
    bufs = [[torch.full((3,), float(r + 1)) for _ in range(2)] for r in range(2)]

    def body(r, rt):
        first = _submit(rt, "late.0", bufs[r][0])
        if r == 1:
            time.sleep(0.01)
        second = _submit(rt, "late.1", bufs[r][1])
        wait(first)
        wait(second)

    on_every_rank(rts, body)
    assert hub.calls.get("control_allgather", 0) == 0
    for r in range(2):
        assert [b.tolist() for b in bufs[r]] == [[3.0] * 3, [3.0] * 3]
    stop(rts)
