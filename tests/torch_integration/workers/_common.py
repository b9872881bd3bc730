"""Shared by the worker scripts that tests/torch_integration launches with hvdlite-run."""

import sys
import traceback

import torch

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.torch import compression as _c, functions as _f, optimizer as _o  # noqa: E402
from hvdlite.torch import sync_batch_norm as _s  # noqa: E402

# hvdlite/torch/__init__.py re-exports these; fill them in if a checkout lacks that
# (tests/torch_integration/test_exports.py checks the real exports separately).
for _mod, _names in ((_c, ["Compression"]), (_o, ["DistributedOptimizer"]),
                     (_f, ["broadcast_parameters", "broadcast_optimizer_state",
                           "broadcast_object", "allgather_object"]),
                     (_s, ["SyncBatchNorm"])):
    for _n in _names:
        if not hasattr(hvd, _n):
            setattr(hvd, _n, getattr(_mod, _n))

torch.set_num_threads(1)


def run_cases(cases, only=None):
    """Run each ``name -> fn`` case; print OK/FAIL lines naming the rank; exit 1 on failure."""
    hvd.init()
    failed = 0
    for name, fn in cases.items():
        if only and name not in only:
            continue
        try:
            fn()
            print(f"OK {name} rank={hvd.rank()}", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name} rank={hvd.rank()}\n{traceback.format_exc()}", flush=True)
    hvd.shutdown()
    sys.exit(1 if failed else 0)


def assert_close(name, got, want, rtol, atol):
    if not torch.allclose(got, want, rtol=rtol, atol=atol):
        diff = (got - want).abs().max().item()
        raise AssertionError(f"{name}: max abs diff {diff:.3g} (rtol={rtol}, atol={atol}) "
                             f"on rank {hvd.rank()}")
