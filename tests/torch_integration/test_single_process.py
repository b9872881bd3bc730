"""In-process checks that need no second rank (a script run without the launcher is 1 rank)."""

import pytest
import torch

import hvdlite.torch as hvd
from hvdlite.torch.compression import Compression
from hvdlite.torch.functions import allgather_object, broadcast_object, broadcast_parameters
from hvdlite.torch.optimizer import DistributedOptimizer


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    hvd.init()
    yield
    hvd.shutdown()


def test_exports():
    """hvdlite.torch re-exports the integration's public names (Horovod users expect them)."""
    for name in (
        "DistributedOptimizer",
        "Compression",
        "broadcast_parameters",
        "broadcast_optimizer_state",
        "broadcast_object",
        "allgather_object",
        "SyncBatchNorm",
    ):
        assert hasattr(hvd, name), f"hvdlite.torch does not export {name}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
def test_fp16_roundtrip(dtype):
    t = (torch.arange(10) - 3).to(dtype)
    c, ctx = Compression.fp16.compress(t)
    if dtype in (torch.float32, torch.float64):
        assert c.dtype == torch.float16
    else:
        assert c.dtype == dtype
    back = Compression.fp16.decompress(c, ctx)
    assert back.dtype == dtype and torch.equal(back, t)
    n, ctx = Compression.none.compress(t)
    assert n is t and Compression.none.decompress(n, ctx) is t


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def _train_alike(ref, ref_opt, model, opt, steps=3):
    """Train both on the same batches; the wrapped model must end equal to the plain one."""
    for i in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_one_rank_matches_plain_training():
    ref = _model()
    model = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    _train_alike(ref, ref_opt, model, opt)


def test_grads_are_bucket_views():
    model = _model()
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.randn(2, 4)).sum().backward()
    ptrs = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(ptrs) == 1, "gradients should share one flat bucket"
    opt.step()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(backward_passes_per_step=0), "backward_passes_per_step"),
        (dict(gradient_predivide_factor=0), "gradient_predivide_factor"),
        (dict(op=hvd.Min), "op="),
        (dict(bucket_cap_mb=-1), "bucket_cap_mb"),
    ],
)
def test_bad_arguments(kwargs, needle):
    model = _model()
    with pytest.raises(ValueError, match=needle):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            **kwargs,
        )


def test_adasum_on_one_rank_is_plain_training():
    """As in Horovod: Adasum of one rank's gradient is that gradient."""
    ref, model = _model(), _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        op=hvd.Adasum,
    )
    _train_alike(ref, ref_opt, model, opt)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            op=hvd.Adasum,
            gradient_predivide_factor=2.0,
        )


def test_named_parameters_not_pairs():
    model = _model()
    with pytest.raises(ValueError, match="named_parameters"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=list(model.parameters())
        )


def test_group_with_foreign_parameter():
    model = _model()
    stranger = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"groups\[0\]"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=[[stranger]])


def test_zero_grad_while_in_flight():
    model = _model()
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


def test_wrap_twice_refused():
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already"):
        DistributedOptimizer(opt)


def test_broadcast_helpers_one_rank():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    broadcast_parameters(model.state_dict(), root_rank=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert broadcast_object({"a": 1}, root_rank=0) == {"a": 1}
    assert allgather_object(3) == [3]
    with pytest.raises(ValueError, match="root_rank"):
        broadcast_parameters(model.state_dict(), root_rank=1)


def _optimizer_classes():
    return [
        getattr(torch.optim, a)
        for a in sorted(dir(torch.optim))
        if isinstance(getattr(torch.optim, a), type)
        and issubclass(getattr(torch.optim, a), torch.optim.Optimizer)
        and a not in ("Optimizer", "LBFGS")
    ]


#: options that take an optimizer down another path of its first step (where it has them)
_VARIANTS = {
    "SGD": [
        dict(momentum=0.9),
        dict(momentum=0.9, dampening=0.5),
        dict(momentum=0.9, nesterov=True, weight_decay=0.1),
    ],
    "Adam": [dict(), dict(amsgrad=True, weight_decay=0.1)],
    "AdamW": [dict(weight_decay=0.1), dict(amsgrad=True)],
    "RMSprop": [dict(momentum=0.5, centered=True)],
    "NAdam": [dict(), dict(decoupled_weight_decay=True, weight_decay=0.1)],
    "RAdam": [dict(), dict(decoupled_weight_decay=True, weight_decay=0.1)],
    "ASGD": [dict(t0=1)],
}
#: the classes that also take sparse gradients
_SPARSE = ("SGD", "Adagrad", "SparseAdam")


def _cases():
    for cls in _optimizer_classes():
        for options in _VARIANTS.get(cls.__name__, [dict()]):
            if cls.__name__ != "SparseAdam":
                yield pytest.param(cls, options, False, id=f"{cls.__name__}-{options}")
            if cls.__name__ in _SPARSE and not options.get("weight_decay"):
                yield pytest.param(cls, options, True, id=f"{cls.__name__}-{options}-sparse")


@pytest.mark.parametrize("cls,options,sparse", _cases())
def test_broadcast_optimizer_state_leaves_no_trace_of_its_first_step(cls, options, sparse):
    """broadcast_optimizer_state makes a new optimizer's state with one step on zero
    gradients (as Horovod's); afterwards every torch.optim class must train exactly as the
    same optimizer that was never broadcast: step counters, momentum products and the rest
    as before a first step."""

    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5, 3))
        return p, cls([p], lr=0.01, **options)

    (plain, plain_opt), (broadcast, opt) = make(), make()
    new = not opt.state  # Adagrad makes its state when it is built
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if new:
        assert broadcast.grad is not None and not broadcast.grad.to_dense().count_nonzero(), (
            "p.grad should be a zero gradient after the broadcast, as Horovod users expect"
        )
    step = opt.state[broadcast].get("step")
    assert step is None or float(step) == 0, f"step counter {step} after the broadcast"
    data = torch.Generator().manual_seed(1)
    for _ in range(4):
        g = torch.randn(5, 3, generator=data)
        for p, o in ((plain, plain_opt), (broadcast, opt)):
            p.grad = g.to_sparse() if sparse else g.clone()
            o.step()
    assert torch.equal(plain.detach(), broadcast.detach()), (
        f"{cls.__name__}: max diff {(plain - broadcast).abs().max().item():.3g}"
    )


def test_a_tensor_off_the_cpu_is_refused_naming_it_and_the_fix():
    """No GPU here: a `meta` tensor stands for any non-CPU device (the check is the same)."""
    with pytest.raises(ValueError) as info:
        hvd.allreduce(torch.empty(3, device="meta"), name="layer1.weight")
    msg = str(info.value)
    assert "'layer1.weight'" in msg and "is on meta" in msg
    assert "CPU tensors only" in msg and "model.cpu()" in msg
