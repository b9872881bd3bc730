"""Shared by the worker scripts that tests/torch_integration launches with hvdlite-run."""

import torch

import hvdlite.torch as hvd
from tests.worker_cases import run_cases as _run_cases

torch.set_num_threads(1)


def run_cases(cases, only=None):
    """Run each ``name -> fn`` case; print OK/FAIL lines naming the rank; exit 1 on failure."""
    _run_cases(hvd, cases, only)


def assert_close(name, got, want, rtol, atol):
    if not torch.allclose(got, want, rtol=rtol, atol=atol):
        diff = (got - want).abs().max().item()
        raise AssertionError(
            f"{name}: max abs diff {diff:.3g} (rtol={rtol}, atol={atol}) on rank {hvd.rank()}"
        )
