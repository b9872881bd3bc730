"""op=Adasum on every rank of a real job: each check rebuilds every rank's input from its
rank number and compares with the plainly written rule (tests/common/adasum_reference.py).

Prints ``OK <check> rank=R`` per passing check (see tests/worker_cases.py); ``--only a,b``
runs a subset.
"""

import argparse
import os
import signal
import time

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics
from hvdlite.common.exceptions import HvdliteInternalError
from tests.common.adasum_reference import tolerance, tree
from tests.worker_cases import run_cases

torch.set_num_threads(1)


def data(rank, dtype, n, seed=0):
    """Rank ``rank``'s input: a direction every rank shares plus its own noise."""
    shared = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    own = torch.randn(
        n, generator=torch.Generator().manual_seed(seed * 100 + rank + 1), dtype=torch.float64
    )
    return (0.5 * shared + own).to(dtype)


def assert_close(got, expected, dtype, what):
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=what)


def check_allreduce_matches_reference():
    r, n = hvd.rank(), hvd.size()
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        every = [data(q, dtype, 37) for q in range(n)]
        got = hvd.allreduce(every[r], op=hvd.Adasum, name=f"ada.{dtype}")
        assert got.dtype == dtype
        assert_close(got, tree(every), dtype, str(dtype))
        assert torch.equal(every[r], data(r, dtype, 37)), "input was modified"
    # several tensors in one fused buffer: the rule applies tensor by tensor
    shapes = [(3, 4), (1,), (5,), (2, 2, 2)]
    every = [
        [
            data(q, torch.float32, int(torch.Size(s).numel()), seed=i + 1).reshape(s)
            for i, s in enumerate(shapes)
        ]
        for q in range(n)
    ]
    every[1][2] = torch.zeros(5)  # rank 1's is zero: left out
    outs = hvd.grouped_allreduce(every[r], op=hvd.Adasum, name="ada.grouped")
    for i, out in enumerate(outs):
        assert_close(out, tree([ts[i] for ts in every]), torch.float32, f"grouped {i}")
    # pre/post scaling, in place, async
    x = data(r, torch.float64, 9)
    hvd.allreduce_(x, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=4.0, name="ada.scaled")
    expected = tree([data(q, torch.float64, 9) * 0.5 for q in range(n)]) * 4.0
    assert_close(x, expected, torch.float64, "scaled")
    h = hvd.allreduce_async(torch.full((4,), 3.0), op=hvd.Adasum, name="ada.async")
    assert hvd.synchronize(h).tolist() == [3.0] * 4  # equal vectors: that vector


def check_integers_refused():
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.int64), op=hvd.Adasum, name="ada.int")
    except TypeError as exc:
        assert "Adasum" in str(exc) and "int64" in str(exc), exc
    else:
        raise AssertionError("an integer Adasum was accepted")
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="ada.int.after")
    assert got.tolist() == [float(hvd.size())] * 2


def check_non_power_of_two_refused():
    try:
        hvd.allreduce(torch.ones(3), op=hvd.Adasum, name="ada.npot")
    except ValueError as exc:
        assert f"this job has {hvd.size()}" in str(exc), exc
    else:
        raise AssertionError(f"Adasum over {hvd.size()} ranks was accepted")
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="ada.npot.after").item() == hvd.size()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def check_optimizer_step_is_adasum_of_updates():
    """One SGD step: every parameter becomes old + adasum(-lr * grad of each rank)."""
    r = hvd.rank()
    model = _model()
    lr = 0.1
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        named_parameters=model.named_parameters(),
        op=hvd.Adasum,
    )
    old = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(r))
    model(x).pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():  # the model stays usable until step()
        assert torch.equal(p.detach(), old[name]), name
    opt.step()
    for name, p in model.named_parameters():
        every = hvd.allgather(grads[name].unsqueeze(0), name=f"ada.grads.{name}")
        expected = old[name] + tree([-lr * g for g in every])
        assert_close(p.detach(), expected, torch.float32, name)


def check_optimizer_api():
    """Gradient accumulation, and the calls that mean nothing (or cannot work) with Adasum."""
    r = hvd.rank()
    model = _model()
    lr = 0.1
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        named_parameters=model.named_parameters(),
        op=hvd.Adasum,
        backward_passes_per_step=2,
    )
    assert isinstance(opt, torch.optim.SGD) and opt.backward_passes_per_step == 2
    try:
        opt.skip_synchronize()
    except NotImplementedError as exc:
        assert "Adasum" in str(exc), exc
    else:
        raise AssertionError("skip_synchronize() was accepted with Adasum")
    old = {name: p.detach().clone() for name, p in model.named_parameters()}
    for k in range(2):  # two passes accumulate, then one local step
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * r + k))
        model(x).pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    try:
        opt.zero_grad()
    except RuntimeError as exc:
        assert "in flight" in str(exc), exc
    else:
        raise AssertionError("zero_grad() with reductions in flight was accepted")
    opt.synchronize()  # nothing to do: step() finishes the reductions
    opt.step()
    for name, p in model.named_parameters():
        every = hvd.allgather(grads[name].unsqueeze(0), name=f"ada.acc.{name}")
        expected = old[name] + tree([-lr * g for g in every])
        assert_close(p.detach(), expected, torch.float32, name)
    opt.zero_grad()


def _train(opt_factory, steps, compression=hvd.Compression.none):
    """Regression of a fixed teacher on this rank's own shard; returns (first, last) loss
    averaged over ranks, and checks every rank ends with the same parameters."""
    r = hvd.rank()
    model = _model()
    model.unused = torch.nn.Parameter(torch.zeros(3))  # never gets a gradient
    teacher = torch.nn.Linear(6, 1)
    torch.nn.init.normal_(teacher.weight, generator=torch.Generator().manual_seed(42))
    gen = torch.Generator().manual_seed(100 + r)
    x = torch.randn(64, 6, generator=gen)
    with torch.no_grad():
        y = teacher(x)
    opt = hvd.DistributedOptimizer(
        opt_factory(model.parameters()),
        named_parameters=model.named_parameters(),
        op=hvd.Adasum,
        compression=compression,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(hvd.allreduce(loss.detach(), name=f"ada.loss.{step}").item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = hvd.allgather(flat.unsqueeze(0), name="ada.params")
    for q in range(hvd.size()):
        assert torch.equal(rows[q], rows[0]), f"rank {q}'s parameters differ from rank 0's"
    return losses[0], losses[-1]


def check_training_converges():
    # no learning-rate scaling with the number of ranks (Adasum keeps one rank's step size)
    first, last = _train(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), 60)
    assert last < 0.05 * first, (first, last)
    first, last = _train(
        lambda ps: torch.optim.Adam(ps, lr=0.02), 60, compression=hvd.Compression.fp16
    )
    assert last < 0.1 * first, (first, last)


CHECKS = {
    name[len("check_") :]: fn for name, fn in list(globals().items()) if name.startswith("check_")
}


def hang_in_exchange():
    """Rank 1 freezes (SIGSTOP) between two of Adasum's exchanges; rank 0 must raise
    HvdliteInternalError once the op timeout passes, then exit 3 (the launcher then ends the
    frozen rank)."""
    hvd.init()
    if hvd.rank() == 1:
        backend = basics.runtime().backend
        exchange, calls = backend.sendrecv_, []

        def freezing(send, recv, peer):
            calls.append(peer)
            if len(calls) == 2:  # after the first halving, before the norms' sum
                os.kill(os.getpid(), signal.SIGSTOP)
                # the stop may be taken by another thread; this one must not run on meanwhile
                time.sleep(600)
            exchange(send, recv, peer)

        backend.sendrecv_ = freezing
    start = time.monotonic()
    try:
        hvd.allreduce(torch.ones(64), op=hvd.Adasum, name="ada.hang")
    except HvdliteInternalError as exc:
        print(
            f"RAISED {type(exc).__name__} after {time.monotonic() - start:.2f}s: {exc}", flush=True
        )
        os._exit(3)
    raise AssertionError("the exchange with a frozen peer returned")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args()
    if args.hang:
        hang_in_exchange()
    run_cases(hvd, CHECKS, only=[c for c in args.only.split(",") if c])


if __name__ == "__main__":
    main()
