"""Train a small regression model with hvdlite on a Ray cluster (synthetic data).

    python examples/ray_pytorch_train.py                  # a local Ray cluster of this machine
    python examples/ray_pytorch_train.py --address auto   # the cluster this machine belongs to

Each Ray actor is one rank; the training function is ordinary hvdlite.torch code and would
run unchanged under hvdlite-run.  Written for horovod.ray: only the imports differ.
"""

import argparse

import ray

from hvdlite.ray import RayExecutor


def train(epochs, lr):
    import torch
    import torch.nn as nn
    import hvdlite.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    target = nn.Linear(8, 1)  # the function to learn, same on every rank
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(100 + hvd.rank())  # each rank its own shard
    losses = []
    for _ in range(epochs):
        x = torch.randn(64, 8, generator=data)
        with torch.no_grad():
            y = target(x)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(hvd.allreduce(loss.detach()).item())  # the mean over ranks
    result = {"rank": hvd.rank(), "size": hvd.size(), "first": losses[0], "last": losses[-1]}
    hvd.shutdown()
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", help="Ray cluster address (default: start a local one)")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.02)
    args = p.parse_args()
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_workers, include_dashboard=False)
    executor = RayExecutor(
        RayExecutor.create_settings(timeout_s=60), num_workers=args.num_workers, cpus_per_worker=1
    )
    executor.start()
    try:
        results = executor.run(train, args=[args.epochs, args.lr])
    finally:
        executor.shutdown()
    r = results[0]
    print(f"trained on {r['size']} ranks: mean loss {r['first']:.4f} -> {r['last']:.4f}")
    print(f"FINAL_LOSS {r['last']:.6f} FIRST_LOSS {r['first']:.6f}")


if __name__ == "__main__":
    main()
