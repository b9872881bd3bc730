"""Corners where hvdlite.torch must behave as horovod.torch does (issue 20), at np=2 and np=3:
DistributedOptimizer on process sets of 1 and 2 ranks, sparse reductions in a set, join with
allgather/broadcast, duplicate names, reducescatter with Adasum, generated parameter names,
SparseAdam under the wrapper, the synchronize()-then-step() warning, and uint16."""

import copy
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from _common import assert_close, hvd
from tests.worker_cases import run_cases

BATCH = 12  # divisible by every set size used here (1, 2, 3)


def _sets():
    """The process sets the optimizer cases train on: sets of 1 and 2 ranks that are not
    the whole job (np=2: [1]; np=3: [2] and [0, 1])."""
    n = hvd.size()
    sets = [hvd.add_process_set([n - 1])]
    if n > 2:
        sets.append(hvd.add_process_set([0, 1]))
    return sets


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class EmbNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 3, sparse=True)

    def forward(self, idx):
        return self.emb(idx).sum(1)


def _batch(step, sparse):
    g = torch.Generator().manual_seed(500 + step)
    if sparse:
        return torch.randint(0, 20, (BATCH, 4), generator=g), torch.randn(BATCH, 3, generator=g)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)


def _train_on_set(ps, make_model, make_opt, steps=3, **dist_kw):
    """Members of ``ps`` train on their slices of each batch; a local reference trains on
    the whole batch; the parameters must agree."""
    sparse = make_model is EmbNet
    torch.manual_seed(0)
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make_opt(ref.parameters())
    opt = hvd.DistributedOptimizer(
        make_opt(model.parameters()),
        named_parameters=model.named_parameters(),
        process_set=ps,
        **dist_kw,
    )
    k, r = ps.size(), ps.rank()
    s = BATCH // k
    for step in range(steps):
        x, y = _batch(step, sparse)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        F.mse_loss(model(x[r * s : (r + 1) * s]), y[r * s : (r + 1) * s]).backward()
        opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(f"{name} (set {ps.ranks})", p.detach(), q.detach(), 1e-5, 1e-6)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def optimizer_on_sets():
    """Every gradient path on sets that are not the whole job: no hang, the right result."""
    variants = [
        (Net, _sgd, {}),
        (Net, _sgd, {"bucket_cap_mb": 0}),
        (Net, _sgd, {"num_groups": 2}),
        (EmbNet, _sgd, {"bucket_cap_mb": 0}),
        (EmbNet, _sgd, {}),
    ]
    sets = _sets()
    for ps in sets:
        if ps.included():
            for make_model, make_opt, kw in variants:
                _train_on_set(ps, make_model, make_opt, **kw)
            for kw in (
                {"op": hvd.Adasum},
                {"backward_passes_per_step": 2},
                {"compression": hvd.Compression.fp16},
            ):
                _same_on_members(ps, **kw)
        hvd.barrier()
    for ps in sets:
        hvd.remove_process_set(ps)


def _same_on_members(ps, **dist_kw):
    """Options whose result has no one-process reference: the members train different data
    and must end with the same parameters (and not hang)."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        process_set=ps,
        **dist_kw,
    )
    passes = dist_kw.get("backward_passes_per_step", 1)
    for step in range(2):
        opt.zero_grad()
        for k in range(passes):
            x, y = _batch(10 * step + k + hvd.rank(), False)
            F.mse_loss(model(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).unsqueeze(0)
    everyone = hvd.allgather(flat, name=f"same.{sorted(dist_kw)}", process_set=ps)
    assert_close(f"members of {ps.ranks} with {dist_kw}", everyone[0], everyone[-1], 0, 0)


def sparse_in_sets():
    """sparse_allreduce_async and fused allgathers of mixed dtypes inside process sets (the
    fused bytes of a one-rank set were viewed at unaligned offsets)."""
    sets = _sets()
    for ps in sets:
        if ps.included():
            me = hvd.rank()
            for i in range(3):
                vals = torch.tensor([1.0, 2.0, 3.0]) * (me + 1)
                t = torch.sparse_coo_tensor(torch.tensor([[0, 2, 4]]), vals, (6,))
                got = hvd.sparse_allreduce_async(
                    t, name=f"ps.sparse.{i}", op=hvd.Sum, process_set=ps
                )().to_dense()
                scale = float(sum(q + 1 for q in ps.ranks))
                want = torch.tensor([1.0, 0, 2.0, 0, 3.0, 0]) * scale
                assert_close("sparse sum in set", got, want, 0, 0)
                a = hvd.allgather_async(torch.ones(3), name=f"ps.f32.{i}", process_set=ps)
                b = hvd.allgather_async(torch.arange(3), name=f"ps.i64.{i}", process_set=ps)
                assert hvd.synchronize(b).tolist() == list(range(3)) * ps.size()
                assert hvd.synchronize(a).tolist() == [1.0] * (3 * ps.size())
        hvd.barrier()
    for ps in sets:
        hvd.remove_process_set(ps)


def join_refuses_allgather_broadcast():
    """While rank 0 has joined, the others' allgather and broadcast fail at once (as in
    Horovod); allreduce goes on; every join() returns the same rank; later ops work."""
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        last = hvd.join()
    else:
        for what, call in (
            ("allgather", lambda: hvd.allgather(torch.ones(1), name="j.ag")),
            ("broadcast", lambda: hvd.broadcast(torch.ones(1), root_rank=1, name="j.bc")),
        ):
            started = time.monotonic()
            try:
                call()
            except RuntimeError as e:
                assert "not supported with join" in str(e).lower(), e
                assert time.monotonic() - started < 10, "the error was not raised at once"
            else:
                raise AssertionError(f"{what} with a joined rank did not raise")
        s = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="j.ar")
        assert s.tolist() == [float(n - 1)] * 2, s
        last = hvd.join()
    lasts = hvd.allgather(torch.tensor([last]), name="j.lasts").tolist()
    assert lasts == [last] * n and last != 0, lasts
    assert hvd.broadcast(torch.tensor([float(r)]), root_rank=n - 1, name="j.after").item() == n - 1


def duplicate_names_are_value_errors():
    """A second async op under a name still in flight raises ValueError (Horovod's type).
    Each rank takes a turn; the others submit only after its check (they wait in a broadcast
    from it), so its first op is surely still in flight."""
    r, n = hvd.rank(), hvd.size()
    starts = {
        "allreduce": lambda nm: hvd.allreduce_async(torch.ones(2), name=nm),
        "allgather": lambda nm: hvd.allgather_async(torch.ones(2), name=nm),
        "broadcast": lambda nm: hvd.broadcast_async(torch.ones(2), root_rank=0, name=nm),
        "reducescatter": lambda nm: hvd.reducescatter_async(torch.ones(n, 2), name=nm),
    }
    for turn in range(n):
        handles = []
        if r != turn:
            hvd.broadcast(torch.zeros(1), root_rank=turn, name=f"dup.go.{turn}")
        for what, start in starts.items():
            nm = f"dup.{turn}.{what}"
            handles.append(start(nm))
            if r == turn:
                try:
                    start(nm)
                except ValueError as e:
                    assert "already in flight" in str(e) and nm in str(e), e
                else:
                    raise AssertionError(f"a second {what} named {nm!r} was accepted")
        if r == turn:
            hvd.broadcast(torch.zeros(1), root_rank=turn, name=f"dup.go.{turn}")
        for h in handles:
            hvd.synchronize(h)


def reducescatter_adasum():
    """Horovod refuses Adasum for reducescatter with a HorovodInternalError."""
    for call in (
        lambda: hvd.reducescatter(torch.ones(4, 1), op=hvd.Adasum),
        lambda: hvd.reducescatter_async(torch.ones(4, 1), op=hvd.Adasum),
        lambda: hvd.grouped_reducescatter([torch.ones(4, 1)], op=hvd.Adasum),
    ):
        try:
            call()
        except hvd.HorovodInternalError as e:
            assert isinstance(e, RuntimeError)
            assert "Reducescatter currently only supports SUM" in str(e), e
        else:
            raise AssertionError("reducescatter(op=Adasum) was accepted")
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()  # still usable


def generated_parameter_names():
    """Without named_parameters, several param groups get unique names, the same on every
    rank, exposed as optimizer._parameter_names (param -> name) as Horovod does."""
    torch.manual_seed(0)
    model = Net()
    groups = [
        {"params": list(model.fc1.parameters())},
        {"params": list(model.fc2.parameters()), "lr": 0.05},
    ]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    names = opt._parameter_names
    params = [p for g in opt.param_groups for p in g["params"]]
    assert set(names) == set(params) and len(set(names.values())) == len(params), names
    assert [names[p] for p in params] == [
        "allreduce.noname.0.0",
        "allreduce.noname.0.1",
        "allreduce.noname.1.0",
        "allreduce.noname.1.1",
    ]
    everyone = hvd.allgather_object([names[p] for p in params], name="names")
    assert all(x == everyone[0] for x in everyone), everyone
    model2 = Net()
    opt2 = hvd.DistributedOptimizer(
        torch.optim.SGD(model2.parameters(), lr=0.1), named_parameters=model2.named_parameters()
    )
    assert opt2._parameter_names == {p: nm for nm, p in model2.named_parameters()}
    x, y = _batch(0, False)
    F.mse_loss(model(x), y).backward()
    opt.step()


def _sparse_adam_case(**dist_kw):
    def case():
        torch.manual_seed(0)
        ref = EmbNet()
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
        opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(model.parameters(), lr=0.05),
            named_parameters=model.named_parameters(),
            **dist_kw,
        )
        n, r = hvd.size(), hvd.rank()
        s = BATCH // n
        for step in range(4):
            idx, y = _batch(step, True)
            ref_opt.zero_grad()
            F.mse_loss(ref(idx), y).backward()
            ref_opt.step()
            opt.zero_grad()
            F.mse_loss(model(idx[r * s : (r + 1) * s]), y[r * s : (r + 1) * s]).backward()
            opt.step()
            assert model.emb.weight.grad.is_sparse, "SparseAdam needs a sparse gradient"
        assert_close("emb.weight", model.emb.weight.detach(), ref.emb.weight.detach(), 1e-5, 1e-6)

    return case


def sync_then_step_warns():
    """synchronize() then step() outside skip_synchronize(): Horovod's warning."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    x, y = _batch(0, False)
    F.mse_loss(model(x), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    texts = [str(w.message) for w in caught]
    assert any(
        "optimizer.step() called without optimizer.skip_synchronize()" in t for t in texts
    ), texts
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    assert not caught, [str(w.message) for w in caught]


def uint16_everywhere():
    """torch's uint16 in every collective (Horovod's TF ops accept it): reductions wrap as
    uint16 arithmetic does, moves keep every bit, in-place forms write the caller's tensor."""
    r, n = hvd.rank(), hvd.size()
    u16 = torch.uint16

    def mine(k=0, rows=None):
        base = torch.tensor([65530, 1, 300 + r, 7 * r], dtype=torch.int64) + k
        if rows is not None:
            base = torch.arange(rows, dtype=torch.int64) + 100 * r
        return base.to(torch.int32).to(u16)

    def every(k=0):
        return [(torch.tensor([65530, 1, 300 + q, 7 * q], dtype=torch.int64) + k) for q in range(n)]

    def expect(got, want):
        assert got.dtype == u16, got.dtype
        assert torch.equal(got.to(torch.int64), torch.as_tensor(want, dtype=torch.int64)), (
            got,
            want,
        )

    total = sum(every())
    expect(hvd.allreduce(mine(), op=hvd.Sum, name="u16.sum"), total % 65536)
    expect(hvd.allreduce(mine(), name="u16.avg"), torch.div(total, n, rounding_mode="trunc"))
    expect(hvd.allreduce(mine(), op=hvd.Max, name="u16.max"), torch.stack(every()).max(0).values)
    t = mine()
    assert hvd.allreduce_(t, op=hvd.Sum, name="u16.inplace") is t
    expect(t, total % 65536)
    ts = [mine(), mine(1)]
    outs = hvd.grouped_allreduce_(ts, op=hvd.Sum, name="u16.grouped")
    assert all(o is x for o, x in zip(outs, ts))
    expect(ts[1], sum(every(1)) % 65536)
    expect(hvd.allgather(mine(), name="u16.gather"), torch.cat(every()))
    [g] = hvd.grouped_allgather([mine()], name="u16.ggather")
    expect(g, torch.cat(every()))
    expect(hvd.broadcast(mine(), 0, name="u16.bcast"), every()[0])
    t = mine()
    hvd.broadcast_(t, n - 1, name="u16.bcast_")
    expect(t, every()[n - 1])
    rows = mine(rows=2 * n)
    got = hvd.alltoall(rows, name="u16.a2a")
    expect(got, torch.cat([torch.arange(2 * r, 2 * r + 2) + 100 * q for q in range(n)]))
    got, splits = hvd.alltoall(rows, splits=[2] * n, name="u16.a2a.splits")
    expect(got, torch.cat([torch.arange(2 * r, 2 * r + 2) + 100 * q for q in range(n)]))
    assert splits.tolist() == [2] * n
    rs = hvd.reducescatter(mine(rows=n), op=hvd.Sum, name="u16.rs")
    expect(rs, [sum(r_ + 100 * q for q in range(n)) for r_ in [r]])


CASES = {
    "uint16_everywhere": uint16_everywhere,
    "optimizer_on_sets": optimizer_on_sets,
    "sparse_in_sets": sparse_in_sets,
    "join_refuses_allgather_broadcast": join_refuses_allgather_broadcast,
    "duplicate_names_are_value_errors": duplicate_names_are_value_errors,
    "reducescatter_adasum": reducescatter_adasum,
    "generated_parameter_names": generated_parameter_names,
    "sparse_adam_buckets": _sparse_adam_case(),
    "sparse_adam_allgather": _sparse_adam_case(bucket_cap_mb=0),
    "sparse_adam_as_dense": _sparse_adam_case(bucket_cap_mb=0, sparse_as_dense=True),
    "sync_then_step_warns": sync_then_step_warns,
}


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_cases(hvd, CASES, set(sys.argv[1:]) or None, process_sets="dynamic")
