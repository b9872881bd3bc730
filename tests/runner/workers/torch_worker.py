"""Trains a tiny linear model with hvdlite.torch allreduce; every rank must end equal."""

import os

import torch

import hvdlite.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
assert rank == int(os.environ.get("HVDLITE_RANK", rank))
torch.manual_seed(1234)
model = torch.nn.Linear(4, 1)
gen = torch.Generator().manual_seed(rank)
x = torch.randn(64, 4, generator=gen)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
for step in range(30):
    model.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            g = hvd.allreduce(p.grad, name=f"grad.{i}")  # average over ranks
            p -= 0.1 * g
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
summed = hvd.allreduce(flat, name="check", op=hvd.Sum)
assert torch.allclose(summed, flat * size, atol=1e-5), "ranks diverged"
print(f"TRAINOK rank={rank} size={size} loss={loss.item():.4f}", flush=True)
hvd.shutdown()
