"""Functions for the hvdlite.run tests, importable by the ranks (PYTHONPATH is this folder)."""

import os
import threading
import time

from hvdlite.common import config as cfg
from hvdlite.runner.tasks.function_rank import this_rank


def whoami():
    return {
        "rank": this_rank(os.environ),
        "host": os.environ.get(cfg.HOSTNAME),
        "size": os.environ.get(cfg.SIZE),
    }


def fail_on(bad_rank, sleep_s=60.0):
    rank = this_rank(os.environ)
    if rank == bad_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    time.sleep(sleep_s)
    return rank


def unpicklable_result():
    return threading.Lock()


def allreduce_rank():
    """A real training-style use: init, one allreduce across the ranks, shutdown."""
    import torch
    import hvdlite.torch as hvd

    hvd.init()
    try:
        total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="r")
        return (hvd.rank(), hvd.size(), total.item())
    finally:
        hvd.shutdown()
