"""Each case: 2 ranks training on halves of every batch must end where 1 process on the full
batch ends (every rank computes that reference locally and compares)."""

import copy
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from _common import assert_close, hvd, run_cases


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 6 * 6, 16)
        self.fc2 = nn.Linear(16, 3)
        self.unused = nn.Linear(3, 3)  # never gets a gradient: must not deadlock anyone

    def forward(self, x):
        x = F.relu(self.conv(x))
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


STEPS = 4
BATCH = 8


def data(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 2, 6, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def make_opt(kind, params, lr_mult=1.0):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1 * lr_mult, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01 * lr_mult)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01 * lr_mult, weight_decay=0.0)
    if kind == "adamw_decay":
        return torch.optim.AdamW(params, lr=0.01 * lr_mult, weight_decay=0.1)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=0.01 * lr_mult, momentum=0.5)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=0.05 * lr_mult)
    raise ValueError(kind)


def train_case(
    kind="sgd",
    bpps=1,
    compression=None,
    op=None,
    predivide=1.0,
    rtol=1e-5,
    atol=1e-6,
    broadcast=False,
    **dist_kw,
):
    """``broadcast``: rank 1 starts from other weights, and broadcast_parameters +
    broadcast_optimizer_state give every rank rank 0's before training (the reference
    process never broadcasts).  There the never-used layer is frozen in both: a
    DistributedOptimizer gives an unused parameter a zero gradient (as Horovod's), which
    AdamW's weight decay would move while the reference's None gradient is skipped."""

    def case():
        comp = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
        the_op = hvd.Sum if op == "sum" else hvd.Average
        torch.manual_seed(0)
        ref = Net()
        model = copy.deepcopy(ref)
        if broadcast and hvd.rank() != 0:
            torch.manual_seed(hvd.rank())
            model = Net()
        if broadcast:
            ref.unused.requires_grad_(False)
            model.unused.requires_grad_(False)
        ref_opt = make_opt(kind, ref.parameters())
        kw = dict(dist_kw)
        if callable(kw.get("groups")):
            kw["groups"] = kw["groups"](model)
        opt = hvd.DistributedOptimizer(
            make_opt(kind, model.parameters()),
            named_parameters=model.named_parameters(),
            compression=comp,
            backward_passes_per_step=bpps,
            op=the_op,
            gradient_predivide_factor=predivide,
            **kw,
        )
        assert isinstance(opt, type(ref_opt)), type(opt).__mro__
        if broadcast:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        loss_scale = hvd.size() if op == "sum" else 1.0
        n, r = hvd.size(), hvd.rank()
        for step in range(STEPS):
            x, y = data(step)
            ref_opt.zero_grad()
            (F.cross_entropy(ref(x), y) * loss_scale).backward()
            ref_opt.step()

            opt.zero_grad()
            shard = BATCH // n
            xs, ys = x[r * shard : (r + 1) * shard], y[r * shard : (r + 1) * shard]
            micro = shard // bpps
            for k in range(bpps):
                out = model(xs[k * micro : (k + 1) * micro])
                (F.cross_entropy(out, ys[k * micro : (k + 1) * micro]) / bpps).backward()
            opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(name, p.detach(), q.detach(), rtol, atol)

    return case


def uneven_usage():
    """A parameter used only on rank 1 (data-dependent branch): no deadlock, same result."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    for step in range(3):
        x, y = data(step)
        opt.zero_grad()
        out = model(x)
        if hvd.rank() == 1:
            out = model.unused(out)
        F.cross_entropy(out, y).backward()
        opt.step()
    w = model.unused.weight.detach().clone()
    allw = hvd.allgather(w.unsqueeze(0))
    assert_close("unused.weight across ranks", allw[0], allw[-1], 0, 0)


def errors():
    model = Net()
    named = list(model.named_parameters())
    try:
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named[:-1]
        )
    except ValueError as e:
        assert "missing" in str(e), e
    else:
        raise AssertionError("missing names accepted")
    dup = [("same", p) for _, p in named]
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=dup)
    except ValueError as e:
        assert "duplicate" in str(e) and "same" in str(e), e
    else:
        raise AssertionError("duplicate names accepted")
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    x, y = data(0)
    F.cross_entropy(model(x), y).backward()
    try:
        F.cross_entropy(model(x), y).backward()
    except RuntimeError as e:
        assert "backward_passes_per_step" in str(e), e
    else:
        raise AssertionError("second backward before step accepted")
    opt.synchronize()
    opt.zero_grad()


def _match_full_batch(steps, momentum, ref_update, dist_update, prepare=lambda m: m):
    """Train a reference on each full batch and a DistributedOptimizer copy on this rank's
    shard (both SGD, lr 0.1, the model through ``prepare`` first); the parameters must agree
    afterwards."""
    torch.manual_seed(0)
    ref = prepare(Net())
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
        named_parameters=model.named_parameters(),
    )
    s, r = BATCH // hvd.size(), hvd.rank()
    for step in range(steps):
        x, y = data(step)
        ref_update(ref, ref_opt, x, y)
        dist_update(model, opt, x[r * s : (r + 1) * s], y[r * s : (r + 1) * s])
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(name, p.detach(), q.detach(), 1e-5, 1e-6)


def sync_then_step():
    """The gradient-clipping pattern: synchronize(), clip, step() under skip_synchronize()."""

    def ref_update(ref, ref_opt, x, y):
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()

    def dist_update(model, opt, x, y):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with opt.skip_synchronize():
            opt.step()

    _match_full_batch(2, 0.0, ref_update, dist_update)


def set_to_none_by_module():
    """model.zero_grad() (set_to_none) instead of opt.zero_grad(): grads re-adopt buckets."""

    def ref_update(ref, ref_opt, x, y):
        ref.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()

    def dist_update(model, opt, x, y):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    _match_full_batch(3, 0.9, ref_update, dist_update)


def channels_last():
    """A channels_last model (and input): the full-batch result, and the conv weight's
    gradient, a view of its bucket, keeps the weight's strides (DDP's layout), so autograd
    accumulates into it without reordering."""

    def to_last(x):
        return x.contiguous(memory_format=torch.channels_last)

    def ref_update(ref, ref_opt, x, y):
        ref_opt.zero_grad()
        F.cross_entropy(ref(to_last(x)), y).backward()
        ref_opt.step()

    def dist_update(model, opt, x, y):
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(to_last(x)), y).backward()
        opt.step()
        w = model.conv.weight
        assert w.grad.stride() == w.stride() and not w.grad.is_contiguous(), w.grad.stride()

    _match_full_batch(
        3, 0.9, ref_update, dist_update, lambda m: m.to(memory_format=torch.channels_last)
    )


def lr_scheduler():
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "scheduler.step() before optimizer.step()" must not fire
        for step in range(2):
            x, y = data(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
    assert abs(opt.param_groups[0]["lr"] - 0.025) < 1e-12, opt.param_groups[0]["lr"]


class EmbNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


def sparse_case(**dist_kw):
    def case():
        torch.manual_seed(0)
        ref = EmbNet()
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5),
            named_parameters=model.named_parameters(),
            **dist_kw,
        )
        n, r = hvd.size(), hvd.rank()
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 20, (BATCH, 3), generator=g)
            y = torch.randint(0, 3, (BATCH,), generator=g)
            ref_opt.zero_grad()
            F.cross_entropy(ref(idx), y).backward()
            ref_opt.step()
            opt.zero_grad()
            s = BATCH // n
            F.cross_entropy(model(idx[r * s : (r + 1) * s]), y[r * s : (r + 1) * s]).backward()
            opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(name, p.detach(), q.detach(), 1e-5, 1e-6)

    return case


class ScaledSGD(torch.optim.SGD):
    """A user subclass with its own attribute and step: both must survive wrapping."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure)


def custom_subclass():
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(
        ScaledSGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    assert isinstance(opt, ScaledSGD)
    x, y = data(0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.calls == 1, opt.calls


CASES = {
    "sparse_params_path": sparse_case(bucket_cap_mb=0),
    "sparse_as_dense": sparse_case(bucket_cap_mb=0, sparse_as_dense=True),
    "sparse_buckets": sparse_case(),
    "custom_subclass": custom_subclass,
    "sgd_momentum": train_case("sgd"),
    "adam": train_case("adam"),
    "adamw_params_path": train_case("adamw", bucket_cap_mb=0),
    "sgd_tiny_buckets": train_case("sgd", bucket_cap_mb=0.001),
    "sgd_bpps2": train_case("sgd", bpps=2),
    "adam_bpps2_params_path": train_case("adam", bpps=2, bucket_cap_mb=0),
    "sgd_fp16": train_case("sgd", compression="fp16", rtol=1e-2, atol=2e-3),
    "adam_fp16_params_path": train_case(
        "adam", compression="fp16", rtol=1e-2, atol=2e-3, bucket_cap_mb=0
    ),
    "sgd_op_sum": train_case("sgd", op="sum"),
    "sgd_op_sum_predivide": train_case("sgd", op="sum", predivide=2.0),
    "sgd_average_predivide": train_case("sgd", predivide=4.0),
    "sgd_num_groups": train_case("sgd", groups=2),
    "adam_explicit_groups": train_case(
        "adam", groups=lambda m: [[m.conv.weight, m.conv.bias], [m.fc2.bias, m.fc1.weight]]
    ),
    "sgd_momentum_after_broadcast": train_case("sgd", broadcast=True),
    "adam_after_broadcast": train_case("adam", broadcast=True),
    "adamw_after_broadcast": train_case("adamw_decay", broadcast=True),
    "rmsprop_after_broadcast": train_case("rmsprop", broadcast=True),
    "adagrad_after_broadcast": train_case("adagrad", broadcast=True),
    "uneven_usage": uneven_usage,
    "errors": errors,
    "sync_then_step": sync_then_step,
    "set_to_none_by_module": set_to_none_by_module,
    "lr_scheduler": lr_scheduler,
    "channels_last": channels_last,
}


if __name__ == "__main__":
    run_cases(CASES, only=set(sys.argv[1:]) or None)
