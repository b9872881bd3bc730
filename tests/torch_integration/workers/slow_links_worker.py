"""hvd.DiLoCo and hvd.Compression.int8 on every rank.

DiLoCo: with H = 1 and an outer SGD of lr 1 it is synchronous data parallel SGD; every rank
holds the same parameters after each outer step (and not between them); one outer step is
Nesterov SGD on the averaged change; checkpoints and an elastic TorchState keep the outer
state; the refusals.  Int8: each reduced entry within the stated bound of the exact
average; with error feedback the sum over steps stays within one step's bound, without it
the error grows; DiLoCo's outer step through it.  Case names on the command line run only
those (the np=3 launch)."""

import sys

import torch

from _common import hvd, run_cases

STEPS = 6


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 3, dtype=torch.float64),
        torch.nn.Tanh(),
        torch.nn.Linear(3, 1, dtype=torch.float64),
    )


def _batch(step: int, rank: int, size: int, per_rank: int = 4):
    """This rank's shard of the global batch of ``step`` (the same global data at any size)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(per_rank * size, 4, generator=g, dtype=torch.float64)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)).sin()
    return x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]


def _train(opt, model, steps=STEPS, rank=None, size=None, each=None):
    rank = hvd.rank() if rank is None else rank
    size = hvd.size() if size is None else size
    for step in range(steps):
        x, y = _batch(step, rank, size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if each is not None:
            each(step)


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _gathered(model):
    """Every rank's parameters, one row each."""
    return hvd.allgather(_flat(model).unsqueeze(0), name="diloco.test.params")


def _full_batch_sgd(steps=STEPS):
    """One process on the whole global batches: what averaging the shards' SGD steps is."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        xs, ys = zip(*(_batch(step, r, hvd.size()) for r in range(hvd.size())))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return _flat(model)


def h1_equals_synchronous_sgd():
    model = _model()
    opt = hvd.DiLoCo(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        sync_every=1,
        outer_optimizer=lambda anchors: torch.optim.SGD(anchors, lr=1.0),
    )
    _train(opt, model)
    sync = _model()
    dist = hvd.DistributedOptimizer(
        torch.optim.SGD(sync.parameters(), lr=0.1), named_parameters=sync.named_parameters()
    )
    _train(dist, sync)
    for what, want in (("DistributedOptimizer", _flat(sync)), ("one process", _full_batch_sgd())):
        diff = (_flat(model) - want).abs().max().item()
        assert diff <= 1e-5, f"DiLoCo(H=1) differs from {what} by {diff:.3g}"
    assert opt.outer_steps == STEPS and opt.inner_steps == STEPS


def ranks_agree_after_each_outer_step():
    model = _model()
    opt = hvd.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=0.01), sync_every=3)
    seen = []

    def check(step):
        rows = _gathered(model)
        spread = (rows - rows[0]).abs().max().item()
        seen.append(spread)
        if (step + 1) % 3 == 0:
            assert spread == 0.0, f"after outer step {opt.outer_steps}: ranks differ by {spread}"
        else:
            assert spread > 0.0, f"inner step {step}: the ranks trained on the same data?"

    _train(opt, model, steps=9, each=check)
    assert opt.outer_steps == 3, opt.outer_steps


def outer_step_is_nesterov_on_the_average():
    model = _model()
    opt = hvd.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=2)
    reference = torch.nn.Parameter(_flat(model).clone())  # the default outer optimizer
    outer = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for outer_step in range(2):  # the second one uses the momentum
        for step in (2 * outer_step, 2 * outer_step + 1):
            x, y = _batch(step, hvd.rank(), hvd.size())
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.inner_optimizer.step()
        rows = _gathered(model)  # every rank's parameters before the outer step
        opt.outer_step()
        reference.grad = reference.detach() - rows.mean(dim=0)
        outer.step()
        diff = (_flat(model) - reference.detach()).abs().max().item()
        assert diff <= 1e-12, f"outer step {outer_step}: {diff:.3g} from Nesterov SGD"
        anchor = torch.cat([a.flatten() for a in opt.anchors])
        assert torch.equal(anchor, _flat(model)), "the anchors are not the new parameters"


def checkpoint_round_trip():
    model = _model()
    opt = hvd.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=0.01), sync_every=2)
    _train(opt, model, steps=4)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict()
    anchors = [a.clone() for a in opt.anchors]
    _train(opt, model, steps=3)
    assert opt.outer_steps == 3
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved)
    assert (opt.inner_steps, opt.outer_steps) == (4, 2)
    assert all(torch.equal(a, b) for a, b in zip(opt.anchors, anchors))
    # and it trains on from there exactly as it did the first time
    _train(opt, model, steps=3)
    again = _flat(model).clone()
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved)
    _train(opt, model, steps=3)
    assert torch.equal(_flat(model), again)


def elastic_state_keeps_the_outer_state():
    model = _model()
    opt = hvd.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=2)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    _train(opt, model, steps=2)
    state.commit()
    committed = (_flat(model).clone(), [a.clone() for a in opt.anchors])
    momentum = {k: v.clone() for k, v in opt.outer_optimizer.state_dict()["state"][0].items()}
    _train(opt, model, steps=3)  # one more outer step, then an inner one
    assert opt.outer_steps == 2
    state.restore()
    assert (opt.inner_steps, opt.outer_steps) == (2, 1)
    assert torch.equal(_flat(model), committed[0])
    assert all(torch.equal(a, b) for a, b in zip(opt.anchors, committed[1]))
    got = opt.outer_optimizer.state_dict()["state"][0]
    assert all(torch.equal(got[k], v) for k, v in momentum.items())
    # sync (after a reset): rank 0's outer state on every rank
    if hvd.rank() != 0:
        with torch.no_grad():
            opt.anchors[0].add_(1.0)
        opt.outer_steps = 99
    state.sync()
    rows = hvd.allgather(torch.cat([a.flatten() for a in opt.anchors]).unsqueeze(0))
    assert (rows - rows[0]).abs().max().item() == 0.0 and opt.outer_steps == 1


def refusals():
    model = _model()
    for bad in (0, -1, 1.5, True):
        try:
            hvd.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=bad)
        except ValueError as exc:
            assert f"sync_every={bad!r}" in str(exc), exc
        else:
            raise AssertionError(f"sync_every={bad!r} was taken")
    wrapped = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    try:
        hvd.DiLoCo(model, wrapped)
    except ValueError as exc:
        assert "pass the plain torch optimizer" in str(exc), exc
    else:
        raise AssertionError("a DistributedOptimizer was taken as the inner optimizer")
    other = torch.nn.Linear(2, 2)
    try:
        hvd.DiLoCo(model, torch.optim.SGD(other.parameters(), lr=0.1))
    except ValueError as exc:
        assert "not trainable parameters of model" in str(exc), exc
    else:
        raise AssertionError("an optimizer of another model was taken")


def _reduced_by(compression, grads):
    """The gradients ``DistributedOptimizer(compression=...)`` reduces ``grads`` (one per
    parameter of a fresh model of those shapes) to, over ``len(grads[0])`` steps."""
    params = [torch.nn.Parameter(torch.zeros_like(g[0])) for g in grads]
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.0), named_parameters=named, compression=compression
    )
    out = []
    for step in range(len(grads[0])):
        opt.zero_grad()
        sum((p * g[step]).sum() for p, g in zip(params, grads)).backward()
        opt.synchronize()
        out.append([p.grad.clone() for p in params])
        with opt.skip_synchronize():
            opt.step()
    return out


def _one_step_bound(wanted, chunk=1024):
    """The stated bound on the averaged entry: the mean over the ranks of each chunk's
    ``max|x| / 254``, for what each rank had to send (``wanted``)."""
    pad = (-wanted.numel()) % chunk
    rows = torch.nn.functional.pad(wanted, (0, pad)).view(-1, chunk)
    amax = hvd.allgather(rows.abs().amax(dim=1).unsqueeze(0), name="int8.test.amax")
    per_chunk = amax.mean(dim=0) / 254
    return per_chunk.repeat_interleave(chunk)[: wanted.numel()]


def _rank_grads(steps, numel=3000, constant=False):
    g = torch.Generator().manual_seed(7 + hvd.rank())
    first = torch.randn(numel, generator=g, dtype=torch.float64)
    return [
        first if constant else torch.randn(numel, generator=g, dtype=torch.float64)
        for _ in range(steps)
    ]


def int8_within_its_bound():
    big, bias = _rank_grads(3), [torch.full((3,), float(hvd.rank() + 1), dtype=torch.float64)] * 3
    got = _reduced_by(hvd.Compression.int8(), [big, bias])
    exact = hvd.allreduce(big[0], op=hvd.Average, name="int8.test.exact")
    diff = (got[0][0] - exact).abs()
    bound = _one_step_bound(big[0])
    assert bool((diff <= bound * (1 + 1e-9)).all()), (
        f"{int((diff > bound).sum())} entries beyond the bound (worst {(diff - bound).max():.3g})"
    )
    assert diff.max().item() > 0, "nothing was quantized"
    want_bias = sum(range(1, hvd.size() + 1)) / hvd.size()
    assert torch.equal(got[0][1], torch.full((3,), want_bias, dtype=torch.float64)), got[0][1]


def int8_error_feedback_is_unbiased_over_steps():
    steps = 40
    grads = _rank_grads(steps, constant=True)
    exact = hvd.allreduce(grads[0], op=hvd.Average, name="int8.test.exact_ef")
    bound = _one_step_bound(grads[0])
    drift = {}
    for feedback in (True, False):
        got = _reduced_by(hvd.Compression.int8(error_feedback=feedback), [grads])
        total = sum(step[0] for step in got)
        drift[feedback] = ((total - steps * exact).abs() / bound).max().item()
    # the residual telescopes: the sum is off by the last residual only (about one step's
    # rounding, here with the residual added, under 2 bounds); without feedback the same
    # rounding repeats every step
    assert drift[True] <= 2.0, f"with error feedback the sum drifted {drift[True]:.3g} bounds"
    assert drift[False] >= 10.0, f"without error feedback only {drift[False]:.3g} bounds?"


def diloco_with_an_int8_outer_exchange():
    model, plain = _model(), _model()
    opt = hvd.DiLoCo(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        sync_every=2,
        compression=hvd.Compression.int8(min_numel=1, chunk=4),
    )
    ref = hvd.DiLoCo(plain, torch.optim.SGD(plain.parameters(), lr=0.05), sync_every=2)

    def agree(step):
        if (step + 1) % 2 == 0:
            rows = _gathered(model)
            assert (rows - rows[0]).abs().max().item() == 0.0, "ranks differ after int8"

    _train(opt, model, steps=6, each=agree)
    _train(ref, plain, steps=6)
    diff = (_flat(model) - _flat(plain)).abs().max().item()
    assert 0 < diff < 1e-2, f"int8 outer steps {diff:.3g} from float64 ones"
    saved = opt.state_dict()
    assert saved["exchange"]["kind"] == "int8" and saved["exchange"]["tensors"], saved.keys()


def streaming_fragments_sync_in_turn():
    """Two fragments, H = 4: the first is synced at steps 2, 6 (ranks then agree on it, not
    on the second), the second at 4, 8; a checkpoint keeps both outer optimizers."""
    model = _model()
    opt = hvd.DiLoCo(
        model, torch.optim.AdamW(model.parameters(), lr=0.01), sync_every=4, fragments=2
    )
    first = sum(list(model.parameters())[i].numel() for i in opt.fragments[0])

    def check(step):
        rows = _gathered(model)
        spread = [(r - r[0]).abs().max().item() for r in (rows[:, :first], rows[:, first:])]
        synced = {1: 0, 5: 0, 3: 1, 7: 1}.get(step)
        if synced is None:
            assert min(spread) > 0.0, f"step {step}: a fragment synced out of turn: {spread}"
        else:
            assert spread[synced] == 0.0, f"step {step}: fragment {synced} not synced"
            assert spread[1 - synced] > 0.0, f"step {step}: fragment {1 - synced} synced too"

    assert opt.fragments == [[0], [1, 2, 3]], opt.fragments
    assert opt.offsets == [2, 0], opt.offsets
    _train(opt, model, steps=8, each=check)
    assert opt.outer_steps == 2, opt.outer_steps
    saved = opt.state_dict()
    assert isinstance(saved["outer_optimizer"], list) and len(saved["outer_optimizer"]) == 2
    again = hvd.DiLoCo(model, torch.optim.AdamW(model.parameters()), sync_every=4, fragments=2)
    again.load_state_dict(saved)
    for a, b in zip(again.outer_optimizers, opt.outer_optimizers):
        assert str(a.state_dict()) == str(b.state_dict())
    for bad in (0, 5, 2.0):
        try:
            hvd.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 4, fragments=bad)
        except ValueError as exc:
            assert f"fragments={bad!r}" in str(exc), exc
        else:
            raise AssertionError(f"fragments={bad!r} was taken")


def overlap_applies_the_average_one_step_late():
    """Constant gradients, SGD inside, outer SGD of lr 1: each step moves a rank by its own
    -lr * g; with overlap the anchors trail by the one allreduce under way and a rank keeps
    its own last step on top; the state_dict applies it (then the same as without)."""
    lr, steps = 0.1, 5
    size, rank = hvd.size(), hvd.rank()
    g = [torch.full((3,), float(r + 1), dtype=torch.float64) for r in range(size)]
    mean = sum(g) / size
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = hvd.DiLoCo(
        torch.nn.ParameterList([w]),
        torch.optim.SGD([w], lr=lr),
        sync_every=1,
        outer_optimizer=lambda anchors: torch.optim.SGD(anchors, lr=1.0),
        overlap=True,
    )
    for step in range(1, steps + 1):
        opt.zero_grad()
        (w * g[rank]).sum().backward()
        opt.step()
        want_anchor = -(step - 1) * lr * mean
        assert torch.allclose(opt.anchors[0], want_anchor), (step, opt.anchors[0])
        assert torch.allclose(w.detach(), want_anchor - lr * g[rank]), (step, w)
    opt.state_dict()
    assert torch.allclose(opt.anchors[0], -steps * lr * mean) and opt.outer_steps == steps
    assert torch.allclose(w.detach(), -steps * lr * mean), w


CASES = {
    f.__name__: f
    for f in (
        h1_equals_synchronous_sgd,
        ranks_agree_after_each_outer_step,
        outer_step_is_nesterov_on_the_average,
        checkpoint_round_trip,
        elastic_state_keeps_the_outer_state,
        refusals,
        int8_within_its_bound,
        int8_error_feedback_is_unbiased_over_steps,
        diloco_with_an_int8_outer_exchange,
        streaming_fragments_sync_in_turn,
        overlap_applies_the_average_one_step_late,
    )
}

if __name__ == "__main__":
    run_cases(CASES, only=sys.argv[1:] or None)
