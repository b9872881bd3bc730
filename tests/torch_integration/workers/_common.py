"""Shared by the worker scripts that tests/torch_integration launches with hvdlite-run."""

import os
import sys
import traceback

import torch

if os.environ.get("HVDLITE_TI_DEV_FAKE"):  # development only: a stand-in for mpi_ops
    sys.path.insert(0, os.environ["HVDLITE_TI_DEV_FAKE"])
    import fake_mpi_ops
    sys.modules["hvdlite.torch.mpi_ops"] = fake_mpi_ops
    import types
    from hvdlite.torch.compression import Compression
    from hvdlite.torch.optimizer import DistributedOptimizer
    from hvdlite.torch.functions import (broadcast_parameters, broadcast_optimizer_state,
                                         broadcast_object, allgather_object)
    from hvdlite.torch.sync_batch_norm import SyncBatchNorm
    hvd = types.SimpleNamespace(**{k: getattr(fake_mpi_ops, k) for k in dir(fake_mpi_ops)
                                   if not k.startswith("_")})
    hvd.Compression = Compression
    hvd.DistributedOptimizer = DistributedOptimizer
    hvd.broadcast_parameters = broadcast_parameters
    hvd.broadcast_optimizer_state = broadcast_optimizer_state
    hvd.broadcast_object = broadcast_object
    hvd.allgather_object = allgather_object
    hvd.SyncBatchNorm = SyncBatchNorm
else:
    import hvdlite.torch as hvd  # noqa: F401

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
