"""A Horovod-style training script (hvdlite.torch, DistributedOptimizer, the broadcasts), as
a user runs it under hvdlite-run or, unchanged, under torchrun.

Each rank trains on its shard of every global batch and prints ``PLACE``, ``OBJECT`` (what
``broadcast_object`` gave it) and ``WEIGHTS [...]``; :func:`train` at size 1 is the
one-process reference on whole batches.
"""

import json
import os
import sys

import torch

GLOBAL_BATCH = 8
STEPS = 8


def batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=g)
    return x, x @ torch.tensor([[0.5], [-1.0], [2.0], [1.5]]) + 0.25


def train(rank: int, size: int, hvd=None):
    """The weights after STEPS steps of SGD with momentum on rank's shard of each batch."""
    torch.manual_seed(rank if hvd is not None else 0)  # ranks start apart: the broadcast
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if hvd is not None:
        torch.manual_seed(0)  # rank 0's start is the one-process run's
        if hvd.rank() == 0:
            fresh = torch.nn.Sequential(
                torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
            )
            model.load_state_dict(fresh.state_dict())
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    shard = GLOBAL_BATCH // size
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def say(line: str) -> None:
    """One write per line: torchrun's ranks share one unprefixed stdout."""
    os.write(1, (line + "\n").encode())


def main():
    import hvdlite.torch as hvd

    hvd.init()
    say(
        f"PLACE rank={hvd.rank()} size={hvd.size()} local_rank={hvd.local_rank()} "
        f"local_size={hvd.local_size()} cross_rank={hvd.cross_rank()} "
        f"cross_size={hvd.cross_size()}"
    )
    got = hvd.broadcast_object({"from": hvd.rank(), "argv": sys.argv[1:]}, root_rank=0)
    say("OBJECT " + json.dumps(got))
    weights = train(hvd.rank(), hvd.size(), hvd)
    say("WEIGHTS " + json.dumps(weights))
    hvd.shutdown()


if __name__ == "__main__":
    main()
