"""broadcast_parameters / broadcast_optimizer_state / *_object and SyncBatchNorm, per rank."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from _common import assert_close, hvd, run_cases


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def _root_values(tensors):
    """Rank 0's copy of each tensor, gathered to everyone."""
    return [hvd.allgather(t.detach().clone().unsqueeze(0))[0] for t in tensors]


def broadcast_params():
    torch.manual_seed(hvd.rank())  # different on every rank
    model = BNNet()
    model(torch.randn(4, 3, 5, 5))  # buffers (running stats, num_batches_tracked) differ too
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sd = model.state_dict()
    for (k, v), root in zip(sd.items(), _root_values(list(sd.values()))):
        assert_close(k, v.float(), root.float(), 0, 0)
    torch.manual_seed(10 + hvd.rank())
    model2 = BNNet()
    hvd.broadcast_parameters(model2.named_parameters(), root_rank=1 % hvd.size())
    for k, v in model2.named_parameters():
        allv = hvd.allgather(v.detach().unsqueeze(0))
        assert_close(k, v.detach(), allv[1 % hvd.size()], 0, 0)


def _adam_state(opt):
    return [(i, k, v) for i, (p, st) in enumerate(opt.state.items()) for k, v in sorted(st.items())]


def broadcast_opt_state_after_step():
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (1 + hvd.rank()), betas=(0.8, 0.9))
    # rank 0 has taken two steps, other ranks one (different state and step counts)
    for _ in range(2 if hvd.rank() == 0 else 1):
        opt.zero_grad()
        model(torch.randn(4, 3, 5, 5) + hvd.rank()).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01, opt.param_groups[0]["lr"]
    assert tuple(opt.param_groups[0]["betas"]) == (0.8, 0.9)
    for p in model.parameters():
        st = opt.state[p]
        for k in ("step", "exp_avg", "exp_avg_sq"):
            root = hvd.allgather(st[k].reshape(1, -1))[0]
            assert_close(k, st[k].reshape(-1), root, 0, 0)
        assert float(st["step"]) == 2.0, st["step"]


def broadcast_lazy_state():
    """Root stepped, others have empty state: state is created, nothing else steps."""
    torch.manual_seed(0)
    model = BNNet()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if hvd.rank() == 0:
        model(torch.randn(4, 3, 5, 5)).sum().backward()
        opt.step()
        opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for p in model.parameters():
        assert float(opt.state[p]["step"]) == 1.0, opt.state[p]["step"]
    if hvd.rank() != 0:
        for p, b in zip(model.parameters(), before):
            assert_close("param unchanged by broadcast", p.detach(), b, 0, 0)


def broadcast_empty_state_as_horovod():
    """All ranks empty (the usual start): the state is created as Horovod creates it (a
    step of the optimizer's own on zero gradients, so every parameter that trains has a
    zero ``grad`` and its state entries), frozen parameters keep ``grad`` None and get no
    state, and, unlike Horovod, that step leaves no trace: weight decay does not move the
    parameters and Adam's step count is still 0 (Horovod's is 1)."""
    torch.manual_seed(0)
    model = BNNet()
    frozen = model.conv.bias
    frozen.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.5)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for (k, p), b in zip(model.named_parameters(), before):
        assert_close(k, p.detach(), b, 0, 0)
        if p is frozen:
            assert p.grad is None and p not in opt.state, (k, p.grad)
            continue
        assert p.grad is not None and not p.grad.any(), (k, p.grad)
        assert float(opt.state[p]["step"]) == 0.0, (k, opt.state[p])
        root = hvd.broadcast(opt.state[p]["exp_avg"], root_rank=0)
        assert_close(k, opt.state[p]["exp_avg"], root, 0, 0)


def broadcast_state_no_grad():
    """Horovod's grad-less parameter case: an int parameter that requires no gradient, a
    DistributedOptimizer with momentum; afterwards the trained parameter's ``grad`` is a
    tensor equal on every rank and the frozen one's stays None (Horovod's test)."""

    class NoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
            self.b = nn.Parameter(torch.rand(4))

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x

    torch.manual_seed(hvd.rank())
    model = NoGrad()
    opt = torch.optim.SGD(
        model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True
    )
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    if hvd.rank() == 1:  # torch then wraps the reducing step in the wrapper's class
        opt.load_state_dict(opt.state_dict())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    assert opt.param_groups[0]["params"][0].grad is None
    assert torch.equal(grad, hvd.broadcast(grad, root_rank=0)), grad
    buf = opt.state[model.b]["momentum_buffer"]
    assert torch.equal(buf, hvd.broadcast(buf, root_rank=0)), buf
    opt.state[model.b]["unset"] = None  # a state entry that is None travels
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.state[model.b]["unset"] is None
    model(torch.ones(2)).sum().backward()  # and training goes on
    opt.step()


def broadcast_with_scheduler():
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    for _ in range(2 if hvd.rank() == 0 else 0):
        model(torch.randn(2, 3, 5, 5)).sum().backward()
        opt.step()
        sched.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert abs(opt.param_groups[0]["lr"] - 0.01) < 1e-12, opt.param_groups[0]["lr"]
    for p in model.parameters():
        buf = opt.state[p]["momentum_buffer"]
        assert_close("momentum_buffer", buf.reshape(-1), hvd.allgather(buf.reshape(1, -1))[0], 0, 0)


def distributed_optimizer_state():
    """broadcast_optimizer_state accepts the DistributedOptimizer wrapper."""
    torch.manual_seed(hvd.rank())
    model = BNNet()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1 + hvd.rank()),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.1


def objects():
    obj = {"rank": hvd.rank(), "data": list(range(hvd.rank() + 1)), "t": torch.ones(2) * hvd.rank()}
    got = hvd.broadcast_object(obj, root_rank=0)
    assert got["rank"] == 0 and got["data"] == [0] and torch.equal(got["t"], torch.zeros(2)), got
    allobj = hvd.allgather_object(obj)
    assert [o["rank"] for o in allobj] == list(range(hvd.size())), allobj
    assert allobj[-1]["data"] == list(range(hvd.size()))
    assert hvd.broadcast_object(None, root_rank=0) is None


def sync_batch_norm():
    """Forward output, input grads, weight grads and running stats match BatchNorm2d on the
    gathered batch; ranks hold different numbers of samples."""
    n, r = hvd.size(), hvd.rank()
    counts = [3 + k for k in range(n)]  # uneven batches
    g = torch.Generator().manual_seed(7)
    full = torch.randn(sum(counts), 4, 5, 5, generator=g) * 3 + 1
    gout = torch.randn(sum(counts), 4, 5, 5, generator=g)
    start = sum(counts[:r])
    local = full[start : start + counts[r]].clone().requires_grad_(True)

    ref = nn.BatchNorm2d(4)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5, generator=g)
        ref.bias.uniform_(-0.5, 0.5, generator=g)
    sbn = hvd.SyncBatchNorm(4)
    sbn.load_state_dict(ref.state_dict())
    full_in = full.clone().requires_grad_(True)
    want = ref(full_in)
    (want * gout).sum().backward()
    got = sbn(local)
    (got * gout[start : start + counts[r]]).sum().backward()

    assert_close("output", got, want[start : start + counts[r]], 1e-4, 1e-5)
    assert_close("input grad", local.grad, full_in.grad[start : start + counts[r]], 1e-4, 1e-5)
    wgrad = hvd.allreduce(sbn.weight.grad, op=hvd.Sum)
    bgrad = hvd.allreduce(sbn.bias.grad, op=hvd.Sum)
    assert_close("weight grad", wgrad, ref.weight.grad, 1e-4, 1e-4)
    assert_close("bias grad", bgrad, ref.bias.grad, 1e-4, 1e-4)
    assert_close("running_mean", sbn.running_mean, ref.running_mean, 1e-5, 1e-6)
    assert_close("running_var", sbn.running_var, ref.running_var, 1e-5, 1e-6)
    sbn.eval()
    ref.eval()
    assert_close("eval output", sbn(local.detach()), ref(local.detach()), 1e-5, 1e-6)
    conv = hvd.SyncBatchNorm.convert_sync_batchnorm(BNNet())
    assert isinstance(conv.bn, hvd.SyncBatchNorm)


CASES = {
    "broadcast_parameters": broadcast_params,
    "broadcast_optimizer_state": broadcast_opt_state_after_step,
    "broadcast_lazy_state": broadcast_lazy_state,
    "broadcast_empty_state_as_horovod": broadcast_empty_state_as_horovod,
    "broadcast_state_no_grad": broadcast_state_no_grad,
    "broadcast_with_scheduler": broadcast_with_scheduler,
    "distributed_optimizer_state": distributed_optimizer_state,
    "objects": objects,
    "sync_batch_norm": sync_batch_norm,
}

if __name__ == "__main__":
    run_cases(CASES, only=set(sys.argv[1:]) or None)
