"""A small deterministic training job for the Slurm tests (and the sbatch example).

Each step trains on a global batch of 8 samples made from the step's seed; rank r takes
its shard, and the gradients are averaged, so the final weights equal a one-process run
of the same steps (``python train.py --reference``).  Rank 0 writes the weights, the job
size and every rank's place as JSON to ``--out`` (or prints them).
"""

import argparse
import json
import os

import torch

import hvdlite.torch as hvd

GLOBAL_BATCH = 8
STEPS = 20


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 3, generator=g)
    return x, x @ torch.tensor([[1.5], [-2.0], [0.25]]) + 0.5


def train(rank: int, size: int):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if size > 1:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    shard = GLOBAL_BATCH // size
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", action="store_true", help="one process, no hvdlite")
    parser.add_argument("--out", help="rank 0 writes the result here (JSON)")
    parser.add_argument("--fail-rank", type=int, help="this rank raises after init()")
    args = parser.parse_args()
    if args.reference:
        result = {"size": 1, "weights": train(0, 1)}
    else:
        hvd.init()
        if hvd.rank() == args.fail_rank:
            raise ValueError(f"rank {hvd.rank()} gives up on purpose")
        places = hvd.allgather_object(
            (hvd.rank(), hvd.local_rank(), hvd.cross_rank(), os.environ.get("SLURM_PROCID"))
        )
        result = {"size": hvd.size(), "weights": train(hvd.rank(), hvd.size()), "places": places}
        if hvd.rank() != 0:
            return
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
