"""A job with one slow rank, to read in a timeline: rank 1 sleeps 20 ms every fourth step.

    hvdlite-run -np 2 --timeline-filename t.json python examples/timeline_slow_rank.py
    python -m hvdlite.timeline summary t.json --plot out.png

The summary's table of the ranks waited for should put rank 1 first (docs/timeline_autotune.md).
"""

import time

import torch

import hvdlite.torch as hvd

STEPS = 40


def main():
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(STEPS):
        if hvd.rank() == 1 and step % 4 == 0:
            time.sleep(0.02)  # the slow rank
        x = torch.randn(64, 256)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    hvd.shutdown()


if __name__ == "__main__":
    main()
