"""Process sets at np=4: ops, concurrent training, overlapping sets, removal, errors.

``process_sets_worker.py dynamic`` starts with dynamic sets (Gloo or, under --mpi, MPI);
``process_sets_worker.py static`` registers two sets at init.
"""

import sys

import torch
import torch.nn as nn

from _common import assert_close, hvd
from hvdlite.common import basics, process_sets
from tests.worker_cases import run_each

torch.set_num_threads(1)
EVEN, ODD = [0, 2], [1, 3]


def _mine(even, odd):
    return even if hvd.rank() in EVEN else odd


def _set_ranks():
    return EVEN if hvd.rank() in EVEN else ODD


def check_collectives(even, odd):
    ps, ranks = _mine(even, odd), _set_ranks()
    other = odd if ps is even else even
    me = hvd.rank()
    assert ps.size() == 2 and ps.rank() == ranks.index(me) and ps.included(), ps
    assert other.rank() == -1 and not other.included()
    assert ps.process_set_id not in (None, 0) and ps.ranks == ranks
    # a set's backend is built by the same constructor as the job's: no attribute missing
    job_attrs = set(vars(basics.runtime().backend))
    set_attrs = set(vars(process_sets.runtime_of(ps).backend))
    assert set_attrs == job_attrs, sorted(set_attrs ^ job_attrs)
    # allreduce: only the set's values count, averaged over the set's size
    x = torch.tensor([float(me + 1), 10.0 * (me + 1)])
    want = sum(torch.tensor([r + 1.0, 10.0 * (r + 1)]) for r in ranks)
    assert_close("sum", hvd.allreduce(x, op=hvd.Sum, process_set=ps), want, 0, 0)
    assert_close("avg", hvd.allreduce(x, process_set=ps), want / 2, 0, 1e-6)
    got = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum, process_set=ps)
    assert_close("grouped", got[1], want * 2, 0, 0)
    # allgather: rows in set-rank order, uneven first dimensions
    rows = torch.full((me + 1, 2), float(me))
    g = hvd.allgather(rows, process_set=ps)
    assert_close("allgather", g, torch.cat([torch.full((r + 1, 2), float(r)) for r in ranks]), 0, 0)
    # broadcast: root_rank is a job rank that belongs to the set
    b = hvd.broadcast(torch.tensor([float(me)]), root_rank=ranks[1], process_set=ps)
    assert b.item() == ranks[1]
    t = torch.tensor([float(me)])
    hvd.broadcast_(t, root_rank=ranks[0], process_set=ps)
    assert t.item() == ranks[0]
    # alltoall: splits over the set's two members; member j gets splits[j] rows of each
    out, recv = hvd.alltoall(torch.arange(3.0) + 10 * me, splits=[1, 2], process_set=ps)
    mine_rows = [0] if ps.rank() == 0 else [1, 2]
    assert recv.tolist() == [len(mine_rows)] * 2, recv
    assert out.tolist() == [10.0 * r + i for r in ranks for i in mine_rows], out
    # reducescatter: each member keeps its slice of the set's sum
    rs = hvd.reducescatter(torch.ones(4, 1) * (me + 1), op=hvd.Sum, process_set=ps)
    assert rs.shape == (2, 1) and rs.flatten().tolist() == [float(sum(r + 1 for r in ranks))] * 2
    hvd.barrier(process_set=ps)
    # a set this rank is not in is refused on the spot, naming the rank and set
    try:
        hvd.allreduce(x, process_set=other)
    except ValueError as e:
        assert f"rank {me} is not a member" in str(e), e
    else:
        raise AssertionError("an op on a foreign set was accepted")
    try:
        hvd.broadcast(x, root_rank=[r for r in range(4) if r not in ranks][0], process_set=ps)
    except ValueError as e:
        assert "not a member of the process set" in str(e), e
    else:
        raise AssertionError("a root outside the set was accepted")
    # the global set keeps working beside them
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == 4.0
    assert hvd.global_process_set.ranks == [0, 1, 2, 3]


def check_autograd(even, odd):
    ps = _mine(even, odd)
    x = torch.full((2, 3), float(hvd.rank()), requires_grad=True)
    y = hvd.allgather(x, process_set=ps)
    (y * torch.arange(1.0, 5.0).unsqueeze(1)).sum().backward()
    # d/dx: the set-average of the output gradient, this member's rows
    rows = torch.arange(1.0, 5.0).unsqueeze(1).expand(4, 3)
    want = rows[2 * ps.rank() : 2 * ps.rank() + 2]
    assert_close("allgather grad", x.grad, want, 0, 1e-6)


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batches(set_index, member, steps=6):
    g = torch.Generator().manual_seed(100 * set_index + member)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(steps)]


def check_concurrent_training(even, odd):
    """The two sets train different models at once; each matches one process on the full
    batches of its set."""
    ps, ranks = _mine(even, odd), _set_ranks()
    index = 0 if ps is even else 1
    model = _model(seed=7 + index)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        process_set=ps,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=ranks[0], process_set=ps)
    for xb, yb in _batches(index, ps.rank()):
        opt.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
    ref = _model(seed=7 + index)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for (xa, ya), (xb, yb) in zip(_batches(index, 0), _batches(index, 1)):
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(torch.cat([xa, xb])), torch.cat([ya, yb])).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(name, p.detach(), q.detach(), 1e-5, 1e-6)
    # the two models differ: the sets really trained apart
    w = hvd.allgather(model[0].weight.detach().flatten().unsqueeze(0))
    assert not torch.allclose(w[0], w[1]) and torch.allclose(w[0], w[2])


def check_objects_and_batchnorm(even, odd):
    ps, ranks = _mine(even, odd), _set_ranks()
    obj = hvd.broadcast_object({"from": hvd.rank()}, root_rank=ranks[1], process_set=ps)
    assert obj == {"from": ranks[1]}, obj
    assert hvd.allgather_object(hvd.rank() * 10, process_set=ps) == [r * 10 for r in ranks]
    torch.manual_seed(hvd.rank())
    bn = hvd.SyncBatchNorm(3, process_set=ps)
    x = torch.randn(4, 3, 2, 2)
    y = bn(x)
    full = torch.cat([_rank_batch(r) for r in ranks])
    ref = nn.BatchNorm2d(3)(full)
    mine = ref[4 * ps.rank() : 4 * ps.rank() + 4]
    assert_close("sync batch norm", y.detach(), mine.detach(), 1e-4, 1e-5)


def _rank_batch(r):
    torch.manual_seed(r)  # as the rank seeded before making its batch
    return torch.randn(4, 3, 2, 2)


def check_overlapping_sets_run_concurrently(even, odd):
    low = hvd.add_process_set([0, 1, 2])
    high = hvd.add_process_set(hvd.ProcessSet([1, 2, 3]))
    me = hvd.rank()
    handles = []
    if me in low.ranks:
        handles.append(
            (low, hvd.allreduce_async(torch.tensor([me + 1.0]), op=hvd.Sum, process_set=low))
        )
    if me in high.ranks:
        handles.append(
            (high, hvd.allreduce_async(torch.tensor([me + 1.0]), op=hvd.Sum, process_set=high))
        )
    for ps, h in handles:
        assert hvd.synchronize(h).item() == sum(r + 1.0 for r in ps.ranks)
    # unnamed ops are numbered per set: a rank outside a set does not shift its names
    for _ in range(3):
        if me in high.ranks:
            hvd.allreduce(torch.ones(1), process_set=high)
    if me in low.ranks:
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=low).item() == 3.0
    hvd.remove_process_set(low)
    hvd.remove_process_set(high)


def check_remove_and_readd(even, odd):
    ps = _mine(even, odd)
    old_id = ps.process_set_id
    assert hvd.remove_process_set(even) and hvd.remove_process_set(odd)
    assert even.process_set_id is None and even.size() is None
    try:
        hvd.allreduce(torch.ones(1), process_set=ps)
    except ValueError as e:
        assert "not registered" in str(e), e
    else:
        raise AssertionError("a removed set was usable")
    again = hvd.add_process_set(EVEN)
    again_odd = hvd.add_process_set(ODD)
    assert again.process_set_id > old_id
    mine = again if hvd.rank() in EVEN else again_odd
    want = float(sum(r + 1 for r in _set_ranks()))
    assert (
        hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, process_set=mine).item() == want
    )
    return again, again_odd


def check_mismatch_names_job_ranks(even, odd):
    """A mismatch inside a set is reported on its members naming job ranks, not set ranks."""
    ps, ranks = _mine(even, odd), _set_ranks()
    me = hvd.rank()
    try:
        hvd.allreduce(torch.ones(2 + ranks.index(me)), name="mismatched", process_set=ps)
    except RuntimeError as e:
        msg = str(e)
        assert f"ranks [{ranks[0]}] sent [2]" in msg and f"ranks [{ranks[1]}] sent [3]" in msg, msg
    else:
        raise AssertionError("a shape mismatch inside a set was accepted")
    # and the set still works afterwards
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps).item() == 2.0


def check_errors():
    me = hvd.rank()
    try:  # the ranks disagree: every rank is told
        hvd.add_process_set([0, 1] if me == 0 else [0, 3])
    except ValueError as e:
        assert "disagree" in str(e) and "[0, 1]" in str(e) and "[0, 3]" in str(e), e
    else:
        raise AssertionError("disagreeing add_process_set was accepted")
    for bad, words in (([0, 9], "subset of 0..3"), ([0, 1, 2, 3], "global_process_set")):
        try:
            hvd.add_process_set(bad)
        except ValueError as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"add_process_set({bad}) was accepted")
    try:
        hvd.remove_process_set(hvd.global_process_set)
    except ValueError as e:
        assert "cannot be removed" in str(e)
    else:
        raise AssertionError("the global set was removed")
    dup = hvd.add_process_set([1, 2])
    try:
        hvd.add_process_set([2, 1])
    except ValueError as e:
        assert "already exists" in str(e), e
    else:
        raise AssertionError("a duplicate set was accepted")
    hvd.remove_process_set(dup)
    # the job is still healthy after the refusals
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == 4.0


def main():
    mode = sys.argv[1]
    if mode == "static":
        even, odd = hvd.ProcessSet(EVEN), hvd.ProcessSet(ODD)
        hvd.init(process_sets=[even, odd])
        assert (even.process_set_id, odd.process_set_id) == (1, 2)
        cases = {
            "static_collectives": lambda: check_collectives(even, odd),
            "static_not_dynamic": _static_refuses_add,
        }
    else:
        hvd.init(process_sets="dynamic")
        even, odd = hvd.add_process_set(EVEN), hvd.add_process_set(ODD)
        sets = {"even": even, "odd": odd}

        def readd():
            sets["even"], sets["odd"] = check_remove_and_readd(sets["even"], sets["odd"])

        cases = {
            "collectives": lambda: check_collectives(sets["even"], sets["odd"]),
            "autograd": lambda: check_autograd(sets["even"], sets["odd"]),
            "concurrent_training": lambda: check_concurrent_training(sets["even"], sets["odd"]),
            "objects_and_batchnorm": lambda: check_objects_and_batchnorm(sets["even"], sets["odd"]),
            "overlapping": lambda: check_overlapping_sets_run_concurrently(
                sets["even"], sets["odd"]
            ),
            "remove_and_readd": readd,
            "collectives_after_readd": lambda: check_collectives(sets["even"], sets["odd"]),
            "mismatch_names_job_ranks": lambda: check_mismatch_names_job_ranks(
                sets["even"], sets["odd"]
            ),
            "errors": check_errors,
        }
    rank = hvd.rank()
    failed = run_each(cases, lambda: rank)
    hvd.shutdown()
    sys.exit(1 if failed else 0)


def _static_refuses_add():
    try:
        hvd.add_process_set([0, 1])
    except ValueError as e:
        assert "dynamic process sets are off" in str(e), e
    else:
        raise AssertionError("add_process_set worked without dynamic process sets")


if __name__ == "__main__":
    main()
