"""A plain torch.distributed program (DDP over Gloo, env:// rendezvous) with no hvdlite in
it, as a user would run it under torchrun; here under hvdlite-run.

Prints ``TORCHENV name=value ...`` (torchrun's variables as it sees them), trains a small
model for a few steps on its shard of each global batch, and prints ``WEIGHTS [...]``.
``--fail-rank R``: rank R raises after the rendezvous.  ``--with-hvdlite``: the same
process then also runs ``hvdlite.torch.init()`` and one allreduce.
"""

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
)
GLOBAL_BATCH = 8
STEPS = 10


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) - 1.0


def train(rank: int, size: int, wrap=lambda m: m):
    """The weights after STEPS steps of SGD on rank's shard of each global batch."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    trained = wrap(model)
    opt = torch.optim.SGD(trained.parameters(), lr=0.05)
    shard = GLOBAL_BATCH // size
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
        opt.zero_grad()
        torch.nn.functional.mse_loss(trained(x), y).backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int)
    parser.add_argument("--with-hvdlite", action="store_true")
    args = parser.parse_args()
    print("TORCHENV " + " ".join(f"{n}={os.environ.get(n, '<unset>')}" for n in NAMES), flush=True)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if rank == args.fail_rank:
        raise ValueError(f"rank {rank} gives up on purpose")
    weights = train(rank, size, DistributedDataParallel)
    print("WEIGHTS " + json.dumps(weights), flush=True)
    if args.with_hvdlite:
        import hvdlite.torch as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum).item()
        print(f"HVD rank={hvd.rank()} size={hvd.size()} total={total}", flush=True)
        hvd.shutdown()
    # DDP's hooks hold the model in reference cycles, so without a collection its Gloo
    # process group outlives destroy_process_group() and is freed as the interpreter
    # ends, where torch 2.13 aborts now and then ("terminate called without an active
    # exception", SIGABRT) -- under torchrun too
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
