"""Jobs for the monitoring tests: ``straggler`` (rank 1 sleeps 50 ms before every step)
and ``stall SECONDS`` (rank 1 sleeps that long before an allreduce rank 0 waits in)."""

import sys
import time

import torch

import hvdlite.torch as hvd


def straggler(steps: int = 50) -> None:
    x = torch.ones(1000)
    for _ in range(steps):
        if hvd.rank() == 1:
            time.sleep(0.05)
        hvd.allreduce(x, name="grad")


def stall(seconds: float) -> None:
    x = torch.ones(1000)
    for i in range(20):
        hvd.allreduce(x, name=f"warm{i % 4}")
    if hvd.rank() == 1:
        time.sleep(seconds)
    hvd.allreduce(x, name="late")


if __name__ == "__main__":
    hvd.init()
    if sys.argv[1] == "straggler":
        straggler()
    else:
        stall(float(sys.argv[2]))
    hvd.shutdown()
