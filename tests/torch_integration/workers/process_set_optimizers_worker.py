"""Every torch.optim optimizer class in turn, each training its own model through a
DistributedOptimizer restricted to this rank's process set (even / odd ranks), as Horovod's
process-set optimizer test does at any np >= 2.

Some classes fail on the way and the job must go on in step: Muon refuses the model's 1-D
parameters when it is constructed, LBFGS's closure calls ``zero_grad()`` while reductions are
in flight (an error, as in Horovod), SparseAdam refuses dense gradients.  After each class
the set's members must hold equal weights; at the end both sets are removed and every rank
meets at a barrier.  Before the fix, LBFGS's error left reductions in flight whose names the
next optimizer reused: on some ranks they had finished, on others the next optimizer got a
duplicate-name error, and the ranks went different ways until everything hung.
"""

import torch
import torch.nn as nn

from _common import assert_close, hvd
from tests.worker_cases import run_cases


def _classes():
    return [
        getattr(torch.optim, a)
        for a in sorted(dir(torch.optim))
        if isinstance(getattr(torch.optim, a), type)
        and issubclass(getattr(torch.optim, a), torch.optim.Optimizer)
        and a != "Optimizer"
    ]


def _train(cls, this_set, set_root):
    """One model trained two steps with ``cls`` in this rank's set; the error it raised,
    or None when it trained (the set's members then hold equal weights)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    try:
        opt = cls(model.parameters(), lr=0.01)
    except Exception as exc:  # e.g. Muon and 1-D parameters
        return f"construct: {type(exc).__name__}"
    try:
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), process_set=this_set
        )
        data = torch.Generator().manual_seed(hvd.rank())
        for _ in range(2):
            x = torch.randn(8, 4, generator=data)

            def closure():
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss

            if isinstance(opt, torch.optim.LBFGS):
                opt.step(closure)
            else:
                closure()
                opt.step()
    except Exception as exc:  # LBFGS updated with local gradients first
        return f"train: {type(exc).__name__}"
    for name, p in model.named_parameters():
        root = hvd.broadcast(
            p.detach().clone(), set_root, name=f"{cls.__name__}.{name}", process_set=this_set
        )
        assert_close(f"{cls.__name__} {name}", p.detach(), root, 0, 0)
    return None


def optimizers_in_process_sets():
    n, r = hvd.size(), hvd.rank()
    even = hvd.add_process_set([k for k in range(n) if k % 2 == 0])
    odd = hvd.add_process_set([k for k in range(n) if k % 2 == 1])
    this_set, set_root = (even, 0) if r % 2 == 0 else (odd, 1)
    outcomes = {cls.__name__: _train(cls, this_set, set_root) for cls in _classes()}
    hvd.remove_process_set(odd)
    hvd.remove_process_set(even)
    hvd.barrier()
    assert outcomes["Muon"] == "construct: ValueError", outcomes
    assert outcomes["LBFGS"] == "train: RuntimeError", outcomes
    assert outcomes["SGD"] is None and outcomes["Adam"] is None, outcomes
    # every rank went the same way through the classes
    everyone = hvd.allgather_object(sorted(outcomes.items(), key=lambda kv: kv[0]))
    assert all(o == everyone[0] for o in everyone), everyone


def optimizer_on_a_non_member():
    """Horovod's test_optimizer_process_sets: every rank wraps its optimizer with the even
    set.  On the odd ranks it is a local optimizer (no hooks, no reductions, no error): their
    weights are those of a plain optimizer on their own data; the even ranks' are equal."""
    n, r = hvd.size(), hvd.rank()
    even = hvd.add_process_set([k for k in range(n) if k % 2 == 0])
    odd = hvd.add_process_set([k for k in range(n) if k % 2 == 1])
    this_set = even if r % 2 == 0 else odd

    def model_and_optimizer(process_set=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=0.1)
        if process_set is not None:
            opt = hvd.DistributedOptimizer(
                opt, named_parameters=model.named_parameters(), process_set=process_set
            )
        return model, opt

    model, opt = model_and_optimizer(even)
    local_model, local_opt = model_and_optimizer()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(r)
    for _ in range(3):
        x, y = torch.randn(16, 6, generator=data), torch.randn(16, 2, generator=data)
        for m, o in ((model, opt), (local_model, local_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    opt.synchronize()  # nothing in flight: returns at once everywhere
    weight = model.state_dict()["2.weight"]
    everyone = hvd.allgather(weight.unsqueeze(0), process_set=this_set)
    if r % 2 == 0:
        for other in everyone:
            assert_close("even set's weights", other, weight, 0, 0)
    else:
        assert_close("non-member's weights", weight, local_model.state_dict()["2.weight"], 0, 0)
        assert not opt._hvd_hook_handles, "a non-member's optimizer hooked its parameters"
    hvd.remove_process_set(odd)
    hvd.remove_process_set(even)
    hvd.barrier()


if __name__ == "__main__":
    run_cases(
        hvd,
        {
            "optimizers_in_process_sets": optimizers_in_process_sets,
            "optimizer_on_a_non_member": optimizer_on_a_non_member,
        },
        process_sets="dynamic",
    )
