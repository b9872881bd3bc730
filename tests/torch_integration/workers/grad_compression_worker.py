"""DistributedOptimizer with PowerSGD and top-k: reduced gradients equal a NumPy reference of
each algorithm over several steps (so warm start and error feedback matter) in every launch
strategy; error feedback loses nothing; checkpoints, backward_passes_per_step, a process set,
broadcast_optimizer_state, elastic TorchState and the refusals (run per rank)."""

import copy
import sys

import numpy as np
import torch

from _common import hvd
from tests.compression_reference import grads as _grads, powersgd_reference, topk_reference
from tests.worker_cases import run_cases

MODES = ({}, {"bucket_cap_mb": 0}, {"num_groups": 1})
STEPS = 4


class _Params(torch.nn.Module):
    """A matrix (compressed) and a vector (reduced as it is); float64 for tight checks."""

    def __init__(self, shapes):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(shapes[0], dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.zeros(shapes[1], dtype=torch.float64))


def _backward(model, grads):
    """One backward pass whose gradients are exactly ``grads``."""
    loss = sum((p * torch.from_numpy(g)).sum() for p, g in zip(model.parameters(), grads))
    loss.backward()


def _wrap(model, compression, lr=0.0, opt_cls=torch.optim.SGD, **kw):
    return hvd.DistributedOptimizer(
        opt_cls(model.parameters(), lr=lr),
        named_parameters=model.named_parameters(),
        compression=compression,
        **kw,
    )


def _check(what, got, want, atol=1e-9):
    got = got.detach().numpy() if isinstance(got, torch.Tensor) else got
    diff = np.abs(got - want).max()
    if not diff <= atol:
        raise AssertionError(f"{what}: max abs diff {diff:.3g} > {atol} on rank {hvd.rank()}")


def _run_against(
    reference_of, compression, shapes, state_key, bpps=1, process_set=None, steps=STEPS
):
    """Train ``steps`` steps in every launch strategy; compare each reduced gradient and
    this rank's residual with ``reference_of(grads_by_step, initial_state, n)``."""
    kw = {} if process_set is None else {"process_set": process_set}
    n = hvd.size() if process_set is None else process_set.size()
    rank = hvd.rank() if process_set is None else process_set.rank()
    for mode in MODES:
        model = _Params(shapes)
        opt = _wrap(model, compression, backward_passes_per_step=bpps, **mode, **kw)
        initial = opt.state_dict()["hvdlite_compression"]["tensors"]["w"]
        passes = [
            [_grads(r, s * bpps + i, shapes) for i in range(bpps)]
            for s in range(steps)
            for r in range(n)
        ]
        summed = [
            [sum(ps[j] for ps in passes[s * n + r]) for j in range(2)]
            for s in range(steps)
            for r in range(n)
        ]
        by_step = [[summed[s * n + r][0] for r in range(n)] for s in range(steps)]
        want = reference_of(by_step, initial, n)
        for s in range(steps):
            opt.zero_grad()
            for i in range(bpps):
                _backward(model, passes[s * n + rank][i])
            opt.synchronize()
            tag = f"{compression!r} {mode} step {s}"
            _check(f"{tag} matrix", model.w.grad, want[s][0])
            _check(f"{tag} vector", model.b.grad, sum(summed[s * n + r][1] for r in range(n)) / n)
            got_error = opt.state_dict()["hvdlite_compression"]["tensors"]["w"][state_key]
            _check(f"{tag} residual", got_error.reshape(want[s][1][rank].shape), want[s][1][rank])
            with opt.skip_synchronize():
                opt.step()


def _powersgd_case(bpps=1, with_set=False):
    spec = hvd.Compression.powersgd(rank=2, start_iter=1, min_compression_rate=1.0)

    def reference(by_step, initial, n):
        return powersgd_reference(by_step, initial["q"].numpy(), 1, n)

    def case():
        _run_against(reference, spec, [(12, 10), (10,)], "error", bpps)
        if not with_set:
            return
        # np=2: the only set that is not the whole job is a single rank's
        ps = hvd.add_process_set([hvd.size() - 1])
        try:
            if ps.included():
                _run_against(reference, spec, [(12, 10), (10,)], "error", bpps, ps)
        finally:
            hvd.remove_process_set(ps)

    return case


def _topk_case(dense=None):
    spec = hvd.Compression.topk(ratio=0.05, min_numel=100, dense=dense)

    def reference(by_step, _initial, n):
        return topk_reference(by_step, spec.k_of(by_step[0][0].size), n)

    return lambda: _run_against(reference, spec, [(40, 30), (30,)], "error")


def channels_last_as_row_major():
    """A channels_last weight is compressed as its row-major twin is: the same reduced
    gradients and residuals in every launch strategy; in a bucket its gradient keeps the
    weight's own strides."""
    shapes = [(8, 3, 3, 3), (3,)]
    for spec in (
        hvd.Compression.powersgd(rank=2, start_iter=1, min_compression_rate=1.0),
        hvd.Compression.topk(ratio=0.05, min_numel=100),
    ):
        for mode in MODES:
            models = [_Params(shapes), _Params(shapes)]
            last = models[1].w
            last.data = last.data.contiguous(memory_format=torch.channels_last)
            opts = [_wrap(m, spec, **mode) for m in models]
            for s in range(3):
                g = _grads(hvd.rank(), s, shapes)
                for m, o in zip(models, opts):
                    o.zero_grad()
                    _backward(m, g)
                    o.synchronize()
                tag = f"{spec!r} {mode} step {s}"
                _check(
                    f"{tag} channels_last gradient", last.grad, models[0].w.grad.numpy(), atol=1e-12
                )
                if not mode:
                    assert last.grad.stride() == last.stride(), (last.grad.stride(), tag)
                for o in opts:
                    with o.skip_synchronize():
                        o.step()
            errs = [o.state_dict()["hvdlite_compression"]["tensors"]["w"]["error"] for o in opts]
            _check(f"{spec!r} {mode} residual", errs[1], errs[0].numpy(), atol=1e-12)


def _train(model, opt, steps, first=0):
    for s in range(first, first + steps):
        opt.zero_grad()
        _backward(model, _grads(hvd.rank(), s, [tuple(p.shape) for p in model.parameters()]))
        opt.step()


def error_feedback_loses_nothing():
    """Sum of the reduced gradients + the mean residual = sum of the mean gradients."""
    shapes = [(24, 20), (20,)]
    for spec in (
        hvd.Compression.powersgd(rank=1, start_iter=0),
        hvd.Compression.topk(ratio=0.02, min_numel=10),
    ):
        model = _Params(shapes)
        opt = _wrap(model, spec)
        sent, total = 0, 0
        for s in range(5):
            opt.zero_grad()
            _backward(model, _grads(hvd.rank(), s, shapes))
            opt.synchronize()
            sent = sent + model.w.grad.clone()
            total = total + sum(_grads(r, s, shapes)[0] for r in range(hvd.size())) / hvd.size()
            with opt.skip_synchronize():
                opt.step()
        err = opt.state_dict()["hvdlite_compression"]["tensors"]["w"]["error"]
        mean_err = hvd.allreduce(err, name=f"ef.{spec.kind}").reshape(shapes[0])
        residual = np.abs(mean_err.numpy()).max()
        if residual < 1e-3:
            raise AssertionError(f"{spec!r}: the residual is {residual}: nothing compressed?")
        _check(f"{spec!r} sent + residual", sent + mean_err, total)


def checkpoint_round_trip():
    """state_dict() after 3 steps, loaded into a fresh model+wrapper, gives the same 4th
    step as the original; without it, a different one."""
    shapes = [(16, 12), (12,)]
    for spec in (
        hvd.Compression.powersgd(rank=2, start_iter=1),
        hvd.Compression.topk(ratio=0.1, min_numel=10),
    ):
        model = _Params(shapes)
        opt = _wrap(model, spec, lr=0.1, opt_cls=torch.optim.Adam)
        _train(model, opt, 3)
        saved_model = copy.deepcopy(model.state_dict())
        saved_opt = copy.deepcopy(opt.state_dict())
        _train(model, opt, 1, first=3)
        for load in (True, False):
            fresh = _Params(shapes)
            fresh.load_state_dict(saved_model)
            fresh_opt = _wrap(fresh, spec, lr=0.1, opt_cls=torch.optim.Adam)
            fresh_opt.load_state_dict(
                saved_opt
                if load
                else {k: v for k, v in saved_opt.items() if k != "hvdlite_compression"}
            )
            _train(fresh, fresh_opt, 1, first=3)
            same = torch.equal(fresh.w, model.w)
            if same != load:
                raise AssertionError(
                    f"{spec!r}: loaded={load} but the next step is "
                    f"{'the same' if same else 'different'}"
                )


def one_checkpoint_on_every_rank():
    """Every rank loads rank 0's checkpoint: the step counter and PowerSGD's Q on all of
    them, the residuals only on rank 0 (zeros elsewhere, not rank 0's residual n times)."""
    shapes = [(16, 12), (12,)]
    for spec in (
        hvd.Compression.powersgd(rank=2, start_iter=1),
        hvd.Compression.topk(ratio=0.1, min_numel=10),
    ):
        model = _Params(shapes)
        opt = _wrap(model, spec, lr=0.1)
        _train(model, opt, 3)
        saved = hvd.broadcast_object(
            opt.state_dict(), root_rank=0, name=f"one_checkpoint.{spec.kind}"
        )["hvdlite_compression"]
        assert (saved["rank"], saved["size"], saved["step"]) == (0, hvd.size(), 3), saved
        fresh = _wrap(_Params(shapes), spec, lr=0.1)
        fresh.load_state_dict({**opt.state_dict(), "hvdlite_compression": saved})
        got = fresh.state_dict()["hvdlite_compression"]
        assert got["step"] == 3, got["step"]
        for key, value in saved["tensors"]["w"].items():
            mine = got["tensors"]["w"][key]
            if key == "error" and hvd.rank() != 0:
                assert not mine.any() and value.any(), (key, spec.kind)
            else:
                assert torch.equal(mine, value), (key, spec.kind, hvd.rank())


def broadcast_and_elastic_state():
    """broadcast_optimizer_state gives rank 1 rank 0's step count and Q but keeps its own
    residual; TorchState.restore() brings the compression state back."""
    shapes = [(16, 12), (12,)]
    model = _Params(shapes)
    opt = _wrap(model, hvd.Compression.powersgd(rank=2, start_iter=0))
    _train(model, opt, 2)
    mine = opt.state_dict()
    if hvd.rank() == 1:  # make rank 1 differ
        changed = copy.deepcopy(mine)
        changed["hvdlite_compression"]["step"] = 99
        changed["hvdlite_compression"]["tensors"]["w"]["q"].mul_(3)
        opt.load_state_dict(changed)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after = opt.state_dict()["hvdlite_compression"]
    root = hvd.broadcast_object(mine["hvdlite_compression"], root_rank=0, name="bc.root")
    assert after["step"] == root["step"] == 2, (after["step"], root["step"])
    _check("q after broadcast", after["tensors"]["w"]["q"], root["tensors"]["w"]["q"].numpy(), 0)
    _check(
        "own residual",
        after["tensors"]["w"]["error"],
        mine["hvdlite_compression"]["tensors"]["w"]["error"].numpy(),
        0,
    )
    state = hvd.elastic.TorchState(model=model, optimizer=opt)
    _train(model, opt, 1, first=2)
    state.restore()
    back = opt.state_dict()["hvdlite_compression"]
    assert back["step"] == 2, back["step"]
    _check(
        "residual after restore",
        back["tensors"]["w"]["error"],
        after["tensors"]["w"]["error"].numpy(),
        0,
    )


def refusals():
    spec = hvd.Compression.powersgd()
    try:
        hvd.allreduce(torch.ones(3), name="refused", compression=spec)
        raise AssertionError("allreduce accepted PowerSGD")
    except TypeError as e:
        assert "DistributedOptimizer" in str(e), e
    model = _Params([(8, 8), (8,)])
    try:
        _wrap(model, spec, op=hvd.Adasum)
        raise AssertionError("Adasum accepted PowerSGD")
    except ValueError as e:
        assert "Adasum" in str(e), e
    opt = _wrap(model, hvd.Compression.topk())
    try:
        opt.load_state_dict(_wrap(_Params([(8, 8), (8,)]), spec).state_dict())
        raise AssertionError("a PowerSGD checkpoint loaded into a top-k optimizer")
    except ValueError as e:
        assert "'powersgd'" in str(e) and "'topk'" in str(e), e


CASES = {
    "powersgd_matches_reference": _powersgd_case(),
    "powersgd_backward_passes_and_process_set": _powersgd_case(bpps=2, with_set=True),
    "topk_matches_reference": _topk_case(),
    "topk_dense_matches_reference": _topk_case(dense=True),
    "error_feedback_loses_nothing": error_feedback_loses_nothing,
    "checkpoint_round_trip": checkpoint_round_trip,
    "broadcast_and_elastic_state": broadcast_and_elastic_state,
    "refusals": refusals,
    "channels_last_as_row_major": channels_last_as_row_major,
    "one_checkpoint_on_every_rank": one_checkpoint_on_every_rank,
}


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_cases(hvd, CASES, set(sys.argv[1:]) or None, process_sets="dynamic")
