"""Two models trained at the same time by two halves of one job, with process sets.

    hvdlite-run -np 4 python examples/pytorch_process_sets.py

Ranks 0 and 2 train a regressor on one task, ranks 1 and 3 another; each half averages its
gradients among its own members only (its own negotiation, fusion and transport), so neither
waits for the other.  At the end the whole job compares the two halves' losses.
Written for horovod.torch: only the import differs.
"""

import argparse

import torch
import torch.nn as nn

import hvdlite.torch as hvd


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    hvd.init(process_sets="dynamic")
    if hvd.size() < 2 or hvd.size() % 2:
        raise SystemExit("run with an even number of ranks, e.g. hvdlite-run -np 4")
    even = hvd.add_process_set(list(range(0, hvd.size(), 2)))
    odd = hvd.add_process_set(list(range(1, hvd.size(), 2)))
    mine = even if even.included() else odd
    task = 0 if mine is even else 1

    torch.manual_seed(task)  # same model within a half, different across
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    target = nn.Linear(8, 1)  # the function this half learns
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr),
        named_parameters=model.named_parameters(),
        process_set=mine,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=mine.ranks[0], process_set=mine)

    data = torch.Generator().manual_seed(100 + hvd.rank())
    for step in range(args.steps):
        x = torch.randn(32, 8, generator=data)
        with torch.no_grad():
            y = target(x)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step % 20 == 0 and mine.rank() == 0:
            print(f"task {task} step {step}: loss {loss.item():.4f}", flush=True)

    final = hvd.allreduce(loss.detach(), process_set=mine)  # the half's mean loss
    losses = hvd.allgather_object((task, round(final.item(), 4)))
    if hvd.rank() == 0:
        for t in (0, 1):
            print(f"FINAL task {t} loss {dict(losses)[t]}", flush=True)
    hvd.remove_process_set(even)
    hvd.remove_process_set(odd)
    hvd.shutdown()


if __name__ == "__main__":
    main()
